"""`MemoryStorage`: objects in this process's memory, for a shard that is built here and
then handed on whole rather than stored.

An online job's engine writes each captured unit with the usual `ShardWriter` (the same
encoding, per-sample digests and commit protocol as a stored shard) into a
`MemoryStorage`, then takes the finished shard out of it (`take`) as one numpy buffer and
returns it to Ray, which copies it once into the node's object store (hsx_workers.stream).
It is made in code by whoever needs it, never opened by URI, so it is not in `STORAGES`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from hsx.output.storage import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectWriter,
    Storage,
    StorageError,
    check_key,
)

_MIN_CAPACITY = 1 << 20


class MemoryStorage(Storage):
    """Objects held as numpy byte buffers in this process; see the module docstring.

    `expect_bytes`: how large the next large object will be, about (its writer allocates
    that much at once, so a shard is not copied while it grows).
    """

    def __init__(self, name: str = "memory", expect_bytes: int = 0) -> None:
        self.uri = f"memory://{name}"
        self.expect_bytes = expect_bytes
        self._objects: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def create(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._lock:
            if key in self._objects:
                raise ObjectExistsError(f"{self.url(key)} exists")
            self._objects[key] = np.frombuffer(bytes(data), np.uint8)

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._lock:
            self._objects[key] = np.frombuffer(bytes(data), np.uint8)

    def open_writer(self, key: str, *, head_size: int = 0) -> ObjectWriter:
        check_key(key)
        return _MemoryWriter(self, key, head_size)

    def read(self, key: str) -> bytes:
        return self._get(key).tobytes()

    def read_range(self, key: str, start: int, length: int) -> memoryview:
        buf = self._get(key)
        if start < 0 or start + length > buf.nbytes:
            raise StorageError(f"{self.url(key)}: bytes [{start}, {start + length}) past "
                               f"its {buf.nbytes}")
        return memoryview(buf[start : start + length].data)

    def head(self, key: str) -> ObjectInfo | None:
        with self._lock:
            buf = self._objects.get(key)
        return None if buf is None else ObjectInfo(key, int(buf.nbytes))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        folder = check_key(prefix, folder=True) + "/" if prefix else ""
        with self._lock:
            return [ObjectInfo(k, int(v.nbytes)) for k, v in sorted(self._objects.items())
                    if k.startswith(folder)]

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def take(self, key: str) -> np.ndarray:
        """The object's bytes, removed from the storage (the caller owns them now)."""
        with self._lock:
            buf = self._objects.pop(key, None)
        if buf is None:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist")
        return buf

    def check_writable(self) -> None:
        return None

    def abort_incomplete_writes(self, which: Callable[[str], bool] | None = None) -> int:
        return 0

    def _get(self, key: str) -> np.ndarray:
        with self._lock:
            buf = self._objects.get(key)
        if buf is None:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist")
        return buf

    def _publish(self, key: str, buf: np.ndarray) -> None:
        with self._lock:
            self._objects[key] = buf


class _MemoryWriter(ObjectWriter):
    """The head's region first, then the body, in one buffer that doubles when full."""

    def __init__(self, storage: MemoryStorage, key: str, head_size: int) -> None:
        super().__init__(storage, key, head_size)
        self._memory = storage
        self._buf = np.empty(max(_MIN_CAPACITY, head_size + storage.expect_bytes), np.uint8)
        self._end = head_size

    def _write(self, data: memoryview) -> None:
        end = self._end + data.nbytes
        if end > self._buf.nbytes:
            grown = np.empty(max(end, 2 * self._buf.nbytes), np.uint8)
            grown[: self._end] = self._buf[: self._end]
            self._buf = grown
        self._buf[self._end : end] = np.frombuffer(data, np.uint8)
        self._end = end

    def _finish(self, head: bytes) -> int:
        if len(head) == self.head_size:
            self._buf[: len(head)] = np.frombuffer(head, np.uint8)
            out = self._buf[: self._end]
        else:  # a head of another length: the body moves behind it
            out = np.empty(len(head) + self._end - self.head_size, np.uint8)
            out[: len(head)] = np.frombuffer(head, np.uint8)
            out[len(head) :] = self._buf[self.head_size : self._end]
        self._memory._publish(self.key, out)
        self._buf = np.empty(0, np.uint8)
        return int(out.nbytes)

    def _abort(self) -> None:
        self._buf = np.empty(0, np.uint8)
