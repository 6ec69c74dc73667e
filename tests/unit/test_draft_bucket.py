"""`hsx.draft.BucketDraft` on a local folder read like a bucket (no training): what a
push uploads and in which order, what a reader takes while the trainer replaces draft/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hsx.draft import BucketDraft
from hsx.output import StorageError
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR, DRAFT_UPLOADED
from tests.unit.test_output import RangedStorage


def _draft(root: Path, step: int, weights: bytes) -> None:
    ckpt = root / DRAFT_CHECKPOINTS / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(weights)
    (ckpt / "config.json").write_text("{}")
    (root / DRAFT_DIR / "model.safetensors").write_bytes(weights)
    (root / DRAFT_DIR / "train.json").write_text(json.dumps({"step": step}))
    (root / DRAFT_DIR / ".stop").write_text("")  # hidden: never uploaded


def test_push_uploads_checkpoints_then_markers_and_prunes(tmp_path: Path) -> None:
    bucket = RangedStorage(tmp_path / "bucket")
    work = tmp_path / "work"
    _draft(work, 2, b"w2")
    mirror = BucketDraft(bucket, work)
    mirror.push()
    assert sorted(mirror.complete_checkpoints()) == [2]
    top = json.loads(bucket.read(f"{DRAFT_DIR}/{DRAFT_UPLOADED}"))
    assert sorted(top["files"]) == ["model.safetensors", "train.json"]
    assert top["checkpoints"] == [2]
    assert not bucket.exists(f"{DRAFT_DIR}/.stop")
    # A newer checkpoint; the old one pruned here is pruned in the bucket, marker first.
    shutil.rmtree(work / DRAFT_CHECKPOINTS / "step-00000002")
    newer = work / DRAFT_CHECKPOINTS / "step-00000004"
    newer.mkdir()
    (newer / "model.safetensors").write_bytes(b"w4")
    mirror.push()
    assert sorted(mirror.complete_checkpoints()) == [4]
    assert sorted(i.key for i in bucket.list(DRAFT_CHECKPOINTS)) == [
        f"{DRAFT_CHECKPOINTS}/step-00000004/model.safetensors",
        f"{DRAFT_CHECKPOINTS}/step-00000004/{DRAFT_UPLOADED}"]


def test_a_reader_takes_draft_only_whole(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = RangedStorage(tmp_path / "bucket")
    work = tmp_path / "work"
    _draft(work, 2, b"old")
    BucketDraft(bucket, work).push()
    reader = BucketDraft(bucket, tmp_path / "reader")
    # The trainer has deleted the marker and is replacing files: nothing is taken.
    marker = bucket.read(f"{DRAFT_DIR}/{DRAFT_UPLOADED}")
    bucket.delete(f"{DRAFT_DIR}/{DRAFT_UPLOADED}")
    with pytest.raises(StorageError, match="kept changing"):
        reader.pull_draft(tries=1)
    bucket.create(f"{DRAFT_DIR}/{DRAFT_UPLOADED}", marker)
    # The marker changes while the reader downloads: it reads again, and ends whole.
    (work / DRAFT_DIR / "model.safetensors").write_bytes(b"newer")
    reads = 0
    real_read = bucket.read

    def read(key: str) -> bytes:
        nonlocal reads
        if key.endswith(DRAFT_UPLOADED) and key.startswith(DRAFT_DIR + "/u"):
            reads += 1
            if reads == 2:  # between the reader's two reads of the marker
                BucketDraft(bucket, work).push_draft()
        return real_read(key)

    monkeypatch.setattr(bucket, "read", read)
    assert reader.pull_draft()
    assert (reader.draft / "model.safetensors").read_bytes() == b"newer"
    assert reads >= 4
    # Nothing at all in the bucket: no draft.
    assert not BucketDraft(RangedStorage(tmp_path / "empty"), tmp_path / "r2").pull_draft()
