"""What hsx keeps on disk, against whoever can write or read it besides its owner.

- A checkpoint lies in the job's output: whoever can write there must not get code run
  by a trainer that resumes from it. A crafted trainer state (a pickle that would create
  a file when loaded) is refused with an error naming the file, and nothing runs; an
  honest checkpoint still resumes exactly (the same weights as a run never interrupted).
  A bucket draft's upload marker cannot name files outside the local draft folder.
- An output's files and folders, a draft's, the export's and the coordinator's ledger
  (with its -wal and -shm files) are owner-only by default, and get HSX_OUTPUT_MODE's
  mode when it is set, whatever the umask.
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.output import Output, ShardWriter
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR
from hsx.output.local_storage import (
    OUTPUT_MODE_ENV,
    make_output_dirs,
    output_dir_mode,
    output_file_mode,
    replace_output_file,
)
from hsx.spec import JobSpec

LAYERS = [1, 2, 4]
HIDDEN = 64


class _WritesAFile:
    """Unpickled, calls open(marker, "w"): the file appears only if the load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _modes(root: Path) -> Iterator[tuple[Path, int]]:
    """Every folder and file under `root` (itself included) with its permission bits."""
    yield root, stat.S_IMODE(root.stat().st_mode)
    for path in sorted(root.rglob("*")):
        yield path, stat.S_IMODE(path.lstat().st_mode)


def _assert_modes(root: Path, file_mode: int, dir_mode: int) -> None:
    wrong = [(str(p.relative_to(root.parent)), oct(m)) for p, m in _modes(root)
             if m != (dir_mode if p.is_dir() else file_mode)]
    assert not wrong, f"want files {oct(file_mode)}, folders {oct(dir_mode)}: {wrong}"


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_crafted_trainer_state_is_refused_and_runs_nothing(tmp_path: Path, how: str) -> None:
    torch = pytest.importorskip("torch")
    from hsx_workers.trainer import TrainRefused
    from hsx_workers.trainer.draft_trainer import read_trainer_state

    marker = tmp_path / "ran"
    hostile = tmp_path / "checkpoints" / "step-00000004" / "trainer_state.pt"
    hostile.parent.mkdir(parents=True)
    payload = {"optimizer": _WritesAFile(marker), "scheduler": {}, "state": {}}
    if how == "pickle":
        hostile.write_bytes(pickle.dumps(payload, protocol=2))
    else:
        torch.save(payload, hostile)
    with pytest.raises(TrainRefused, match="is not a checkpoint hsx can read safely") as err:
        read_trainer_state(hostile)
    assert str(hostile) in str(err.value) and "afresh" in str(err.value)
    assert not marker.exists(), "loading the checkpoint ran the code it named"


def test_a_trainer_resuming_from_a_crafted_checkpoint_refuses_it(
        tmp_path: Path, tiny_llama: Path) -> None:
    pytest.importorskip("speculators.models.eagle3")
    from hsx_workers.trainer import DraftTrainer, TrainRefused
    from tests.unit.test_trainer import make_output, spec

    root = make_output(tmp_path / "out", tiny_llama)
    DraftTrainer(root, spec(max_steps=2)).run()
    newest = root / DRAFT_CHECKPOINTS / "step-00000002"
    marker = tmp_path / "ran"
    # Whoever can write the output replaces the trainer state of its newest checkpoint.
    (newest / "trainer_state.pt").write_bytes(pickle.dumps(
        {"optimizer": _WritesAFile(marker), "scheduler": {}, "state": {"step": 2}}, protocol=2))
    with pytest.raises(TrainRefused, match=r"trainer_state\.pt is not a checkpoint hsx can "
                                           r"read safely"):
        DraftTrainer(root, spec(max_steps=4)).run()
    assert not marker.exists(), "resuming ran the code the checkpoint named"


@pytest.mark.parametrize(("body", "says"), [
    (b"not a checkpoint at all", "is not a checkpoint hsx can read safely"),
    (None, "is missing"),
], ids=["garbage", "missing"])
def test_an_unreadable_trainer_state_names_the_file(tmp_path: Path, body: bytes | None,
                                                    says: str) -> None:
    pytest.importorskip("torch")
    from hsx_workers.trainer import TrainRefused
    from hsx_workers.trainer.draft_trainer import read_trainer_state

    path = tmp_path / "checkpoints" / "step-00000002" / "trainer_state.pt"
    path.parent.mkdir(parents=True)
    if body is not None:
        path.write_bytes(body)
    with pytest.raises(TrainRefused, match=says) as err:
        read_trainer_state(path)
    assert str(path) in str(err.value)


def test_a_resumed_training_ends_where_an_uninterrupted_one_does(
        tmp_path: Path, tiny_llama: Path) -> None:
    """Optimizer moments, scheduler, step and the units of the epoch come back exactly:
    5 steps then 3 more give the weights 8 steps in one run give."""
    pytest.importorskip("speculators.models.eagle3")
    import torch
    from safetensors.torch import load_file

    from hsx_workers.trainer import DraftTrainer
    from tests.unit.test_trainer import make_output, spec

    whole = make_output(tmp_path / "whole", tiny_llama)
    DraftTrainer(whole, spec(max_steps=8)).run()
    parts = make_output(tmp_path / "parts", tiny_llama)
    DraftTrainer(parts, spec(max_steps=5)).run()
    resumed = DraftTrainer(parts, spec(max_steps=8))
    resumed.run()
    assert resumed.resumed_from == 5
    ours, theirs = (load_file(str(root / DRAFT_CHECKPOINTS / "step-00000008" /
                                  "model.safetensors")) for root in (parts, whole))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "the resumed run drifted"


def test_a_draft_within_the_outputs_quota(tmp_path: Path, tiny_llama: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """HSX_QUOTA_BYTES covers the draft's checkpoints too: a checkpoint that would take
    the output past it is refused naming the quota, and the one before it stays."""
    pytest.importorskip("speculators.models.eagle3")
    from hsx_workers.trainer import DraftTrainer
    from hsx_workers.trainer.draft_trainer import TrainRefused
    from tests.unit.test_trainer import make_output, spec

    root = make_output(tmp_path / "out", tiny_llama)
    DraftTrainer(root, spec(max_steps=2, checkpoint_every=2)).run()
    used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    monkeypatch.setenv("HSX_QUOTA_BYTES", str(used + 1024))  # room for no more checkpoint
    with pytest.raises(TrainRefused, match=r"over its quota of .* bytes \(HSX_QUOTA_BYTES\)"):
        DraftTrainer(root, spec(max_steps=4, checkpoint_every=2, keep_checkpoints=3)).run()
    kept = sorted(p.name for p in (root / DRAFT_CHECKPOINTS).iterdir())
    assert kept == ["step-00000002"]
    assert not list((root / DRAFT_DIR / ".tmp").iterdir())


@pytest.mark.parametrize("name", ["../../escaped", ".hidden", "sub/../../escaped"])
def test_a_bucket_drafts_marker_cannot_name_files_outside_the_folder(
        tmp_path: Path, name: str) -> None:
    """Whoever can write the bucket writes the uploaded.json a resume or eval-draft
    downloads by: its names must stay plain files of the draft folder."""
    import json

    from hsx.draft import BucketDraft
    from hsx.output import StorageError
    from hsx.output.local_storage import LocalStorage

    bucket = LocalStorage(tmp_path / "bucket")
    bucket.put("draft/escaped", b"x")
    bucket.put("draft/uploaded.json", json.dumps(
        {"files": {name: {"size": 1, "mtime_ns": 0}}}).encode())
    work = tmp_path / "work" / "a" / "b"
    with pytest.raises(StorageError, match="not a file of a draft folder"):
        BucketDraft(bucket, work).pull_draft(tries=1)
    assert not list(tmp_path.glob("work/**/*escaped*")), "a file was written outside draft/"


# ---------------------------------------------------------------------- file modes


def _write_output(root: Path) -> Output:
    """An output as `hsx extract` writes it: the folder made by hsx, the manifest, one
    committed shard."""
    import numpy as np

    from tests.unit.outputs import make_manifest

    out = Output(root)
    out.check_writable()
    out.publish_manifest(make_manifest(layers=LAYERS, hidden_size=HIDDEN, num_layers=4,
                                       units={0: [0, 1]}))
    rng = np.random.default_rng(0)
    with ShardWriter(root, 0, layers=LAYERS, hidden_size=HIDDEN, storage_dtype="bf16") as w:
        for i in (0, 1):
            w.add(i, rng.integers(16, 200, 9).astype(np.int32), np.ones(9, np.uint8),
                  rng.standard_normal((9, len(LAYERS), HIDDEN)).astype(np.float32))
        w.commit(errors=[])
    return out


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """A umask stricter than any setting: the modes must still be the configured ones."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize(("setting", "file_mode", "dir_mode", "umask"), [
    (None, 0o600, 0o700, False),
    ("0640", 0o640, 0o750, False),
    ("0640", 0o640, 0o750, True),
    ("660", 0o660, 0o770, False),
], ids=["default", "0640", "0640-umask-077", "660"])
def test_an_outputs_files_and_folders_get_the_output_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
        setting: str | None, file_mode: int, dir_mode: int, umask: bool) -> None:
    if setting is None:
        monkeypatch.delenv(OUTPUT_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(OUTPUT_MODE_ENV, setting)
    if umask:
        request.getfixturevalue("strict_umask")
    assert (output_file_mode(), output_dir_mode()) == (file_mode, dir_mode)
    root = tmp_path / "jobs" / "out"  # hsx makes both folders
    out = _write_output(root)
    assert out.read_manifest() is not None and out.committed_units() == {0}
    replace_output_file(root / DRAFT_DIR / "train.json", "{}")  # how the trainer writes
    _assert_modes(tmp_path / "jobs", file_mode, dir_mode)


@pytest.mark.parametrize(("setting", "file_mode"), [(None, 0o600), ("0640", 0o640)],
                         ids=["default", "0640"])
def test_the_ledger_and_its_wal_get_the_output_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None,
        file_mode: int) -> None:
    from hsx_service.ledger import Ledger

    if setting is None:
        monkeypatch.delenv(OUTPUT_MODE_ENV, raising=False)
    else:
        monkeypatch.setenv(OUTPUT_MODE_ENV, setting)
    folder = tmp_path / "state"
    ledger = Ledger(folder / "ledger.sqlite")
    try:
        ledger.insert_job("a", JobSpec(model="/m", dataset="/d.jsonl", output="/o"), "/o")
        names = {p.name for p in folder.iterdir()}
        assert {"ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"} <= names
        _assert_modes(folder, file_mode, output_dir_mode())
    finally:
        ledger.close()


def test_a_trained_draft_gets_the_output_mode(tmp_path: Path, tiny_llama: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("speculators.models.eagle3")
    from hsx_workers.trainer import DraftTrainer
    from tests.unit.test_trainer import make_output, spec

    monkeypatch.delenv(OUTPUT_MODE_ENV, raising=False)
    root = make_output(tmp_path / "out", tiny_llama)
    DraftTrainer(root, spec(max_steps=3)).run()
    _assert_modes(root / DRAFT_DIR, 0o600, 0o700)


def test_existing_folders_keep_their_mode(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OUTPUT_MODE_ENV, raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    make_output_dirs(shared / "a" / "b")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    assert [stat.S_IMODE((shared / p).stat().st_mode) for p in ("a", "a/b")] == [0o700] * 2


@pytest.mark.parametrize("setting", ["rw", "0644x", "0400", "0755", "4600", "0060"])
def test_a_bad_output_mode_is_refused(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv(OUTPUT_MODE_ENV, setting)
    with pytest.raises(ValueError, match=OUTPUT_MODE_ENV):
        output_file_mode()
