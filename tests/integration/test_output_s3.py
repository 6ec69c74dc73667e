"""hsx.output on a real S3 server (SeaweedFS on loopback): shards streamed as multipart
uploads, commit records by conditional create, HiddenStatesDataset by ranged reads, a
writer killed mid-upload, export. No engines: shards are written with ShardWriter.

Credentials reach hsx the way a user gives them: the usual AWS_* variables.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output, ShardCorrupt, ShardReader, ShardWriter, Storage
from hsx.output.layout import SHARDS_DIR
from hsx.output.object_storage import ObjectStoreStorage
from hsx.output.s3_multipart import MIN_PART_SIZE
from hsx_service.errors import JobRefused
from hsx_service.prepare import check_writable, open_output
from tests.s3server import SeaweedS3
from tests.unit.test_dataset import (
    UNITS,
    check,
    read_with_workers,
    write_manifest,
    write_unit,
)
from tests.unit.test_export import assert_same_as_hsx, make_output
from tests.unit.test_shards import commit_side_by_side

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]
LAYERS = [2, 4, 5, 8]
HIDDEN = 512  # 4 KiB per token in bf16: a few thousand tokens make several parts


@pytest.fixture
def aws_env(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server.env


def _big_samples(n: int, tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{
        "sample_index": 1000 + k,
        "input_ids": rng.integers(0, 30_000, tokens).astype(np.int32),
        "loss_mask": rng.integers(0, 2, tokens).astype(np.uint8),
        "hidden_states": rng.standard_normal((tokens, len(LAYERS), HIDDEN)).astype(np.float32),
    } for k in range(n)]


def _write(storage: Storage, unit: int, samples: list[dict[str, Any]], attempt: str
           ) -> ShardWriter:
    """A writer of one attempt with every sample added, not committed yet."""
    w = ShardWriter(storage, unit, layers=LAYERS, hidden_size=HIDDEN, storage_dtype="bf16",
                    attempt=attempt)
    for s in samples:
        w.add(s["sample_index"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    return w


def test_a_shard_streams_to_s3_and_equals_the_local_one(
    aws_env: dict[str, str], s3_uri: str, tmp_path: Path
) -> None:
    samples = _big_samples(6, 700)  # ~16 MiB of states: parts 2..4 while streaming, 1 last
    storage = Output(s3_uri, part_size=MIN_PART_SIZE).storage
    assert isinstance(storage, ObjectStoreStorage) and storage.multipart is not None
    with ShardWriter(storage, 3, layers=LAYERS, hidden_size=HIDDEN, storage_dtype="bf16",
                     attempt="s3") as w:
        for s in samples:
            w.add(s["sample_index"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        w.flush()
        assert storage.list(SHARDS_DIR) == []  # streaming: nothing visible yet
        assert len(storage.multipart.list_uploads()) == 1
        remote = w.commit().record
    local = _write(Storage.for_uri(tmp_path), 3, samples, "s3").commit().record
    # The same bytes either way: the same checksums and size.
    assert remote.checksum == local.checksum and remote.bytes == local.bytes
    assert storage.multipart.list_uploads() == []
    out = Output(s3_uri)
    assert out.committed_units() == {3} and out.read_commit(3) == remote
    assert out.verify() == 1
    ranged = ShardReader.open(Output(s3_uri).storage, remote.shard, record=remote)
    assert ranged.path is None and len(ranged) == 6
    for i in (4, 0, 5):
        got = ranged.sample(i, backend="torch")
        want = torch.from_numpy(samples[i]["hidden_states"]).to(torch.bfloat16)
        assert torch.equal(got["hidden_states"], want)
        assert got["input_ids"].tolist() == samples[i]["input_ids"].tolist()


def test_two_attempts_of_a_unit_commit_exactly_once(aws_env: dict[str, str], s3_uri: str
                                                    ) -> None:
    storage = Output(s3_uri).storage
    samples = _big_samples(2, 50)
    winner = commit_side_by_side([_write(storage, 7, samples, name) for name in ("aaaa", "bbbb")])
    assert [i.key for i in storage.list(SHARDS_DIR)] == [winner.shard]  # the loser's deleted
    assert Output(s3_uri).verify() == 1


KILLED_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from hsx.output import Output

    out = Output(sys.argv[1], part_size=5 * 2**20)
    w = out.shard_writer(5, layers=[2, 4, 5, 8], hidden_size=512, storage_dtype="bf16")
    for k in range(6):
        w.add(k, np.arange(1000), np.ones(1000), np.ones((1000, 4, 512), np.float32))
    w.flush()
    while not out.storage.multipart.list_uploads():
        pass
    print("uploading", flush=True)
    sys.stdin.read()  # wait here until killed
    """
)


def test_a_writer_killed_mid_upload_leaves_nothing_visible(
    aws_env: dict[str, str], s3_uri: str
) -> None:
    out = Output(s3_uri)
    _write(out.storage, 0, _big_samples(1, 10), "done").commit()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, s3_uri], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"uploading"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    storage = out.storage
    assert isinstance(storage, ObjectStoreStorage) and storage.multipart is not None
    # Parts were uploaded, but no object exists until the upload completes: a reader
    # (or a listing) sees only the committed shard.
    uploads = storage.multipart.list_uploads()
    assert len(uploads) == 1 and uploads[0][0].startswith(f"{SHARDS_DIR}/unit-000005-")
    assert [i.key for i in storage.list(SHARDS_DIR)] == ["shards/unit-000000-done.safetensors"]
    assert out.committed_units() == {0}
    assert out.clean_orphans() == 0  # unit 5 is not committed: perhaps still running
    assert out.clean_orphans(final=True) == 1  # nothing runs: the dead upload, aborted
    assert storage.multipart.list_uploads() == []
    assert out.verify() == 1


@pytest.fixture
def s3_output(aws_env: dict[str, str], s3_uri: str) -> str:
    write_manifest(s3_uri, UNITS)
    for unit in (2, 0, 1):
        write_unit(s3_uri, unit, UNITS[unit],
                   errors=[{"sample_index": 99, "reason": "engine failed"}] if unit == 1 else None)
    return s3_uri


def test_dataset_reads_a_bucket(s3_output: str) -> None:
    ds = HiddenStatesDataset(s3_output, backend="numpy")
    assert len(ds) == 12 and ds.manifest.layers == [1, 3, 4, 6]
    for i in np.random.default_rng(0).permutation(12):  # random access
        check(ds[int(i)], torch_out=False)
    check(HiddenStatesDataset(s3_output, backend="torch")[5], torch_out=True)
    assert [s["sample_index"] for s in ds] == list(range(12))
    assert ds.errors() == [{"sample_index": 99, "reason": "engine failed"}]
    assert ds.verify() == 3
    assert not ds.complete
    Output(s3_output).mark_complete({})
    assert ds.complete
    clone = pickle.loads(pickle.dumps(ds))
    check(clone[7], torch_out=False)
    # Hugging Face datasets over the bucket: the same samples, in the same order.
    hf = ds.to_hf_dataset()
    assert hf["sample_index"] == list(range(12))
    assert hf[7]["input_ids"] == ds[7]["input_ids"].tolist()
    assert [s["sample_index"] for s in ds.to_hf_iterable()] == list(range(12))


def test_dataset_follows_a_bucket(aws_env: dict[str, str], s3_uri: str) -> None:
    write_manifest(s3_uri, UNITS)
    write_unit(s3_uri, 1, UNITS[1])
    ds = HiddenStatesDataset(s3_uri, follow=True, backend="numpy", poll_interval=0.05,
                             timeout=60)
    seen: list[int] = []

    def job() -> None:
        while len(seen) < 3:
            threading.Event().wait(0.01)
        write_unit(s3_uri, 0, UNITS[0])
        write_unit(s3_uri, 2, UNITS[2])
        Output(s3_uri).mark_complete({})

    thread = threading.Thread(target=job)
    thread.start()
    try:
        seen.extend(s["sample_index"] for s in ds)
    finally:
        thread.join()
    assert seen[:3] == [4, 5, 6] and sorted(seen) == list(range(12))


def test_forked_dataloader_workers_read_a_bucket(s3_output: str) -> None:
    # Fork is the case that once hung (a client runtime does not survive fork()); a
    # spawned worker unpickles the dataset, as the clone in test_dataset_reads_a_bucket
    # does, and costs a fresh interpreter with torch (tests/unit covers spawn).
    ds = HiddenStatesDataset(s3_output)
    ds[0]  # the parent has read the bucket before it forks
    assert read_with_workers(ds, "fork") == list(range(12))


def test_verify_finds_a_changed_shard_in_a_bucket(s3_output: str) -> None:
    out = Output(s3_output)
    record = out.read_commit(1)
    data = bytearray(out.storage.read(record.shard))
    data[-3] ^= 0xFF
    out.storage.put(record.shard, bytes(data))
    with pytest.raises(ShardCorrupt, match=r"unit 1.*data checksum mismatch"):
        HiddenStatesDataset(s3_output).verify()


def test_export_reads_a_bucket(aws_env: dict[str, str], s3_uri: str, tmp_path: Path) -> None:
    from hsx.cli import main

    make_output(s3_uri)
    dest = tmp_path / "exported"
    assert main(["export", "--format", "speculators", s3_uri, str(dest)]) == 0
    assert_same_as_hsx(s3_uri, dest)  # type: ignore[arg-type]


def test_an_unusable_bucket_is_refused_naming_it(s3_server: SeaweedS3, s3_uri: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    check_writable(open_output(s3_uri))  # fine
    with pytest.raises(JobRefused, match=r"output: .*bucket 'no-such-bucket' does not exist"):
        check_writable(open_output("s3://no-such-bucket/job"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(JobRefused, match=rf"output: s3://{s3_server.bucket}.*denied"):
        check_writable(open_output(s3_uri))

