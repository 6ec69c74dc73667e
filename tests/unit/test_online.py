"""The online job's stream (hsx.online's protocol and `StreamHub`) and the driver's feed
(hsx_service.online): which unit the engines capture next for which training worker and
epoch, the bounded buffer, and the books made again when a worker starts a run from a
checkpoint. The hub stands here for its Ray actor (hsx_workers.stream)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hsx.online import (
    EPOCH_STRIDE,
    Books,
    Captured,
    Resume,
    StreamHub,
    rank_of,
    split_unit,
    stream_unit,
)
from hsx.plan import WorkUnit
from hsx_service.online import OnlineFeed

UNITS = [WorkUnit(0, 0, 10, 100), WorkUnit(1, 10, 20, 100), WorkUnit(2, 20, 30, 100)]


class HubStream:
    """The driver's port on a hub in this process (DriverStream does it over Ray)."""

    def __init__(self) -> None:
        self.hub = StreamHub()

    def books(self) -> Books:
        return self.hub.books()

    def put(self, unit: Captured, payload: Any) -> bool:
        return self.hub.put(unit, payload)

    def close(self) -> None:
        pass

    # what a training worker does
    def start_run(self, epoch: int, units_done: list[int], rank: int = 0, world: int = 1,
                  node: str = "") -> None:
        self.hub.start_run(Resume.new(rank, world, epoch, units_done, node))

    def take(self, sid: int) -> None:
        self.hub.take(sid)


def capture(feed: OnlineFeed, units: list[WorkUnit], size: int = 100,
            node: str = "n1") -> None:
    """The engines captured these stream units (each `size` bytes)."""
    for unit in units:
        feed.committed(unit.unit, size, node, f"bytes of {unit.unit}")


def ids(units: list[WorkUnit]) -> list[tuple[int, int]]:
    return [split_unit(u.unit) for u in units]


@pytest.fixture
def stream() -> HubStream:
    return HubStream()


def test_stream_units_name_their_epoch_and_their_worker() -> None:
    assert stream_unit(0, 7) == 7
    assert split_unit(stream_unit(3, 7)) == (3, 7)
    assert stream_unit(1, 0) == EPOCH_STRIDE
    assert [rank_of(u, 2) for u in range(4)] == [0, 1, 0, 1]  # as offline: u % N


def test_the_hub_holds_what_no_worker_has_taken_and_hands_each_its_own() -> None:
    hub = StreamHub()
    assert hub.ready(0, 0) == [] and set(hub.books().waits) == {0}  # waits for units
    assert hub.put(Captured(0, 0, 300, "a"), "p0")
    assert hub.put(Captured(stream_unit(1, 1), 1, 200, "a"), "p1")
    assert not hub.put(Captured(0, 0, 300, "a"), "again")  # a unit is in it once
    assert hub.ready(0, 0) == [(0, "p0")]
    assert hub.ready(1, 0) == []  # epoch 1's unit is not for a worker in epoch 0 yet
    assert set(hub.books().waits) == {1}  # worker 0 got its unit
    assert hub.ready(1, 1) == [(stream_unit(1, 1), "p1")]
    books = hub.books()
    assert set(books.units) == {0, EPOCH_STRIDE + 1} and set(books.reading) == set(books.units)
    hub.take(0)
    hub.lose(stream_unit(1, 1))  # its node died before the worker read it
    books = hub.books()
    assert books.units == {} and books.lost == [EPOCH_STRIDE + 1]
    assert (books.taken_units, books.taken_bytes) == (1, 300)
    assert hub.books().lost == []  # told once


def test_units_go_out_epoch_after_epoch_once_the_plan_is_whole(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS[:2], whole=False)
    assert ids(feed.take(10)) == [(0, 0), (0, 1)]
    assert feed.take(10) == []  # more units may still be planned: no epoch 1 yet
    feed.planned(UNITS[2:], whole=True)
    assert ids(feed.take(4)) == [(0, 2), (1, 0), (1, 1), (1, 2)]
    sid = stream_unit(1, 1)
    assert feed.rows_of(sid) == UNITS[1]


def test_the_engines_wait_for_the_trainer_beyond_the_buffer(stream: HubStream) -> None:
    # Each unit is 100 tokens x 1 byte; the buffer holds 250 bytes.
    feed = OnlineFeed(stream, buffer_bytes=250, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    first = feed.take(10)
    assert ids(first) == [(0, 0), (0, 1)]
    assert feed.waiting_for is not None and "the trainer" in feed.waiting_for
    assert "online buffer" in feed.waiting_for
    # Both captured (100 bytes each in the stream): still no room for a third.
    capture(feed, first)
    assert feed.take(10) == []
    stream.take(first[0].unit)  # the trainer took one
    assert ids(feed.take(1)) == [(0, 2)]
    assert feed.waiting_for is None
    assert feed.take(1) == [] and "200 B of captured states" in (feed.waiting_for or "")


def test_a_unit_larger_than_the_buffer_still_moves(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    assert ids(feed.take(10)) == [(0, 0)]  # alone, when nothing else is held


def test_the_default_buffer_holds_three_of_the_largest_units(stream: HubStream) -> None:
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


def test_a_buffer_larger_than_rays_object_stores_is_refused_before_any_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    from hsx.spec import JobSpec
    from hsx_service import runner
    from hsx_service.errors import JobRefused
    from hsx_workers import stream as ray_stream

    closed: list[str] = []

    class Offline:  # no Ray here: the stream actor is not started
        def __init__(self, location: str) -> None:
            self.location = location

        def close(self) -> None:
            closed.append(self.location)

    monkeypatch.setattr(ray_stream, "DriverStream", Offline)
    spec = JobSpec(model="/m", dataset="/d.jsonl", output="/out", layers=[1, 2, 4],
                   train={"online": True})
    job = SimpleNamespace(spec=spec, layers=[1, 2, 4], manifest=SimpleNamespace(hidden_size=4096),
                          units=[WorkUnit(0, 0, 10, 65536)],
                          output=SimpleNamespace(location="/out"))
    store = {"object_store_memory": 64 * 2**20}  # a small node's
    monkeypatch.setattr(ray, "cluster_resources", lambda: store)
    with pytest.raises(JobRefused, match=r"train\.buffer_bytes: the online stream needs "
                                         r"4,608 MiB .* the cluster's hold 64 MiB"):
        runner.online_feed(job)  # type: ignore[arg-type]
    assert closed == ["/out"]
    store["object_store_memory"] = 8 * 2**30
    assert runner.online_feed(job).buffer_bytes == 3 * 65536 * 3 * 4096 * 2  # type: ignore[arg-type]


def test_a_new_trainer_run_gets_back_what_its_checkpoint_had_not(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(0, [])
    handed = feed.take(3)
    assert ids(handed) == [(0, 0), (0, 1), (0, 2)]
    capture(feed, handed)
    # The trainer took units 0 and 1, checkpointed after unit 0 only, and died; unit 2
    # is still in the stream. Its next run resumes at (epoch 0, [0]).
    stream.take(stream_unit(0, 0))
    stream.take(stream_unit(0, 1))
    stream.start_run(0, [0])
    assert ids(feed.take(2)) == [(0, 1), (1, 0)]


def test_a_run_resumed_in_a_later_epoch_drops_the_earlier_books(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(1, [0, 2])
    assert ids(feed.take(2)) == [(1, 1), (2, 0)]


def test_a_unit_whose_bytes_were_lost_is_captured_again(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(0, [])
    handed = feed.take(3)
    capture(feed, handed, node="engine-node")
    stream.hub.lose(stream_unit(0, 1))  # the engine's node died before the worker read it
    assert ids(feed.take(1)) == [(0, 1)]


def test_a_unit_the_books_count_but_nobody_holds_is_captured_again_once_a_worker_wants_it(
        stream: HubStream) -> None:
    # The buffer is full (a later epoch's unit), and the books say unit 2 of epoch 0 is
    # captured: it was in the stream when the run began, then left it unseen. The worker
    # waits for it; its word settles the books, and unit 2 is captured again.
    feed = OnlineFeed(stream, buffer_bytes=150, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    capture(feed, [WorkUnit(2, 20, 30, 100)])
    stream.start_run(0, [0, 1])
    capture(feed, [WorkUnit(stream_unit(1, 0), 0, 10, 100)])
    feed.read_books()  # the run began with unit 2 in the stream
    stream.hub.units.pop(2)  # then it left, and no worker said so
    assert feed.take(2) == [] and feed.waiting_for is not None  # the books: nothing due
    run = stream.hub.runs[0].run
    assert stream.hub.ready(0, 0, wanted=[2], run=run) == []
    assert stream.hub.books().wants == {0: (0, [2])}
    assert ids(feed.take(2)) == [(0, 2)]
    assert feed.take(2) == []  # being captured: not again


def test_a_worker_waiting_in_a_later_epoch_is_not_sent_earlier_ones(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(0, [])
    capture(feed, feed.take(3))
    for u in range(3):
        stream.take(u)
    # A second copy of unit 1 (captured again after a fault) is lost after the worker
    # finished epoch 0: the books alone would capture it once more.
    stream.hub.put(Captured(1, 0, 100, "e"), "again")
    stream.hub.lose(1)
    run = stream.hub.runs[0].run
    assert stream.hub.ready(0, 1, wanted=[0, 1, 2], run=run) == []
    assert ids(feed.take(5)) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]


def test_a_run_that_ended_neither_takes_units_nor_speaks_for_its_worker() -> None:
    hub = StreamHub()
    old = Resume.new(0, 1, 0, [])
    hub.start_run(old)
    hub.put(Captured(3, 0, 100, "e"), "p3")
    assert hub.ready(0, 0, wanted=[3], run=old.run) == [(3, "p3")]
    hub.start_run(Resume.new(0, 1, 0, []))  # its worker was restarted
    hub.take(3, run=old.run)  # the old run, still reading as its node went down
    assert set(hub.books().units) == {3}  # the new run's to read
    hub.units.pop(3)
    hub.ready(0, 0, wanted=[3], run=old.run)
    assert hub.books().wants == {}


def test_a_status_asking_who_waits_leaves_the_lost_units_to_the_driver() -> None:
    # The trainer's status asks the stream who waits as often as the driver reads its
    # books: a lost unit told to the status alone was never captured again, and its
    # worker waited for it forever.
    from hsx_workers.stream import StreamActor

    actor = StreamActor()  # the Ray actor's class, called in this process
    feed = OnlineFeed(actor, buffer_bytes=10**9, bytes_per_token=1)  # type: ignore[arg-type]
    feed.planned(UNITS, whole=True)
    actor.start_run(Resume.new(0, 1, 0, []))
    handed = feed.take(3)
    for unit in handed:
        feed.committed(unit.unit, 100, "engine-node", [f"bytes of {unit.unit}"])
    actor.lose(stream_unit(0, 1))
    assert actor.waiting() == {}  # what stream_waits asks, for the status
    assert ids(feed.take(1)) == [(0, 1)]


def test_two_workers_each_get_their_own_units_every_epoch(stream: HubStream) -> None:
    units = [WorkUnit(u, 10 * u, 10 * u + 10, 100) for u in range(4)]
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1, workers=2)
    feed.planned(units, whole=True)
    stream.start_run(0, [], rank=0, world=2, node="t0")
    stream.start_run(0, [], rank=1, world=2, node="t1")
    handed = feed.take(4)
    # Each epoch's units are split u % 2, served to the worker with least waiting first.
    assert sorted(ids(handed)) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    capture(feed, handed, node="e")
    assert [u for u, _ in stream.hub.ready(0, 0)] == [0, 2]
    assert [u for u, _ in stream.hub.ready(1, 0)] == [1, 3]
    feed.read_books()  # as each round does
    runs, held = feed.where()
    assert runs == {0: "t0", 1: "t1"}
    assert held == {"t0": 200, "t1": 200}  # handed to the workers, being read
    # Worker 1 died after taking unit 1 and checkpointing nothing: only its units come
    # back; worker 0's books are untouched.
    stream.take(1)
    stream.start_run(0, [], rank=1, world=2)
    nxt = ids(feed.take(1))
    assert nxt == [(0, 1)]


def test_a_starved_worker_gets_its_unit_whatever_the_buffer_holds(stream: HubStream) -> None:
    # DDP: worker 1 waiting for data holds worker 0 too. The buffer is full of worker 0's
    # units; worker 1's next one moves anyway, and only then the buffer holds the rest.
    units = [WorkUnit(u, 10 * u, 10 * u + 10, 100) for u in range(4)]
    feed = OnlineFeed(stream, buffer_bytes=250, bytes_per_token=1, workers=2)
    feed.planned(units, whole=True)
    stream.start_run(0, [], rank=0, world=2)
    stream.start_run(0, [1, 3], rank=1, world=2)  # worker 1 is in epoch 0, units done
    capture(feed, [WorkUnit(0, 0, 10, 100), WorkUnit(2, 20, 30, 100)])
    capture(feed, [WorkUnit(stream_unit(1, 0), 0, 10, 100)])
    assert ids(feed.take(4)) == [(1, 1)]
    assert feed.take(4) == [] and feed.waiting_for is not None


def test_the_feed_ends_when_the_trainer_is_done_not_when_it_stops(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    stream.start_run(0, [])
    stream.hub.set_trainer("stopped")  # its coordinator shut down: it resumes later
    feed.read_books()
    assert not feed.finished()
    stream.hub.set_trainer("done", step=30)
    assert feed.take(5) == []
    assert feed.finished() and feed.ended == "done"


def test_a_failed_trainer_ends_the_feed_with_its_error(stream: HubStream) -> None:
    feed = OnlineFeed(stream, buffer_bytes=10**9, bytes_per_token=1)
    stream.hub.set_trainer("failed", error="the trainer died 4 times")
    feed.read_books()
    assert feed.finished() and feed.error == "the trainer died 4 times"


def test_what_the_trainer_needs_first_passes_a_buffer_of_later_epochs(
        stream: HubStream) -> None:
    # The buffer is full of epoch 1's unit 0 when the trainer, killed in epoch 0, resumes
    # needing unit 2 of epoch 0 again: it is captured, or nothing ever moves.
    feed = OnlineFeed(stream, buffer_bytes=150, bytes_per_token=1)
    feed.planned(UNITS, whole=True)
    capture(feed, [WorkUnit(stream_unit(1, 0), 0, 10, 100)], size=300)
    stream.start_run(0, [0, 1])
    assert ids(feed.take(2)) == [(0, 2)]
    assert feed.take(2) == [] and feed.waiting_for is not None


def test_a_stream_name_is_one_per_output() -> None:
    from hsx_workers.stream import stream_name

    assert stream_name("/a") == stream_name("/a") != stream_name("/b")
