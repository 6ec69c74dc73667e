"""Rows from a dataset's files: JSON lines (whole, or the lines starting in a byte
range), a JSON array file, Parquet row groups, `save_to_disk` Arrow streams. A row that
cannot be parsed is a `BadRow` in its place (datafiles.py); a file that cannot be read at
all is a `DatasetFormatError` naming it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import PurePosixPath
from typing import IO, Any

import pyarrow as pa

from hsx.ingest.datafiles import BOM, BadRow, DataFile, DatasetFormatError, Row
from hsx.output.storage import StorageError

# --------------------------------------------------------------------------- rows


def _parse_json_row(raw: bytes) -> Row:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        # Replacing the bytes would train on text nobody wrote: the row is refused.
        return BadRow(f"the line is not valid UTF-8 (byte {raw[err.start]:#04x} at "
                       f"offset {err.start})")
    line = line.rstrip("\r\n")
    if not line.strip():
        return BadRow("the line is empty")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return BadRow(f"the line is not valid JSON ({err})")
    except RecursionError:
        return BadRow("the line nests JSON too deeply to be read")
    if not isinstance(row, dict):
        return BadRow(f"the row is a JSON {type(row).__name__}, not an object")
    return row


def iter_jsonl(files: Sequence[DataFile]) -> Iterator[Row]:
    for file in files:
        yield from jsonl_lines(file, 0, None)


def _is_json_array(file: DataFile, stream: io.BufferedReader) -> bool:
    head = stream.peek(4096)[:4096].removeprefix(BOM).lstrip()
    return file.suffix == ".json" and head.startswith(b"[")


def jsonl_lines(file: DataFile, start: int, stop: int | None) -> Iterator[Row]:
    """The rows of the lines of `file` that start at a byte in [start, stop) (to the end
    when stop is None); `start` is 0 or the first byte of a line."""
    with file.open() as stream:
        if start == 0 and _is_json_array(file, stream):
            yield from _json_array(file, stream)
            return
        if start:
            stream.seek(start)
        position = start
        # Bytes, split at \n only (as count_rows counts), each line decoded on its own.
        for line in stream:
            if stop is not None and position >= stop:
                return
            first = position == 0
            position += len(line)
            yield _parse_json_row(line.removeprefix(BOM) if first else line)


def jsonl_cuts(file: DataFile, slice_bytes: int) -> list[int]:
    """Where the slices of a JSON lines file start: 0, then the first line start at or
    after every `slice_bytes` bytes (a JSON array file: 0 only, it is read whole)."""
    cuts = [0]
    with file.open() as stream:
        if _is_json_array(file, stream):
            return cuts
        target = slice_bytes
        while target < file.size:
            stream.seek(target - 1)
            stream.readline()  # to the end of the line holding byte target - 1
            cut = stream.tell()
            if cut >= file.size:
                break
            if cut > cuts[-1]:
                cuts.append(cut)
            target = max(cut, target) + slice_bytes
    return cuts


def _json_array(file: DataFile, stream: IO[bytes]) -> Iterator[Row]:
    # A JSON array file: not streamable, read whole (JSON lines are the norm).
    try:
        rows = json.loads(stream.read().removeprefix(BOM).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise DatasetFormatError(
            f"dataset file {file.url!r} starts like a JSON array but cannot be read "
            f"as one ({type(err).__name__}: {err}); a JSON lines file (.jsonl) lets "
            "each bad row be skipped on its own") from None
    for row in rows:
        yield row if isinstance(row, dict) else BadRow(
            f"the row is a JSON {type(row).__name__}, not an object")


def _unreadable(file: DataFile, kind: str, err: Exception) -> DatasetFormatError:
    return DatasetFormatError(
        f"dataset file {file.url!r} is not a readable {kind} file (truncated or damaged?): "
        f"{str(err).strip() or type(err).__name__}")


def parquet_file(file: DataFile) -> Any:
    import pyarrow.parquet as pq

    try:
        # From a bucket, pre_buffer coalesces a row group's column chunks into few GETs.
        return pq.ParquetFile(file.arrow_source(), pre_buffer=file.path is None)
    except StorageError:
        raise
    except (pa.ArrowException, OSError) as err:  # no footer: no row can be located
        raise _unreadable(file, "Parquet", err) from None


def iter_parquet(file: DataFile, batch_rows: int, groups: range | None = None
                  ) -> Iterator[pa.RecordBatch | BadRow]:
    """A Parquet file's rows by batch (of `groups`, else every row group); the rows of a
    row group that cannot be decoded are each a BadRow (the footer says how many)."""
    parquet = parquet_file(file)
    for group in groups if groups is not None else range(parquet.metadata.num_row_groups):
        expected = parquet.metadata.row_group(group).num_rows
        seen = 0
        try:
            for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group]):
                seen += batch.num_rows
                yield batch
        except StorageError:
            raise  # the store failed, not the file: no row is bad
        except (pa.ArrowException, OSError) as err:
            reason = (f"row group {group} of {PurePosixPath(file.name).name} cannot be "
                      f"decoded: {str(err).strip() or type(err).__name__}")
            for _ in range(max(expected - seen, 0)):
                yield BadRow(reason)


def iter_record_batches(kind: str, files: Sequence[DataFile], batch_rows: int
                         ) -> Iterator[pa.RecordBatch | BadRow]:
    if kind == "parquet":
        for file in files:
            yield from iter_parquet(file, batch_rows)
        return
    for file in files:
        yield from iter_arrow_stream(file, batch_rows)


def iter_arrow_stream(file: DataFile, batch_rows: int) -> Iterator[pa.RecordBatch]:
    # save_to_disk writes Arrow IPC *stream* files; memory-mapped on disk, no copy.
    try:
        with (pa.memory_map(str(file.path)) if file.path is not None
              else pa.PythonFile(file.open(), mode="r")) as source:
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                for start in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(start, batch_rows)
    except StorageError:
        raise
    except (pa.ArrowException, OSError) as err:  # a stream says nothing of what is left
        raise _unreadable(file, "Arrow stream", err) from None


def batches_rows(batches: Iterable[pa.RecordBatch | BadRow]) -> Iterator[Row]:
    """The rows of record batches in order; a BadRow among them stays in its place."""
    for batch in batches:
        if isinstance(batch, BadRow):
            yield batch
        else:
            yield from record_batch_rows(batch)


def record_batch_rows(batch: pa.RecordBatch) -> Iterator[Row]:
    try:
        yield from batch.to_pylist()
    except UnicodeDecodeError:
        # Writers do not all validate: a string column may hold bytes that are not
        # UTF-8. Only the rows holding them are bad.
        for i in range(batch.num_rows):
            try:
                yield batch.slice(i, 1).to_pylist()[0]
            except UnicodeDecodeError as err:
                yield BadRow(f"a string column holds bytes that are not valid UTF-8 "
                              f"({err.reason})")
