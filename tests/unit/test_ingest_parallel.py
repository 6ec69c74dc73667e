"""Ingestion in slices and on several processes: the same rows, the same bytes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.ingest import IngestProgress, ingest, resolve_source
from hsx.ingest import pipeline as pipeline_module
from hsx.ingest import sources as sources_module
from hsx.output import Output
from hsx_workers.tiny_models import ChatDataset, make_chat_dataset, write_rows


def _rows(source: Any, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """(every row of the source, the rows of its slices one after the other)."""
    whole = list(source.rows(5))
    sliced = [row for s in source.slices(**kwargs) for row in s.rows(5)]
    return whole, sliced


def test_jsonl_slices_cut_at_line_starts(tmp_path: Path) -> None:
    lines = [b'\xef\xbb\xbf{"text": "bom first"}', b'{"text": "a"}', b"", b"not json",
             b'{"text": "crlf"}\r', b"  ", b'{"text": "' + b"x" * 300 + b'"}',
             b"\xff\xfe not utf-8", b"[1, 2]", b'{"text": "last, no newline"}']
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines))
    source = resolve_source(str(path))
    for size in (1, 7, 40, 301, 10_000):
        whole, sliced = _rows(source, slice_bytes=size)
        assert sliced == whole, size
    assert len(source.slices(slice_bytes=1)) == len(lines)  # one line each at most
    assert len(whole) == len(lines)


def test_json_array_is_one_slice(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": str(i)} for i in range(50)]))
    source = resolve_source(str(path))
    assert len(source.slices(slice_bytes=10)) == 1
    whole, sliced = _rows(source, slice_bytes=10)
    assert sliced == whole and len(whole) == 50


def test_parquet_slices_are_runs_of_row_groups(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    table = pa.table({"text": [f"row {i}" for i in range(60)]})
    pq.write_table(table.slice(0, 45), folder / "a.parquet", row_group_size=7)
    pq.write_table(table.slice(45), folder / "b.parquet", row_group_size=100)
    source = resolve_source(str(folder))
    slices = source.slices(slice_rows=10)
    # a.parquet: 7 groups of <= 7 rows, cut after 14, 28, 42 and its end; b: one group.
    assert [(s.start, s.stop, s.weight) for s in slices] == [
        (0, 2, 14), (2, 4, 14), (4, 6, 14), (6, 7, 3), (0, 1, 15)]
    whole, sliced = _rows(source, slice_rows=10)
    assert sliced == whole and len(whole) == 60


def test_save_to_disk_slices_by_file(tmp_path: Path) -> None:
    folder = write_rows([{"text": f"row {i}"} for i in range(30)], tmp_path / "hf", "hf")
    source = resolve_source(str(folder))
    whole, sliced = _rows(source)
    assert sliced == whole and len(whole) == 30


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory: pytest.TempPathFactory) -> ChatDataset:
    """Every row format and every kind of bad row, 400 rows."""
    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    return make_chat_dataset(path, n=380, seed=3, bad_rows=20, formats="mixed")


def _tables(out: Path) -> list[tuple[str, bytes]]:
    """Every part of the inputs and errors tables, by name, byte for byte (the parts'
    records say where the source goes on, in slices, so they differ with the cuts)."""
    return [(str(p.relative_to(out)), p.read_bytes())
            for p in sorted([*out.glob("inputs/*.arrow"), *out.glob("errors/*.arrow")])]


def test_parallel_ingestion_writes_the_same_bytes(tiny_tokenizer: Path,
                                                  mixed_dataset: ChatDataset,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices tokenized by other processes (a pool of 2, or any executor), written in
    order: inputs.arrow and errors.arrow are byte for byte those of one process, bad
    rows included (and so are the units planned from them, and their shards)."""
    data = str(mixed_dataset.path)
    per = {"rows_per_part": 64}  # 6 parts, cut inside batches and between bad rows
    one = ingest(data, str(tiny_tokenizer), 128, tmp_path / "one", **per)
    monkeypatch.setattr(pipeline_module, "PARALLEL_SLICE_BYTES", 4096)
    assert len(pipeline_module._slices(resolve_source(data), 2)) > 16
    seen: list[IngestProgress] = []
    two = ingest(data, str(tiny_tokenizer), 128, tmp_path / "two", workers=2,
                 batch_rows=50, progress=seen.append, **per)
    with ThreadPoolExecutor(3) as pool:
        three = ingest(data, str(tiny_tokenizer), 128, tmp_path / "three", executor=pool,
                       **per)
    records = Output(tmp_path / "one").part_records()
    assert [r.samples for r in records] == [64] * 5 + [60]
    assert sum(r.errors for r in records) == 20 and records[-1].last
    assert _tables(tmp_path / "two") == _tables(tmp_path / "one")
    assert _tables(tmp_path / "three") == _tables(tmp_path / "one")
    assert one.num_errors == 20 and one.num_rows == 400
    for result in (two, three):
        assert result.to_dict() | {"inputs_path": "", "errors_path": ""} == (
            one.to_dict() | {"inputs_path": "", "errors_path": ""})
    rows = [p.rows for p in seen]
    assert rows == sorted(rows) and rows[-1] == 400
    # The total is estimated from whole slices only: it does not climb with the rows of
    # the slice being read (it did, then dropped at the slice's end).
    expected = [p.rows_expected for p in seen if p.rows_expected]
    assert expected[-1] == 400 and all(abs(e - 400) <= 0.25 * 400 for e in expected[3:]), \
        expected
    fractions = [p.fraction for p in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert 0 < fractions[len(fractions) // 2] < 1


def test_the_first_part_is_tokenized_here_while_the_processes_start(
        tiny_tokenizer: Path, mixed_dataset: ChatDataset, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines wait for the first part, and other processes begin with their
    imports: the slices up to the one that closes the first part are tokenized in the
    ingesting process while each process loads its tokenizer, and the processes take
    every slice after them, none before. The bytes are those of one process."""
    data = str(mixed_dataset.path)
    per = {"rows_per_part": 64}
    one = ingest(data, str(tiny_tokenizer), 128, tmp_path / "one", **per)
    monkeypatch.setattr(pipeline_module, "PARALLEL_SLICE_BYTES", 4096)
    slices = pipeline_module._slices(resolve_source(data), 2)
    calls: list[tuple[str, Any]] = []

    class Recording(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            calls.append((fn.__name__, args[0]))
            return super().submit(fn, *args, **kwargs)

    with Recording(2) as pool:
        two = ingest(data, str(tiny_tokenizer), 128, tmp_path / "two", executor=pool,
                     workers=2, **per)
    assert [name for name, _ in calls[:2]] == ["warm_tokenizer"] * 2
    sent = [(slc.start, slc.stop) for name, slc in calls if name == "tokenize_slice"]
    first = Output(tmp_path / "two").part_records()[0]
    head = first.next_slice + 1  # the slice whose rows closed the first part, and before
    assert 1 <= head < len(slices)
    assert sent == [(slc.start, slc.stop) for slc in slices[head:]]
    assert _tables(tmp_path / "two") == _tables(tmp_path / "one")
    assert two.num_rows == one.num_rows == 400


def test_parallel_parquet_and_kept_messages(tiny_tokenizer: Path, mixed_dataset: ChatDataset,
                                            tmp_path: Path) -> None:
    rows = [r for r in mixed_dataset.rows if isinstance(r, dict)]
    data = tmp_path / "d.parquet"
    pq.write_table(pa.parquet.read_table(write_rows(rows, tmp_path / "w.parquet",
                                                    "parquet")), data, row_group_size=16)
    kwargs: dict[str, Any] = {"keep_messages": True}
    ingest(str(data), str(tiny_tokenizer), 128, tmp_path / "one", **kwargs)
    with ThreadPoolExecutor(2) as pool:
        ingest(str(data), str(tiny_tokenizer), 128, tmp_path / "two", executor=pool,
               **kwargs)
    assert _tables(tmp_path / "two") == _tables(tmp_path / "one")


def test_a_slice_that_fails_fails_the_ingestion_and_leaves_no_table(
        tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    write_rows([{"text": f"row {i}"} for i in range(20)], folder / "a.parquet", "parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    with pytest.raises(sources_module.DatasetFormatError, match=r"b\.parquet"), \
            ThreadPoolExecutor(2) as pool:
        ingest(str(folder), str(tiny_tokenizer), 128, tmp_path / "out", executor=pool)
    assert Output(tmp_path / "out").part_numbers() == []


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_ingestion_goes_on_after_its_last_part(
        tiny_tokenizer: Path, mixed_dataset: ChatDataset, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """Killed after some parts were published, an ingestion run again tokenizes only
    the rows after the last part, and its tables are those of one uninterrupted run."""
    data = str(mixed_dataset.path)
    per = {"rows_per_part": 64, "batch_rows": 50}
    ingest(data, str(tiny_tokenizer), 128, tmp_path / "whole", **per)
    monkeypatch.setattr(pipeline_module, "PARALLEL_SLICE_BYTES", 4096)
    real = pipeline_module._PartBuilder.add
    tokenized: list[int] = []

    def counting(self: Any, batch: Any, *args: Any) -> Any:
        # The rows tokenized (in the children), as they come to be written.
        if fail_after and sum(tokenized) >= fail_after:
            raise RuntimeError("killed")
        tokenized.append(batch.rows)
        return real(self, batch, *args)

    monkeypatch.setattr(pipeline_module._PartBuilder, "add", counting)
    fail_after = 250  # rows: the ingestion dies in its third or fourth part
    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="killed"):
        ingest(data, str(tiny_tokenizer), 128, tmp_path / "out", workers=workers,
               executor=pool if workers > 1 else None, **per)
    out = Output(tmp_path / "out")
    published = out.part_records()
    assert 1 <= len(published) <= 3 and not published[-1].last
    done = published[-1].rows_end
    fail_after, tokenized[:] = 0, []
    with ThreadPoolExecutor(2) as pool:
        result = ingest(data, str(tiny_tokenizer), 128, out, workers=workers,
                        executor=pool if workers > 1 else None, **per)
    assert sum(tokenized) == 400 - done  # the published rows were not tokenized again
    assert _tables(tmp_path / "out") == _tables(tmp_path / "whole")
    assert result.num_rows == 400 and result.num_errors == 20
