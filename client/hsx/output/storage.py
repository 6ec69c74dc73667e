"""Where an output's objects live: local disk or an object store, behind one small interface.

`Storage` has exactly what hsx needs from a bucket, nothing more:

- `create(key, data)`: create-if-absent of a small object. The commit record of a work
  unit is created this way, so when two attempts of a unit finish, exactly one wins and
  the other gets `ObjectExistsError`.
- `put(key, data)`: replace a small object atomically.
- `open_writer(key, head_size=...)`: stream a large object (a shard) that becomes visible
  only when `finish()` succeeds, whole; an abort or a crash leaves nothing listable.
  The first `head_size` bytes (the shard's header, known only at the end) are handed to
  `finish(head)`; the body streams in between (see docs/ARCHITECTURE.md, "Storage").
- `read`, `read_range`, `head`, `exists`, `list` (a folder), `delete`.
- `local_path(key)`: the file behind a key where the storage is a local disk (readers
  memory-map shards there); None on object stores, where readers use `read_range`.
- `check_writable()`: write, read back and delete a probe, so an unusable output fails
  before any work starts, with a message that names it and the problem.
- `abort_incomplete_writes()`: remove what crashed writers left behind (staging files,
  unfinished multipart uploads); only while no writer of this output runs.

This module is the interface and the registry of its variants, and imports none of them.
As vLLM's `KVConnectorFactory`, `STORAGES` maps each URI scheme to the module path and
class name of the variant that serves it (`hsx.registry.ClassRegistry`), and
`Storage.for_uri(uri, **options)` imports that module when a URI of its scheme is first
opened. The variants import this module; this module never imports them, so there is no
circle, and `import hsx` never loads obstore. Registered:

- a plain path or `file://`: `LocalStorage` (local_storage.py);
- `s3://`, `gs://`, `az://`: `ObjectStoreStorage` (object_storage.py: obstore, i.e. Rust
  object_store).

A new backend is a module with a `Storage` subclass that defines `from_uri`, and one
`STORAGES.register` line below.

Keys are relative, `/`-separated names (`commits/unit-000042.json`). `list(prefix)` takes
a folder: `list("commits")` lists everything under `commits/`, never `commitsX/...`.
"""

from __future__ import annotations

import abc
import errno
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from hsx.output.layout import TMP_DIR
from hsx.registry import ClassRegistry

STAGING_DIR = TMP_DIR
"""Folder (under the root) where a local storage stages objects before publishing them.
Never listed; `abort_incomplete_writes` empties it."""

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9._=+@,-]+$")


class StorageError(Exception):
    """An output location could not be used; the message names the location and the problem."""


class ObjectExistsError(StorageError):
    """`create()` found the key already taken (another writer created it first)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


def is_disk_full(err: BaseException) -> bool:
    """Whether an error (or its message, for one that crossed a process boundary) says
    the output's file system is full: ENOSPC, or EDQUOT (a quota)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return any(words in text for words in (os.strerror(errno.ENOSPC),
                                           os.strerror(errno.EDQUOT)))


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key (relative to the storage root) and its size in bytes.

    Object stores also say what changes when the object is replaced (its ETag, and when
    it was last written, in Unix seconds); None where the store or path did not say.
    They do not take part in comparisons.
    """

    key: str
    size: int
    etag: str | None = field(default=None, compare=False)
    modified: float | None = field(default=None, compare=False)


def check_key(key: str, *, folder: bool = False) -> str:
    """`key` without a trailing slash, or ValueError if it is not a safe relative key.

    A key is one or more `/`-separated segments of letters, digits and `._=+@,-`, none of
    them `.` or `..`. With `folder=True` the empty key (the root) is allowed too.
    """
    if not isinstance(key, str):
        raise TypeError(f"a storage key must be a str, got {type(key).__name__}")
    stripped = key.rstrip("/") if folder else key
    if not stripped:
        if folder:
            return ""
        raise ValueError("a storage key must not be empty")
    for segment in stripped.split("/"):
        if segment in (".", "..") or not _KEY_SEGMENT.match(segment):
            raise ValueError(
                f"bad storage key {key!r}: segments must be non-empty, not '.' or '..', and "
                "use only letters, digits and ._=+@,-"
            )
    if stripped == STAGING_DIR or stripped.startswith(STAGING_DIR + "/"):
        raise ValueError(f"bad storage key {key!r}: {STAGING_DIR}/ is reserved for staging")
    return stripped


class ObjectWriter(abc.ABC):
    """One large object being written: `write()` the body, then `finish(head)` publishes.

    The object becomes `head + body`, visible atomically when `finish()` returns. Until
    then nothing is visible under its key; `abort()` (or leaving a `with` block without
    finishing) discards it. `head_size` (given to `open_writer`) is the expected length
    of the head: an equal-length head is the fast path; another length is accepted when
    `head_size > 0` but costs a rewrite on local disk. With `head_size == 0` there is no
    head and `finish()` takes none.
    """

    def __init__(self, storage: Storage, key: str, head_size: int) -> None:
        if head_size < 0:
            raise ValueError(f"head_size must be >= 0, got {head_size}")
        self.storage = storage
        self.key = key
        self.head_size = head_size
        self.body_bytes = 0
        self._state = "open"

    def write(self, data: Any, *, keep: bool = False) -> None:
        """Append `data` (any contiguous bytes-like object) to the body.

        `keep=True` promises that `data` stays unchanged until the writer is finished or
        aborted: a writer that holds bytes back (an object store's parts) then keeps a
        reference to them instead of a copy.
        """
        self._check_open()
        view = memoryview(data).cast("B")
        if view.nbytes:
            if keep:
                self._write_kept(view)
            else:
                self._write(view)
            self.body_bytes += view.nbytes

    def finish(self, head: bytes = b"") -> ObjectInfo:
        """Publish `head + body` under the key; on any error nothing is published."""
        self._check_open()
        if head and not self.head_size:
            raise ValueError(f"{self.storage.url(self.key)}: writer was opened without a head")
        try:
            size = self._finish(bytes(head))
        except BaseException:
            self.abort()
            raise
        self._state = "finished"
        return ObjectInfo(self.key, size)

    def abort(self) -> None:
        """Discard the object (idempotent; a no-op after `finish()`)."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._abort()

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"writer of {self.storage.url(self.key)} is already {self._state}")

    @abc.abstractmethod
    def _write(self, data: memoryview) -> None: ...

    def _write_kept(self, data: memoryview) -> None:
        """`_write` of bytes the caller keeps unchanged (see `write`)."""
        self._write(data)

    @abc.abstractmethod
    def _finish(self, head: bytes) -> int:
        """Publish; return the object's size."""

    @abc.abstractmethod
    def _abort(self) -> None: ...


class RangedFile(io.RawIOBase):
    """A stored object as a read-only, seekable file: each read is one ranged read.

    Readers that want fewer, larger requests wrap it in `io.BufferedReader`; pyarrow
    takes it as it is (`pa.PythonFile(RangedFile(...))`) and asks for whole column chunks
    or record batches.
    """

    def __init__(self, storage: Storage, key: str, size: int) -> None:
        super().__init__()
        self._storage = storage
        self._key = key
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        if n:
            buffer[:n] = self._storage.read_range(self._key, self._pos, n)
            self._pos += n
        return n


class Storage(abc.ABC):
    """The operations hsx performs on an output location (see the module docstring)."""

    uri: str
    """The root, as a URI without a trailing slash (`file:///...`, `s3://bucket/prefix`)."""

    @staticmethod
    def for_uri(uri: str | os.PathLike[str], **options: Any) -> Storage:
        """The storage for a path, `file://`, `s3://`, `gs://` or `az://` URI.

        `options` go to the object store: for `s3://`, `endpoint`, `region`,
        `access_key_id`, `secret_access_key`, `session_token`, `allow_http`, and any other
        obstore `S3Config` key; unset ones come from the usual `AWS_*` variables.
        The variant is the one `STORAGES` registers for the URI's scheme.
        """
        text = os.fspath(uri)
        scheme, sep, _ = text.partition("://")
        scheme = scheme.lower() if sep else "file"
        if scheme not in STORAGES:
            *others, last = (f"{s}://" for s in STORAGES.names())
            raise ValueError(
                f"unsupported storage URI {text!r}: use a path, {', '.join(others)} or {last}"
            )
        return STORAGES.load(scheme).from_uri(text, **options)

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> Storage:
        """This variant for `uri` (one of its schemes, or a plain path for local disk);
        ValueError when the URI or the options do not fit it. A variant registered in
        `STORAGES` defines it; one made only in code (a test's) need not."""
        raise NotImplementedError(f"{cls.__name__} is not opened by URI")

    def url(self, key: str) -> str:
        """The URI of `key`, for messages."""
        return f"{self.uri}/{key}" if key else self.uri

    @property
    def is_local(self) -> bool:
        """True where `local_path()` gives files that can be memory-mapped."""
        return False

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> None:
        """Create `key` holding `data` if it does not exist; else raise ObjectExistsError."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace `key` with `data`, atomically."""

    @abc.abstractmethod
    def open_writer(self, key: str, *, head_size: int = 0) -> ObjectWriter:
        """Start streaming a large object to `key` (see `ObjectWriter`)."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object (ObjectNotFoundError if absent)."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, length: int) -> memoryview:
        """Bytes `[start, start + length)` of the object; StorageError if it is shorter."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """The object's size, or None if it does not exist."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def size(self, key: str) -> int:
        """The object's size in bytes (ObjectNotFoundError if absent)."""
        info = self.head(key)
        if info is None:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist")
        return info.size

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under the folder `prefix` (recursively), sorted by key."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object; deleting a missing one is not an error."""

    def local_path(self, key: str) -> Path | None:
        """The local file of `key` (which may not exist), or None on object stores."""
        check_key(key)
        return None

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Write, read back and delete a probe object; StorageError naming the problem."""

    @abc.abstractmethod
    def abort_incomplete_writes(self, which: Callable[[str], bool] | None = None) -> int:
        """Remove unfinished writes (staging files, multipart uploads) left by crashed
        writers; return how many. `which(key)` says which keys' writes are garbage (None:
        all of them, only while no writer of this storage is running)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


STORAGES: ClassRegistry[Storage] = ClassRegistry("storage scheme")
"""URI scheme -> the variant serving it, by module path (imported on first use)."""
STORAGES.register("file", "hsx.output.local_storage", "LocalStorage")
STORAGES.register("s3", "hsx.output.object_storage", "ObjectStoreStorage")
STORAGES.register("gs", "hsx.output.object_storage", "ObjectStoreStorage")
STORAGES.register("az", "hsx.output.object_storage", "ObjectStoreStorage")
