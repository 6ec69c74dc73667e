"""The shard format: how one work unit's hidden states are written, published and read.

A shard is one standard safetensors file holding every sample of one work unit,
concatenated along tokens (docs/FORMAT.md has the byte-level description):

- `hidden_states` [T_total, L, H] BF16, or F8_E4M3 with `scales` [T_total, L] F32
- `offsets` [n+1] I64, `sample_index` [n] I64, `input_ids` [T_total] I32,
  `loss_mask` [T_total] U8

Who calls what:

- Workers (inside Ray actors) write with `ShardWriter`: `add()` per sample, then
  `commit()`. The commit record `commits/unit-XXXXXX.json` is created if absent, so when
  Ray runs a unit twice exactly one attempt becomes visible and the other deletes its file.
- The job driver calls `clean_orphans()` at start (when no attempt runs) and
  `read_commits()` / `committed_units()` to rebuild its ledger from the output.
- Readers (`hsx.dataset.HiddenStatesDataset`, trainers) list commit records and open
  the shards they name with `ShardReader`: mmap, zero-copy views, O(1) per sample.
  Nothing else in the output is ever read, so a crash at any moment leaves nothing
  visible but whole, committed shards.

This module imports numpy only; torch is imported inside functions, and only when the
caller handed in a torch tensor or asked for torch output.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import io
import json
import logging
import math
import mmap
import os
import queue
import re
import secrets
import shutil
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

import ml_dtypes
import numpy as np

from hsx.layout import (
    COMMITS_DIR,
    SHARD_FORMAT_NAME,
    SHARDS_DIR,
    TMP_DIR,
    commit_path,
    shard_path,
    unit_name,
)

logger = logging.getLogger(__name__)

StorageDtype = Literal["bf16", "fp8"]
Backend = Literal["numpy", "torch"]
Checksum = Literal["blake3", "sha256"]

DEFAULT_CHECKSUM: Checksum = "blake3"
"""BLAKE3 runs at several GB/s on one core (sha256 at 0.7-1.4 GB/s, below a fast disk:
it was the writer's limit); sha256 stays available, and records of either are read."""

SHARD_FORMAT_VERSION = "1"
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; per-token scales map each row's absmax onto it."""

DEFAULT_HEADER_RESERVE = 64 * 1024
"""Bytes reserved for the JSON header before the streamed data. A header is ~1 KiB; a
larger one (very many samples do not enlarge it, only odd metadata could) makes the
writer rewrite the file with a larger region instead of failing."""

_HEADER_PREFIX = 8  # little-endian u64 header length, as safetensors defines
_QUEUE_DEPTH = 4  # samples in flight between add() and the writer thread
_SYNC_EVERY = 256 * 2**20  # bytes written between background fdatasyncs
_HASH_CHUNK = 16 * 1024 * 1024
_COMMIT_NAME = re.compile(r"^unit-(\d{6,})\.json$")

_BF16 = np.dtype(ml_dtypes.bfloat16)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

# safetensors dtype names <-> numpy dtypes, for the tensors a shard holds.
_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BF16": _BF16,
    "F8_E4M3": _FP8,
    "F32": np.dtype(np.float32),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U8": np.dtype(np.uint8),
}
_HIDDEN_DTYPE: dict[str, str] = {"bf16": "BF16", "fp8": "F8_E4M3"}


class ShardCorrupt(Exception):
    """A shard or commit record whose bytes are not what was committed, or not a shard."""


@dataclass(frozen=True)
class CommitResult:
    """Outcome of `ShardWriter.commit()`.

    `won` is False when another attempt of the same unit had already committed; then
    `record` is that attempt's record and this attempt's shard has been deleted.
    """

    won: bool
    record: dict[str, Any]


# --------------------------------------------------------------------------- helpers


def _is_torch_tensor(x: object) -> bool:
    # torch can only have made `x` if it is already imported; never import it to check.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _fsync_dir(path: Path) -> None:
    """Make a rename/link/unlink inside `path` durable (POSIX needs the directory synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _as_numpy_1d(x: Any, name: str) -> np.ndarray:
    if _is_torch_tensor(x):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def _to_host(t: Any) -> Any:
    """A device tensor copied into pinned host memory (a CPU tensor as it is).

    `.cpu()` copies into freshly allocated pageable memory: 1.1-1.6 GB/s on an H200
    node, against 50-55 GB/s into pinned memory (torch's caching host allocator keeps
    pinned blocks for reuse).
    """
    if t.device.type == "cpu":
        return t
    import torch

    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def _torch_bf16_to_numpy(t: Any) -> np.ndarray:
    """A CPU torch bf16 tensor as a numpy bfloat16 array sharing its memory.

    numpy has no bf16 of its own, and `.float().numpy()` would double the bytes moved;
    reinterpreting the int16 bits keeps it one copy-free view.
    """
    import torch

    return np.asarray(t.view(torch.int16).numpy()).view(_BF16)


def quantize_fp8(x: Any, *, check: bool = True) -> tuple[Any, Any]:
    """Quantize `x` [..., H] to float8_e4m3fn with one scale per row (per token and layer).

    scale = absmax(row) / 448 (1.0 for an all-zero row), q = x / scale, so every row
    uses the whole e4m3 range and the relative error stays ~2^-4 of the row's absmax.
    numpy input gives numpy (ml_dtypes.float8_e4m3fn, float32); a torch tensor is
    quantized with torch on its own device. Non-finite input raises ValueError: its
    scale would silently turn the whole row into garbage. With `check=False` (a device
    tensor, where checking would wait for the device) such a row's scale is NaN instead,
    for whoever reads the scales on the host to refuse.
    """
    if _is_torch_tensor(x):
        import torch

        xf = x.detach().to(torch.float32)
        absmax = xf.abs().amax(dim=-1)
        finite = torch.isfinite(absmax)
        if check and not bool(finite.all()):
            raise ValueError("hidden states contain inf or nan; fp8 scales would be undefined")
        scales = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
        q = (xf / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if not check:
            scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
        return q, scales
    xa = np.asarray(x).astype(np.float32, copy=False)
    absmax = np.abs(xa).max(axis=-1) if xa.shape[-1] else np.zeros(xa.shape[:-1], np.float32)
    if not np.isfinite(absmax).all():
        raise ValueError("hidden states contain inf or nan; fp8 scales would be undefined")
    sc = np.where(absmax > 0, absmax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    # ml_dtypes turns out-of-range values into nan (torch saturates); rounding in the
    # division can land a hair above 448, so clip first.
    qa = np.clip(xa / sc[..., None], -FP8_MAX, FP8_MAX).astype(_FP8)
    return qa, sc


def dequantize_fp8(q: Any, scales: Any) -> Any:
    """Inverse of `quantize_fp8`: float(q) * scale, returned as bf16 (numpy or torch)."""
    if _is_torch_tensor(q):
        import torch

        return (q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(torch.bfloat16)
    out = np.asarray(q).astype(np.float32) * np.asarray(scales, np.float32)[..., None]
    return out.astype(_BF16)


def unit_of_commit_name(name: str) -> int | None:
    """The unit a file in commits/ is the record of, or None for any other name."""
    m = _COMMIT_NAME.match(name)
    return int(m.group(1)) if m else None


def shard_file(root: str | Path, record: Mapping[str, Any]) -> Path:
    """The absolute path of the shard a commit record names (refusing paths outside root)."""
    rel = str(record.get("shard", ""))
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or parts[0] != SHARDS_DIR:
        raise ShardCorrupt(f"commit record of unit {record.get('unit')} names bad shard {rel!r}")
    return Path(root) / rel


# --------------------------------------------------------------------------- writing


BACKGROUND_NICE_ENV = "HSX_BACKGROUND_NICE"


def background_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; $HSX_BACKGROUND_NICE).

    For the threads that move and hash captured states (the shard writer's, the
    committer, the connector's spool writers): they then run on cores the engine leaves
    idle instead of preempting it. On a CPU engine every preemption of one of its
    OpenMP threads stalls the whole parallel region; on a GPU node cores are plenty and
    nothing changes. Linux sets nice per thread; elsewhere this does nothing.
    """
    raw = os.environ.get(BACKGROUND_NICE_ENV, "19").strip() or "0"
    try:
        nice = int(raw)
    except ValueError:
        nice = 19
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(nice, 19))


def new_hasher(algorithm: str) -> Any:
    """A fresh hash object (`update`, `hexdigest`) of a checksum algorithm hsx writes."""
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"checksum must be 'blake3' or 'sha256', got {algorithm!r}")


def record_checksums(record: Mapping[str, Any]) -> tuple[str, str, str]:
    """(algorithm, header digest, data digest) of a commit record, old records included.

    Records name their algorithm under `checksum`; those written before it existed
    carry `header_sha256` and `data_sha256`.
    """
    checksum = record.get("checksum")
    if isinstance(checksum, Mapping):
        try:
            return str(checksum["algorithm"]), str(checksum["header"]), str(checksum["data"])
        except KeyError as err:
            raise ShardCorrupt(f"commit record of unit {record.get('unit')}: checksum lacks "
                               f"{err}") from None
    if "data_sha256" in record and "header_sha256" in record:
        return "sha256", str(record["header_sha256"]), str(record["data_sha256"])
    raise ShardCorrupt(f"commit record of unit {record.get('unit')} has no checksum")


class _DataStream:
    """Appends sample buffers to the shard file, hashing and syncing beside the writes.

    Three threads, so the caller (the engine thread) produces the next sample while
    this one reaches the disk: one writes, one hashes (a hash in series with the writes
    halved the writer's rate on an H200 node), and one starts `fdatasync` every
    `_SYNC_EVERY` bytes, so the fsync at commit has little left to flush. Write, hash
    and sync all release the GIL. The bounded queues keep at most `_QUEUE_DEPTH` samples
    in memory. An error is kept and re-raised to the caller at its next call.
    """

    def __init__(self, f: IO[bytes], name: str, checksum: str) -> None:
        self._f = f
        self.sha = new_hasher(checksum)
        self.nbytes = 0
        self._unsynced = 0
        self._error: BaseException | None = None
        self._writes: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._hashes: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._syncs: queue.Queue[bool | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, args=(q, fn), name=f"hsx-shard-{name}-{what}",
                             daemon=True)
            for q, fn, what in (
                (self._writes, self._write, "write"),
                (self._hashes, self._hash, "hash"),
                (self._syncs, self._sync, "sync"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def _write(self, item: np.ndarray) -> None:
        self._f.write(item.data)
        self._unsynced += item.nbytes
        if self._unsynced >= _SYNC_EVERY:
            self._unsynced = 0
            self._syncs.put(True)

    def _hash(self, item: np.ndarray) -> None:
        self.sha.update(item.data)

    def _sync(self, _item: bool) -> None:
        os.fdatasync(self._f.fileno())

    def _run(self, items: queue.Queue[Any], handle: Any) -> None:
        background_priority()
        while True:
            item = items.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    handle(item)
            except BaseException as err:  # re-raised in the caller's thread
                self._error = err
            finally:
                items.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise OSError(f"cannot write shard data: {self._error}") from self._error

    def put(self, buf: np.ndarray) -> None:
        self._raise_pending()
        if not buf.flags.c_contiguous:
            raise ValueError("internal: shard buffers must be C-contiguous")
        # Raw bytes: the buffer protocol cannot describe ml_dtypes' bf16/fp8.
        raw = buf.reshape(-1).view(np.uint8)
        self._writes.put(raw)
        self._hashes.put(raw)
        self.nbytes += buf.nbytes

    def flush(self) -> None:
        self._writes.join()
        self._hashes.join()
        self._raise_pending()

    def close(self, *, check: bool = True) -> None:
        queues: list[queue.Queue[Any]] = [self._writes, self._hashes, self._syncs]
        for items, thread in zip(queues, self._threads, strict=True):
            if thread.is_alive():
                items.put(None)
                thread.join()
        if check:
            self._raise_pending()


class ShardWriter:
    """Writes one work unit's samples into one shard and publishes it with a commit record.

    Usage (one attempt of one unit, in a worker)::

        with ShardWriter(out, unit, layers=[2, 16, 29, 32], hidden_size=4096,
                         storage_dtype="bf16") as w:
            for s in samples:
                w.add(s.index, s.input_ids, s.loss_mask, s.hidden_states)
            result = w.commit(errors=[{"sample_index": 7, "reason": "too long"}])

    The file grows in `.tmp/` as samples arrive: a reserved header region, then each
    sample's hidden states streamed (and hashed) as they come, so a unit is never held
    in memory whole. `commit()` appends the small tensors, fills in the header, fsyncs,
    renames the file into `shards/`, and creates `commits/unit-XXXXXX.json` if absent.
    Leaving the `with` block by an exception (or without committing) aborts: the
    temporary file is deleted. A crash leaves only files that readers never look at;
    `clean_orphans()` removes them.
    """

    def __init__(
        self,
        root: str | Path,
        unit: int,
        *,
        layers: Sequence[int],
        hidden_size: int,
        storage_dtype: StorageDtype,
        attempt: str | None = None,
        header_reserve: int = DEFAULT_HEADER_RESERVE,
        checksum: Checksum = DEFAULT_CHECKSUM,
    ) -> None:
        if unit < 0:
            raise ValueError(f"unit must be >= 0, got {unit}")
        if storage_dtype not in _HIDDEN_DTYPE:
            raise ValueError(f"storage_dtype must be 'bf16' or 'fp8', got {storage_dtype!r}")
        if not layers:
            raise ValueError("layers must not be empty")
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be > 0, got {hidden_size}")
        attempt = attempt if attempt is not None else secrets.token_hex(4)
        if not re.fullmatch(r"[A-Za-z0-9_.]+", attempt):
            raise ValueError(f"attempt must be letters, digits, '_' or '.', got {attempt!r}")
        self.root = Path(root)
        self.unit = unit
        self.layers = [int(k) for k in layers]
        self.hidden_size = int(hidden_size)
        self.storage_dtype: StorageDtype = storage_dtype
        self.attempt = attempt
        self.checksum = checksum
        new_hasher(checksum)  # refuses an unknown algorithm before any file exists
        self._header_len = _round_up(max(header_reserve, 64), 8)

        for sub in (TMP_DIR, SHARDS_DIR, COMMITS_DIR):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.tmp_path = self.root / TMP_DIR / f"{unit_name(unit)}-{attempt}.safetensors.partial"
        self._f: IO[bytes] = open(self.tmp_path, "xb")  # noqa: SIM115 (closed in commit/abort)
        # Placeholder header region; the real header is written into it at commit.
        self._f.write(bytes(_HEADER_PREFIX + self._header_len))
        self._stream = _DataStream(self._f, f"{unit_name(unit)}-{attempt}", checksum)
        self._offsets: list[int] = [0]
        self._sample_indices: list[int] = []
        self._seen: set[int] = set()
        self._input_ids: list[np.ndarray] = []
        self._loss_mask: list[np.ndarray] = []
        self._scales: list[np.ndarray] = []
        self._state: Literal["open", "committed", "aborted"] = "open"

    # -- context manager

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == "open":
            if exc_type is None:
                logger.warning("%s: left without commit(); discarding it", self.tmp_path.name)
            self.abort()

    # -- public

    @property
    def num_samples(self) -> int:
        return len(self._sample_indices)

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add(
        self,
        sample_index: int,
        input_ids: Any,
        loss_mask: Any,
        hidden_states: Any,
        *,
        take: bool = False,
        scales: Any = None,
    ) -> None:
        """Append one sample. `hidden_states` is [T, L, H]: a numpy array (float32,
        float16 or ml_dtypes.bfloat16) or a torch tensor on any device (bf16/fp16/fp32);
        torch input is cast or quantized on its own device before its bytes move.

        `take=True` hands the buffer over: the caller will not touch it again, so the
        writer thread may read it as it is instead of copying it first (a copy that
        cost the capture loop most of its CPU on a 2-core machine).

        `scales` [T, L] says `hidden_states` is already quantized (float8_e4m3fn, with
        `quantize_fp8`'s scales, as the connector does on the device): an fp8 shard
        stores both as they are.
        """
        self._check_open()
        sample_index = int(sample_index)
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        if sample_index in self._seen:
            raise ValueError(f"sample {sample_index} was already added to unit {self.unit}")
        ids = _as_numpy_1d(input_ids, "input_ids")
        mask = _as_numpy_1d(loss_mask, "loss_mask")
        if not _is_torch_tensor(hidden_states):
            hidden_states = np.asarray(hidden_states)
        shape = tuple(int(d) for d in hidden_states.shape)
        where = f"sample {sample_index}"
        if len(shape) != 3:
            raise ValueError(f"{where}: hidden_states must be [T, L, H], got shape {shape}")
        t, n_layers, h = shape
        if t == 0:
            raise ValueError(f"{where}: empty sample (0 tokens)")
        if len(ids) != t:
            raise ValueError(f"{where}: {len(ids)} input_ids but hidden_states has {t} tokens")
        if len(mask) != t:
            raise ValueError(f"{where}: {len(mask)} loss_mask values but {t} tokens")
        if n_layers != len(self.layers):
            raise ValueError(
                f"{where}: hidden_states has {n_layers} layers, expected {len(self.layers)} "
                f"(layers {self.layers})"
            )
        if h != self.hidden_size:
            raise ValueError(f"{where}: hidden size {h}, expected {self.hidden_size}")
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{where}: input_ids out of int32 range")
        if mask.size and (mask.min() < 0 or mask.max() > 1):
            raise ValueError(f"{where}: loss_mask values must be 0 or 1")

        if scales is None:
            payload, scales = self._encode(hidden_states, where, take)
        else:
            payload, scales = self._take_quantized(hidden_states, scales, where, take)
        self._stream.put(payload)
        self._input_ids.append(ids.astype(np.int32))
        self._loss_mask.append(mask.astype(np.uint8))
        if scales is not None:
            self._scales.append(scales)
        self._sample_indices.append(sample_index)
        self._seen.add(sample_index)
        self._offsets.append(self._offsets[-1] + t)

    def flush(self) -> None:
        """Wait until every added sample has reached the file (not fsynced)."""
        self._check_open()
        self._stream.flush()
        self._f.flush()

    def commit(self, errors: Iterable[Mapping[str, Any]] = ()) -> CommitResult:
        """Finish, publish and return the unit's commit record (see the class docstring).

        `errors` are this unit's samples that could not be extracted
        ({"sample_index", "reason"}); they go into the commit record so that every
        sample of the unit is accounted for.
        """
        self._check_open()
        try:
            error_rows = [
                {"sample_index": int(e["sample_index"]), "reason": str(e["reason"])}
                for e in errors
            ]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"errors must hold sample_index and reason: {err!r}") from err
        both = self._seen.intersection(e["sample_index"] for e in error_rows)
        if both:
            raise ValueError(f"samples {sorted(both)} are both written and listed as errors")
        try:
            data_sha, header_sha, size = self._finish_file()
        except BaseException:
            self.abort()
            raise
        unit = unit_name(self.unit)
        rel = shard_path(self.unit, self.attempt)
        final = self.root / rel
        os.replace(self.tmp_path, final)
        _fsync_dir(final.parent)
        self._state = "committed"

        record: dict[str, Any] = {
            "unit": self.unit,
            "shard": rel,
            "attempt": self.attempt,
            "samples": self.num_samples,
            "tokens": self.num_tokens,
            "bytes": size,
            "checksum": {"algorithm": self.checksum, "header": header_sha, "data": data_sha},
            "sample_indices_first": self._sample_indices[0] if self._sample_indices else None,
            "sample_indices_last": self._sample_indices[-1] if self._sample_indices else None,
            "errors": error_rows,
            "committed_at": _now_iso(),
        }
        tmp_record = self.root / TMP_DIR / f"{unit}-{self.attempt}.commit.json"
        with open(tmp_record, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        commit = self.root / commit_path(self.unit)
        try:
            # link() fails if the name exists: the create-if-absent step that makes
            # exactly one attempt of a unit visible, with the record already complete.
            os.link(tmp_record, commit)
        except FileExistsError:
            tmp_record.unlink()
            final.unlink()
            _fsync_dir(final.parent)
            existing = json.loads(commit.read_text())
            logger.info(
                "%s: attempt %s lost to attempt %s; its shard is deleted",
                unit, self.attempt, existing.get("attempt"),
            )
            return CommitResult(won=False, record=existing)
        except BaseException:
            # Not published: take our shard back out so it does not linger as an orphan.
            tmp_record.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
            raise
        tmp_record.unlink()
        _fsync_dir(commit.parent)
        logger.info(
            "%s committed: %d samples, %d tokens, %d bytes (attempt %s)",
            unit, record["samples"], record["tokens"], size, self.attempt,
        )
        return CommitResult(won=True, record=record)

    def abort(self) -> None:
        """Discard this attempt: stop the writer thread and delete the temporary file."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._stream.close(check=False)
        with contextlib.suppress(OSError):
            self._f.close()
        self.tmp_path.unlink(missing_ok=True)

    # -- internals

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"ShardWriter for {unit_name(self.unit)} is already {self._state}")

    def _take_quantized(self, q: Any, scales: Any, where: str,
                        take: bool) -> tuple[np.ndarray, np.ndarray]:
        """Already-quantized states and their scales, as the bytes to stream."""
        if self.storage_dtype != "fp8":
            raise ValueError(f"{where}: quantized states (scales given) in a "
                             f"{self.storage_dtype} shard")
        if _is_torch_tensor(q):
            import torch

            q = _to_host(q.contiguous()).view(torch.uint8).numpy().view(_FP8)
            scales = _to_host(scales).numpy()
        q, scales = np.asarray(q), np.asarray(scales, np.float32)
        if q.dtype != _FP8:
            raise ValueError(f"{where}: quantized states must be float8_e4m3fn, got {q.dtype}")
        if scales.shape != q.shape[:2]:
            raise ValueError(f"{where}: scales shape {scales.shape}, expected {q.shape[:2]}")
        if not np.isfinite(scales).all():
            raise ValueError(f"{where}: fp8 scales are not finite (inf or nan in the states)")
        out = np.ascontiguousarray(q)
        if np.may_share_memory(out, q) and not take:
            out = out.copy()
        return out, scales

    def _encode(self, hs: Any, where: str, take: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The bytes to stream for one sample (owned by us) and, for fp8, its scales."""
        if _is_torch_tensor(hs):
            import torch

            if hs.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"{where}: hidden_states dtype {hs.dtype} is not bf16/fp16/fp32")
            if self.storage_dtype == "fp8":
                q, scales = quantize_fp8(hs)
                q_np = _to_host(q.contiguous()).view(torch.uint8).numpy()
                return np.ascontiguousarray(q_np), _to_host(scales).numpy()
            t = hs.detach().to(torch.bfloat16).contiguous()
            if t.device.type != "cpu":
                t = _to_host(t)
            elif t.data_ptr() == hs.data_ptr() and not take:
                # Still the caller's memory; the writer thread reads it later. A numpy
                # copy: torch's clone here ran 3-5x slower, on spinning OpenMP threads.
                return _torch_bf16_to_numpy(t).copy(), None
            return _torch_bf16_to_numpy(t), None
        arr = np.asarray(hs)
        if arr.dtype not in (_BF16, np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"{where}: hidden_states dtype {arr.dtype} is not bf16/fp16/fp32")
        if self.storage_dtype == "fp8":
            q, scales = quantize_fp8(arr)
            return q, scales
        out = np.ascontiguousarray(arr.astype(_BF16, copy=False))
        if np.may_share_memory(out, arr) and not take:
            out = out.copy()  # the caller may reuse its buffer before the thread writes it
        return out, None

    def _small_tensors(self) -> list[tuple[str, str, list[int], np.ndarray]]:
        """(name, dtype, shape, array) for everything after hidden_states, in file order.

        int64 tensors come first after hidden_states so they stay 8-byte aligned
        whenever hidden_states' byte size is a multiple of 8 (any H divisible by 8).
        """
        n, t, n_layers = self.num_samples, self.num_tokens, len(self.layers)

        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        out: list[tuple[str, str, list[int], np.ndarray]] = [
            ("offsets", "I64", [n + 1], np.asarray(self._offsets, np.int64)),
            ("sample_index", "I64", [n], np.asarray(self._sample_indices, np.int64)),
        ]
        if self.storage_dtype == "fp8":
            scales = np.concatenate(self._scales) if self._scales else np.zeros((0, n_layers))
            out.append(("scales", "F32", [t, n_layers], scales.astype(np.float32)))
        out.append(("input_ids", "I32", [t], cat(self._input_ids, np.int32)))
        out.append(("loss_mask", "U8", [t], cat(self._loss_mask, np.uint8)))
        return out

    def _header(self, small: list[tuple[str, str, list[int], np.ndarray]]) -> bytes:
        hidden_bytes = self._stream.nbytes
        header: dict[str, Any] = {
            "__metadata__": {
                "format": SHARD_FORMAT_NAME,
                "format_version": SHARD_FORMAT_VERSION,
                "unit": str(self.unit),
                "layers": json.dumps(self.layers),
                "storage_dtype": self.storage_dtype,
                "hidden_size": str(self.hidden_size),
            },
            "hidden_states": {
                "dtype": _HIDDEN_DTYPE[self.storage_dtype],
                "shape": [self.num_tokens, len(self.layers), self.hidden_size],
                "data_offsets": [0, hidden_bytes],
            },
        }
        pos = hidden_bytes
        for name, dtype, shape, arr in small:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + arr.nbytes]}
            pos += arr.nbytes
        return json.dumps(header, separators=(",", ":")).encode()

    def _finish_file(self) -> tuple[str, str, int]:
        """Write the tail and header, fsync; return (data digest, header digest, size)."""
        self._stream.close()
        expected = self.num_tokens * len(self.layers) * self.hidden_size
        expected *= _NUMPY_DTYPES[_HIDDEN_DTYPE[self.storage_dtype]].itemsize
        if self._stream.nbytes != expected:
            raise RuntimeError(
                f"internal: streamed {self._stream.nbytes} bytes, expected {expected}"
            )
        small = self._small_tensors()
        data_sha = self._stream.sha
        for _, _, _, arr in small:
            buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
            self._f.write(buf)
            data_sha.update(buf)
        header = self._header(small)
        if len(header) > self._header_len:
            self._grow_header(_round_up(len(header) * 2, 8))
        block = struct.pack("<Q", self._header_len) + header.ljust(self._header_len, b" ")
        self._f.seek(0)
        self._f.write(block)
        self._f.flush()
        os.fsync(self._f.fileno())
        size = os.fstat(self._f.fileno()).st_size
        self._f.close()
        header_sha = new_hasher(self.checksum)
        header_sha.update(block)
        return data_sha.hexdigest(), header_sha.hexdigest(), size

    def _grow_header(self, new_len: int) -> None:
        """Move the data behind a larger header region (rare: see DEFAULT_HEADER_RESERVE)."""
        logger.info("%s: header needs %d bytes; rewriting", self.tmp_path.name, new_len)
        self._f.flush()
        grown = self.tmp_path.with_name(self.tmp_path.name + ".grow")
        with open(self.tmp_path, "rb") as src, open(grown, "wb") as dst:
            dst.write(bytes(_HEADER_PREFIX + new_len))
            src.seek(_HEADER_PREFIX + self._header_len)
            shutil.copyfileobj(src, dst, _HASH_CHUNK)
        self._f.close()
        os.replace(grown, self.tmp_path)
        self._f = open(self.tmp_path, "r+b")  # noqa: SIM115 (closed in _finish_file)
        self._header_len = new_len


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# --------------------------------------------------------------------------- listing


def read_commits(root: str | Path) -> list[dict[str, Any]]:
    """Every commit record in the output, sorted by unit."""
    commits = Path(root) / COMMITS_DIR
    if not commits.is_dir():
        return []
    records = []
    with os.scandir(commits) as entries:
        for entry in entries:
            unit = unit_of_commit_name(entry.name)
            if unit is not None:
                records.append(load_commit(Path(entry.path), unit))
    records.sort(key=lambda r: r["unit"])
    return records


def load_commit(path: Path, unit: int | None = None) -> dict[str, Any]:
    """One commit record, checked to be a JSON object for the unit its name says."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ShardCorrupt(f"cannot read commit record {path}: {err}") from err
    if not isinstance(record, dict) or not isinstance(record.get("unit"), int):
        raise ShardCorrupt(f"commit record {path} is not an hsx commit record")
    if unit is not None and record["unit"] != unit:
        raise ShardCorrupt(f"commit record {path} is for unit {record['unit']}")
    return record


def committed_units(root: str | Path) -> set[int]:
    """Units with a commit record (cheap: reads directory names only)."""
    commits = Path(root) / COMMITS_DIR
    if not commits.is_dir():
        return set()
    with os.scandir(commits) as entries:
        return {u for e in entries if (u := unit_of_commit_name(e.name)) is not None}


def clean_orphans(root: str | Path) -> int:
    """Delete everything in `.tmp/` and every shard no commit record names.

    Only safe while no attempt is running (the driver calls it at job start): a running
    attempt's shard is an "orphan" between its rename and its commit record.
    Returns the number of files and folders removed.
    """
    root = Path(root)
    removed = 0
    tmp = root / TMP_DIR
    if tmp.is_dir():
        for entry in tmp.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    shards = root / SHARDS_DIR
    if shards.is_dir():
        named = {str(r.get("shard")) for r in read_commits(root)}
        for entry in shards.iterdir():
            if f"{SHARDS_DIR}/{entry.name}" not in named:
                entry.unlink(missing_ok=True)
                removed += 1
        _fsync_dir(shards)
    if removed:
        logger.info("removed %d orphaned files from %s", removed, root)
    return removed


def verify_shard(root: str | Path, record: Mapping[str, Any]) -> None:
    """Check a committed shard against its record's size and checksums; raise ShardCorrupt."""
    path = shard_file(root, record)
    what = f"shard {path} (unit {record.get('unit')})"
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise ShardCorrupt(f"{what} is missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != record.get("bytes"):
            raise ShardCorrupt(
                f"{what} has {size} bytes, its commit record says {record.get('bytes')}"
            )
        prefix = f.read(_HEADER_PREFIX)
        if len(prefix) != _HEADER_PREFIX:
            raise ShardCorrupt(f"{what} is truncated")
        (n,) = struct.unpack("<Q", prefix)
        if _HEADER_PREFIX + n > size:
            raise ShardCorrupt(f"{what}: header checksum mismatch (header length {n} is corrupt)")
        algorithm, header_digest, data_digest = record_checksums(record)
        try:
            header_sha = new_hasher(algorithm)
        except ValueError as err:
            raise ShardCorrupt(f"{what}: {err}") from None
        header_sha.update(prefix)
        _hash_range(f, n, header_sha)
        if header_sha.hexdigest() != header_digest:
            raise ShardCorrupt(f"{what}: header checksum mismatch")
        data_sha = new_hasher(algorithm)
        _hash_range(f, size - _HEADER_PREFIX - n, data_sha)
        if data_sha.hexdigest() != data_digest:
            raise ShardCorrupt(f"{what}: data checksum mismatch")


def _hash_range(f: io.BufferedReader, n: int, sha: Any) -> None:
    buf = bytearray(min(n, _HASH_CHUNK) or 1)
    view = memoryview(buf)
    while n > 0:
        got = f.readinto(view[: min(n, len(buf))])
        if not got:
            raise ShardCorrupt(f"{getattr(f, 'name', 'shard')} ended early")
        sha.update(view[:got])
        n -= got


# --------------------------------------------------------------------------- reading


class ShardReader:
    """One shard, memory-mapped: zero-copy views and O(1) access to any sample.

    The file is mapped copy-on-write (`ACCESS_COPY`): nothing is ever written back to
    it, and torch can wrap the pages without its "non-writable buffer" caveat. numpy
    views are marked read-only. Views stay valid after `close()` or after the reader is
    dropped: they keep the mapping alive themselves.

    `sample(i)` returns {"sample_index", "input_ids", "loss_mask", "hidden_states"} as
    numpy (default) or torch (`backend="torch"`). fp8 shards are dequantized to bf16
    unless `dequantize=False`, which adds the raw "scales" [T, L] instead.
    """

    def __init__(self, path: str | Path, *, record: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.record = dict(record) if record is not None else None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER_PREFIX:
                raise ShardCorrupt(f"{self.path}: not a shard ({size} bytes)")
            self._mm: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        mm = self._mm
        (n,) = struct.unpack_from("<Q", mm, 0)
        if _HEADER_PREFIX + n > size:
            raise ShardCorrupt(f"{self.path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(bytes(mm[_HEADER_PREFIX : _HEADER_PREFIX + n]))
        except ValueError as err:
            raise ShardCorrupt(f"{self.path}: header is not JSON: {err}") from err
        self._data_start = _HEADER_PREFIX + n
        meta = header.pop("__metadata__", None) or {}
        if meta.get("format") != SHARD_FORMAT_NAME:
            raise ShardCorrupt(f"{self.path}: not an hsx shard (format {meta.get('format')!r})")
        if meta.get("format_version") != SHARD_FORMAT_VERSION:
            raise ShardCorrupt(
                f"{self.path}: shard format_version {meta.get('format_version')!r} is not "
                f"supported (this hsx reads {SHARD_FORMAT_VERSION!r}); upgrade hsx"
            )
        self.metadata: dict[str, str] = meta
        try:
            self.unit = int(meta["unit"])
            self.layers: list[int] = [int(k) for k in json.loads(meta["layers"])]
            self.hidden_size = int(meta["hidden_size"])
            self.storage_dtype: StorageDtype = meta["storage_dtype"]
        except (KeyError, TypeError, ValueError) as err:
            raise ShardCorrupt(f"{self.path}: bad shard metadata: {err!r}") from err
        if self.storage_dtype not in _HIDDEN_DTYPE:
            raise ShardCorrupt(f"{self.path}: unknown storage_dtype {self.storage_dtype!r}")
        self._tensors: dict[str, dict[str, Any]] = header
        self._np_views: dict[str, np.ndarray] = {}
        self._torch_views: dict[str, Any] = {}
        for name in ("hidden_states", "offsets", "sample_index", "input_ids", "loss_mask"):
            self._check_tensor(name, size)
        if self.storage_dtype == "fp8":
            self._check_tensor("scales", size)
        # Small, and read on every sample: copy once instead of re-viewing.
        self.offsets = self.tensor("offsets").copy()
        self.sample_indices = self.tensor("sample_index").copy()
        if len(self.offsets) != len(self.sample_indices) + 1:
            raise ShardCorrupt(f"{self.path}: offsets and sample_index lengths disagree")
        self.num_tokens = int(self._tensors["hidden_states"]["shape"][0])
        if self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens:
            raise ShardCorrupt(f"{self.path}: offsets do not span the {self.num_tokens} tokens")

    def _check_tensor(self, name: str, size: int) -> None:
        info = self._tensors.get(name)
        if info is None:
            raise ShardCorrupt(f"{self.path}: tensor {name!r} is missing")
        dtype = _NUMPY_DTYPES.get(info.get("dtype", ""))
        if dtype is None:
            raise ShardCorrupt(f"{self.path}: tensor {name!r} has bad dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        if end - start != math.prod(info["shape"]) * dtype.itemsize:
            raise ShardCorrupt(f"{self.path}: tensor {name!r} shape and byte range disagree")
        if start < 0 or self._data_start + end > size:
            raise ShardCorrupt(f"{self.path}: tensor {name!r} lies outside the file (truncated?)")

    def __len__(self) -> int:
        return len(self.sample_indices)

    def __repr__(self) -> str:
        return f"ShardReader({str(self.path)!r}, samples={len(self)}, tokens={self.num_tokens})"

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop this reader's mapping. Views handed out keep it alive until they go."""
        # Never mm.close(): torch.frombuffer views do not pin the buffer export, so
        # closing would leave them pointing at unmapped memory.
        self._mm = None
        self._np_views.clear()
        self._torch_views.clear()

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"{self.path}: reader is closed")
        return self._mm

    def tensor(self, name: str) -> np.ndarray:
        """A whole tensor as a read-only numpy view on the file (bf16/fp8 via ml_dtypes)."""
        view = self._np_views.get(name)
        if view is None:
            info = self._tensors.get(name)
            if info is None:
                raise KeyError(f"{self.path}: no tensor {name!r}")
            dtype = _NUMPY_DTYPES[info["dtype"]]
            start, _ = info["data_offsets"]
            count = math.prod(info["shape"])
            if count == 0:
                view = np.zeros(info["shape"], dtype)
            else:
                view = np.frombuffer(
                    self._map(), dtype=dtype, count=count, offset=self._data_start + start
                ).reshape(info["shape"])
            view.flags.writeable = False
            self._np_views[name] = view
        return view

    def torch_tensor(self, name: str) -> Any:
        """A whole tensor as a torch tensor sharing the mapped pages (zero copy)."""
        view = self._torch_views.get(name)
        if view is None:
            import torch

            dtypes = {
                "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
                "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
            }
            info = self._tensors.get(name)
            if info is None:
                raise KeyError(f"{self.path}: no tensor {name!r}")
            start, _ = info["data_offsets"]
            count = math.prod(info["shape"])
            if count == 0:
                view = torch.zeros(info["shape"], dtype=dtypes[info["dtype"]])
            else:
                view = torch.frombuffer(
                    self._map(), dtype=dtypes[info["dtype"]], count=count,
                    offset=self._data_start + start,
                ).view(info["shape"])
            self._torch_views[name] = view
        return view

    def sample(
        self, i: int, *, backend: Backend = "numpy", dequantize: bool = True
    ) -> dict[str, Any]:
        """Sample `i` of this shard (0 <= i < len; negative counts from the end)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {self.path.name} ({n} samples)")
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        get = self.torch_tensor if backend == "torch" else self.tensor
        out: dict[str, Any] = {
            "sample_index": int(self.sample_indices[i]),
            "input_ids": get("input_ids")[a:b],
            "loss_mask": get("loss_mask")[a:b],
        }
        hidden = get("hidden_states")[a:b]
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
