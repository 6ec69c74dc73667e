"""The online job's stream (hsx.online) and the driver's feed (hsx_service.online): which
unit the engines capture next for which epoch, the bounded buffer, and the books made
again when the trainer starts a run from a checkpoint."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hsx.online import EPOCH_STRIDE, Stream, StreamFolderError, split_unit, stream_unit
from hsx.output.layout import commit_path, shard_path
from hsx.plan import WorkUnit
from hsx_service.online import OnlineFeed

UNITS = [WorkUnit(0, 0, 10, 100), WorkUnit(1, 10, 20, 100), WorkUnit(2, 20, 30, 100)]


def commit(stream: Stream, sid: int, size: int = 100) -> None:
    """What an engine leaves in the stream for a committed unit: its shard, its record."""
    for key, body in ((shard_path(sid, "a1"), b"x" * size), (commit_path(sid), b"{}")):
        path = stream.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)


def ids(units: list[WorkUnit]) -> list[tuple[int, int]]:
    return [split_unit(u.unit) for u in units]


@pytest.fixture
def stream(tmp_path: Path) -> Stream:
    made = Stream("/data/out", root=tmp_path / "streams")
    made.open("{}")  # as the driver does before any engine commits into it
    return made


def test_stream_units_name_their_epoch() -> None:
    assert stream_unit(0, 7) == 7
    assert split_unit(stream_unit(3, 7)) == (3, 7)
    assert stream_unit(1, 0) == EPOCH_STRIDE


def test_the_stream_counts_what_the_trainer_has_not_taken(stream: Stream) -> None:
    commit(stream, 1, 300)
    commit(stream, stream_unit(1, 0), 200)
    assert stream.committed() == {1, EPOCH_STRIDE}
    assert stream.buffered() == (2, 500)
    stream.take(1)
    assert stream.committed() == {EPOCH_STRIDE}
    assert stream.buffered() == (1, 200)


def test_units_go_out_epoch_after_epoch_once_the_plan_is_whole(stream: Stream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS[:2], whole=False)
    assert ids(feed.take(10)) == [(0, 0), (0, 1)]
    assert feed.take(10) == []  # more units may still be planned: no epoch 1 yet
    feed.planned(UNITS[2:], whole=True)
    assert ids(feed.take(4)) == [(0, 2), (1, 0), (1, 1), (1, 2)]
    sid = stream_unit(1, 1)
    assert feed.rows_of(sid) == UNITS[1]


def test_the_engines_wait_for_the_trainer_beyond_the_buffer(stream: Stream) -> None:
    # Each unit is 100 tokens x 1 byte; the buffer holds 250 bytes.
    feed = OnlineFeed(stream, buffer_bytes=250, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    first = feed.take(10)
    assert ids(first) == [(0, 0), (0, 1)]
    assert feed.waiting_for is not None and "the trainer" in feed.waiting_for
    assert "online buffer" in feed.waiting_for
    # Both committed (100 bytes each in the stream): still no room for a third.
    for unit in first:
        commit(stream, unit.unit)
        feed.committed(unit.unit)
    assert feed.take(10) == []
    stream.take(first[0].unit)  # the trainer took one
    assert ids(feed.take(1)) == [(0, 2)]
    assert feed.waiting_for is None
    assert feed.take(1) == [] and "200 B of captured states" in (feed.waiting_for or "")


def test_a_unit_larger_than_the_buffer_still_moves(stream: Stream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    assert ids(feed.take(10)) == [(0, 0)]  # alone, when nothing else is held


def test_the_default_buffer_holds_three_of_the_largest_units(stream: Stream) -> None:
    """An 8B target's 65,536-token unit is 2 GiB in bf16: a 1 GiB buffer would let one
    unit out at a time, the engine idle while the trainer reads it."""
    from hsx.online import DEFAULT_BUFFER_BYTES

    feed = OnlineFeed(stream, buffer_bytes=None, bytes_per_token=32 * 1024)
    assert feed.buffer_bytes == DEFAULT_BUFFER_BYTES  # nothing planned yet
    feed.planned([WorkUnit(0, 0, 10, 65536), WorkUnit(1, 10, 20, 65536),
                  WorkUnit(2, 20, 30, 65536), WorkUnit(3, 30, 40, 1000)], whole=True)
    assert feed.buffer_bytes == 3 * 65536 * 32 * 1024
    assert [split_unit(u.unit) for u in feed.take(10)] == [(0, 0), (0, 1), (0, 2)]
    small = OnlineFeed(stream, buffer_bytes=None, bytes_per_token=1)
    small.planned(UNITS, whole=True)
    assert small.buffer_bytes == DEFAULT_BUFFER_BYTES  # small units: the 1 GiB floor
    assert OnlineFeed(stream, buffer_bytes=250, bytes_per_token=1).buffer_bytes == 250


def test_a_stream_folder_without_room_for_the_buffer_is_refused_before_any_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from types import SimpleNamespace

    from hsx.online import STREAM_DIR_ENV
    from hsx.spec import JobSpec
    from hsx_service import runner
    from hsx_service.errors import JobRefused

    monkeypatch.setenv(STREAM_DIR_ENV, str(tmp_path / "streams"))
    spec = JobSpec(model="/m", dataset="/d.jsonl", output=str(tmp_path / "out"),
                   layers=[1, 2, 4], train={"online": True})
    manifest = SimpleNamespace(hidden_size=4096, to_json=lambda: b"{}")
    job = SimpleNamespace(spec=spec, layers=[1, 2, 4], manifest=manifest,
                          units=[WorkUnit(0, 0, 10, 65536)],
                          output=SimpleNamespace(location=str(tmp_path / "out")))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(runner.shutil, "disk_usage",
                        lambda _: usage._replace(free=64 * 2**20))  # a container's /dev/shm
    with pytest.raises(JobRefused, match=r"train\.buffer_bytes: the online stream .* needs "
                                         r"4,608 MiB .* has 64 MiB free; point HSX_STREAM_DIR"):
        runner.online_feed(job)  # type: ignore[arg-type]
    monkeypatch.setattr(runner.shutil, "disk_usage",
                        lambda _: usage._replace(free=8 * 2**30))
    assert runner.online_feed(job).buffer_bytes == 3 * 65536 * 3 * 4096 * 2  # type: ignore[arg-type]


def test_a_new_trainer_run_gets_back_what_its_checkpoint_had_not(stream: Stream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(0, [])
    handed = feed.take(3)
    assert ids(handed) == [(0, 0), (0, 1), (0, 2)]
    for unit in handed:
        feed.committed(unit.unit)
    # The trainer took units 0 and 1, checkpointed after unit 0 only, and died; unit 2
    # is still in the stream. Its next run resumes at (epoch 0, [0]).
    commit(stream, stream_unit(0, 2))
    stream.start_run(0, [0])
    assert ids(feed.take(2)) == [(0, 1), (1, 0)]


def test_a_run_resumed_in_a_later_epoch_drops_the_earlier_books(stream: Stream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(1, [0, 2])
    assert ids(feed.take(2)) == [(1, 1), (2, 0)]


def test_the_feed_ends_when_the_trainer_is_done_not_when_it_stops(stream: Stream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(0, [])
    stream.set_trainer("stopped")  # its coordinator shut down: it resumes later
    assert not feed.finished()
    stream.set_trainer("done", step=30)
    assert feed.finished() and feed.ended == "done"
    assert feed.take(5) == []


def test_a_failed_trainer_ends_the_feed_with_its_error(stream: Stream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    stream.set_trainer("failed", error="the trainer died 4 times")
    assert feed.finished() and feed.error == "the trainer died 4 times"


def test_the_stream_lives_in_memory_by_default(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    from hsx.online import STREAM_DIR_ENV, stream_root

    monkeypatch.setenv(STREAM_DIR_ENV, str(tmp_path))
    assert stream_root() == tmp_path
    monkeypatch.delenv(STREAM_DIR_ENV)
    if Path("/dev/shm").is_dir():
        assert stream_root() == Path(f"/dev/shm/hsx-stream-{os.geteuid()}")
    # Two spellings of one output share one stream; two outputs do not.
    assert Stream("/a").path != Stream("/b").path


def test_what_the_trainer_needs_first_passes_a_buffer_of_later_epochs(stream: Stream) -> None:
    # The buffer is full of epoch 1's unit 0 when the trainer, killed in epoch 0, resumes
    # needing unit 2 of epoch 0 again: it is captured, or nothing ever moves.
    feed = OnlineFeed(stream, buffer_bytes=150, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    commit(stream, stream_unit(1, 0), 300)
    stream.start_run(0, [0, 1])
    assert ids(feed.take(2)) == [(0, 2)]
    assert feed.take(2) == [] and feed.waiting_for is not None


def test_a_stream_is_its_users_own(tmp_path: Path) -> None:
    """Created owner-only in a root of the user's own; taken again by a resumed job; a
    folder at its name that is a link, another user's or open to others is never used."""
    root = tmp_path / "streams"
    stream = Stream("/data/out", root=root)
    stream.open("{}")
    for folder in (root, stream.path):
        info = os.lstat(folder)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    stream.set_trainer("running")
    Stream("/data/out", root=root).open("{}")  # a restarted driver finds it again
    assert Stream("/data/out", root=root).trainer() == {"state": "running"}

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    planted = Stream("/data/planted", root=root)
    planted.path.symlink_to(elsewhere)
    opened = Stream("/data/open", root=root)
    opened.path.mkdir()
    opened.path.chmod(0o755)
    theirs = Stream("/data/theirs", root=root)
    theirs.path.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs.path, 4242, 4242)
    for hostile, says in ((planted, "is a symlink"), (opened, "is open to other users"),
                          *([(theirs, "belongs to another user")] if os.geteuid() == 0
                            else [])):
        for write in (lambda s: s.open("{}"), lambda s: s.set_trainer("running"),
                      lambda s: s.output()):
            with pytest.raises(StreamFolderError, match=says):
                write(hostile)
    assert not list(elsewhere.iterdir()), "a unit or a file was written through the link"
    # The root of the streams, too: others must not be able to write it.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StreamFolderError, match=r"shared is open to other users \(mode 0777\)"):
        Stream("/data/out", root=shared).open("{}")
