"""A draft trained on a bucket output, into the bucket: real SeaweedFS on loopback, real
training of a tiny draft on CPU (no engines: the output is written with ShardWriter).

- `hsx train s3://...` (no --draft-dir) trains in a working folder under $HSX_CACHE and
  leaves each checkpoint and draft/ in the bucket, each ended by its uploaded.json.
- A second `hsx train` with an empty cache (another machine) resumes from the bucket's
  newest checkpoint; a checkpoint upload without its marker (a crash) is never taken.
- The download eval-draft makes gives the bucket's draft byte for byte, and it loads;
  `hsx export` reads the same bucket.
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path

import pytest

from hsx.cli import main
from hsx.draft import BucketDraft, draft_folder, fetch_draft
from hsx.output import Output
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR, DRAFT_METRICS, DRAFT_UPLOADED
from hsx.output.local_storage import LocalStorage
from tests.s3server import SeaweedS3
from tests.unit.test_trainer import HIDDEN, make_output

pytestmark = pytest.mark.s3
pytest.importorskip("speculators.models.eagle3")

TRAIN = ["--set", "draft_vocab_size=128", "--set", "batch_tokens=48", "--set",
         "checkpoint_every=2", "--set", "keep_checkpoints=2", "--set", "steps=200",
         "--set", "val_fraction=0.25"]


@pytest.fixture
def bucket_output(s3_server: SeaweedS3, tiny_llama: Path, tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> Output:
    """The trainer tests' output (18 samples, 3 units), copied into a fresh prefix."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    local = LocalStorage(make_output(tmp_path / "local", tiny_llama))
    output = Output(f"s3://{s3_server.bucket}/draft-{secrets.token_hex(4)}")
    for info in local.list():
        output.storage.put(info.key, local.read(info.key))
    return output


def _objects(output: Output, folder: str) -> dict[str, bytes]:
    """The objects directly in `folder` of the bucket, by name."""
    return {info.key.rpartition("/")[2]: output.storage.read(info.key)
            for info in output.storage.list(folder) if info.key.count("/") ==
            folder.count("/") + 1}


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in (root / DRAFT_CHECKPOINTS).iterdir())


def test_train_into_the_bucket_and_resume_elsewhere(
    bucket_output: Output, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    uri = bucket_output.uri
    monkeypatch.setenv("HSX_CACHE", str(tmp_path / "node-a"))
    assert main(["train", uri, "--set", "max_steps=4", *TRAIN]) == 0
    captured = capsys.readouterr()
    assert f"-> {uri}/draft" in (captured.out + captured.err).replace("\n", "")
    work = draft_folder(bucket_output)
    assert work.is_relative_to(tmp_path / "node-a")
    assert _steps(work) == ["step-00000002", "step-00000004"]
    for name in _steps(work):
        uploaded = _objects(bucket_output, f"{DRAFT_CHECKPOINTS}/{name}")
        marker = json.loads(uploaded.pop(DRAFT_UPLOADED))
        assert marker["step"] == int(name.split("-")[1])
        assert marker["files"] == {k: len(v) for k, v in uploaded.items()}
        assert uploaded == {p.name: p.read_bytes()
                            for p in (work / DRAFT_CHECKPOINTS / name).iterdir()}
    top = _objects(bucket_output, DRAFT_DIR)
    assert set(json.loads(top.pop(DRAFT_UPLOADED))["files"]) == set(top)
    assert {"config.json", "model.safetensors", "metrics.jsonl", "train.json"} <= set(top)
    assert json.loads(top["train.json"])["state"] == "done"

    # A crashed upload of step 6: its objects, no marker.
    bucket_output.storage.put(f"{DRAFT_CHECKPOINTS}/step-00000006/model.safetensors", b"cut")
    # Another machine, an empty cache: resumes from the bucket's step 4.
    monkeypatch.setenv("HSX_CACHE", str(tmp_path / "node-b"))
    assert main(["train", uri, "--set", "max_steps=8", *TRAIN]) == 0
    captured = capsys.readouterr()
    assert "(resumed from step 4)" in captured.out + captured.err
    other = draft_folder(bucket_output)
    assert other.is_relative_to(tmp_path / "node-b")
    steps = [json.loads(x)["step"] for x in
             bucket_output.storage.read(DRAFT_METRICS).decode().splitlines()]
    assert steps == list(range(1, 9))
    uploaded = sorted(BucketDraft(bucket_output.storage, other).complete_checkpoints())
    assert [f"step-{s:08d}" for s in uploaded] == _steps(other)
    assert "step-00000008" in _steps(other)
    step6 = _objects(bucket_output, f"{DRAFT_CHECKPOINTS}/step-00000006")
    assert step6.get("model.safetensors") != b"cut"  # written again, whole, by this run
    if "step-00000006" in _steps(other):
        assert DRAFT_UPLOADED in step6

    # What eval-draft downloads for vLLM: the bucket's draft/, byte for byte, loadable.
    monkeypatch.setenv("HSX_CACHE", str(tmp_path / "node-c"))
    fetched = fetch_draft(bucket_output) / DRAFT_DIR
    top = _objects(bucket_output, DRAFT_DIR)
    marker = json.loads(top.pop(DRAFT_UPLOADED))
    assert {p.name: p.read_bytes() for p in fetched.iterdir()
            if p.is_file() and p.name != DRAFT_UPLOADED} == top
    assert json.loads((fetched / DRAFT_UPLOADED).read_text()) == marker
    from speculators.models.eagle3 import Eagle3DraftModel

    assert Eagle3DraftModel.from_pretrained(str(fetched)).fc.weight.shape == (
        HIDDEN, 2 * HIDDEN)

    # hsx export reads the same bucket.
    dest = tmp_path / "speculators"
    assert main(["export", "--format", "speculators", uri, str(dest), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"] == 18


def test_the_coordinator_trains_a_bucket_output(
    bucket_output: Output, tmp_path: Path, ray_local: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The coordinator's trainer actor (Ray) gets the Output, trains in its node's
    working folder, uploads into the bucket; the status reads the bucket's copy."""
    from hsx.spec import TrainSpec
    from hsx.wire import TrainState
    from hsx_service.ledger import Ledger
    from hsx_service.training import TrainingRequest
    from hsx_service.trainings import Trainings

    monkeypatch.delenv("HSX_CACHE", raising=False)
    work = draft_folder(bucket_output)  # the actor's (Ray's workers keep the default)
    spec = TrainSpec(draft_vocab_size=128, batch_tokens=48, checkpoint_every=2, steps=200,
                     max_steps=4, val_fraction=0.25, eval_prompts=0, device="cpu")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    trainings = Trainings(ledger)
    try:
        trainings.start(TrainingRequest(bucket_output.uri, spec, job_id="job-1"))
        assert trainings.wait_idle(600)
        row = ledger.training("job-1")
        assert row is not None and row.state is TrainState.done, row
        assert BucketDraft(bucket_output.storage, tmp_path / "x").complete_checkpoints()
        monkeypatch.setenv("HSX_CACHE", str(tmp_path / "coordinator"))
        from hsx.draft import draft_view

        status = trainings.status(row, draft_view(bucket_output))
        assert status.step == 4 and status.checkpoint_step == 4
        assert [p.step for p in status.history] == [1, 2, 3, 4]
    finally:
        shutil.rmtree(work, ignore_errors=True)
