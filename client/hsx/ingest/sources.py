"""A dataset's rows, in source order, and its fingerprint.

`resolve_source(dataset)` says where the rows come from (a `DatasetSource`); `dataset` is
a path or URI, or a `DatasetSpec` (path and split) as a job names it:

- a local file: JSON lines (`.jsonl`, `.ndjson`; `.json` holding JSON lines or one
  array), or Parquet;
- a local folder of such files; a `datasets` `save_to_disk` folder (Arrow streams); a
  `save_to_disk` DatasetDict, one split at a time;
- a bucket object or prefix (`s3://`, `gs://`, `az://`), read through hsx.output's
  storage layer with the same credentials as an output (options resolved where the
  source is made travel with it when it is pickled), by the same rules as a folder;
- a Hugging Face hub id (no local path of that name): `datasets.load_dataset(id,
  split=...)`, when the hub can be reached.

**Splits.** The dataset files of a folder or prefix (hidden folders skipped) split as
Hugging Face lays them out: files named `{split}-00000-of-00003...` (how `push_to_hub`
names shards: UltraChat's `data/train_sft-00000-of-00003.parquet`) belong to that split;
otherwise the files directly in the folder are one dataset (no splits); otherwise each
subfolder holding files is a split named by its path (`train`, `data/test`). A dataset
with one split is read without naming it; with several, the split must be named
(`DatasetSpec.split`) and a dataset without it is refused, with the splits found and
what to write. Files of one split are read in name order; where a split holds Parquet
and JSON lines files, the Parquet ones (as a folder always was).

**Streaming.** JSON lines stream line by line (from a bucket through a buffer of
`READ_BUFFER` bytes, one ranged GET per refill), a line in chunks of at most the row
limit (`HSX_MAX_ROW_BYTES`, limits.py: a longer one is a bad row, skipped to its end).
Parquet from a bucket is read through a file object whose every read is one ranged GET
(pyarrow asks for the footer, then each row group's column chunks, coalesced): nothing
is downloaded whole, nothing needs scratch disk, and memory is one row group, as on
local disk. A JSON array file is read whole (it cannot be streamed), and refused by
`check` above `HSX_MAX_JSON_ARRAY_BYTES`.

**Slices.** `slices()` cuts a source into independent parts (`SourceSlice`: lines of a
JSON lines file starting in a byte range, a run of Parquet row groups, one Arrow file),
each read on its own, by another process if need be; read one after the other they give
the source's rows in order. A hub dataset is one slice.

A row that cannot even be parsed (malformed JSON, undecodable bytes) is a `BadRow`
with its reason, in its place: `sample_index` is a row's position in the source.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import re
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from hsx.ingest.datafiles import (
    DATASET_SUFFIXES,
    JSONL_SUFFIXES,
    OBJECT_SCHEMES,
    BadRow,
    BucketFolder,
    DataFile,
    DatasetAccessError,
    DatasetError,
    DatasetFormatError,
    DatasetNotFoundError,
    Folder,
    LocalFolder,
    Row,
    object_file,
)
from hsx.ingest.limits import IngestLimits
from hsx.ingest.readers import (
    batches_rows,
    bounded_lines,
    check_json_array,
    iter_arrow_stream,
    iter_jsonl,
    iter_parquet,
    iter_record_batches,
    jsonl_cuts,
    jsonl_lines,
    parquet_file,
    record_batch_rows,
)
from hsx.output.storage import Storage, StorageError, check_key
from hsx.spec import DatasetSpec

logger = logging.getLogger(__name__)

# `{split}-00000-of-00003...`: how `datasets`' push_to_hub (and the hub's parquet
# conversion) name a split's shards.
_SHARD_NAME = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}(?:[-_.][^/]*)?\.[^/.]+$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?$")
_HUB_PROBE_TIMEOUT_S = 10.0

# ----------------------------------------------------------------------- sources


class DatasetSource(abc.ABC):
    """A dataset resolved: where its rows come from, in order (see the module docstring)."""

    kind: str
    location: str  # the dataset as named, for messages
    counts_quickly: bool = True  # count_rows reads metadata, not every row

    @abc.abstractmethod
    def rows(self, batch_rows: int = 1024, limits: IngestLimits | None = None
             ) -> Iterator[Row]:
        """Every row in source order; a row that cannot be parsed, or is over the row
        limit (`limits`, else this process's: limits.py), is a BadRow."""

    @abc.abstractmethod
    def count_rows(self) -> int:
        """Rows of the dataset without parsing them."""

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """Short hash that changes when the dataset does (see `dataset_fingerprint`)."""

    @abc.abstractmethod
    def check(self) -> None:
        """What preflight asks beyond resolving: that the rows can be read from here."""

    def slices(self, slice_bytes: int = 0, slice_rows: int = 0) -> list[SourceSlice]:
        """Independent parts whose rows, one after the other, are the source's rows in
        order (see SourceSlice); this one: the whole source, which cannot be cut."""
        return [SourceSlice("whole", source=self)]

    def __str__(self) -> str:
        return f"{self.location} ({self.kind})"


class FilesSource(DatasetSource):
    """Rows from files: JSON lines, Parquet, or `save_to_disk` Arrow streams, on local
    disk or in a bucket. `fingerprinted` are the files the fingerprint covers (for a
    save_to_disk folder, every file of it)."""

    def __init__(self, kind: str, files: Sequence[DataFile], location: str, *,
                 fingerprinted: Sequence[DataFile] | None = None,
                 split: str | None = None) -> None:
        self.kind = kind  # "jsonl" | "parquet" | "save_to_disk"
        self.files = tuple(files)
        self.location = location
        self.split = split
        self.fingerprinted = tuple(self.files if fingerprinted is None else fingerprinted)
        self.remote = any(f.path is None for f in self.files)
        self.counts_quickly = not (self.remote and kind == "jsonl")

    def __str__(self) -> str:
        split = f", split {self.split}" if self.split is not None else ""
        return f"{self.location} ({self.kind}, {len(self.files)} files{split})"

    def rows(self, batch_rows: int = 1024, limits: IngestLimits | None = None
             ) -> Iterator[Row]:
        limits = limits or IngestLimits.from_env()
        try:
            if self.kind == "jsonl":
                yield from iter_jsonl(self.files, limits)
                return
            yield from batches_rows(iter_record_batches(self.kind, self.files, batch_rows),
                                    limits)
        except StorageError as err:  # a bucket that failed mid-read (after its retries)
            raise DatasetAccessError(str(err)) from err

    def slices(self, slice_bytes: int = 0, slice_rows: int = 0) -> list[SourceSlice]:
        """JSON lines files cut at line starts every ~`slice_bytes` (a JSON array file
        is one slice), Parquet files by runs of row groups of ~`slice_rows` rows (a row
        group is never cut), save_to_disk folders by file. Reads footers and a line
        per cut, not the rows."""
        slice_bytes = slice_bytes or SLICE_BYTES
        slice_rows = slice_rows or SLICE_ROWS
        limits = IngestLimits.from_env()  # this process's, wherever the slices are read
        out: list[SourceSlice] = []
        try:
            for file in self.files:
                if self.kind == "jsonl":
                    cuts = jsonl_cuts(file, slice_bytes)
                    ends = [*cuts[1:], file.size]
                    out += [SourceSlice("jsonl", file, a, b if b < file.size else None,
                                        weight=b - a, limits=limits)
                            for a, b in zip(cuts, ends, strict=True)]
                elif self.kind == "parquet":
                    meta = parquet_file(file).metadata
                    start = rows = 0
                    for group in range(meta.num_row_groups):
                        rows += meta.row_group(group).num_rows
                        if rows >= slice_rows or group == meta.num_row_groups - 1:
                            out.append(SourceSlice("parquet", file, start, group + 1,
                                                   weight=rows, limits=limits))
                            start, rows = group + 1, 0
                else:
                    out.append(SourceSlice(self.kind, file, weight=file.size,
                                           limits=limits))
        except StorageError as err:
            raise DatasetAccessError(str(err)) from err
        return out

    def count_rows(self) -> int:
        try:
            if self.kind == "parquet":
                return sum(parquet_file(f).metadata.num_rows for f in self.files)
            if self.kind == "save_to_disk":
                return sum(batch.num_rows for batch in iter_record_batches(
                    self.kind, self.files, 1 << 30) if isinstance(batch, pa.RecordBatch))
            rows = 0
            chunk = IngestLimits.from_env().row_bytes
            for f in self.files:
                with f.open() as stream:
                    for line in bounded_lines(stream, chunk):  # a line over it: a row
                        rows += isinstance(line, int) or bool(line.strip())
            return rows
        except StorageError as err:
            raise DatasetAccessError(str(err)) from err

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for f in self.fingerprinted:
            digest.update(f"{f.name}\0{f.size}\0{f.version}\n".encode())
        return digest.hexdigest()[:16]

    def check(self) -> None:
        """Its first file's first byte can be read, and no JSON array file of it is
        over the limit on those (a look at the first bytes of a large `.json` file)."""
        first = self.files[0]
        try:
            if first.path is not None:
                with first.open() as stream:
                    stream.read(1)
            elif first.size and first.storage is not None:
                first.storage.read_range(first.key, 0, 1)
            if self.kind == "jsonl":
                limits = IngestLimits.from_env()
                for file in self.files:
                    check_json_array(file, limits)
        except StorageError as err:
            raise DatasetAccessError(str(err)) from err
        except OSError as err:
            raise DatasetAccessError(
                f"cannot read {first.url}: {err.strerror or err}"
            ) from err


@dataclass(frozen=True)
class SourceSlice:
    """An independent part of a source, read on its own (by another process): one
    JSON lines file's lines starting in bytes [start, stop), one Parquet file's row
    groups [start, stop), one Arrow stream file of a save_to_disk folder, or a whole
    source that cannot be cut (a hub dataset). A source's slices, read one after the
    other, give exactly its rows in order (`DatasetSource.slices`).

    `weight` is its size in the unit of its kind (bytes of a JSON lines or Arrow file,
    rows of Parquet), for estimating how much of a source is read. `limits` are those
    of the process that cut it, and hold in the one that reads it.
    """

    kind: str  # "jsonl" | "parquet" | "save_to_disk" | "whole"
    file: DataFile | None = None
    start: int = 0
    stop: int | None = None
    weight: int = 0
    source: DatasetSource | None = None  # kind "whole"
    limits: IngestLimits = field(default_factory=IngestLimits.from_env)

    def rows(self, batch_rows: int = 1024) -> Iterator[Row]:
        """The slice's rows in source order; a row that cannot be parsed, or is over
        the row limit, is a BadRow."""
        if self.kind == "whole":
            if self.source is None:
                raise RuntimeError("a whole-source slice without its source")
            yield from self.source.rows(batch_rows, self.limits)
            return
        if self.file is None:
            raise RuntimeError(f"a {self.kind} slice without its file")
        try:
            if self.kind == "jsonl":
                yield from jsonl_lines(self.file, self.start, self.stop, self.limits)
                return
            batches: Iterator[pa.RecordBatch | BadRow] = (
                iter_parquet(self.file, batch_rows, range(self.start, self.stop or 0))
                if self.kind == "parquet" else iter_arrow_stream(self.file, batch_rows))
            yield from batches_rows(batches, self.limits)
        except StorageError as err:  # a bucket that failed mid-read (after its retries)
            raise DatasetAccessError(str(err)) from err


SLICE_BYTES = 4 * 2**20  # a JSON lines slice: about this many bytes
SLICE_ROWS = 16384  # a Parquet slice: row groups until about this many rows


class HubSource(DatasetSource):
    """A Hugging Face hub dataset, read with `datasets.load_dataset(id, split=...)`.

    The hub is asked first, quickly (the dataset's page, a 10 s timeout), unless hub
    access is switched off (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`: then only the local
    cache of `datasets` is read), so an unreachable hub refuses the job in seconds
    rather than after `datasets`' own retries.
    """

    kind = "hub"
    counts_quickly = False  # counting means downloading it

    def __init__(self, hub_id: str, split: str | None) -> None:
        self.location = hub_id
        self.split = split
        self._split: str | None = None
        self._dataset: Any = None

    def __str__(self) -> str:
        split = self._split or self.split
        return f"{self.location} (hub{f', split {split}' if split else ''})"

    def check(self) -> None:
        self._resolved_split()

    def _resolved_split(self) -> str:
        if self._split is None:
            datasets = _datasets_module(self.location)
            if not _hub_offline():
                _probe_hub(self.location)
            try:
                names = list(datasets.get_dataset_split_names(self.location))
            except Exception as err:
                raise _hub_error(self.location, err) from err
            self._split = _choose_split(self.location, names, self.split)
        return self._split

    def dataset(self) -> Any:
        """The split as a `datasets.Dataset` (downloaded into the `datasets` cache)."""
        if self._dataset is None:
            split = self._resolved_split()
            datasets = _datasets_module(self.location)
            try:
                self._dataset = datasets.load_dataset(self.location, split=split)
            except Exception as err:
                raise _hub_error(self.location, err) from err
        return self._dataset

    def rows(self, batch_rows: int = 1024, limits: IngestLimits | None = None
             ) -> Iterator[Row]:
        limits = limits or IngestLimits.from_env()
        for table in self.dataset().with_format("arrow").iter(batch_size=batch_rows):
            for batch in table.to_batches():
                yield from record_batch_rows(batch, limits)

    def count_rows(self) -> int:
        return int(self.dataset().num_rows)

    def fingerprint(self) -> str:
        ds = self.dataset()
        # `datasets`' own fingerprint of the prepared split: it follows the builder's
        # configuration and data files (a new revision of the dataset changes it).
        own = getattr(ds, "_fingerprint", "")
        digest = hashlib.sha256(
            f"hub\0{self.location}\0{self._resolved_split()}\0{ds.num_rows}\0{own}\n".encode())
        return digest.hexdigest()[:16]


DatasetLike = str | os.PathLike[str] | DatasetSpec | DatasetSource
"""What names a dataset: a path or URI, a job's `DatasetSpec`, or a source resolved."""


def _datasets_module(hub_id: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DatasetAccessError(
            f"{hub_id} is not a local path, so it would be read from the Hugging "
            "Face hub, which needs the `datasets` package here (pip install datasets)"
        ) from None
    return datasets


def _hub_offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _unreachable(hub_id: str, detail: str) -> DatasetAccessError:
    return DatasetAccessError(
        f"{hub_id} is not a local path, so it was read as a Hugging Face hub id, "
        f"and the hub cannot be reached from this machine ({detail}). Download it where "
        f"the hub is reachable (`hf download {hub_id} --repo-type dataset "
        "--local-dir DIR`, or `datasets.load_dataset(...).to_parquet(FILE)`), copy it "
        "here or into a bucket, and set `dataset:` to that path or s3:// URI (with "
        "`split:` when it has several splits)"
    )


def _probe_hub(hub_id: str) -> None:
    """Ask the hub for the dataset's page: DatasetAccessError at once when the hub
    cannot be reached; DatasetNotFoundError when it has no such (public) dataset."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:  # datasets brings it; without it, datasets' own error says why
        return
    try:
        HfApi().dataset_info(hub_id, timeout=_HUB_PROBE_TIMEOUT_S)
    except GatedRepoError:
        raise DatasetAccessError(
            f"{hub_id} on the Hugging Face hub is gated: accept its terms on its "
            "page and set HF_TOKEN where the job runs") from None
    except RepositoryNotFoundError:
        raise DatasetNotFoundError(
            f"{hub_id} is neither a local path nor a dataset on the Hugging Face "
            "hub (a private one needs HF_TOKEN where the job runs)") from None
    except Exception as err:
        raise _unreachable(hub_id, f"{type(err).__name__}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _hub_error(hub_id: str, err: Exception) -> DatasetError:
    """An error of `datasets` about a hub dataset as a DatasetError that says what to do."""
    if isinstance(err, DatasetError):
        return err
    detail = _first_line(err)
    if type(err).__name__ == "DatasetNotFoundError":  # datasets.exceptions'
        return DatasetNotFoundError(f"{hub_id}: {detail}")
    if isinstance(err, ConnectionError) or "Couldn't reach" in detail:
        return _unreachable(hub_id, detail)
    if isinstance(err, ValueError):  # an unknown split, a config to choose, ...
        return DatasetFormatError(f"{hub_id}: {detail}")
    return DatasetAccessError(f"{hub_id}: {type(err).__name__}: {detail}")


# --------------------------------------------------------------------- resolution


def is_hub_id(path: str) -> bool:
    """Whether a job's dataset path names a hub dataset: no local file or folder has that
    name, it is no URI and no file name, and it is spelt like `org/name` or `name`."""
    if "://" in path or path.startswith(("/", ".", "~")) or path.endswith(DATASET_SUFFIXES):
        return False
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def is_bucket_uri(path: str) -> bool:
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in OBJECT_SCHEMES


def _as_spec(dataset: str | os.PathLike[str] | DatasetSpec) -> DatasetSpec:
    if isinstance(dataset, DatasetSpec):
        return dataset
    return DatasetSpec(path=os.fspath(dataset))


def resolve_source(dataset: DatasetLike
                   ) -> DatasetSource:
    """Where the dataset's rows come from; DatasetNotFoundError, DatasetFormatError or
    DatasetAccessError naming it and what to do when it cannot be read. Lists files or
    objects and reads small metadata files; reads no rows (a hub dataset: nothing)."""
    if isinstance(dataset, DatasetSource):
        return dataset
    spec = _as_spec(dataset)
    text = spec.path
    if is_bucket_uri(text):
        return _bucket_source(text, spec.split)
    if "://" in text and not text.startswith("file://"):
        raise DatasetFormatError(
            f"{text}: unsupported URI; use a local path, file://, "
            + ", ".join(f"{s}://" for s in OBJECT_SCHEMES) + " or a hub id")
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(text).path)
                if text.startswith("file://") else text).expanduser()
    if path.exists():
        return _local_source(path, text, spec.split)
    if is_hub_id(text):
        return HubSource(text, spec.split)
    raise DatasetNotFoundError(
        f"{text} does not exist (expected a .jsonl, .json or .parquet file, a "
        "folder of them, a `datasets` save_to_disk folder, an s3:// object or prefix, or "
        "a hub id such as org/name)"
    )


def check_dataset(dataset: DatasetLike
                  ) -> DatasetSource:
    """Resolve the dataset and make sure its rows can be read from here (a bucket: one
    byte of its first object; a hub id: the hub answers and has the split), without
    reading them: the check before any engine starts."""
    source = resolve_source(dataset)
    source.check()
    return source


def _local_source(path: Path, location: str, split: str | None) -> DatasetSource:
    if path.is_file():
        return _file_source(DataFile.local(path, path.name), location, split)
    return _folder_source(LocalFolder(path, location), split)


def _file_source(file: DataFile, location: str, split: str | None) -> FilesSource:
    if split is not None:
        raise DatasetFormatError(
            f"{location} is one file, which has no splits; remove `split`")
    if file.suffix in JSONL_SUFFIXES:
        return FilesSource("jsonl", (file,), location)
    if file.suffix == ".parquet":
        return FilesSource("parquet", (file,), location)
    raise DatasetFormatError(
        f"{location}: unsupported file type {file.suffix or '(none)'!r}; "
        "use .jsonl, .json (JSON lines) or .parquet"
    )


def _bucket_source(uri: str, split: str | None) -> DatasetSource:
    parent, _, name = uri.rstrip("/").rpartition("/")
    has_parent = bool(parent.partition("://")[2])
    try:
        if has_parent and name.endswith(DATASET_SUFFIXES):
            storage = Storage.for_uri(parent)
            info = storage.head(name)
            if info is not None:
                return _file_source(object_file(storage, name, info), uri, split)
        folder = BucketFolder(Storage.for_uri(uri), uri)
        if not folder.files():
            raise DatasetNotFoundError(
                f"{uri}: no such object, and no objects under that prefix")
        source = _folder_source(folder, split)
        for file in source.files:
            check_key(file.key)  # a name the storage layer cannot read is refused now
        return source
    except StorageError as err:
        raise DatasetAccessError(str(err)) from err
    except ValueError as err:
        if isinstance(err, DatasetError):
            raise
        raise DatasetFormatError(f"{uri}: {err}") from err


def _folder_source(folder: Folder, split: str | None) -> FilesSource:
    location = folder.location
    if folder.read_text("dataset_dict.json") is not None:
        splits = sorted({f.name.split("/")[0] for f in folder.files()
                         if f.name.count("/") == 1 and f.name.endswith("/state.json")})
        chosen = _choose_split(location, splits, split)
        return _save_to_disk(folder, f"{chosen}/", chosen)
    if folder.read_text("state.json") is not None and folder.read_text(
            "dataset_info.json") is not None:
        if split is not None:
            raise DatasetFormatError(
                f"{location} is one saved split, which has no splits to choose "
                "from; remove `split`")
        return _save_to_disk(folder, "", None)
    files = [f for f in folder.files() if f.suffix in DATASET_SUFFIXES and not f.hidden]
    if not files:
        raise DatasetFormatError(
            f"{location} is a folder that holds no *.parquet or *.jsonl files and is not "
            "a `datasets` save_to_disk folder (no state.json / dataset_info.json)"
        )
    groups = split_groups(files)
    if None in groups:
        if split is not None:
            raise DatasetFormatError(
                f"{location} has no splits (its files are read together, "
                "as one dataset); remove `split`, or point `dataset` at one file")
        return _of_one_kind(groups[None], location, None)
    names = sorted(name for name in groups if name is not None)
    chosen = _choose_split(location, names, split)
    return _of_one_kind(groups[chosen], location, chosen)


def split_groups(files: Sequence[DataFile]) -> dict[str | None, list[DataFile]]:
    """A folder's dataset files by split (the key None: a folder without splits); see
    the module docstring for the rules."""
    top = [f for f in files if "/" not in f.name]
    candidates = top or list(files)
    sharded: dict[str | None, list[DataFile]] = {}
    others = []
    for f in candidates:
        match = _SHARD_NAME.match(PurePosixPath(f.name).name)
        if match:
            sharded.setdefault(match.group("split"), []).append(f)
        else:
            others.append(f)
    if sharded:
        if others:
            logger.warning("dataset files not named as a split's shards are not read: %s",
                           ", ".join(f.name for f in others[:5]))
        return sharded
    if top:
        return {None: top}
    by_folder: dict[str | None, list[DataFile]] = {}
    for f in candidates:
        by_folder.setdefault(f.name.rpartition("/")[0], []).append(f)
    return by_folder


def _of_one_kind(files: Sequence[DataFile], location: str, split: str | None
                 ) -> FilesSource:
    parquet = [f for f in files if f.suffix == ".parquet"]
    if parquet:
        return FilesSource("parquet", parquet, location, split=split)
    return FilesSource("jsonl", files, location, split=split)


def _choose_split(location: str, names: Sequence[str], split: str | None) -> str:
    if not names:
        raise DatasetFormatError(f"{location} has no splits")
    if split is None:
        if len(names) == 1:
            return names[0]
        raise DatasetFormatError(
            f"{location} has splits {list(names)}; name the one to read, e.g. "
            f"`dataset: {{path: {location}, split: {names[0]}}}`")
    if split not in names:
        raise DatasetFormatError(
            f"{location} has no split {split!r}; its splits are {list(names)}")
    return split


def _save_to_disk(folder: Folder, prefix: str, split: str | None) -> FilesSource:
    location = folder.location
    where = f"{location}/{prefix}".rstrip("/")
    state = json.loads(folder.read_text(f"{prefix}state.json") or "{}")
    if state.get("_indices_data_files"):
        # Old `datasets` versions saved a select/shuffle as an indices mapping; the
        # row order would then differ from the arrow files' order.
        raise DatasetFormatError(
            f"{where} was saved with an indices mapping; re-save it "
            "after `dataset.flatten_indices()`"
        )
    below = [f for f in folder.files() if f.name.startswith(prefix)]
    by_name = {f.name: f for f in below}
    files = []
    for entry in state.get("_data_files", []):
        name = f"{prefix}{entry['filename']}"
        if name not in by_name:
            raise DatasetFormatError(f"{where}: state.json names {name}, which "
                                     "is missing")
        files.append(by_name[name])
    if not files:
        raise DatasetFormatError(f"{where}: state.json names no data files")
    return FilesSource("save_to_disk", files, location, fingerprinted=below, split=split)


# --------------------------------------------------------- the functions of before


def iter_rows(dataset: DatasetLike, *,
              batch_rows: int = 1024) -> Iterator[Row]:
    """Every row of the dataset in source order; a row that cannot be parsed is a BadRow."""
    yield from resolve_source(dataset).rows(batch_rows)


def count_rows(dataset: DatasetLike) -> int:
    """Rows of the dataset without parsing them: lines of JSONL files (blank ones not
    counted), Parquet footers, Arrow stream files' batches, a hub split's row count."""
    return resolve_source(dataset).count_rows()


def dataset_fingerprint(dataset: DatasetLike
                        ) -> str:
    """Short sha256 of what identifies the dataset's content, cheaply, reading no rows:
    the files' names (below the dataset's root), sizes and modification times on disk;
    the objects' keys, sizes and ETags in a bucket; a hub split's id, name, row count
    and `datasets`' fingerprint.

    A changed or touched file changes it; that is enough to tell a resumed job that its
    dataset is no longer the one it ingested.
    """
    return resolve_source(dataset).fingerprint()
