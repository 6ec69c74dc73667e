"""`Storage` on a local (or mounted) file system.

Every object is staged in `<root>/.tmp/`, fsynced, and published by one atomic step:
`os.replace` for `put` and streamed objects, `os.link` for `create` (link fails if the
name exists, which is the create-if-absent). The folder is fsynced after each publish so
the name survives a power cut. A crash leaves only staging files, which are never listed
and which `abort_incomplete_writes()` removes.

What hsx writes on local disk (an output's files and folders, a draft, the coordinator's
ledger) is created owner-only unless HSX_OUTPUT_MODE says otherwise (`output_file_mode`):
hidden states and the prompts beside them are often private data. Each file gets its
mode when it is created (`open_output_file`), never by a chmod once it has a name others
could open.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

import numpy as np

from hsx import settings
from hsx.output import faults
from hsx.output.storage import (
    STAGING_DIR,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectWriter,
    Storage,
    StorageError,
    check_key,
)

SYNC_EVERY = 256 * 2**20
"""Bytes written between background `fdatasync`s of a streamed object, so the fsync at
`finish()` has little left to flush."""

_COPY_CHUNK = 16 * 2**20

DIRECT_IO_ENV = settings.DIRECT_IO.name
DIRECT_ALIGN = 512
"""Offset, length and address alignment of a write that bypasses the page cache
(O_DIRECT; the logical block size of common disks). With HSX_DIRECT_IO=1 a streamed
object's body goes that way where its buffers allow: the disk then reads the states out
of the caller's memory (DMA) instead of the CPU copying them into the page cache, which
costs a fraction of the CPU. It is off by default: each direct write waits for the
disk, and on a shared disk a CPU engine's extraction ran slower than through the page
cache (benchmarks/bench_writer.py and bench_pipeline.py's `hsx-direct` variant measure
both). Where the file system refuses O_DIRECT, or a buffer is not aligned, the write goes
through the page cache."""


OUTPUT_MODE_ENV = settings.OUTPUT_MODE.name
DEFAULT_OUTPUT_MODE = settings.OUTPUT_MODE.default
"""The mode of the files hsx creates on local disk: owner-only unless HSX_OUTPUT_MODE
(an octal string such as `0640`, to share an output with the owner's group) says
otherwise. Folders get the same bits plus x where r is set (0600 -> 0700, 0640 -> 0750).
Read by `hsx extract` and the coordinator alike; bucket outputs are not affected (the
bucket's own policy governs them)."""


def output_file_mode() -> int:
    """The mode of a file hsx creates on local disk (HSX_OUTPUT_MODE, default 0600)."""
    return settings.OUTPUT_MODE.get()


def output_dir_mode() -> int:
    """The mode of a folder hsx creates: the file mode plus x wherever r is set."""
    mode = output_file_mode()
    return mode | (mode & 0o444) >> 2


def _give_mode(fd: int, mode: int) -> None:
    """Make a file hsx just created have `mode` exactly."""
    # The creating call already gave `mode` less the umask, never more; a umask stricter
    # than the setting (077 with HSX_OUTPUT_MODE=0640) would take bits the operator asked
    # for. A file system without modes (some mounts) refuses: it keeps what it has.
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        with contextlib.suppress(OSError):
            os.fchmod(fd, mode)


def make_output_dirs(path: str | os.PathLike[str]) -> Path:
    """`mkdir -p path`, each folder it creates given `output_dir_mode()` (Path.mkdir
    gives the parents it creates the umask's mode); folders already there are left as
    they are. Returns the path."""
    path = Path(path)
    mode = output_dir_mode()
    missing: list[Path] = []
    at = path
    while not os.path.isdir(at) and at.parent != at:
        missing.append(at)
        at = at.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue  # made meanwhile by another writer: theirs
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _give_mode(fd, mode)
        finally:
            os.close(fd)
    return path


def output_opener(path: str | os.PathLike[str], flags: int) -> int:
    """An `opener` for `open()` whose new files get `output_file_mode()`; a file that
    exists already keeps its mode."""
    mode = output_file_mode()
    if not flags & os.O_CREAT:
        return os.open(path, flags)
    if flags & os.O_EXCL:
        fd = os.open(path, flags, mode)
        _give_mode(fd, mode)
        return fd
    while True:
        try:
            fd = os.open(path, flags | os.O_EXCL, mode)
        except FileExistsError:
            try:
                return os.open(path, flags & ~os.O_CREAT)
            except FileNotFoundError:
                continue  # removed in between: create it after all
        _give_mode(fd, mode)
        return fd


def open_output_file(path: str | os.PathLike[str], mode: str = "w") -> IO[Any]:
    """`open(path, mode)` for a file hsx writes on local disk: a new file gets
    `output_file_mode()` as it is created."""
    return open(path, mode, opener=output_opener)


def replace_output_file(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace a small file atomically (readers see the old or the new content), the
    new one created with `output_file_mode()` and its folder made if missing."""
    path = Path(path)
    make_output_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open_output_file(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _address(data: memoryview) -> int:
    return int(np.frombuffer(data, np.uint8).ctypes.data) if data.nbytes else 0


def fsync_dir(path: Path) -> None:
    """Make a rename/link/unlink inside `path` durable (POSIX needs the folder synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview, offset: int | None = None) -> None:
    """Write every byte of `data` (os.write may write fewer bytes than asked)."""
    while data.nbytes:
        n = os.write(fd, data) if offset is None else os.pwrite(fd, data, offset)
        data = data[n:]
        if offset is not None:
            offset += n


class LocalStorage(Storage):
    """A folder as an output location; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.uri = self.root.as_uri()
        self.direct_io = settings.DIRECT_IO.get()
        """Streamed bodies bypass the page cache where they can (HSX_DIRECT_IO=1; see
        DIRECT_ALIGN); turned off by the first refusal."""

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> LocalStorage:
        """A path or a `file://` URI; local disk takes no options."""
        if options:
            kind = "a file:// URI" if "://" in uri else "a local path"
            raise ValueError(f"{kind} takes no storage options, got {sorted(options)}")
        if "://" not in uri:
            return cls(uri)
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {uri!r} names host {parts.netloc!r}; only local files work")
        if not parts.path:
            raise ValueError(f"file URI {uri!r} has no path")
        return cls(unquote(parts.path))

    @property
    def is_local(self) -> bool:
        return True

    def local_path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _staging_file(self, key: str) -> tuple[Path, int]:
        """A new staging file for `key` (opened for writing) and its descriptor."""
        staging = self.root / STAGING_DIR
        try:
            make_output_dirs(staging)
            path = staging / f"{key.replace('/', '--')}.{secrets.token_hex(6)}.part"
            fd = output_opener(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except OSError as err:
            raise StorageError(f"cannot write to {self.uri}: {err.strerror or err}") from err
        return path, fd

    def _stage(self, key: str, data: bytes) -> Path:
        path, fd = self._staging_file(key)
        try:
            _write_all(fd, memoryview(data).cast("B"))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return path

    def _publish_dir(self, key: str) -> Path:
        final = self.local_path(key)
        make_output_dirs(final.parent)
        return final

    def create(self, key: str, data: bytes) -> None:
        # link() fails if the name exists: the create-if-absent, with the content complete.
        self._publish_small(key, data, os.link)

    def put(self, key: str, data: bytes) -> None:
        self._publish_small(key, data, os.replace)

    def _publish_small(self, key: str, data: bytes, publish: Callable[[Path, Path], None]) -> None:
        final = self._publish_dir(check_key(key))
        staged = self._stage(key, data)
        try:
            publish(staged, final)
        except FileExistsError:
            raise ObjectExistsError(f"{self.url(key)} already exists") from None
        finally:
            staged.unlink(missing_ok=True)
        fsync_dir(final.parent)

    def open_writer(self, key: str, *, head_size: int = 0) -> ObjectWriter:
        return LocalObjectWriter(self, check_key(key), head_size)

    def read(self, key: str) -> bytes:
        path = self.local_path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist") from None
        except IsADirectoryError:
            raise ObjectNotFoundError(f"{self.url(key)} is a folder, not an object") from None

    def read_range(self, key: str, start: int, length: int) -> memoryview:
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        path = self.local_path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist") from None
        try:
            data = os.pread(fd, length, start)
            if len(data) != length:
                size = os.fstat(fd).st_size
                raise StorageError(
                    f"{self.url(key)} has {size} bytes; cannot read [{start}, {start + length})"
                )
        finally:
            os.close(fd)
        return memoryview(data)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self.local_path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(check_key(key), st.st_size)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        folder = check_key(prefix, folder=True)
        base = self.root / folder if folder else self.root
        out: list[ObjectInfo] = []
        if not base.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/")
            if not rel:
                dirnames[:] = [d for d in dirnames if d != STAGING_DIR]
            for name in filenames:
                key = f"{rel}/{name}" if rel else name
                try:
                    out.append(ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size))
                except FileNotFoundError:
                    continue  # deleted while listing
        out.sort(key=lambda info: info.key)
        return out

    def delete(self, key: str) -> None:
        path = self.local_path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)

    def check_writable(self) -> None:
        probe = f".hsx-probe-{secrets.token_hex(6)}"
        try:
            make_output_dirs(self.root)
            self.create(probe, b"hsx")
            if self.read(probe) != b"hsx":
                raise StorageError(f"{self.uri}: a probe object read back different bytes")
            self.delete(probe)
        except OSError as err:
            if isinstance(err, StorageError):
                raise
            raise StorageError(f"{self.uri} is not writable: {err.strerror or err}") from err

    def abort_incomplete_writes(self, which: Callable[[str], bool] | None = None) -> int:
        staging = self.root / STAGING_DIR
        if not staging.is_dir():
            return 0
        removed = 0
        for entry in staging.iterdir():
            # Staging names are `<key with / as -->.<random>.part` (_staging_file).
            if which is not None and not which(entry.name.rsplit(".", 2)[0].replace("--", "/")):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
        return removed


class LocalObjectWriter(ObjectWriter):
    """Streams a body into a staging file (after `head_size` reserved bytes), then
    writes the head in place, fsyncs, and renames the file onto its key."""

    def __init__(self, storage: LocalStorage, key: str, head_size: int) -> None:
        super().__init__(storage, key, head_size)
        self._storage = storage
        self._path, self._fd = storage._staging_file(key)
        self._direct = self._open_direct()
        self._pos = head_size
        self._unsynced = 0
        self._syncer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hsx-fsync")
        self._sync: concurrent.futures.Future[None] | None = None

    def _open_direct(self) -> int:
        """A second descriptor of the staging file that bypasses the page cache, or -1."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or not self._storage.direct_io:
            return -1
        try:
            return os.open(self._path, os.O_WRONLY | flag)
        except OSError:  # the file system has no direct I/O
            self._storage.direct_io = False
            return -1

    def _close_direct(self) -> None:
        if self._direct >= 0:
            os.close(self._direct)
            self._direct = -1

    def _write(self, data: memoryview) -> None:
        if (self._direct >= 0 and self._pos % DIRECT_ALIGN == 0
                and data.nbytes % DIRECT_ALIGN == 0 and _address(data) % DIRECT_ALIGN == 0):
            try:
                _write_all(self._direct, data, self._pos)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                # Refused after all (an alignment this file system wants larger): the
                # page cache from now on, for this object and the storage's next ones.
                self._storage.direct_io = False
                self._close_direct()
                _write_all(self._fd, data, self._pos)
        else:
            _write_all(self._fd, data, self._pos)
        self._pos += data.nbytes
        self._unsynced += data.nbytes
        if self._unsynced >= SYNC_EVERY and (self._sync is None or self._sync.done()):
            self._unsynced = 0
            if self._sync is not None:
                self._sync.result()  # re-raise a failed background sync
            self._sync = self._syncer.submit(os.fdatasync, self._fd)

    def _finish(self, head: bytes) -> int:
        if self._sync is not None:
            self._sync.result()
        self._syncer.shutdown()
        # Direct writes are done when they return; the fsync below makes them durable
        # with the rest (it flushes the inode's metadata and the disk's cache).
        self._close_direct()
        if len(head) != self.head_size:
            self._rewrite_with_head(head)
        elif head:
            _write_all(self._fd, memoryview(head), 0)
        faults.reached("after_shard_write", self.key)
        os.fsync(self._fd)
        faults.reached("after_fsync", self.key)
        size = os.fstat(self._fd).st_size
        os.close(self._fd)
        self._fd = -1
        final = self._storage._publish_dir(self.key)
        os.replace(self._path, final)
        fsync_dir(final.parent)
        return size

    def _rewrite_with_head(self, head: bytes) -> None:
        """Copy the body behind a head of another length (rare: a larger header)."""
        path, fd = self._storage._staging_file(self.key)
        try:
            _write_all(fd, memoryview(head))
            offset, left = self.head_size, self.body_bytes
            while left:
                chunk = os.pread(self._fd, min(left, _COPY_CHUNK), offset)
                if not chunk:
                    raise StorageError(f"{self._path}: ended early while rewriting")
                _write_all(fd, memoryview(chunk))
                offset += len(chunk)
                left -= len(chunk)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(self._fd)
        self._path.unlink(missing_ok=True)
        self._path, self._fd = path, fd

    def _abort(self) -> None:
        self._syncer.shutdown(wait=True)
        self._close_direct()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._path.unlink(missing_ok=True)
