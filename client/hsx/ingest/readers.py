"""Rows from a dataset's files: JSON lines (whole, or the lines starting in a byte
range), a JSON array file, Parquet row groups, `save_to_disk` Arrow streams. A row that
cannot be parsed is a `BadRow` in its place (datafiles.py); a file that cannot be read at
all is a `DatasetFormatError` naming it.

A row larger than `IngestLimits.row_bytes` (limits.py) is a BadRow that says its size:
a JSON line is read in chunks of at most that many bytes and skipped to its newline,
never held whole; a Parquet or Arrow row is measured in its record batch and never
turned into Python objects. A JSON array file, which is read whole, is refused above
`IngestLimits.json_array_bytes` (`check_json_array`).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import PurePosixPath
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hsx.ingest.datafiles import BOM, BadRow, DataFile, DatasetFormatError, Row
from hsx.ingest.limits import MAX_JSON_ARRAY_BYTES_ENV, IngestLimits, text_bytes
from hsx.output.storage import StorageError
from hsx.progress import human_bytes

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


def iter_jsonl(files: Sequence[DataFile], limits: IngestLimits) -> Iterator[Row]:
    for file in files:
        yield from jsonl_lines(file, 0, None, limits)


def _is_json_array(file: DataFile, stream: io.BufferedReader) -> bool:
    head = stream.peek(4096)[:4096].removeprefix(BOM).lstrip()
    return file.suffix == ".json" and head.startswith(b"[")


SKIP_CHUNK = 2**20  # bytes read at a time past the end of a line over the limit


def bounded_lines(stream: IO[bytes], limit: int) -> Iterator[bytes | int]:
    """The lines of `stream`, split at \\n only, each with its \\n; in the place of a
    line over `limit` bytes (its \\n not counted), its size in bytes (\\n counted),
    read in chunks and dropped: memory stays within `limit` whatever the line."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n"):
            line = stream.readline(SKIP_CHUNK)
            if not line:
                break
            size += len(line)
        yield size


def skip_line(stream: IO[bytes]) -> None:
    """Move `stream` past the end of the line it is in, in chunks."""
    while True:
        chunk = stream.readline(SKIP_CHUNK)
        if not chunk or chunk.endswith(b"\n"):
            return


def jsonl_lines(file: DataFile, start: int, stop: int | None, limits: IngestLimits
                ) -> Iterator[Row]:
    """The rows of the lines of `file` that start at a byte in [start, stop) (to the end
    when stop is None); `start` is 0 or the first byte of a line. A line over the row
    limit is a BadRow, skipped without being read whole."""
    with file.open() as stream:
        if start == 0 and _is_json_array(file, stream):
            yield from _json_array(file, stream, limits)
            return
        if start:
            stream.seek(start)
        position = start
        # Bytes, split at \n only (as count_rows counts), each line decoded on its own.
        for line in bounded_lines(stream, limits.row_bytes):
            if stop is not None and position >= stop:
                return
            first = position == 0
            if isinstance(line, int):
                position += line
                yield BadRow(limits.row_too_large(line))
                continue
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
            skip_line(stream)  # to the end of the line holding byte target - 1
            cut = stream.tell()
            if cut >= file.size:
                break
            if cut > cuts[-1]:
                cuts.append(cut)
            target = max(cut, target) + slice_bytes
    return cuts


def check_json_array(file: DataFile, limits: IngestLimits) -> None:
    """DatasetFormatError unless `file`, if it is a JSON array file, is within the
    limit on those (they are read whole): a look at its first bytes, for a `.json`
    file over the limit only."""
    if file.suffix != ".json" or file.size <= limits.json_array_bytes:
        return
    with file.open() as stream:
        if _is_json_array(file, stream):
            raise _array_too_large(file, limits)


def _array_too_large(file: DataFile, limits: IngestLimits) -> DatasetFormatError:
    name = PurePosixPath(file.name).name
    return DatasetFormatError(
        f"dataset file {file.url!r} is one JSON array of {human_bytes(file.size)}, over "
        f"the {human_bytes(limits.json_array_bytes)} such a file may hold "
        f"({MAX_JSON_ARRAY_BYTES_ENV}): an array is read whole. Convert it to JSON lines, "
        f"which stream row by row: `jq -c '.[]' {name} > "
        f"{PurePosixPath(name).stem}.jsonl`")


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _after_space(text: str, pos: int) -> int:
    match = _JSON_SPACE.match(text, pos)
    return match.end() if match is not None else pos  # (it always matches)


def _json_array(file: DataFile, stream: IO[bytes], limits: IngestLimits) -> Iterator[Row]:
    """A JSON array file's rows. Not streamable, so read whole (JSON lines are the
    norm) within the limit on those files; each element is parsed on its own, so one
    over the row limit is a BadRow as a line would be. A file that is not one JSON
    array is refused before any of its rows is given."""
    if file.size > limits.json_array_bytes:
        raise _array_too_large(file, limits)
    decoder = json.JSONDecoder()
    rows: list[Row] = []
    try:
        text = stream.read().removeprefix(BOM).decode("utf-8")
        pos = _after_space(text, 0)
        if not text.startswith("[", pos):
            raise json.JSONDecodeError("Expecting '['", text, pos)
        pos = _after_space(text, pos + 1)
        closed = text.startswith("]", pos)
        while not closed:
            row, end = decoder.raw_decode(text, pos)
            size = text_bytes(text[pos:end], limits.row_bytes) if (
                4 * (end - pos) > limits.row_bytes) else end - pos
            if size > limits.row_bytes:
                rows.append(BadRow(limits.row_too_large(size)))
            else:
                rows.append(row if isinstance(row, dict) else BadRow(
                    f"the row is a JSON {type(row).__name__}, not an object"))
            pos = _after_space(text, end)
            closed = text.startswith("]", pos)
            if not closed:
                if not text.startswith(",", pos):
                    raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
                pos = _after_space(text, pos + 1)
        pos = _after_space(text, pos + 1)
        if pos != len(text):
            raise json.JSONDecodeError("Extra data", text, pos)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise DatasetFormatError(
            f"dataset file {file.url!r} starts like a JSON array but cannot be read "
            f"as one ({type(err).__name__}: {err}); a JSON lines file (.jsonl) lets "
            "each bad row be skipped on its own") from None
    yield from rows


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


def batches_rows(batches: Iterable[pa.RecordBatch | BadRow], limits: IngestLimits
                 ) -> Iterator[Row]:
    """The rows of record batches in order; a BadRow among them stays in its place."""
    for batch in batches:
        if isinstance(batch, BadRow):
            yield batch
        else:
            yield from record_batch_rows(batch, limits)


def record_batch_rows(batch: pa.RecordBatch, limits: IngestLimits) -> Iterator[Row]:
    """A record batch's rows; a row over the row limit (`row_bytes`) is a BadRow,
    never turned into Python objects."""
    sizes = row_bytes(batch)
    over = sizes > limits.row_bytes
    if not over.any():
        yield from _pylist(batch)
        return
    rows = _pylist(batch.filter(pa.array(~over)))
    for size, big in zip(sizes.tolist(), over.tolist(), strict=True):
        yield BadRow(limits.row_too_large(size)) if big else next(rows)


def _pylist(batch: pa.RecordBatch) -> Iterator[Row]:
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


def row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """The bytes of each row of `batch`: its strings' and binaries' bytes and its
    numbers' widths, through lists, structs and dictionaries (int64)."""
    total = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        total += _value_bytes(column)
    return total


def _value_bytes(array: pa.Array) -> np.ndarray:
    kind = array.type
    if (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        lengths = pc.binary_length(array).fill_null(0)
        return np.asarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)
            or pa.types.is_map(kind)):
        # Offsets into the whole child array (`values` ignores a slice; they do not).
        offsets = np.asarray(array.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
        inner = np.concatenate([[0], np.cumsum(_value_bytes(array.values))])
        return inner[offsets[1:]] - inner[offsets[:-1]]
    if pa.types.is_fixed_size_list(kind):
        inner = _value_bytes(array.flatten())
        return inner.reshape(len(array), kind.list_size).sum(axis=1)
    if pa.types.is_struct(kind):
        total = np.zeros(len(array), dtype=np.int64)
        for child in array.flatten():
            total += _value_bytes(child)
        return total
    if pa.types.is_dictionary(kind):
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
        return _value_bytes(array.dictionary)[indices]
    if pa.types.is_null(kind):
        return np.zeros(len(array), dtype=np.int64)
    try:
        width = max(kind.bit_width // 8, 1)
    except ValueError:  # another layout: its buffers shared out
        width = array.nbytes // max(len(array), 1)
    return np.full(len(array), width, dtype=np.int64)
