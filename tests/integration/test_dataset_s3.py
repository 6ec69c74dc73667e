"""Datasets in a bucket, on a real S3 server (SeaweedFS on loopback): objects and prefixes
read through the output's storage layer (credentials from the AWS_* variables), streamed
by ranged reads, split as local folders are, fingerprinted by keys, sizes and ETags, and
refused before any engine starts when missing, empty or not readable with the
credentials at hand. No engine runs here; tests/integration/test_extract_s3.py extracts
one end to end.
"""

from __future__ import annotations

import io
import json
import pickle
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.ingest import (
    DatasetAccessError,
    DatasetFormatError,
    DatasetNotFoundError,
    check_dataset,
    count_rows,
    datafiles,
    dataset_fingerprint,
    iter_rows,
    resolve_source,
)
from hsx.output import Storage
from hsx.spec import DatasetSpec, JobSpec
from hsx_service.errors import JobRefused
from hsx_service.prepare import check_dataset as preflight_dataset
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.s3


@pytest.fixture
def aws(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedS3]:
    """The bucket's endpoint and credentials in the usual AWS_* variables."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    yield s3_server


def parquet_bytes(rows: list[dict[str, Any]], row_group_size: int | None = None) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=row_group_size)
    return buf.getvalue()


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def upload(uri: str, objects: dict[str, bytes]) -> Storage:
    storage = Storage.for_uri(uri)
    for key, data in objects.items():
        storage.put(key, data)
    return storage


def texts(dataset: Any) -> list[str]:
    return [row["text"] for row in iter_rows(dataset)]


def test_a_jsonl_object_streams_in_ranged_reads(aws: SeaweedS3, s3_uri: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"text": f"row {i} " + "x" * (300 if i == 7 else i)} for i in range(40)]
    data = jsonl_bytes(rows) + b"not json\n"
    storage = upload(s3_uri, {"chats.jsonl": data})
    reads: list[int] = []
    real = type(storage).read_range

    def counted(self: Any, key: str, start: int, length: int) -> memoryview:
        reads.append(length)
        return real(self, key, start, length)

    # A buffer smaller than a line: lines span refills, and nothing is read whole.
    monkeypatch.setattr(datafiles, "READ_BUFFER", 256)
    monkeypatch.setattr(type(storage), "read_range", counted)
    monkeypatch.setattr(type(storage), "read", lambda *a: pytest.fail("read whole"))
    got = list(iter_rows(f"{s3_uri}/chats.jsonl"))
    assert [r["text"] for r in got[:-1]] == [r["text"] for r in rows]
    assert "not valid JSON" in got[-1].reason
    assert len(reads) > len(data) // 256 and max(reads) <= 256
    source = check_dataset(f"{s3_uri}/chats.jsonl")
    assert source.kind == "jsonl" and not source.counts_quickly
    assert count_rows(source) == 41


def test_a_prefix_of_splits_reads_one_split_of_parquet(aws: SeaweedS3, s3_uri: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    train = [{"text": f"train {i}"} for i in range(30)]
    upload(s3_uri, {
        "ultrachat/README.md": b"---\n---\n",
        "ultrachat/data/train_sft-00000-of-00002.parquet": parquet_bytes(train[:20], 8),
        "ultrachat/data/train_sft-00001-of-00002.parquet": parquet_bytes(train[20:]),
        "ultrachat/data/test_sft-00000-of-00001.parquet": parquet_bytes([{"text": "t"}]),
    })
    root = f"{s3_uri}/ultrachat"
    with pytest.raises(DatasetFormatError) as refused:
        resolve_source(root)
    assert f"{root} has splits ['test_sft', 'train_sft']" in str(refused.value)
    assert f"dataset: {{path: {root}, split: test_sft}}" in str(refused.value)
    spec = DatasetSpec(path=root, split="train_sft")
    storage_type = type(Storage.for_uri(s3_uri))
    monkeypatch.setattr(storage_type, "read", lambda *a: pytest.fail("read whole"))
    assert texts(spec) == [r["text"] for r in train]
    assert count_rows(spec) == 30  # from the footers
    assert texts(DatasetSpec(path=root, split="test_sft")) == ["t"]
    # As a job names it; the check reads one byte of the first object.
    preflight_dataset(JobSpec(model="m", dataset=spec, output="/o"))


def test_a_save_to_disk_folder_in_a_bucket(aws: SeaweedS3, s3_uri: str, tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]}),
                               "test": datasets.Dataset.from_dict({"text": ["c"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    upload(f"{s3_uri}/dd", {p.relative_to(tmp_path / "dd").as_posix(): p.read_bytes()
                            for p in (tmp_path / "dd").rglob("*") if p.is_file()})
    with pytest.raises(DatasetFormatError, match=r"splits \['test', 'train'\]"):
        resolve_source(f"{s3_uri}/dd")
    assert texts(DatasetSpec(path=f"{s3_uri}/dd", split="train")) == ["a", "b"]


def test_the_fingerprint_follows_keys_sizes_and_etags(aws: SeaweedS3, s3_uri: str) -> None:
    storage = upload(s3_uri, {"d/a.jsonl": jsonl_bytes([{"text": "aa"}]),
                              "d/b.jsonl": jsonl_bytes([{"text": "bb"}])})
    prefix = f"{s3_uri}/d"
    first = dataset_fingerprint(prefix)
    assert first == dataset_fingerprint(prefix)
    assert first != dataset_fingerprint(f"{prefix}/a.jsonl")
    storage.put("d/b.jsonl", jsonl_bytes([{"text": "cc"}]))  # same size, new content
    second = dataset_fingerprint(prefix)
    assert second != first
    storage.put("d/c.jsonl", jsonl_bytes([{"text": "dd"}]))
    assert dataset_fingerprint(prefix) != second


def test_a_source_carries_the_settings_it_was_resolved_with(
    aws: SeaweedS3, s3_uri: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload(s3_uri, {"d/a.parquet": parquet_bytes([{"text": "a"}])})
    source = resolve_source(f"{s3_uri}/d")
    for name in aws.env:
        monkeypatch.delenv(name)
    # Unpickled where no AWS_* variable is set (a Ray worker's process, say).
    assert [r["text"] for r in pickle.loads(pickle.dumps(source)).rows()] == ["a"]


def test_unusable_bucket_datasets_are_refused_naming_them(
    aws: SeaweedS3, s3_uri: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload(s3_uri, {"d/a.jsonl": jsonl_bytes([{"text": "a"}]), "other/notes.txt": b"x"})
    missing = f"{s3_uri}/d/missing.jsonl"
    with pytest.raises(DatasetNotFoundError, match=f"{missing}: no such object"):
        check_dataset(missing)
    with pytest.raises(DatasetNotFoundError, match=f"{s3_uri}/empty: no such object, and no"):
        check_dataset(f"{s3_uri}/empty")
    with pytest.raises(DatasetFormatError, match=f"{s3_uri}/other is a folder that holds no"):
        check_dataset(f"{s3_uri}/other")
    nobucket = f"s3://no-such-bucket-{secrets.token_hex(3)}/d"
    with pytest.raises(DatasetAccessError, match=nobucket):
        check_dataset(nobucket)
    spec = JobSpec(model="m", dataset=missing, output="/o")
    with pytest.raises(JobRefused, match=f"^dataset: {missing}: no such object"):
        preflight_dataset(spec)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    for uri in (f"{s3_uri}/d", f"{s3_uri}/d/a.jsonl"):
        with pytest.raises(DatasetAccessError, match=rf"{s3_uri}/d.*access denied"):
            check_dataset(uri)
