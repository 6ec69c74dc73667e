"""The shard format: how one work unit's hidden states are written, published and read.

A shard is one standard safetensors file holding every sample of one work unit,
concatenated along tokens (docs/FORMAT.md has the byte-level description):

- `hidden_states` [T_total, L, H] BF16, or F8_E4M3 with `scales` [T_total, L] F32
- `offsets` [n+1] I64, `sample_index` [n] I64, `input_ids` [T_total] I32,
  `loss_mask` [T_total] U8

Who calls what (through `hsx.output.Output`, which owns the rest of the output):

- Workers (inside Ray actors) write with `ShardWriter`: `add()` per sample, then
  `commit()`. The shard streams through the output's `Storage` (a local file, or a
  multipart upload to an object store) and becomes an object only when whole; the
  commit record `commits/unit-XXXXXX.json` is then created if absent, so when Ray runs
  a unit twice exactly one attempt becomes visible and the other deletes its shard.
- Readers (`hsx.dataset.HiddenStatesDataset`, trainers) open the shards that commit
  records name with `ShardReader`: memory-mapped on local disk (zero-copy views), ranged
  reads on object stores (one GET per sample); O(1) per sample either way. Nothing else
  in the output is ever read, so a crash at any moment leaves nothing visible but whole,
  committed shards.

This module imports numpy only; torch is imported inside functions, and only when the
caller handed in a torch tensor or asked for torch output.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import math
import mmap
import os
import queue
import re
import secrets
import struct
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import ml_dtypes
import numpy as np

from hsx.output import faults
from hsx.output.layout import SHARD_FORMAT_NAME, commit_path, shard_path, unit_name
from hsx.output.records import CommitRecord, OutputCorrupt, RegenerationsRef
from hsx.output.storage import ObjectExistsError, ObjectWriter, Storage, StorageError

logger = logging.getLogger(__name__)

StorageDtype = Literal["bf16", "fp8"]
Backend = Literal["numpy", "torch"]
Checksum = Literal["blake3", "sha256"]

DEFAULT_CHECKSUM: Checksum = "blake3"
"""BLAKE3 runs at several GB/s on one core (sha256 at 0.7-1.4 GB/s, below a fast disk:
it was the writer's limit); sha256 stays available, and records of either are read."""
CHECKSUM_SCHEME = "samples"
"""What a commit record's data digest covers (docs/FORMAT.md, "Checksums"): `samples`,
the bytes after hidden_states, which hold each sample's digest (so every byte is hashed
once, not twice); `whole` (records without a scheme), the whole data section."""

SHARD_FORMAT_VERSION = "1"
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; per-token scales map each row's absmax onto it."""

DEFAULT_HEADER_RESERVE = 64 * 1024 - 8
"""Bytes reserved for the JSON header before the streamed data, so that the data starts
at 64 KiB (aligned for direct I/O). A header is ~1 KiB; a larger one (very many samples
do not enlarge it, only odd metadata could) makes the writer rewrite the file with a
larger region instead of failing."""
_BUFFER_ALIGN = 4096  # the writer's own copies start on a page (direct I/O needs 512)

_HEADER_PREFIX = 8  # little-endian u64 header length, as safetensors defines
_QUEUE_DEPTH = 4  # samples in flight between add() and the writer thread
_HASH_CHUNK = 16 * 1024 * 1024
_REMOTE_HEAD = _HEADER_PREFIX + DEFAULT_HEADER_RESERVE  # first GET of a remote shard

SAMPLE_DIGESTS = "sample_digests"
"""Optional tensor [n, 32] U8: each sample's digest (the shard's checksum algorithm, named
in the metadata's `sample_digest`) over its hidden_states rows, then its input_ids,
loss_mask and (fp8) scales rows. Readers check it on every sample they return, so a
flipped byte is named with its sample; shards written before it have none."""
_SAMPLE_DIGEST_BYTES = 32

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


class ShardCorrupt(OutputCorrupt):
    """A shard whose bytes are not what its commit record says, or not a shard."""


@dataclass(frozen=True)
class CommitResult:
    """Outcome of `ShardWriter.commit()`.

    `won` is False when another attempt of the same unit had already committed; then
    `record` is that attempt's record and this attempt's shard has been deleted.
    """

    won: bool
    record: CommitRecord


# --------------------------------------------------------------------------- helpers


def _is_torch_tensor(x: object) -> bool:
    # torch can only have made `x` if it is already imported; never import it to check.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _aligned_copy(arr: np.ndarray) -> np.ndarray:
    """A copy of `arr` whose memory starts on a page: the storage can then write it
    without the page cache (local_storage.DIRECT_ALIGN)."""
    block = np.empty(arr.nbytes + _BUFFER_ALIGN, np.uint8)
    skip = -int(block.ctypes.data) % _BUFFER_ALIGN
    out = block[skip : skip + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    np.copyto(out, arr)
    return out


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


class _DataStream:
    """Appends sample buffers to the shard's object writer, hashing beside the writes.

    Two threads, so the caller (the engine thread) produces the next sample while
    these reach the storage: one writes, one hashes each sample (a hash in series with
    the writes halved the writer's rate on an H200 node). Each byte is hashed once: the
    shard's data digest covers the samples through their digests (`CHECKSUM_SCHEME`).
    The writer syncs in the background on local disk (`fdatasync` every 256 MiB, so the
    fsync at commit has little left) and uploads parts in the background on object
    stores. Write and hash release the GIL.
    The bounded queues keep at most `_QUEUE_DEPTH` samples in memory. An error is kept
    and re-raised to the caller at its next call.
    """

    def __init__(self, sink: ObjectWriter, name: str, checksum: str) -> None:
        self._sink = sink
        self._checksum = checksum
        self.sample_digests: list[bytes] = []  # one per put(), in order (see put)
        self.nbytes = 0
        self._error: BaseException | None = None
        self._writes: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._digests: queue.Queue[tuple[np.ndarray, bytes] | None] = queue.Queue(
            maxsize=_QUEUE_DEPTH)
        self._queues: list[queue.Queue[Any]] = [self._writes, self._digests]
        self._threads = [
            threading.Thread(target=self._run, args=(q, fn), name=f"hsx-shard-{name}-{what}",
                             daemon=True)
            for q, fn, what in (
                (self._writes, self._write, "write"),
                (self._digests, self._digest, "digest"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def _write(self, item: np.ndarray) -> None:
        # The sample's buffer is the writer's own (add() copied it or was handed it) and
        # never changes: an object store's part may reference it instead of copying it.
        self._sink.write(item.data, keep=True)

    def _digest(self, item: tuple[np.ndarray, bytes]) -> None:
        raw, rest = item
        sample = new_hasher(self._checksum)
        sample.update(raw.data)
        sample.update(rest)
        self.sample_digests.append(sample.digest())

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
        err = self._error
        if err is not None:
            # errno kept: a full disk (ENOSPC) is told apart from other failures upstream.
            code = err.errno if isinstance(err, OSError) else None
            raise OSError(code, f"cannot write shard data: {err}") from err

    def put(self, buf: np.ndarray, rest: bytes = b"") -> None:
        """Append one sample's hidden states; its digest covers them, then `rest` (its
        other rows: input_ids, loss_mask, scales)."""
        self._raise_pending()
        if not buf.flags.c_contiguous:
            raise ValueError("internal: shard buffers must be C-contiguous")
        # Raw bytes: the buffer protocol cannot describe ml_dtypes' bf16/fp8.
        raw = buf.reshape(-1).view(np.uint8)
        self._writes.put(raw)
        self._digests.put((raw, rest))
        self.nbytes += buf.nbytes

    def flush(self) -> None:
        for items in self._queues:
            items.join()
        self._raise_pending()

    def close(self, *, check: bool = True) -> None:
        for items, thread in zip(self._queues, self._threads, strict=True):
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

    `out` is the output's `Storage`, or a path or URI for one. The shard streams
    through `Storage.open_writer` with the header region (8 bytes + `header_reserve`)
    as its head: each sample's hidden states are written (and hashed) as they come, so
    a unit is never held in memory whole. On local disk that is a file in `.tmp/`
    (fsynced in the background, the header written in place at commit, fsync, rename
    into `shards/`); on an object store a multipart upload whose first part, holding
    the header, goes last. `commit()` appends the small tensors, hands over the header,
    and once the shard exists whole creates `commits/unit-XXXXXX.json` if absent
    (`os.link` on disk, a conditional PUT on object stores). Leaving the `with` block by
    an exception (or without committing) aborts: the file or upload is dropped. A crash
    leaves only what readers never look at; `Output.clean_orphans()` removes it.
    """

    def __init__(
        self,
        output: Storage | str | os.PathLike[str],
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
        self.storage = output if isinstance(output, Storage) else Storage.for_uri(output)
        self.unit = unit
        self.layers = [int(k) for k in layers]
        self.hidden_size = int(hidden_size)
        self.storage_dtype: StorageDtype = storage_dtype
        self.attempt = attempt
        self.checksum = checksum
        new_hasher(checksum)  # refuses an unknown algorithm before any file exists
        self._header_len = _round_up(max(header_reserve, 64), 8)
        self.key = shard_path(unit, attempt)
        # The header region is the writer's head: filled in at commit.
        self._sink = self.storage.open_writer(self.key, head_size=_HEADER_PREFIX +
                                              self._header_len)
        self._stream = _DataStream(self._sink, f"{unit_name(unit)}-{attempt}", checksum)
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
                logger.warning("%s: left without commit(); discarding it", self.key)
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
        ids, mask = ids.astype(np.int32), mask.astype(np.uint8)
        rows = [ids.tobytes(), mask.tobytes()]
        if scales is not None:
            scales = np.ascontiguousarray(scales, np.float32)
            rows.append(scales.tobytes())
        self._stream.put(payload, b"".join(rows))
        self._input_ids.append(ids)
        self._loss_mask.append(mask)
        if scales is not None:
            self._scales.append(scales)
        self._sample_indices.append(sample_index)
        self._seen.add(sample_index)
        self._offsets.append(self._offsets[-1] + t)

    def flush(self) -> None:
        """Wait until every added sample has been handed to the storage (not synced)."""
        self._check_open()
        self._stream.flush()

    def commit(self, errors: Iterable[Mapping[str, Any]] = (),
               regenerations: RegenerationsRef | None = None) -> CommitResult:
        """Finish, publish and return the unit's commit record (see the class docstring).

        `errors` are this unit's samples that could not be extracted
        ({"sample_index", "reason"}); they go into the commit record so that every
        sample of the unit is accounted for. `regenerations` names this attempt's table
        of regenerated conversations, already stored whole: it becomes visible with the
        shard, through the record, and is deleted with it when another attempt won.
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
            data_sha, header_sha, size = self._finish_object()
        except BaseException:
            self.abort()
            raise
        faults.reached("after_publish", self.key)
        self._state = "committed"
        record = CommitRecord.model_validate({
            "unit": self.unit,
            "shard": self.key,
            "attempt": self.attempt,
            "samples": self.num_samples,
            "tokens": self.num_tokens,
            "bytes": size,
            "checksum": {"algorithm": self.checksum, "scheme": CHECKSUM_SCHEME,
                         "header": header_sha, "data": data_sha},
            "sample_indices_first": self._sample_indices[0] if self._sample_indices else None,
            "sample_indices_last": self._sample_indices[-1] if self._sample_indices else None,
            "errors": error_rows,
            "committed_at": _now_iso(),
            "regenerations": regenerations,
        })
        own = [self.key] + ([regenerations.key] if regenerations is not None else [])
        unit = unit_name(self.unit)
        key = commit_path(self.unit)
        try:
            # The create-if-absent step that makes exactly one attempt of a unit
            # visible, with the record already complete.
            self.storage.create(key, record.to_json())
        except ObjectExistsError:
            existing = self._read_record(key)
            if existing is None:
                raise StorageError(
                    f"{self.storage.url(key)} exists and yet cannot be read") from None
            if existing.attempt == self.attempt:
                # Ours: a retried create whose first try had landed.
                return CommitResult(won=True, record=existing)
            for key_ in own:
                self.storage.delete(key_)
            logger.info(
                "%s: attempt %s lost to attempt %s; its shard is deleted",
                unit, self.attempt, existing.attempt,
            )
            return CommitResult(won=False, record=existing)
        except BaseException:
            # Perhaps published after all (a create retried after its answer was lost):
            # our shard may be deleted only when the record is surely not ours.
            try:
                existing, known = self._read_record(key), True
            except (StorageError, OSError, OutputCorrupt):
                existing, known = None, False  # the shard stays: an orphan at worst
            if existing is not None and existing.attempt == self.attempt:
                return CommitResult(won=True, record=existing)
            if known:
                for key_ in own:
                    with contextlib.suppress(StorageError, OSError):
                        self.storage.delete(key_)
            raise  # the create's own error
        faults.reached("after_commit_record", self.key)
        logger.info(
            "%s committed: %d samples, %d tokens, %d bytes (attempt %s)",
            unit, record.samples, record.tokens, size, self.attempt,
        )
        return CommitResult(won=True, record=record)

    def _read_record(self, key: str) -> CommitRecord | None:
        try:
            data = self.storage.read(key)
        except FileNotFoundError:
            return None
        return CommitRecord.parse(data, self.storage.url(key))

    def abort(self) -> None:
        """Discard this attempt: stop the writer threads and drop the unfinished object."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._stream.close(check=False)
        self._sink.abort()

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
            out = _aligned_copy(out)
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
                return _aligned_copy(_torch_bf16_to_numpy(t)), None
            return _torch_bf16_to_numpy(t), None
        arr = np.asarray(hs)
        if arr.dtype not in (_BF16, np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"{where}: hidden_states dtype {arr.dtype} is not bf16/fp16/fp32")
        if self.storage_dtype == "fp8":
            q, scales = quantize_fp8(arr)
            return q, scales
        out = np.ascontiguousarray(arr.astype(_BF16, copy=False))
        if np.may_share_memory(out, arr) and not take:
            out = _aligned_copy(out)  # the caller may reuse its buffer before it is written
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
        digests = self._stream.sample_digests
        if len(digests) != n:
            raise RuntimeError(f"internal: {len(digests)} sample digests for {n} samples")
        table = np.frombuffer(b"".join(digests), np.uint8).reshape(n, _SAMPLE_DIGEST_BYTES)
        out.append((SAMPLE_DIGESTS, "U8", [n, _SAMPLE_DIGEST_BYTES], table))
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
                "sample_digest": self.checksum,
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

    def _finish_object(self) -> tuple[str, str, int]:
        """Write the tail, hand over the header; return (data digest, header digest, size).

        A header larger than its reserved region gets a larger region (the storage
        moves the body behind it on local disk; part 1 just grows on S3).
        """
        self._stream.close()
        expected = self.num_tokens * len(self.layers) * self.hidden_size
        expected *= _NUMPY_DTYPES[_HIDDEN_DTYPE[self.storage_dtype]].itemsize
        if self._stream.nbytes != expected:
            raise RuntimeError(
                f"internal: streamed {self._stream.nbytes} bytes, expected {expected}"
            )
        small = self._small_tensors()
        data_sha = new_hasher(self.checksum)  # the tail: it holds the samples' digests
        for _, _, _, arr in small:
            buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
            self._sink.write(buf, keep=True)
            data_sha.update(buf)
        header = self._header(small)
        header_len = self._header_len
        if len(header) > header_len:
            logger.info("%s: header needs %d bytes; its region grows", self.key, len(header))
            header_len = _round_up(len(header), 8)
        block = struct.pack("<Q", header_len) + header.ljust(header_len, b" ")
        size = self._sink.finish(block).size
        header_sha = new_hasher(self.checksum)
        header_sha.update(block)
        return data_sha.hexdigest(), header_sha.hexdigest(), size


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# --------------------------------------------------------------------------- checking


def verify_shard(storage: Storage, record: CommitRecord) -> None:
    """Check a committed shard against its record's size and checksums; raise ShardCorrupt.

    Reads the whole shard once: from the file on local disk, by ranged reads (16 MiB
    each) from an object store. Under the `samples` scheme the data digest covers the
    bytes after hidden_states and each sample's rows are checked against its digest;
    under `whole` (older records) the data digest covers the whole data section.
    """
    what = f"shard {storage.url(record.shard)} (unit {record.unit})"
    info = storage.head(record.shard)
    if info is None:
        raise ShardCorrupt(f"{what} is missing")
    size = info.size
    if size != record.bytes:
        raise ShardCorrupt(f"{what} has {size} bytes, its commit record says {record.bytes}")
    if size < _HEADER_PREFIX:
        raise ShardCorrupt(f"{what} is truncated")
    algorithm, header_digest, data_digest = record.checksums()
    scheme = record.checksum_scheme()
    if scheme not in ("whole", CHECKSUM_SCHEME):
        raise ShardCorrupt(f"{what}: checksum scheme {scheme!r} is unknown; upgrade hsx")
    try:
        header_sha, data_sha = new_hasher(algorithm), new_hasher(algorithm)
    except ValueError as err:
        raise ShardCorrupt(f"{what}: {err}") from None
    with _ByteSource.open(storage, record.shard, size) as source:
        prefix = source.read(0, _HEADER_PREFIX)
        (n,) = struct.unpack("<Q", prefix)
        if _HEADER_PREFIX + n > size:
            raise ShardCorrupt(f"{what}: header checksum mismatch (header length {n} is corrupt)")
        header = source.read(_HEADER_PREFIX, n)
        header_sha.update(prefix)
        header_sha.update(header)
        if header_sha.hexdigest() != header_digest:
            raise ShardCorrupt(f"{what}: header checksum mismatch")
        start = _HEADER_PREFIX + n
        if scheme == CHECKSUM_SCHEME:
            start += int(json.loads(bytes(header))["hidden_states"]["data_offsets"][1])
        source.hash_range(start, size - start, data_sha)
        if data_sha.hexdigest() != data_digest:
            raise ShardCorrupt(f"{what}: data checksum mismatch")
        if scheme == CHECKSUM_SCHEME:
            with ShardReader(source, record=record) as reader:  # closing it closes source
                if reader.sample_digests is None:
                    raise ShardCorrupt(f"{what}: the record's checksum needs sample digests "
                                       "and the shard has none")
                if reader.failing_samples():
                    raise ShardCorrupt(f"{what}: data checksum mismatch")


class _ByteSource:
    """The bytes of one stored shard: a memory map on local disk, ranged reads elsewhere."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size

    @staticmethod
    def open(storage: Storage, key: str, size: int | None = None) -> _ByteSource:
        path = storage.local_path(key)
        if path is not None:
            return _MappedSource(path)
        if size is None:
            size = storage.size(key)
        return _RangedSource(storage, key, size)

    @property
    def mapping(self) -> mmap.mmap | None:
        """The whole shard mapped in memory (local disk), else None."""
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

    def __enter__(self) -> _ByteSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _MappedSource(_ByteSource):
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


class _RangedSource(_ByteSource):
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


# --------------------------------------------------------------------------- reading


def _torch_dtype(name: str) -> Any:
    import torch

    return {
        "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
        "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
    }[name]


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
    numpy (default) or torch (`backend="torch"`). fp8 shards are dequantized to bf16
    unless `dequantize=False`, which adds the raw "scales" [T, L] instead.
    """

    def __init__(
        self, path: str | os.PathLike[str] | _ByteSource, *, record: CommitRecord | None = None
    ) -> None:
        source = path if isinstance(path, _ByteSource) else _MappedSource(Path(path))
        self._source: _ByteSource | None = source
        self.name = source.name
        """The shard's path or URL, for messages."""
        self.record = record
        size = source.size
        if size < _HEADER_PREFIX:
            raise ShardCorrupt(f"{self.name}: not a shard ({size} bytes)")
        head = source.read(0, min(size, _REMOTE_HEAD))
        (n,) = struct.unpack_from("<Q", head, 0)
        if _HEADER_PREFIX + n > size:
            raise ShardCorrupt(f"{self.name}: header length {n} exceeds the file ({size} bytes)")
        raw = head[_HEADER_PREFIX : _HEADER_PREFIX + n] if _HEADER_PREFIX + n <= len(head) \
            else source.read(_HEADER_PREFIX, n)
        try:
            header = json.loads(bytes(raw))
        except ValueError as err:
            raise ShardCorrupt(f"{self.name}: header is not JSON: {err}") from err
        self._data_start = _HEADER_PREFIX + n
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
        if self.storage_dtype not in _HIDDEN_DTYPE:
            raise ShardCorrupt(f"{self.name}: unknown storage_dtype {self.storage_dtype!r}")
        self._tensors: dict[str, dict[str, Any]] = header
        self._np_views: dict[str, np.ndarray] = {}
        self._torch_views: dict[str, Any] = {}
        names = ["hidden_states", "offsets", "sample_index", "input_ids", "loss_mask"]
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
            if digests.shape != (len(self.sample_indices), _SAMPLE_DIGEST_BYTES):
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
        return cls(_ByteSource.open(storage, key, size), record=record)

    @property
    def path(self) -> Path | None:
        """The local file, when the shard is on local disk."""
        return Path(self.name) if isinstance(self._source, _MappedSource) else None

    def _check_tensor(self, name: str, size: int) -> None:
        info = self._tensors.get(name)
        if info is None:
            raise ShardCorrupt(f"{self.name}: tensor {name!r} is missing")
        dtype = _NUMPY_DTYPES.get(info.get("dtype", ""))
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

    def _open_source(self) -> _ByteSource:
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
            row_bytes = math.prod(shape[1:]) * _NUMPY_DTYPES[info["dtype"]].itemsize
            start += first * row_bytes
            shape[0] = rows
        source = self._open_source()
        mapping = source.mapping
        if mapping is not None:
            return mapping, self._data_start + start, shape
        small = self._small
        nbytes = math.prod(shape) * _NUMPY_DTYPES[info["dtype"]].itemsize
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
        if self.storage_dtype == "fp8":
            names.append("scales")
        for name in names:
            buf, offset, shape = hidden if name == "hidden_states" else self._buffer(name, a, b - a)
            nbytes = math.prod(shape) * _NUMPY_DTYPES[self._tensors[name]["dtype"]].itemsize
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
        dtype = _NUMPY_DTYPES[self._tensors[name]["dtype"]]
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
