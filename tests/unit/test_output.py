"""hsx.output.Output: manifest, tables, commit records, totals, errors, orphans, the
complete marker; readers on local disk and through ranged reads.

`RangedStorage` is a local folder that hides its files (`local_path` is None), so
readers take the object-store path (ranged reads, no memory map) without a server; the
same paths run against a real S3 server in tests/integration/test_output_s3.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from hsx.dataset import HiddenStatesDataset
from hsx.output import (
    JobMismatch,
    ObjectExistsError,
    ObjectInfo,
    ObjectWriter,
    Output,
    OutputCorrupt,
    OutputNotFound,
    ShardCorrupt,
    ShardReader,
    Storage,
    StorageError,
)
from hsx.output.layout import COMMITS_DIR, ERRORS, INPUTS, MANIFEST, SHARDS_DIR, TMP_DIR
from hsx.output.local_storage import LocalStorage
from hsx.output.tables import ERRORS_SCHEMA, INPUTS_SCHEMA, TableWriter
from tests.unit.outputs import flip_sample_byte, make_manifest, write_manifest
from tests.unit.test_dataset import LAYERS, UNITS, check, sample, write_unit
from tests.unit.test_dataset import write_manifest as write_planned


class RangedStorage(Storage):
    """A local folder read like an object store: no local paths, only ranged reads."""

    def __init__(self, root: Path) -> None:
        self.disk = LocalStorage(root)
        self.uri = self.disk.uri
        self.ranged_reads = 0

    def read_range(self, key: str, start: int, length: int) -> memoryview:
        self.ranged_reads += 1
        return self.disk.read_range(key, start, length)

    def create(self, key: str, data: bytes) -> None:
        self.disk.create(key, data)

    def put(self, key: str, data: bytes) -> None:
        self.disk.put(key, data)

    def open_writer(self, key: str, *, head_size: int = 0) -> ObjectWriter:
        return self.disk.open_writer(key, head_size=head_size)

    def read(self, key: str) -> bytes:
        return self.disk.read(key)

    def head(self, key: str) -> ObjectInfo | None:
        return self.disk.head(key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.disk.list(prefix)

    def delete(self, key: str) -> None:
        self.disk.delete(key)

    def check_writable(self) -> None:
        self.disk.check_writable()

    def abort_incomplete_writes(self, which: Callable[[str], bool] | None = None) -> int:
        return self.disk.abort_incomplete_writes(which)


@pytest.fixture(params=["mapped", "ranged"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def open_output(root: Path, kind: str) -> Output:
    return Output(root) if kind == "mapped" else Output(RangedStorage(root))


@pytest.fixture
def written(tmp_path: Path) -> Path:
    """Three committed units (UNITS of test_dataset), unit 1 with an extraction error."""
    root = tmp_path / "out"
    write_planned(root, UNITS)
    for unit in (2, 0, 1):
        write_unit(root, unit, UNITS[unit],
                   errors=[{"sample_index": 99, "reason": "engine failed"}] if unit == 1 else None)
    return root


# --------------------------------------------------------------------------- manifest


def test_manifest_is_published_once_and_names_the_job(tmp_path: Path) -> None:
    out = Output(tmp_path / "out")
    assert out.read_manifest() is None and not out.has_manifest()
    with pytest.raises(OutputNotFound, match=f"no hsx output at {tmp_path / 'out'}"):
        out.manifest()
    first = make_manifest(layers=[1, 4], hidden_size=8, num_layers=4, units={0: [0]})
    assert write_manifest(out, first).manifest() == first
    other = make_manifest(layers=[2, 4], hidden_size=8, num_layers=4, units={0: [0]},
                          job_fingerprint="another")
    assert Output(tmp_path / "out").publish_manifest(other) == first  # the first one stays
    same = {"job_fingerprint": first.job_fingerprint, "layers": [1, 4],
            "spec.trust_remote_code": first.spec.get("trust_remote_code")}
    first.check_same_job(same, first.dataset_fingerprint, output="OUT", dataset="DATA")
    with pytest.raises(JobMismatch, match="output: OUT already holds a different job "
                       r"\(job_fingerprint differ"):
        first.check_same_job({**same, "job_fingerprint": "another"}, first.dataset_fingerprint,
                             output="OUT", dataset="DATA")
    # Field by field: a fingerprint copied beside another spec does not pass.
    with pytest.raises(JobMismatch, match=r"\(layers, spec.trust_remote_code differ"):
        first.check_same_job({**same, "layers": [2, 4], "spec.trust_remote_code": True},
                             first.dataset_fingerprint, output="OUT", dataset="DATA")
    with pytest.raises(JobMismatch, match="dataset: DATA changed since OUT was started"):
        first.check_same_job(same, "changed", output="OUT", dataset="DATA")
    # Unknown fields are kept (the format adds fields without a version change).
    data = json.loads((tmp_path / "out" / MANIFEST).read_text())
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / MANIFEST).write_text(json.dumps({**data, "added_later": 1}))
    newer = Output(tmp_path / "newer").manifest()
    assert newer.model_extra == {"added_later": 1} and newer.layers == [1, 4]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"format_version": 2}, "format_version 2 is not supported"),
        ({"layers": "all"}, "layers"),
        ({"units": None}, "units"),
    ],
)
def test_a_bad_manifest_is_named(tmp_path: Path, change: dict[str, Any], match: str) -> None:
    good = make_manifest(layers=[1, 4], hidden_size=8, num_layers=4, units={0: [0]})
    tmp_path.joinpath(MANIFEST).write_text(json.dumps({**good.model_dump(), **change}))
    with pytest.raises(OutputCorrupt, match=match) as err:
        Output(tmp_path).manifest()
    assert MANIFEST in str(err.value)


# --------------------------------------------------------------------------- tables


def _rows(n: int, first: int = 0) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(range(first, first + n), pa.int64()),
         pa.array([[i] * (1 + i % 3) for i in range(first, first + n)], pa.list_(pa.int32())),
         pa.array([[1] * (1 + i % 3) for i in range(first, first + n)], pa.list_(pa.uint8())),
         pa.array([1 + i % 3 for i in range(first, first + n)], pa.int32())],
        schema=INPUTS_SCHEMA)


def test_tables_are_written_in_fixed_batches_and_read_by_row(tmp_path: Path, kind: str) -> None:
    writer = TableWriter(Output(tmp_path).storage, INPUTS, INPUTS_SCHEMA, rows_per_batch=3)
    start = 0
    for n in (2, 5, 0, 1, 3):  # whatever the caller's batches, the file holds 3-row ones
        writer.write(_rows(n, start))
        start += n
    assert not (tmp_path / INPUTS).exists()  # visible only once committed
    writer.commit()
    with pa.memory_map(str(tmp_path / INPUTS)) as source:
        reader = pa.ipc.open_file(source)
        assert [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)] == [
            3, 3, 3, 2]
    out = open_output(tmp_path, kind)
    whole = out.inputs()
    assert whole.column("sample_index").to_pylist() == list(range(11))
    for a in range(12):
        for b in range(a, 13):
            got = out.input_rows(a, b)
            assert got.column("sample_index").to_pylist() == list(range(a, min(b, 11))), (a, b)
            assert got.column("input_ids").to_pylist() == whole.slice(a, b - a).column(
                "input_ids").to_pylist()


def test_tables_written_before_fixed_batches_are_read_whole(tmp_path: Path, kind: str) -> None:
    table = pa.Table.from_batches([_rows(2), _rows(5, 2)])
    with pa.OSFile(str(tmp_path / INPUTS), "wb") as sink, \
            pa.ipc.new_file(sink, INPUTS_SCHEMA) as w:
        w.write_table(table)
    out = open_output(tmp_path, kind)
    assert out.input_rows(1, 6).column("sample_index").to_pylist() == [1, 2, 3, 4, 5]


def test_an_aborted_table_leaves_nothing(tmp_path: Path) -> None:
    writer = Output(tmp_path).table_writer(ERRORS)
    writer.write(pa.RecordBatch.from_arrays(
        [pa.array([1], pa.int64()), pa.array(["bad"])], schema=ERRORS_SCHEMA))
    writer.abort()
    assert not (tmp_path / ERRORS).exists() and not any((tmp_path / TMP_DIR).iterdir())
    assert Output(tmp_path).ingest_errors().num_rows == 0
    with pytest.raises(ValueError, match="not a table"):
        Output(tmp_path).table_writer("other.arrow")


# --------------------------------------------------------------------------- commits


def test_totals_errors_and_progress(written: Path, kind: str) -> None:
    table = pa.table({"sample_index": pa.array([50, 12], pa.int64()),
                      "reason": pa.array(["empty", "too long"])})
    with pa.OSFile(str(written / ERRORS), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    out = open_output(written, kind)
    records = out.commits()
    assert [r.unit for r in records] == [0, 1, 2] and out.committed_units() == {0, 1, 2}
    totals = out.totals()
    assert (totals.samples, totals.units_done, totals.units_total) == (12, 3, 3)
    assert totals.unit_errors == 1 and totals.ingest_errors == 0 and totals.errors == 1
    assert totals.tokens == sum(len(sample(i)["input_ids"]) for i in range(12))
    assert totals.bytes == sum(r.bytes for r in records)
    progress = totals.progress()
    assert (progress.samples_done, progress.samples_failed, progress.shards) == (13, 1, 3)
    # Unit 0 given up (rows 0..4 of inputs.arrow: samples 0..3).
    errors = out.errors(given_up=[(0, 4, "unit 0 was given up: boom")])
    assert [(e.sample_index, e.reason) for e in errors] == [
        (0, "unit 0 was given up: boom"), (1, "unit 0 was given up: boom"),
        (2, "unit 0 was given up: boom"), (3, "unit 0 was given up: boom"),
        (12, "too long"), (50, "empty"), (99, "engine failed")]
    assert [e.sample_index for e in out.errors(records=records[:1])] == [12, 50]


def test_clean_orphans_and_the_complete_marker(written: Path) -> None:
    out = Output(written)
    (written / SHARDS_DIR / "unit-000007-dead.safetensors").write_bytes(b"x" * 10)
    (written / TMP_DIR / "shards--unit-000001-b.safetensors.1234.part").write_bytes(b"y")
    (written / COMMITS_DIR / "notes.txt").write_text("not a record")
    # Safe beside a running attempt: only unit 1's loser (unit 1 is committed); unit 7's
    # shard may be an attempt between its upload and its record.
    assert out.clean_orphans() == 1
    assert (written / SHARDS_DIR / "unit-000007-dead.safetensors").exists()
    assert out.clean_orphans(final=True) == 1  # nothing runs: unit 7's is garbage too
    assert len(list((written / SHARDS_DIR).iterdir())) == 3
    assert out.verify() == 3
    assert not out.is_complete()
    assert out.mark_complete({"samples": 12}) and not out.mark_complete({"samples": 0})
    assert out.is_complete()
    assert json.loads((written / "complete.json").read_text()) == {"samples": 12}


def test_a_bad_commit_record_is_named(written: Path) -> None:
    path = written / COMMITS_DIR / "unit-000001.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "shard": "../../etc/passwd"}))
    with pytest.raises(OutputCorrupt, match=r"unit-000001.json is not a valid hsx CommitRecord"):
        Output(written).commits()
    path.write_text(json.dumps({**record, "unit": 2}))
    with pytest.raises(OutputCorrupt, match="is the record of unit 2"):
        Output(written).commits()


def test_open_shard_checks_the_record_and_the_manifest(written: Path) -> None:
    out = Output(written)
    record = out.read_commit(0)
    assert len(out.open_shard(record)) == 4
    with pytest.raises(ShardCorrupt, match="commit record says 5"):
        out.open_shard(record.model_copy(update={"samples": 5}))
    other = Output(written)
    other._manifest = out.manifest().model_copy(update={"layers": [1, 2]})
    with pytest.raises(ShardCorrupt, match="differ from the manifest"):
        other.open_shard(record)


# --------------------------------------------------------------------------- commit race


class LostAnswer(LocalStorage):
    """A store whose conditional create lands but answers with an error (a lost answer,
    or a retry that then finds the key taken)."""

    def __init__(self, root: Path, answer: type[Exception]) -> None:
        super().__init__(root)
        self.answer = answer

    def create(self, key: str, data: bytes) -> None:
        super().create(key, data)
        if key.startswith(COMMITS_DIR):
            raise self.answer(f"{key}: the answer was lost")


@pytest.mark.parametrize("answer", [ObjectExistsError, StorageError])
def test_a_commit_whose_answer_is_lost_keeps_its_shard(tmp_path: Path,
                                                       answer: type[Exception]) -> None:
    root = tmp_path / "out"
    write_planned(root, UNITS)
    out = Output(LostAnswer(root, answer))
    with out.shard_writer(0, layers=LAYERS, hidden_size=16, storage_dtype="bf16") as w:
        for i in UNITS[0]:
            s = sample(i)
            w.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
        result = w.commit()
    assert result.won and result.record.attempt == w.attempt
    assert Output(root).verify() == 1  # its shard was not deleted


# --------------------------------------------------------------------------- readers


def test_dataset_through_ranged_reads(written: Path) -> None:
    storage = RangedStorage(written)
    ds = HiddenStatesDataset(Output(storage), backend="numpy")
    assert len(ds) == 12 and ds.verify() == 3
    order = np.random.default_rng(1).permutation(12)
    for i in order:
        check(ds[int(i)], torch_out=False)
    before = storage.ranged_reads
    for i in order:
        got = ds[int(i)]
        assert got["sample_index"] == i
    assert storage.ranged_reads - before == 12  # one ranged read per sample, shards open
    torch_ds = HiddenStatesDataset(Output(storage), backend="torch")
    for i in range(12):
        check(torch_ds[i], torch_out=True)
    assert [s["sample_index"] for s in ds] == list(range(12))
    assert ds.errors() == [{"sample_index": 99, "reason": "engine failed"}]


def test_ranged_reader_of_an_fp8_shard_matches_the_mapped_one(tmp_path: Path) -> None:
    root = tmp_path / "fp8"
    write_planned(root, {0: [0, 1, 2]}, storage="fp8")
    record = write_unit(root, 0, [0, 1, 2], storage="fp8")
    mapped = ShardReader(root / record.shard, record=record)
    ranged = ShardReader.open(RangedStorage(root), record.shard, record=record)
    assert ranged.path is None and mapped.path == root / record.shard
    for i in range(3):
        for backend in ("numpy", "torch"):
            a = mapped.sample(i, backend=backend, dequantize=False)  # type: ignore[arg-type]
            b = ranged.sample(i, backend=backend, dequantize=False)  # type: ignore[arg-type]
            for name in ("input_ids", "loss_mask", "scales", "hidden_states"):
                x, y = a[name], b[name]
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
                else:
                    assert np.array_equal(np.asarray(x).view(np.uint8),
                                          np.asarray(y).view(np.uint8)), name
    assert np.array_equal(ranged.tensor("hidden_states").view(np.uint8),
                          mapped.tensor("hidden_states").view(np.uint8))


class RefusedCreate(LocalStorage):
    """A store that refuses to create commit records (a permission, a full bucket)."""

    def create(self, key: str, data: bytes) -> None:
        if key.startswith(COMMITS_DIR):
            raise StorageError(f"{key}: access denied")
        super().create(key, data)


def test_a_commit_that_fails_takes_its_shard_back(tmp_path: Path) -> None:
    root = tmp_path / "out"
    write_planned(root, UNITS)
    out = Output(RefusedCreate(root))
    w = out.shard_writer(0, layers=LAYERS, hidden_size=16, storage_dtype="bf16")
    s = sample(0)
    w.add(0, s["input_ids"], s["loss_mask"], s["hidden_states"])
    with pytest.raises(StorageError, match="access denied"):
        w.commit()
    assert out.committed_units() == set() and out.storage.list(SHARDS_DIR) == []


# --------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("tensor", ["hidden_states", "input_ids"])
def test_a_flipped_byte_is_named_with_its_shard_and_sample(
        written: Path, kind: str, tensor: str) -> None:
    out = open_output(written, kind)
    record = out.read_commit(1)
    index = flip_sample_byte(written / record.shard, 2, tensor)
    ds = HiddenStatesDataset(out, backend="numpy")
    bad_position = next(i for i, r in enumerate(ds.records) if r.unit == 1)
    first = ds._index.starts[bad_position]
    with pytest.raises(ShardCorrupt, match=rf"unit-000001-.*\(unit 1\): sample 2 "
                                           rf"\(sample_index {index}\)"):
        ds[first + 2]
    for i in range(len(ds)):  # every other sample reads
        if i != first + 2:
            ds[i]
    bad = out.check_shards()
    assert [(b.unit, b.shard) for b in bad] == [(1, out.url(record.shard))]
    assert "data checksum mismatch" in bad[0].reason
    assert f"samples 2 (sample_index {index}) fail their checksums" in bad[0].reason
    with pytest.raises(ShardCorrupt, match="1 corrupt shard"):
        out.verify()
    out.mark_complete({"samples": 12})
    assert out.withdraw([1, 5]) == [1]
    assert out.committed_units() == {0, 2} and not out.is_complete()
    assert not (written / record.shard).exists()
    assert out.check_shards() == [] and out.verify() == 2


def test_a_record_that_cannot_be_read_is_listed(written: Path) -> None:
    (written / COMMITS_DIR / "unit-000002.json").write_text("{not json")
    out = Output(written)
    bad = out.check_shards()
    assert [b.unit for b in bad] == [2] and "unit-000002.json" in bad[0].shard
    assert out.withdraw([2]) == [2] and out.committed_units() == {0, 1}
    # Its shard, which no record names now: removed by the final clean-up (a rerun's end).
    assert out.clean_orphans() == 0 and out.clean_orphans(final=True) == 1


def test_hsx_verify_lists_bad_shards_and_repair_withdraws_them(
        written: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hsx.cli import main

    assert main(["verify", str(written)]) == 0
    out = Output(written)
    flip_sample_byte(written / out.read_commit(2).shard, 0)
    assert main(["verify", str(written), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [b["unit"] for b in report["bad"]] == [2] and report["withdrawn"] == []
    assert main(["verify", str(written)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unit 2\t") and "checksum" in lines[0]
    assert main(["verify", str(written), "--repair", "--json"]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["withdrawn"] == [2]
    assert main(["verify", str(written)]) == 0
    assert Output(written).committed_units() == {0, 1}
    assert main(["verify", str(written / "nothing-here")]) == 2


def test_a_disk_full_error_is_recognised_after_crossing_processes() -> None:
    import errno

    from hsx.output.storage import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(RuntimeError("cannot write shard data: [Errno 28] No space left on "
                                     "device"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
