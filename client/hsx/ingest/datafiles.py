"""The files of a dataset, on local disk or in a bucket, and the errors of reading one.

`DataFile` is one file (a local path, or a bucket object read by ranged GETs); a
`Folder` lists a dataset folder's or prefix's files and reads its small text files
(`state.json`, `dataset_info.json`). `BadRow` is a row that could not even be parsed,
kept in its place. sources.py resolves datasets to these; readers.py reads rows from them.
"""

from __future__ import annotations

import abc
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from hsx.output.storage import RangedFile, Storage


class DatasetError(Exception):
    """A dataset that cannot be read; the message names it and says why."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset path, object or prefix does not exist."""


class DatasetFormatError(DatasetError, ValueError):
    """The dataset exists but is not a format ingestion reads, or its split is not named."""


class DatasetAccessError(DatasetError, OSError):
    """The dataset cannot be read from here: no permission, a store or the hub that
    cannot be reached, or a package that reading it needs."""


@dataclass(frozen=True)
class BadRow:
    """A row that failed before it could be parsed (malformed JSON, not an object)."""

    reason: str


Row = dict[str, Any] | BadRow

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DATASET_SUFFIXES = (*JSONL_SUFFIXES, ".parquet")
OBJECT_SCHEMES = ("s3", "gs", "az")
READ_BUFFER = 8 * 2**20  # bytes per ranged GET when a bucket's JSON lines stream
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors write at the start
# A folder's metadata files (`state.json`, `dataset_info.json`) are a few KiB; one
# larger than this is refused, not read whole.
METADATA_BYTES = 16 * 2**20


# ------------------------------------------------------------------------ files


@dataclass(frozen=True)
class DataFile:
    """One file of a dataset: a local file (`path`), or an object (`storage`, `key`).

    `name` is its path below the dataset's root, `/`-separated; `version` what changes
    when it is rewritten (on disk its modification time in ns, in a bucket its ETag or
    else its modification time). Name, size and version make the dataset's fingerprint.
    """

    name: str
    size: int
    version: str
    path: Path | None = None
    storage: Storage | None = None
    key: str = ""

    @property
    def url(self) -> str:
        """Where it is, for messages."""
        if self.path is not None:
            return str(self.path)
        if self.storage is None:
            raise RuntimeError(f"dataset file {self.name} has neither a path nor a storage")
        return self.storage.url(self.key)

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def hidden(self) -> bool:
        """In (or is) a hidden file or folder: `.cache/`, `.git/`, `.DS_Store`."""
        return any(part.startswith(".") for part in self.name.split("/"))

    def open(self) -> io.BufferedReader:
        """The file as a buffered binary stream (a bucket's: ranged GETs)."""
        if self.path is not None:
            return self.path.open("rb")
        return io.BufferedReader(self._ranged(), READ_BUFFER)

    def arrow_source(self) -> Any:
        """What pyarrow reads it from: the path, or a file object of ranged reads."""
        if self.path is not None:
            return self.path
        return pa.PythonFile(self._ranged(), mode="r")

    def _ranged(self) -> RangedFile:
        if self.storage is None:
            raise RuntimeError(f"dataset file {self.name} has neither a path nor a storage")
        return RangedFile(self.storage, self.key, self.size)

    @classmethod
    def local(cls, path: Path, name: str) -> DataFile:
        st = path.stat()
        return cls(name, st.st_size, str(st.st_mtime_ns), path=path)


def _sorted(files: Sequence[DataFile]) -> list[DataFile]:
    # By path components (as sorted Paths were): `a/x` before `a-b/x`.
    return sorted(files, key=lambda f: tuple(f.name.split("/")))


class Folder(abc.ABC):
    """A dataset's folder: a local directory or a bucket prefix."""

    location: str

    @abc.abstractmethod
    def files(self) -> list[DataFile]:
        """Every file below it (hidden ones too), sorted by path."""

    @abc.abstractmethod
    def read_text(self, name: str) -> str | None:
        """A small file's text, or None if it does not exist; DatasetFormatError for
        one over METADATA_BYTES."""

    def _small(self, name: str, size: int) -> None:
        if size > METADATA_BYTES:
            raise DatasetFormatError(
                f"{self.location}: {name} is {size:,} bytes, too large for a dataset's "
                f"metadata file (at most {METADATA_BYTES:,})")


class LocalFolder(Folder):
    def __init__(self, root: Path, location: str) -> None:
        self.root = root
        self.location = location
        self._files: list[DataFile] | None = None

    def files(self) -> list[DataFile]:
        if self._files is None:
            found = [DataFile.local(p, p.relative_to(self.root).as_posix())
                     for p in self.root.rglob("*") if p.is_file()]
            self._files = _sorted(found)
        return self._files

    def read_text(self, name: str) -> str | None:
        path = self.root / name
        if not path.is_file():
            return None
        self._small(name, path.stat().st_size)
        return path.read_text()


class BucketFolder(Folder):
    def __init__(self, storage: Storage, location: str) -> None:
        self.storage = storage
        self.location = location
        self._files: list[DataFile] | None = None

    def files(self) -> list[DataFile]:
        if self._files is None:
            self._files = _sorted([object_file(self.storage, info.key, info)
                                   for info in self.storage.list("")])
        return self._files

    def read_text(self, name: str) -> str | None:
        found = [f for f in self.files() if f.name == name]
        if not found:
            return None
        self._small(name, found[0].size)
        return self.storage.read(name).decode("utf-8")


def object_file(storage: Storage, key: str, info: Any) -> DataFile:
    version = info.etag or (repr(info.modified) if info.modified is not None else "")
    return DataFile(key, info.size, version, storage=storage, key=key)
