"""`ShardWriter`: one attempt of one work unit, streamed into a shard and committed.

See the package docstring for who calls what; the bytes it writes are encoding.py's.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import queue
import re
import secrets
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import numpy as np

from hsx import settings
from hsx.output import faults
from hsx.output.layout import SHARD_FORMAT_NAME, commit_path, shard_path, unit_name
from hsx.output.records import CommitRecord, OutputCorrupt, RegenerationsRef
from hsx.output.shards.encoding import (
    BF16,
    CHECKSUM_SCHEME,
    DEFAULT_CHECKSUM,
    DEFAULT_HEADER_RESERVE,
    FP8,
    HEADER_PREFIX,
    HIDDEN_DTYPE,
    IMAGE,
    MODALITY_MASK,
    NUMPY_DTYPES,
    SAMPLE_DIGEST_BYTES,
    SAMPLE_DIGESTS,
    SHARD_FORMAT_VERSION,
    Checksum,
    StorageDtype,
    is_torch_tensor,
    new_hasher,
    quantize_fp8,
)
from hsx.output.storage import ObjectExistsError, ObjectWriter, Storage, StorageError

logger = logging.getLogger(__name__)


_BUFFER_ALIGN = 4096  # the writer's own copies start on a page (direct I/O needs 512)
_QUEUE_DEPTH = 4  # samples in flight between add() and the writer thread


@dataclass(frozen=True)
class CommitResult:
    """Outcome of `ShardWriter.commit()`.

    `won` is False when another attempt of the same unit had already committed; then
    `record` is that attempt's record and this attempt's shard has been deleted.
    """

    won: bool
    record: CommitRecord


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
    if is_torch_tensor(x):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def _to_host(t: Any) -> Any:
    """A device tensor copied into pinned host memory (a CPU tensor as it is).

    `.cpu()` copies into freshly allocated pageable memory, many times slower than a
    copy into pinned memory (torch's caching host allocator keeps pinned blocks for
    reuse).
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

    return np.asarray(t.view(torch.int16).numpy()).view(BF16)


BACKGROUND_NICE_ENV = settings.BACKGROUND_NICE.name


def background_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; $HSX_BACKGROUND_NICE).

    For the threads that move and hash captured states (the shard writer's, the
    committer, the connector's spool writers): they then run on cores the engine leaves
    idle instead of preempting it. On a CPU engine every preemption of one of its
    OpenMP threads stalls the whole parallel region; on a GPU node cores are plenty and
    nothing changes. Linux sets nice per thread; elsewhere this does nothing.
    """
    try:
        nice = settings.BACKGROUND_NICE.get()
    except ValueError:  # a thread that moves states does not stop over its priority
        nice = settings.BACKGROUND_NICE.default
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(nice, 19))


class _DataStream:
    """Appends sample buffers to the shard's object writer, hashing beside the writes.

    Two threads, so the caller (the engine thread) produces the next sample while
    these reach the storage: one writes, one hashes each sample (a hash in series with
    the writes halves the writer's rate on a GPU node: benchmarks/bench_writer.py).
    Each byte is hashed once: the shard's data digest covers the samples through their
    digests (`CHECKSUM_SCHEME`). The writer syncs in the background on local disk
    (`fdatasync` every 256 MiB, so the fsync at commit has little left) and uploads parts
    in the background on object stores. Write and hash release the GIL.
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
        modality: bool = False,
    ) -> None:
        if unit < 0:
            raise ValueError(f"unit must be >= 0, got {unit}")
        if storage_dtype not in HIDDEN_DTYPE:
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
        self._sink = self.storage.open_writer(self.key, head_size=HEADER_PREFIX +
                                              self._header_len)
        self._stream = _DataStream(self._sink, f"{unit_name(unit)}-{attempt}", checksum)
        self._offsets: list[int] = [0]
        self._sample_indices: list[int] = []
        self._seen: set[int] = set()
        self._input_ids: list[np.ndarray] = []
        self._loss_mask: list[np.ndarray] = []
        # A shard of a job that takes images says each token's modality (MODALITY_MASK).
        self._modality: list[np.ndarray] | None = [] if modality else None
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
        modality_mask: Any = None,
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

        `modality_mask` [T] (0 text, 1 image: MODALITY_MASK) goes into a shard opened
        with `modality=True` (all zeros when not given); a shard without it takes none.
        """
        self._check_open()
        sample_index = int(sample_index)
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        if sample_index in self._seen:
            raise ValueError(f"sample {sample_index} was already added to unit {self.unit}")
        ids = _as_numpy_1d(input_ids, "input_ids")
        mask = _as_numpy_1d(loss_mask, "loss_mask")
        if not is_torch_tensor(hidden_states):
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
        modality = None
        if self._modality is not None:
            modality = (np.zeros(t, np.uint8) if modality_mask is None
                        else _as_numpy_1d(modality_mask, MODALITY_MASK).astype(np.uint8))
            if len(modality) != t:
                raise ValueError(f"{where}: {len(modality)} modality_mask values but {t} "
                                 "tokens")
            if modality.size and modality.max() > IMAGE:
                raise ValueError(f"{where}: modality_mask values must be 0 (text) or 1 "
                                 "(image)")
        elif modality_mask is not None and np.asarray(modality_mask).any():
            raise ValueError(f"{where}: a modality_mask with image tokens, into a shard "
                             "opened without modality=True")

        if scales is None:
            payload, scales = self._encode(hidden_states, where, take)
        else:
            payload, scales = self._take_quantized(hidden_states, scales, where, take)
        ids, mask = ids.astype(np.int32), mask.astype(np.uint8)
        rows = [ids.tobytes(), mask.tobytes()]
        if modality is not None:
            rows.append(modality.tobytes())
        if scales is not None:
            scales = np.ascontiguousarray(scales, np.float32)
            rows.append(scales.tobytes())
        self._stream.put(payload, b"".join(rows))
        self._input_ids.append(ids)
        self._loss_mask.append(mask)
        if self._modality is not None and modality is not None:
            self._modality.append(modality)
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
               regenerations: RegenerationsRef | None = None,
               checks: Mapping[str, Any] | None = None) -> CommitResult:
        """Finish, publish and return the unit's commit record (see the class docstring).

        `errors` are this unit's samples that could not be extracted
        ({"sample_index", "reason"}); they go into the commit record so that every
        sample of the unit is accounted for. `regenerations` names this attempt's table
        of regenerated conversations, already stored whole: it becomes visible with the
        shard, through the record, and is deleted with it when another attempt won.
        `checks` is what the self-check found in the unit (CommitRecord.checks).
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
            "checks": dict(checks) if checks is not None else None,
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
        if is_torch_tensor(q):
            import torch

            q = _to_host(q.contiguous()).view(torch.uint8).numpy().view(FP8)
            scales = _to_host(scales).numpy()
        q, scales = np.asarray(q), np.asarray(scales, np.float32)
        if q.dtype != FP8:
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
        if is_torch_tensor(hs):
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
        if arr.dtype not in (BF16, np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"{where}: hidden_states dtype {arr.dtype} is not bf16/fp16/fp32")
        if self.storage_dtype == "fp8":
            q, scales = quantize_fp8(arr)
            return q, scales
        out = np.ascontiguousarray(arr.astype(BF16, copy=False))
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
        if self._modality is not None:
            out.append((MODALITY_MASK, "U8", [t], cat(self._modality, np.uint8)))
        digests = self._stream.sample_digests
        if len(digests) != n:
            raise RuntimeError(f"internal: {len(digests)} sample digests for {n} samples")
        table = np.frombuffer(b"".join(digests), np.uint8).reshape(n, SAMPLE_DIGEST_BYTES)
        out.append((SAMPLE_DIGESTS, "U8", [n, SAMPLE_DIGEST_BYTES], table))
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
                "dtype": HIDDEN_DTYPE[self.storage_dtype],
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
        expected *= NUMPY_DTYPES[HIDDEN_DTYPE[self.storage_dtype]].itemsize
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
