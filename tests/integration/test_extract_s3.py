"""Extraction into a bucket, end to end: real vLLM CPU engines, real Ray, real SeaweedFS.

- A job with `output: s3://...` (credentials from the AWS_* variables) runs through the
  job driver `hsx extract` uses, on the session's warm engines: every good row exactly
  once, bad rows in `errors()`, every checksum verified from the bucket, tensors equal
  to the same job on local disk.
- A worker killed while its shard streams as a multipart upload: no partial object is
  ever listed, the unit is retried, the job completes, no upload or orphan is left, and
  a rerun has nothing to do.
- `HiddenStatesDataset("s3://...")`, `hsx export --format speculators` from the bucket,
  and `hsx train s3://...` (checkpoints uploaded into it) read the same output.
- A dataset in the bucket (one split of a prefix laid out as UltraChat's) extracts end
  to end, with the token ids of the same rows read from a local file; a rerun has
  nothing to do, and one whose objects changed is refused; a dataset object that does
  not exist is refused before any engine starts, naming it.
"""

from __future__ import annotations

import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR, DRAFT_UPLOADED, SHARDS_DIR
from hsx.output.object_storage import ObjectStoreStorage
from hsx_service.errors import JobRefused
from hsx_service.runner import JobSummary, run_job
from hsx_workers.tiny_models import ChatDataset, make_chat_dataset, write_rows
from tests.s3server import SeaweedS3

from .helpers import by_sample, relative_error

pytestmark = [pytest.mark.integration, pytest.mark.s3]


@pytest.fixture(scope="module")
def aws(s3_server: SeaweedS3) -> Iterator[SeaweedS3]:
    """The bucket's endpoint and credentials in the usual AWS_* variables."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3_server.env.items():
            patch.setenv(name, value)
        yield s3_server


def _uri(server: SeaweedS3, name: str) -> str:
    return f"s3://{server.bucket}/{name}-{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def s3_run(aws: SeaweedS3, make_job: Any, engine_pool: Any) -> tuple[str, JobSummary]:
    uri = _uri(aws, "extract")
    return uri, run_job(make_job(uri), pool=engine_pool)


def test_extraction_into_a_bucket(
    s3_run: tuple[str, JobSummary], chat_dataset: ChatDataset, make_job: Any,
    engine_pool: Any, tmp_path: Path,
) -> None:
    uri, summary = s3_run
    assert summary.output == uri and not summary.nothing_to_do
    assert summary.samples == len(chat_dataset.good_indices)
    assert summary.errors == len(chat_dataset.bad)
    ds = HiddenStatesDataset(uri)
    assert ds.complete and ds.verify() == len(ds.records) == summary.shards
    assert sorted(e["sample_index"] for e in ds.errors()) == sorted(chat_dataset.bad)
    in_bucket = by_sample(uri)  # type: ignore[arg-type]  # asserts no sample twice
    assert sorted(in_bucket) == chat_dataset.good_indices
    # The same job on local disk gives the same data.
    local = tmp_path / "local"
    run_job(make_job(local), pool=engine_pool)
    on_disk = by_sample(local)
    assert sorted(on_disk) == sorted(in_bucket)
    for index, sample in in_bucket.items():
        ref = on_disk[index]
        assert sample["input_ids"].tolist() == ref["input_ids"].tolist()
        assert sample["loss_mask"].tolist() == ref["loss_mask"].tolist()
        assert relative_error(sample["hidden_states"], ref["hidden_states"]).max() < 1e-2
    # Nothing but committed shards and the output's own objects are in the bucket.
    out = Output(uri)
    assert {i.key for i in out.storage.list(SHARDS_DIR)} == {r.shard for r in ds.records}
    storage = out.storage
    assert isinstance(storage, ObjectStoreStorage) and storage.multipart is not None
    assert storage.multipart.list_uploads() == []


def _worker_pid(engine_pool: Any, spec: Any) -> int:
    import ray

    from hsx.modelinfo import read_model_info
    from hsx_service.engine_pool import engine_key

    slots = engine_pool.actors[engine_key(spec, read_model_info(spec.model), spec.layers)]
    return int(ray.get(slots[0].actor.pid.remote(), timeout=60))


def test_a_worker_killed_mid_upload_leaves_no_partial_object(
    aws: SeaweedS3, make_job: Any, engine_pool: Any, s3_run: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Units of ~40k tokens of the tiny model (2 KiB each: ~80 MiB per shard), so a shard
    # streams as a multipart upload for a while (parts of 16 MiB; the first kept for
    # the header) before it completes.
    data = make_chat_dataset(tmp_path_factory.mktemp("big") / "chat.jsonl", n=800, seed=1)
    uri = _uri(aws, "killed")
    spec = make_job(uri, dataset=str(data.path), unit_tokens=40000)
    pid = _worker_pid(engine_pool, spec)
    storage = Output(uri).storage
    assert isinstance(storage, ObjectStoreStorage) and storage.multipart is not None
    outcome: dict[str, Any] = {}

    def shard_uploads() -> list[str]:  # not the probe of the writability check
        assert storage.multipart is not None
        return [k for k, _ in storage.multipart.list_uploads() if k.startswith(SHARDS_DIR)]

    def run() -> None:
        try:
            outcome["summary"] = run_job(spec, pool=engine_pool)
        except BaseException as err:  # re-raised below
            outcome["error"] = err

    thread = threading.Thread(target=run, name="killed-job")
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while not shard_uploads():
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.01)
        psutil.Process(pid).send_signal(signal.SIGKILL)
        # While the unit is retried: every shard a reader can see is whole.
        killed = shard_uploads()
        assert killed, "the upload completed before the worker died"
        assert not {i.key for i in storage.list(SHARDS_DIR)} & set(killed)
        if Output(uri).has_manifest():
            HiddenStatesDataset(uri).verify()
    finally:
        thread.join(timeout=600)
    if "error" in outcome:
        raise outcome["error"]
    summary: JobSummary = outcome["summary"]
    assert summary.restarts >= 1
    ds = HiddenStatesDataset(uri)
    assert ds.complete and ds.verify() == len(ds.records)
    assert sorted(by_sample(uri)) == data.good_indices  # type: ignore[arg-type]
    # The dead attempt's upload was aborted; only shards named by records are left.
    assert storage.multipart.list_uploads() == []
    assert {i.key for i in storage.list(SHARDS_DIR)} == {r.shard for r in ds.records}
    assert run_job(spec, pool=engine_pool).nothing_to_do


def test_export_and_training_read_the_bucket(
    s3_run: tuple[str, JobSummary], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from speculators.train.data import ArrowDataset

    from hsx.cli import main

    uri, summary = s3_run
    dest = tmp_path / "speculators"
    assert main(["export", "--format", "speculators", uri, str(dest), "--json"]) == 0
    exported = ArrowDataset(max_len=256, datapath=dest, on_missing="raise")
    assert len(exported) == summary.samples
    ds = HiddenStatesDataset(uri, backend="torch")
    first = exported[0]
    assert isinstance(first, dict)
    assert first["input_ids"].tolist() == ds[0]["input_ids"].long().tolist()
    # Training from the bucket into the bucket (a working folder under $HSX_CACHE).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HSX_CACHE", str(tmp_path / "cache"))
        assert main(["train", uri, "--set", "max_steps=2", "--set", "batch_tokens=512",
                     "--set", "checkpoint_every=2", "--set", "draft_vocab_size=256"]) == 0
    captured = capsys.readouterr()
    assert "trained 2 steps" in captured.out + captured.err
    bucket = Output(uri).storage
    assert bucket.exists(f"{DRAFT_CHECKPOINTS}/step-00000002/{DRAFT_UPLOADED}")
    assert bucket.exists(f"{DRAFT_DIR}/model.safetensors")


def test_hsx_extract_into_the_bucket_again_has_nothing_to_do(
    s3_run: tuple[str, JobSummary], make_job: Any, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    import yaml

    from hsx.cli import main

    uri, _ = s3_run
    job = tmp_path / "job.yaml"
    spec = make_job(tmp_path / "elsewhere").model_dump(mode="json", exclude_defaults=True)
    job.write_text(yaml.safe_dump(spec))
    assert main(["extract", str(job), "--output", uri, "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["nothing_to_do"] and summary["output"] == uri


def test_a_split_of_a_bucket_dataset_extracts(
    aws: SeaweedS3, make_job: Any, engine_pool: Any, tmp_path: Path,
) -> None:
    from hsx.ingest import dataset_fingerprint, ingest

    rows = make_chat_dataset(tmp_path / "chats.jsonl", n=36, seed=3).rows
    split = {"data/train_sft-00000-of-00002.parquet": rows[:16],
             "data/train_sft-00001-of-00002.parquet": rows[16:24],
             "data/test_sft-00000-of-00001.parquet": rows[24:]}
    prefix = _uri(aws, "ultrachat")
    storage = Output(prefix).storage
    for key, part in split.items():
        storage.put(key, write_rows(part, tmp_path / key, "parquet").read_bytes())
    uri = _uri(aws, "from-bucket")
    spec = make_job(uri, dataset={"path": prefix, "split": "train_sft"})
    summary = run_job(spec, pool=engine_pool)
    assert (summary.samples, summary.errors) == (24, 0)
    ds = HiddenStatesDataset(uri)
    assert ds.complete and ds.verify() == len(ds.records)
    assert sorted(by_sample(uri)) == list(range(24))  # type: ignore[arg-type]
    manifest = Output(uri).manifest()
    assert manifest.spec["dataset"] == {"path": prefix, "split": "train_sft"}
    assert manifest.dataset_fingerprint == dataset_fingerprint(spec.dataset_spec)
    # The same rows from a local file make the same inputs.
    local = write_rows(rows[:24], tmp_path / "train.jsonl", "jsonl")
    ingest(local, spec.model, spec.max_seq_len, tmp_path / "reference")
    assert Output(uri).inputs().equals(Output(tmp_path / "reference").inputs())
    # A rerun finds the same objects and has nothing to do; rewritten ones are refused.
    assert run_job(spec, pool=engine_pool).nothing_to_do
    storage.put("data/train_sft-00001-of-00002.parquet",
                write_rows(rows[16:23], tmp_path / "shorter.parquet", "parquet").read_bytes())
    with pytest.raises(JobRefused, match=rf"dataset: {prefix} \(split train_sft\) changed"):
        run_job(spec, pool=engine_pool)


class ExplodingPool:
    """An engine pool that fails the test if anything asks it for an engine."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"an engine was asked for ({name}) on a refused job")


def test_a_missing_dataset_object_is_refused_before_any_engine_starts(
    aws: SeaweedS3, make_job: Any,
) -> None:
    missing = f"{_uri(aws, 'nothing')}/chats.jsonl"
    uri = _uri(aws, "refused")
    with pytest.raises(JobRefused, match=rf"^dataset: {missing}: no such object"):
        run_job(make_job(uri, dataset=missing), pool=ExplodingPool())  # type: ignore[arg-type]
    assert not Output(uri).has_manifest()
