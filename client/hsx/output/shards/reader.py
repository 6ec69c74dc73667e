"""`ShardReader`: O(1) access to any sample of a shard, and the bytes under it (a memory
map on local disk, ranged reads on an object store).

See the package docstring for who calls what; the bytes it reads are encoding.py's.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hsx.output.layout import SHARD_FORMAT_NAME
from hsx.output.records import CommitRecord
from hsx.output.shards.encoding import (
    DEFAULT_HEADER_RESERVE,
    HEADER_PREFIX,
    HIDDEN_DTYPE,
    MODALITY_MASK,
    NUMPY_DTYPES,
    SAMPLE_DIGEST_BYTES,
    SAMPLE_DIGESTS,
    SHARD_FORMAT_VERSION,
    Backend,
    ShardCorrupt,
    StorageDtype,
    dequantize_fp8,
    new_hasher,
)
from hsx.output.storage import Storage

_HASH_CHUNK = 16 * 1024 * 1024
_REMOTE_HEAD = HEADER_PREFIX + DEFAULT_HEADER_RESERVE  # first GET of a remote shard


class ByteSource:
    """The bytes of one stored shard: a memory map on local disk, ranged reads elsewhere."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size

    @staticmethod
    def open(storage: Storage, key: str, size: int | None = None) -> ByteSource:
        path = storage.local_path(key)
        if path is not None:
            return _MappedSource(path)
        if size is None:
            size = storage.size(key)
        return _RangedSource(storage, key, size)

    @property
    def mapping(self) -> Any:
        """The whole shard in memory (mapped from local disk, or a buffer), else None."""
        return None

    def read(self, start: int, length: int) -> memoryview:
        """Bytes [start, start + length) as a writable buffer (a view where mapped)."""
        raise NotImplementedError

    def hash_range(self, start: int, length: int, sha: Any) -> None:
        while length > 0:
            piece = min(length, _HASH_CHUNK)
            sha.update(self.read(start, piece))
            start += piece
            length -= piece

    def close(self) -> None:
        return None

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MappedSource(ByteSource):
    """A local shard file, mapped copy-on-write (`ACCESS_COPY`): nothing is ever written
    back, and torch can wrap the pages without its "non-writable buffer" caveat."""

    def __init__(self, path: Path) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            raise ShardCorrupt(f"shard {path} is missing") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            self._mm: mmap.mmap | None = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            )
        super().__init__(str(path), size)

    @property
    def mapping(self) -> mmap.mmap | None:
        return self._mm

    def read(self, start: int, length: int) -> memoryview:
        if self._mm is None or start + length > self.size:
            raise ShardCorrupt(f"{self.name}: ended early (wanted bytes up to "
                               f"{start + length} of {self.size})")
        return memoryview(self._mm)[start : start + length]

    def hash_range(self, start: int, length: int, sha: Any) -> None:
        # Plain reads: hashing through the map would fault in and keep every page.
        with open(self.name, "rb") as f:
            f.seek(start)
            buf = bytearray(min(length, _HASH_CHUNK) or 1)
            view = memoryview(buf)
            while length > 0:
                got = f.readinto(view[: min(length, len(buf))])
                if not got:
                    raise ShardCorrupt(f"{self.name} ended early")
                sha.update(view[:got])
                length -= got

    def close(self) -> None:
        # Never mm.close(): torch.frombuffer views do not pin the buffer export, so
        # closing would leave them pointing at unmapped memory. Views keep it alive.
        self._mm = None


class _RangedSource(ByteSource):
    """A shard in an object store: each read is one ranged GET."""

    def __init__(self, storage: Storage, key: str, size: int) -> None:
        super().__init__(storage.url(key), size)
        self._storage = storage
        self._key = key

    def read(self, start: int, length: int) -> memoryview:
        if start + length > self.size:
            raise ShardCorrupt(f"{self.name}: ended early (wanted bytes up to "
                               f"{start + length} of {self.size})")
        if length == 0:
            return memoryview(bytearray())
        # One copy into memory we own: writable, so torch wraps it without a warning.
        return memoryview(bytearray(self._storage.read_range(self._key, start, length)))


def _torch_dtype(name: str) -> Any:
    import torch

    return {
        "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
        "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
    }[name]


class BufferSource(ByteSource):
    """A shard whole in memory: a buffer it was handed (an online job's unit from Ray's
    object store, read-only and shared with the store). Read like a mapped file."""

    def __init__(self, name: str, buffer: Any) -> None:
        self._buf: Any = memoryview(buffer).cast("B")
        super().__init__(name, self._buf.nbytes)

    @property
    def mapping(self) -> Any:
        return self._buf

    def read(self, start: int, length: int) -> memoryview:
        if start + length > self.size:
            raise ShardCorrupt(f"{self.name}: ended early (wanted bytes up to "
                               f"{start + length} of {self.size})")
        return memoryview(self._buf)[start : start + length]

    def close(self) -> None:
        self._buf = None  # views handed out keep the buffer alive


class ShardReader:
    """One shard: O(1) access to any sample, on local disk or in an object store.

    On local disk (`ShardReader(path)`, or `ShardReader.open(storage, key)` on a local
    storage) the file is memory-mapped copy-on-write: tensors are zero-copy views of its
    pages, numpy views are read-only, and views stay valid after `close()` or after the
    reader is dropped (they keep the mapping alive themselves).

    On an object store (`ShardReader.open` where the storage has no local files) the
    reader fetches the header (one ranged GET of the reserved region) and every tensor
    but `hidden_states` (the small ones: offsets, sample_index, input_ids, loss_mask,
    scales; one GET, ~5-9 bytes per token) when it opens, and then one sample's hidden
    states with one ranged GET when that sample is asked for. Nothing else is cached.

    `sample(i)` returns {"sample_index", "input_ids", "loss_mask", "hidden_states"} as
    numpy (default) or torch (`backend="torch"`), and "modality_mask" [T] (0 text, 1
    image) where the shard has it (`has_modality`: a job that takes images). fp8 shards
    are dequantized to bf16 unless `dequantize=False`, which adds the raw "scales"
    [T, L] instead.
    """

    def __init__(
        self, path: str | os.PathLike[str] | ByteSource, *, record: CommitRecord | None = None
    ) -> None:
        source = path if isinstance(path, ByteSource) else _MappedSource(Path(path))
        self._source: ByteSource | None = source
        self.name = source.name
        """The shard's path or URL, for messages."""
        self.record = record
        size = source.size
        if size < HEADER_PREFIX:
            raise ShardCorrupt(f"{self.name}: not a shard ({size} bytes)")
        head = source.read(0, min(size, _REMOTE_HEAD))
        (n,) = struct.unpack_from("<Q", head, 0)
        if HEADER_PREFIX + n > size:
            raise ShardCorrupt(f"{self.name}: header length {n} exceeds the file ({size} bytes)")
        raw = head[HEADER_PREFIX : HEADER_PREFIX + n] if HEADER_PREFIX + n <= len(head) \
            else source.read(HEADER_PREFIX, n)
        try:
            header = json.loads(bytes(raw))
        except ValueError as err:
            raise ShardCorrupt(f"{self.name}: header is not JSON: {err}") from err
        self._data_start = HEADER_PREFIX + n
        meta = header.pop("__metadata__", None) or {}
        if meta.get("format") != SHARD_FORMAT_NAME:
            raise ShardCorrupt(f"{self.name}: not an hsx shard (format {meta.get('format')!r})")
        if meta.get("format_version") != SHARD_FORMAT_VERSION:
            raise ShardCorrupt(
                f"{self.name}: shard format_version {meta.get('format_version')!r} is not "
                f"supported (this hsx reads {SHARD_FORMAT_VERSION!r}); upgrade hsx"
            )
        self.metadata: dict[str, str] = meta
        try:
            self.unit = int(meta["unit"])
            self.layers: list[int] = [int(k) for k in json.loads(meta["layers"])]
            self.hidden_size = int(meta["hidden_size"])
            self.storage_dtype: StorageDtype = meta["storage_dtype"]
        except (KeyError, TypeError, ValueError) as err:
            raise ShardCorrupt(f"{self.name}: bad shard metadata: {err!r}") from err
        if self.storage_dtype not in HIDDEN_DTYPE:
            raise ShardCorrupt(f"{self.name}: unknown storage_dtype {self.storage_dtype!r}")
        self._tensors: dict[str, dict[str, Any]] = header
        self._np_views: dict[str, np.ndarray] = {}
        self._torch_views: dict[str, Any] = {}
        names = ["hidden_states", "offsets", "sample_index", "input_ids", "loss_mask"]
        self.has_modality = MODALITY_MASK in header
        """The shard says each token's modality (a job that takes images)."""
        if self.has_modality:
            names.append(MODALITY_MASK)
        if self.storage_dtype == "fp8":
            names.append("scales")
        if SAMPLE_DIGESTS in header:
            names.append(SAMPLE_DIGESTS)
        for name in names:
            self._check_tensor(name, size)
        # Off the map: every tensor but hidden_states, in one read.
        self._small: tuple[int, int, memoryview] | None = None
        if source.mapping is None:
            spans = [self._tensors[k]["data_offsets"] for k in names[1:]]
            lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
            self._small = (lo, hi, source.read(self._data_start + lo, hi - lo))
        # Small, and read on every sample: copy once instead of re-viewing.
        self.offsets = self.tensor("offsets").copy()
        self.sample_indices = self.tensor("sample_index").copy()
        if len(self.offsets) != len(self.sample_indices) + 1:
            raise ShardCorrupt(f"{self.name}: offsets and sample_index lengths disagree")
        self.num_tokens = int(self._tensors["hidden_states"]["shape"][0])
        if self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens:
            raise ShardCorrupt(f"{self.name}: offsets do not span the {self.num_tokens} tokens")
        self.sample_digests: np.ndarray | None = None
        """Each sample's digest [n, 32] (None in shards written before them)."""
        self._digest_algorithm = str(meta.get("sample_digest", ""))
        if SAMPLE_DIGESTS in self._tensors:
            digests = self.tensor(SAMPLE_DIGESTS).copy()
            if digests.shape != (len(self.sample_indices), SAMPLE_DIGEST_BYTES):
                raise ShardCorrupt(f"{self.name}: {SAMPLE_DIGESTS} has shape {digests.shape} "
                                   f"for {len(self.sample_indices)} samples")
            try:
                new_hasher(self._digest_algorithm)
            except ValueError as err:
                raise ShardCorrupt(f"{self.name}: sample_digest: {err}") from None
            self.sample_digests = digests

    @classmethod
    def open(cls, storage: Storage, key: str, *, record: CommitRecord | None = None
             ) -> ShardReader:
        """The shard stored under `key`: mapped on local disk, by ranged reads elsewhere."""
        size = record.bytes if record is not None else None
        return cls(ByteSource.open(storage, key, size), record=record)

    @property
    def path(self) -> Path | None:
        """The local file, when the shard is on local disk."""
        return Path(self.name) if isinstance(self._source, _MappedSource) else None

    def _check_tensor(self, name: str, size: int) -> None:
        info = self._tensors.get(name)
        if info is None:
            raise ShardCorrupt(f"{self.name}: tensor {name!r} is missing")
        dtype = NUMPY_DTYPES.get(info.get("dtype", ""))
        if dtype is None:
            raise ShardCorrupt(f"{self.name}: tensor {name!r} has bad dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        if end - start != math.prod(info["shape"]) * dtype.itemsize:
            raise ShardCorrupt(f"{self.name}: tensor {name!r} shape and byte range disagree")
        if start < 0 or self._data_start + end > size:
            raise ShardCorrupt(f"{self.name}: tensor {name!r} lies outside the file (truncated?)")

    def __len__(self) -> int:
        return len(self.sample_indices)

    def __repr__(self) -> str:
        return f"ShardReader({self.name!r}, samples={len(self)}, tokens={self.num_tokens})"

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop this reader's mapping. Views handed out keep it alive until they go."""
        if self._source is not None:
            self._source.close()
        self._source = None
        self._np_views.clear()
        self._torch_views.clear()

    def _open_source(self) -> ByteSource:
        if self._source is None:
            raise ValueError(f"{self.name}: reader is closed")
        return self._source

    def _buffer(self, name: str, first: int = 0, rows: int | None = None
                ) -> tuple[Any, int, list[int]]:
        """(buffer, byte offset in it, shape) of rows [first, first + rows) of a tensor."""
        info = self._tensors.get(name)
        if info is None:
            raise KeyError(f"{self.name}: no tensor {name!r}")
        shape = list(info["shape"])
        start, _ = info["data_offsets"]
        if rows is not None:
            row_bytes = math.prod(shape[1:]) * NUMPY_DTYPES[info["dtype"]].itemsize
            start += first * row_bytes
            shape[0] = rows
        source = self._open_source()
        mapping = source.mapping
        if mapping is not None:
            return mapping, self._data_start + start, shape
        small = self._small
        nbytes = math.prod(shape) * NUMPY_DTYPES[info["dtype"]].itemsize
        if small is not None and small[0] <= start and start + nbytes <= small[1]:
            return small[2], start - small[0], shape
        return source.read(self._data_start + start, nbytes), 0, shape

    def tensor(self, name: str) -> np.ndarray:
        """A whole tensor as a read-only numpy array (bf16/fp8 via ml_dtypes): a view of
        the mapped file on local disk; on an object store hidden_states is fetched whole."""
        view = self._np_views.get(name)
        if view is None:
            view = self._numpy(name)
            if name != "hidden_states" or self._small is None:
                self._np_views[name] = view
        return view

    def failing_samples(self) -> list[int]:
        """The samples whose bytes do not match their digests (none without digests);
        reads every sample's rows once."""
        failing = []
        for i in range(len(self) if self.sample_digests is not None else 0):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            try:
                self._check_sample(i, a, b, self._buffer("hidden_states", a, b - a))
            except ShardCorrupt:
                failing.append(i)
        return failing

    def _check_sample(self, i: int, a: int, b: int, hidden: tuple[Any, int, list[int]]) -> None:
        """ShardCorrupt unless sample i's bytes (hidden rows `hidden`, as `_buffer` gave
        them, then its other rows) hash to its digest."""
        digests = self.sample_digests
        if digests is None:
            return
        sha = new_hasher(self._digest_algorithm)
        names = ["hidden_states", "input_ids", "loss_mask"]
        if self.has_modality:
            names.append(MODALITY_MASK)
        if self.storage_dtype == "fp8":
            names.append("scales")
        for name in names:
            buf, offset, shape = hidden if name == "hidden_states" else self._buffer(name, a, b - a)
            nbytes = math.prod(shape) * NUMPY_DTYPES[self._tensors[name]["dtype"]].itemsize
            sha.update(memoryview(buf).cast("B")[offset : offset + nbytes])
        if sha.digest() != digests[i].tobytes():
            raise ShardCorrupt(
                f"shard {self.name} (unit {self.unit}): sample {i} (sample_index "
                f"{int(self.sample_indices[i])}) does not match its checksum; the shard is "
                "corrupt (`hsx verify --repair` withdraws it so that a rerun extracts it again)"
            )

    def _numpy(self, name: str, first: int = 0, rows: int | None = None) -> np.ndarray:
        return self._numpy_view(name, *self._buffer(name, first, rows))

    def _numpy_view(self, name: str, buf: Any, offset: int, shape: list[int]) -> np.ndarray:
        dtype = NUMPY_DTYPES[self._tensors[name]["dtype"]]
        count = math.prod(shape)
        if count == 0:
            view = np.zeros(shape, dtype)
        else:
            view = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)
        view.flags.writeable = False
        return view

    def torch_tensor(self, name: str) -> Any:
        """A whole tensor as a torch tensor sharing the mapped pages (zero copy on disk)."""
        view = self._torch_views.get(name)
        if view is None:
            view = self._torch(name)
            if name != "hidden_states" or self._small is None:
                self._torch_views[name] = view
        return view

    def _torch(self, name: str, first: int = 0, rows: int | None = None) -> Any:
        return self._torch_view(name, *self._buffer(name, first, rows))

    def _torch_view(self, name: str, buf: Any, offset: int, shape: list[int]) -> Any:
        import torch

        dtype = _torch_dtype(self._tensors[name]["dtype"])
        count = math.prod(shape)
        if count == 0:
            return torch.zeros(shape, dtype=dtype)
        if isinstance(self._source, BufferSource):
            # A buffer shared with Ray's object store is read-only, and the trainer
            # reads (never writes) its samples: torch's caveat does not apply.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                return torch.frombuffer(buf, dtype=dtype, count=count,
                                        offset=offset).view(shape)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)

    def sample(
        self, i: int, *, backend: Backend = "numpy", dequantize: bool = True,
        verify: bool = True,
    ) -> dict[str, Any]:
        """Sample `i` of this shard (0 <= i < len; negative counts from the end).

        With `verify` (the default) the sample's bytes are checked against its digest
        (shards that carry them: `SAMPLE_DIGESTS`); a mismatch raises ShardCorrupt
        naming the shard, its unit and the sample.
        """
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {self.name} ({n} samples)")
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        get = self.torch_tensor if backend == "torch" else self.tensor
        out: dict[str, Any] = {
            "sample_index": int(self.sample_indices[i]),
            "input_ids": get("input_ids")[a:b],
            "loss_mask": get("loss_mask")[a:b],
        }
        if self.has_modality:
            out[MODALITY_MASK] = get(MODALITY_MASK)[a:b]
        hidden_rows = self._buffer("hidden_states", a, b - a)
        if verify and self.sample_digests is not None:
            self._check_sample(i, a, b, hidden_rows)
        if self._small is None:
            hidden = get("hidden_states")[a:b]
        else:  # one ranged read of just this sample's rows, the one hashed above
            view = self._torch_view if backend == "torch" else self._numpy_view
            hidden = view("hidden_states", *hidden_rows)
        if self.storage_dtype == "fp8":
            scales = get("scales")[a:b]
            if dequantize:
                hidden = dequantize_fp8(hidden, scales)
            else:
                out["scales"] = scales
        out["hidden_states"] = hidden
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.sample(i) for i in range(len(self)))
