"""A dataset's rows, in source order: JSONL files, Parquet files, or a `datasets`
`save_to_disk` folder (Arrow streams); and its fingerprint.

A row that cannot even be parsed (malformed JSON, undecodable bytes) is a `BadRow`
with its reason, in its place: `sample_index` is a row's position in the source.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa


class DatasetNotFoundError(FileNotFoundError):
    """The dataset path does not exist."""


class DatasetFormatError(ValueError):
    """The dataset path exists but is not a format ingestion reads."""


@dataclass(frozen=True)
class BadRow:
    """A row that failed before it could be parsed (malformed JSON, not an object)."""

    reason: str


Row = dict[str, Any] | BadRow


@dataclass(frozen=True)
class _Source:
    kind: str  # "jsonl" | "parquet" | "hf"
    files: tuple[Path, ...]
    root: Path


_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors write at the start


def resolve_source(dataset: str | Path) -> _Source:
    path = Path(dataset).expanduser()
    if not path.exists():
        raise DatasetNotFoundError(
            f"dataset {str(dataset)!r} does not exist (expected a .jsonl or .parquet file, "
            "a directory of them, or a `datasets` save_to_disk folder; hub ids are not "
            "read directly)"
        )
    if path.is_file():
        if path.suffix in _JSONL_SUFFIXES:
            return _Source("jsonl", (path,), path)
        if path.suffix == ".parquet":
            return _Source("parquet", (path,), path)
        raise DatasetFormatError(
            f"dataset {str(path)!r}: unsupported file type {path.suffix or '(none)'!r}; "
            "use .jsonl, .json (JSON lines) or .parquet"
        )
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise DatasetFormatError(
            f"dataset {str(path)!r} is a DatasetDict with splits {splits}; point `dataset` "
            f"at one split folder, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    if (path / "state.json").exists() and (path / "dataset_info.json").exists():
        state = json.loads((path / "state.json").read_text())
        if state.get("_indices_data_files"):
            # Old `datasets` versions saved a select/shuffle as an indices mapping; the
            # row order would then differ from the arrow files' order.
            raise DatasetFormatError(
                f"dataset {str(path)!r} was saved with an indices mapping; re-save it "
                "after `dataset.flatten_indices()`"
            )
        files = tuple(path / f["filename"] for f in state.get("_data_files", []))
        return _Source("hf", files, path)
    parquet = tuple(sorted(path.glob("*.parquet")))
    if parquet:
        return _Source("parquet", parquet, path)
    jsonl = tuple(sorted(p for p in path.iterdir() if p.suffix in _JSONL_SUFFIXES))
    if jsonl:
        return _Source("jsonl", jsonl, path)
    raise DatasetFormatError(
        f"dataset directory {str(path)!r} holds no *.parquet or *.jsonl files and is not a "
        "`datasets` save_to_disk folder (no state.json / dataset_info.json)"
    )


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


def _iter_jsonl(files: Sequence[Path]) -> Iterator[Row]:
    for path in files:
        with path.open("rb") as f:
            head = f.read(4096).removeprefix(_BOM).lstrip()
        if path.suffix == ".json" and head.startswith(b"["):
            # A JSON array file: not streamable, read whole (JSON lines are the norm).
            try:
                rows = json.loads(path.read_bytes().removeprefix(_BOM).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
                raise DatasetFormatError(
                    f"dataset file {str(path)!r} starts like a JSON array but cannot be read "
                    f"as one ({type(err).__name__}: {err}); a JSON lines file (.jsonl) lets "
                    "each bad row be skipped on its own") from None
            for row in rows:
                yield row if isinstance(row, dict) else BadRow(
                    f"the row is a JSON {type(row).__name__}, not an object")
            continue
        # Bytes, split at \n only (as count_rows counts), each line decoded on its own.
        with path.open("rb") as f:
            for number, line in enumerate(f):
                yield _parse_json_row(line.removeprefix(_BOM) if number == 0 else line)


def _unreadable(path: Path, kind: str, err: Exception) -> DatasetFormatError:
    return DatasetFormatError(
        f"dataset file {str(path)!r} is not a readable {kind} file (truncated or damaged?): "
        f"{str(err).strip() or type(err).__name__}")


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:  # no footer: no row can be located
        raise _unreadable(path, "Parquet", err) from None


def _iter_parquet(path: Path, batch_rows: int) -> Iterator[pa.RecordBatch | BadRow]:
    """A Parquet file's rows by batch; the rows of a row group that cannot be decoded
    are each a BadRow (the footer says how many there are)."""
    parquet = _parquet_file(path)
    for group in range(parquet.metadata.num_row_groups):
        expected = parquet.metadata.row_group(group).num_rows
        seen = 0
        try:
            for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group]):
                seen += batch.num_rows
                yield batch
        except (pa.ArrowException, OSError) as err:
            reason = (f"row group {group} of {path.name} cannot be decoded: "
                      f"{str(err).strip() or type(err).__name__}")
            for _ in range(max(expected - seen, 0)):
                yield BadRow(reason)


def _iter_record_batches(source: _Source, batch_rows: int
                         ) -> Iterator[pa.RecordBatch | BadRow]:
    if source.kind == "parquet":
        for path in source.files:
            yield from _iter_parquet(path, batch_rows)
        return
    for path in source.files:
        # save_to_disk writes Arrow IPC *stream* files; memory-mapped, no copy.
        try:
            with pa.memory_map(str(path)) as mm:
                reader = pa.ipc.open_stream(mm)
                for batch in reader:
                    for start in range(0, batch.num_rows, batch_rows):
                        yield batch.slice(start, batch_rows)
        except (pa.ArrowException, OSError) as err:  # a stream says nothing of what is left
            raise _unreadable(path, "Arrow stream", err) from None


def iter_rows(dataset: str | Path, *, batch_rows: int = 1024) -> Iterator[Row]:
    """Every row of the dataset in source order; a row that cannot be parsed is a BadRow."""
    source = resolve_source(dataset)
    if source.kind == "jsonl":
        yield from _iter_jsonl(source.files)
        return
    for batch in _iter_record_batches(source, batch_rows):
        if isinstance(batch, BadRow):
            yield batch
            continue
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


def count_rows(dataset: str | Path) -> int:
    """Rows of the dataset without parsing them: lines of JSONL files (blank ones not
    counted), Parquet footers, Arrow stream files' batches."""
    source = resolve_source(dataset)
    if source.kind == "parquet":
        return sum(_parquet_file(p).metadata.num_rows for p in source.files)
    if source.kind == "hf":
        return sum(batch.num_rows for batch in _iter_record_batches(source, 1 << 30)
                   if isinstance(batch, pa.RecordBatch))
    rows = 0
    for path in source.files:
        with open(path, "rb") as f:
            for line in f:
                rows += bool(line.strip())
    return rows


def dataset_fingerprint(path: str | Path) -> str:
    """Short sha256 of the dataset files' names, sizes and mtimes: cheap, no reading.

    A changed or touched file changes it; that is enough to tell a resumed job that its
    dataset is no longer the one it ingested.
    """
    source = resolve_source(path)
    root = source.root if source.root.is_dir() else source.root.parent
    files = sorted(p for p in root.rglob("*") if p.is_file()) if source.kind == "hf" else list(
        source.files)
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n"
                      .encode())
    return digest.hexdigest()[:16]
