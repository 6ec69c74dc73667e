"""GPU benchmark of hsx's capture path on one accelerator (see benchmarks/gpu/README.md).

Measures, in one run, on an 8B-shaped Llama with random weights:

1. ceilings: bf16 matmul TFLOP/s (-> compute ceiling in tokens/s), sequential write with
   fsync on the local disk (-> disk ceiling in tokens/s), GPU->host copy GB/s into pinned
   and pageable memory, sha256 and memcpy GB/s on the host;
2. the connector copy path (`hsx_workers.engines.vllm.hostcopy.gather_to_host`): gather + D2H into
   pinned memory on a side stream, alone and beside a matmul loop on the default stream;
3. `ShardWriter` alone with numpy / CPU torch / pinned torch / CUDA tensors vs a raw
   write with fsync;
4. the model forward (as the hf engine calls it, and variants), the `hf` engine
   capture-only, and end to end into shards (capture -> ShardWriter.add -> commit) in
   three ways: GPU tensors handed to ShardWriter as the worker does today, a synchronous
   copy into pinned memory first, and a pinned copy overlapped with the next forward.

Run (GPU machine):  PYTHONPATH=client:workers:service python -m benchmarks.gpu.bench_gpu \
                        --out $OUT/gpu.json
Check (CPU, tiny):  .venv/bin/python -m benchmarks.gpu.bench_gpu --quick --device cpu

Results are written to --out after every phase, so a run cut short keeps what it measured.
Units: GB = 1e9 bytes; GiB = 2**30 bytes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import gc
import hashlib
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

from benchmarks.common import campaign_path

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------------- helpers


class Bench:
    """Holds the results, the clock and the device; writes JSON after every phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.t0 = time.perf_counter()
        self.out = Path(args.out)
        self.res: dict[str, Any] = {"phases_skipped": [], "errors": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def save(self) -> None:
        self.res["elapsed_s"] = round(self.elapsed(), 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=_jsonable) + "\n")
        os.replace(tmp, self.out)

    def phase(self, name: str, fn: Callable[[], Any], need_s: float = 0.0) -> None:
        if self.left() < need_s:
            log(f"== {name}: skipped ({self.left():.0f} s left, needs ~{need_s:.0f} s)")
            self.res["phases_skipped"].append(name)
            self.save()
            return
        log(f"== {name} (t={self.elapsed():.1f} s)")
        start = time.perf_counter()
        try:
            value = fn()
            if value is not None:
                self.res[name] = value
        except Exception as err:
            traceback.print_exc()
            self.res["errors"][name] = f"{type(err).__name__}: {err}"
        self.res.setdefault("phase_seconds", {})[name] = round(time.perf_counter() - start, 2)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        self.save()


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def r3(x: float) -> float:
    return float(f"{x:.4g}")


def stats(times: list[float]) -> dict[str, Any]:
    return {
        "best_s": r3(min(times)),
        "median_s": r3(float(np.median(times))),
        "all_s": [r3(t) for t in times],
    }


def timeit(b: Bench, fn: Callable[[], Any], reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    b.sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        b.sync()
        out.append(time.perf_counter() - t)
    return out


def pin_ok(b: Bench) -> bool:
    return b.cuda


def layers_for(n: int) -> list[int]:
    """EAGLE-3's default capture ids: [2, N//2, N-3, N] (hsx.methods)."""
    return sorted({2, n // 2, n - 3, n})


# --------------------------------------------------------------------------- ceilings


def bench_env(b: Bench) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": b.args.device,
        "device_name": torch.cuda.get_device_name(b.dev) if b.cuda else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "workdir": str(b.args.workdir),
        "quick": b.args.quick,
    }
    try:
        st = os.statvfs(b.args.workdir)
        env["workdir_free_gib"] = round(st.f_bavail * st.f_frsize / GiB, 1)
    except OSError:
        pass
    for cmd in (["df", "-h", str(b.args.workdir)], ["nproc"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            env[" ".join(cmd)] = subprocess.run(
                cmd, capture_output=True, text=True, timeout=10
            ).stdout.strip()
    if b.cuda:
        props = torch.cuda.get_device_properties(b.dev)
        env["gpu_memory_gib"] = round(props.total_memory / GiB, 1)
        env["sm_count"] = props.multi_processor_count
    log(json.dumps(env))
    return env


def bench_matmul(b: Bench) -> dict[str, Any]:
    s = b.args.sizes
    shapes = [(s["mm"], s["mm"], s["mm"])]
    tokens = s["batch"] * s["seq"]
    h, inter = s["hidden"], s["intermediate"]
    shapes += [(tokens, h, inter), (tokens, inter, h)]  # the MLP's own shapes
    out: dict[str, Any] = {}
    dtype = torch.bfloat16
    for m, k, n in shapes:
        a = torch.randn(m, k, device=b.dev, dtype=dtype)
        w = torch.randn(k, n, device=b.dev, dtype=dtype)
        iters = 20 if b.cuda else 3
        times = timeit(b, lambda a=a, w=w, iters=iters: [a @ w for _ in range(iters)], 3, 1)
        tflops = 2 * m * k * n * iters / min(times) / 1e12
        out[f"{m}x{k}x{n}"] = {"tflops": r3(tflops), **stats(times), "iters_per_rep": iters}
        log(f"matmul {m}x{k}x{n}: {tflops:.1f} TFLOP/s")
        del a, w
    out["best_tflops"] = max(v["tflops"] for v in out.values())
    return out


def bench_host(b: Bench) -> dict[str, Any]:
    """sha256 (what the shard writer hashes with) and memcpy on the host."""
    n = b.args.sizes["host_buf"]
    buf = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    t = timeit(b, lambda: hashlib.sha256(buf.data).digest(), 3, 1)
    dst = np.empty_like(buf)
    tc = timeit(b, lambda: np.copyto(dst, buf), 3, 1)
    tt = torch.from_numpy(buf)
    tcl = timeit(b, lambda: tt.clone(), 3, 1)
    out: dict[str, Any] = {
        "bytes": n,
        "sha256_gbps": r3(n / min(t) / GB),
        "numpy_copyto_gbps": r3(n / min(tc) / GB),
        "torch_clone_gbps": r3(n / min(tcl) / GB),
    }
    # Alternatives for the shard checksum (the writer hashes every byte it writes).
    hashes: dict[str, Callable[[], Any]] = {
        "blake2b": lambda: hashlib.blake2b(buf.data).digest(),
        "md5": lambda: hashlib.md5(buf.data).digest(),
        "crc32": lambda: zlib.crc32(buf.data),
    }
    try:
        import xxhash

        hashes["xxh3_128"] = lambda: xxhash.xxh3_128(buf.data).digest()
    except ImportError:
        out["xxh3_128_gbps"] = "xxhash not installed"
    for name, fn in hashes.items():
        out[f"{name}_gbps"] = r3(n / min(timeit(b, fn, 2, 1)) / GB)
    # sha256 of 64 MiB chunks on several threads (hashlib releases the GIL)
    chunks = [buf[i : i + 64 * MiB] for i in range(0, n, 64 * MiB)]
    for workers in (2, 4, 8):
        with ThreadPoolExecutor(workers) as pool:

            def par(pool: ThreadPoolExecutor = pool) -> list[bytes]:
                return list(pool.map(lambda c: hashlib.sha256(c.data).digest(), chunks))

            out[f"sha256_chunks_{workers}threads_gbps"] = r3(n / min(timeit(b, par, 2, 1)) / GB)
    log(json.dumps(out))
    return out


def raw_write(path: Path, chunk: np.ndarray, total: int, fsync: bool = True) -> dict[str, float]:
    """Sequential write of `total` bytes in `chunk`-sized writes, then fsync."""
    start = time.perf_counter()
    with open(path, "wb") as f:
        done = 0
        while done < total:
            f.write(chunk.data)
            done += chunk.nbytes
        f.flush()
        t_write = time.perf_counter() - start
        if fsync:
            os.fsync(f.fileno())
    t_all = time.perf_counter() - start
    return {
        "bytes": done,
        "write_s": t_write,
        "total_s": t_all,
        "gbps": done / t_all / GB,
        "write_only_gbps": done / t_write / GB,
    }


def bench_disk(b: Bench) -> dict[str, Any]:
    s = b.args.sizes
    wd = Path(b.args.workdir) / "disk"
    wd.mkdir(parents=True, exist_ok=True)
    chunk = np.random.default_rng(1).integers(
        0, 255, 64 * MiB if not b.args.quick else MiB, dtype=np.uint8
    )
    runs = []
    for i in range(s["disk_reps"]):
        p = wd / f"raw{i}.bin"
        r = raw_write(p, chunk, s["disk_bytes"])
        p.unlink()
        runs.append({k: r3(v) for k, v in r.items()})
        log(
            f"disk write+fsync {r['bytes'] / GiB:.2f} GiB: {r['gbps']:.2f} GB/s "
            f"(write() alone {r['write_only_gbps']:.2f} GB/s)"
        )
    shutil.rmtree(wd, ignore_errors=True)
    best = max(r["gbps"] for r in runs)
    return {
        "path": str(wd),
        "chunk_bytes": chunk.nbytes,
        "runs": runs,
        "best_gbps": best,
        "median_gbps": r3(float(np.median([r["gbps"] for r in runs]))),
    }


def bench_d2h(b: Bench) -> dict[str, Any]:
    if not b.cuda:
        return {"skipped": "no cuda"}
    s = b.args.sizes
    out: dict[str, Any] = {}
    n = s["d2h_pinned"]
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=b.dev)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    t = timeit(b, lambda: pinned.copy_(src, non_blocking=True), 5, 2)
    out["pinned"] = {"bytes": n, "gbps": r3(n / min(t) / GB), **stats(t)}
    n2 = s["d2h_pageable"]
    src2 = src[:n2]
    pageable = torch.empty(n2, dtype=torch.uint8)
    t = timeit(b, lambda: pageable.copy_(src2), 3, 1)
    out["pageable_preallocated"] = {"bytes": n2, "gbps": r3(n2 / min(t) / GB), **stats(t)}
    t = timeit(b, lambda: src2.cpu(), 3, 1)  # what ShardWriter._encode does
    out["pageable_dot_cpu"] = {"bytes": n2, "gbps": r3(n2 / min(t) / GB), **stats(t)}
    # pinned staging then memcpy into pageable: the cost of a bounce buffer by hand
    stage = torch.empty(n2, dtype=torch.uint8, pin_memory=True)

    def bounce() -> None:
        stage.copy_(src2, non_blocking=True)
        torch.cuda.current_stream(b.dev).synchronize()
        pageable.copy_(stage)

    t = timeit(b, bounce, 3, 1)
    out["pinned_then_memcpy"] = {"bytes": n2, "gbps": r3(n2 / min(t) / GB), **stats(t)}
    t = timeit(b, lambda: torch.empty(n2, dtype=torch.uint8, pin_memory=True), 3, 1)
    out["pinned_alloc_cached_s"] = r3(min(t))
    # Is it the fresh (never touched) destination pages that make .cpu() slow?
    t = timeit(b, lambda: torch.zeros(n2, dtype=torch.uint8).copy_(src2), 3, 1)
    out["pageable_fresh_zeroed_then_copy"] = {"bytes": n2, "gbps": r3(n2 / min(t) / GB), **stats(t)}
    t = timeit(b, lambda: torch.zeros(n2, dtype=torch.uint8), 3, 1)
    out["host_zeros_alloc_gbps"] = r3(n2 / min(t) / GB)
    n3 = 64 * MiB if not b.args.quick else MiB
    t = timeit(b, lambda: src[:n3].cpu(), 5, 1)
    out["pageable_dot_cpu_64mib"] = {"bytes": n3, "gbps": r3(n3 / min(t) / GB), **stats(t)}
    stage3 = torch.empty(n3, dtype=torch.uint8, pin_memory=True)
    t = timeit(b, lambda: stage3.copy_(src[:n3]), 5, 1)
    out["pinned_sync_copy_64mib"] = {"bytes": n3, "gbps": r3(n3 / min(t) / GB), **stats(t)}
    out["pinned_over_pageable"] = r3(out["pinned"]["gbps"] / out["pageable_dot_cpu"]["gbps"])
    log(json.dumps({k: (v["gbps"] if isinstance(v, dict) else v) for k, v in out.items()}))
    return out


# --------------------------------------------------------------------------- connector copy


def bench_connector(b: Bench) -> dict[str, Any]:
    from hsx_workers.engines.vllm.hostcopy import gather, gather_to_host, slots_of_blocks

    s = b.args.sizes
    nl, h, bs = 4, s["hidden"], 16
    blocks = s["cache_blocks"]
    req_tokens = s["seq"]
    nreq = s["conn_requests"]
    cache = torch.randn(blocks, nl, bs, h, device=b.dev, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    per_req = req_tokens // bs
    slot_maps = [
        slots_of_blocks(torch.randperm(blocks, generator=g)[:per_req].tolist(), bs)
        for _ in range(nreq)
    ]
    req_bytes = req_tokens * nl * h * 2
    total = req_bytes * nreq
    out: dict[str, Any] = {
        "cache_shape": list(cache.shape),
        "cache_gib": r3(cache.numel() * 2 / GiB),
        "request_tokens": req_tokens,
        "requests": nreq,
        "bytes_per_request": req_bytes,
    }
    # correctness: the host copy equals the gather done on the device
    ev, host = gather_to_host(cache, slot_maps[0], req_tokens)
    ev.synchronize()
    ref = gather(cache, slot_maps[0].to(b.dev), req_tokens).cpu()
    out["matches_device_gather"] = bool(torch.equal(host, ref))
    out["host_pinned"] = bool(host.is_pinned()) if b.cuda else False
    del host, ref

    stream = torch.cuda.Stream(device=b.dev) if b.cuda else None

    def copies(n: int = nreq) -> list[Any]:
        held = []
        for sm in slot_maps[:n]:
            held.append(gather_to_host(cache, sm, req_tokens, stream=stream))
        for e, _ in held:
            e.synchronize()
        return held

    t = timeit(b, copies, 3, 1)
    out["gather_d2h"] = {"gbps": r3(total / min(t) / GB), **stats(t)}
    dev_slots = [sm.to(b.dev) for sm in slot_maps]
    t = timeit(b, lambda: [gather(cache, sm, req_tokens) for sm in dev_slots], 3, 1)
    out["gather_on_device_only"] = {"gbps": r3(total / min(t) / GB), **stats(t)}
    log(
        f"connector gather+D2H pinned: {out['gather_d2h']['gbps']} GB/s; "
        f"device gather alone {out['gather_on_device_only']['gbps']} GB/s"
    )
    if not b.cuda:
        return out

    # Overlap: per step, k matmuls on the default stream, then one request's copy on the
    # side stream (it waits for that step's matmuls, so it runs beside the next step's).
    m = s["mm"]
    a = torch.randn(m, m, device=b.dev, dtype=torch.bfloat16)
    w = torch.randn(m, m, device=b.dev, dtype=torch.bfloat16)
    k = s["conn_mm_per_step"]
    cur = torch.cuda.current_stream(b.dev)

    def loop(with_copies: bool) -> tuple[float, float]:
        held = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record(cur)
        for i in range(nreq):
            for _ in range(k):
                a @ w
            if with_copies:
                held.append(gather_to_host(cache, slot_maps[i], req_tokens, stream=stream))
        end.record(cur)
        end.synchronize()
        for e, _ in held:
            e.synchronize()
        wall = time.perf_counter() - t
        return start.elapsed_time(end) / 1e3, wall

    loop(False)
    loop(True)
    alone = [loop(False) for _ in range(3)]
    both = [loop(True) for _ in range(3)]
    mm_alone = min(x[0] for x in alone)
    mm_both = min(x[0] for x in both)
    wall_both = min(x[1] for x in both)
    flops = 2 * m**3 * k * nreq
    out["overlap"] = {
        "matmul": f"{m}x{m}x{m} bf16, {k} per step, {nreq} steps",
        "matmul_alone_s": r3(mm_alone),
        "matmul_alone_tflops": r3(flops / mm_alone / 1e12),
        "matmul_with_copies_s": r3(mm_both),
        "matmul_with_copies_tflops": r3(flops / mm_both / 1e12),
        "wall_with_copies_s": r3(wall_both),
        "copies_alone_s": out["gather_d2h"]["best_s"],
        "slowdown": r3(mm_both / mm_alone),
        "serial_would_be_s": r3(mm_alone + out["gather_d2h"]["best_s"]),
        "alone_all": [r3(x[0]) for x in alone],
        "with_all": [r3(x[0]) for x in both],
    }
    log(json.dumps(out["overlap"]))
    return out


# --------------------------------------------------------------------------- ShardWriter


WRITERS = ("current", "pinned_encode", "hash_thread", "fast_stream", "fixed")
"""ShardWriter as it is, and prototypes of proposed fixes (benchmark-only, not hsx code):
pinned_encode: CUDA tensors copied into pinned host memory instead of `.cpu()`;
hash_thread: sha256 on its own thread beside the write thread;
fast_stream: hash_thread + fdatasync running behind the writes (commit flushes little);
fixed: pinned_encode + fast_stream."""


class FastStream:
    """Prototype replacement for hsx.output.shards.writer._DataStream (its interface then).

    The current stream writes and hashes each buffer on ONE thread, so its rate is
    1 / (1/write + 1/sha256). Here the write and the sha256 run on two threads over the
    same buffers, and (optionally) a third thread fdatasyncs every `sync_every` bytes
    while writing continues, so that commit()'s fsync finds little left to flush.
    """

    depth = 4
    sync_every: int | None = 256 * MiB

    def __init__(self, f: Any, name: str) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0
        self._error: BaseException | None = None
        self._wq: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        self._hq: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        self._sq: queue.Queue[Any] = queue.Queue()
        targets = [self._write, self._hash] + ([self._sync] if self.sync_every else [])
        self._threads = [
            threading.Thread(target=t, name=f"{name}-{t.__name__}", daemon=True) for t in targets
        ]
        for th in self._threads:
            th.start()

    def _loop(self, q: queue.Queue[Any], fn: Callable[[Any], None]) -> None:
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    fn(item)
            except BaseException as err:
                self._error = err
            finally:
                q.task_done()

    def _write(self) -> None:
        since = 0

        def one(item: np.ndarray) -> None:
            nonlocal since
            self._f.write(item.data)
            since += item.nbytes
            if self.sync_every and since >= self.sync_every:
                self._f.flush()
                self._sq.put(1)
                since = 0

        self._loop(self._wq, one)

    def _hash(self) -> None:
        self._loop(self._hq, lambda item: self.sha.update(item.data))

    def _sync(self) -> None:
        fd = self._f.fileno()
        self._loop(self._sq, lambda _: os.fdatasync(fd))

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise OSError(f"cannot write shard data: {self._error}") from self._error

    def put(self, buf: np.ndarray) -> None:
        self._raise_pending()
        raw = buf.reshape(-1).view(np.uint8)
        self._wq.put(raw)
        self._hq.put(raw)
        self.nbytes += buf.nbytes

    def flush(self) -> None:
        self._wq.join()
        self._hq.join()
        self._raise_pending()

    def close(self, *, check: bool = True) -> None:
        for q in (self._wq, self._hq, self._sq):
            q.put(None)
        for th in self._threads:
            th.join()
        if check:
            self._raise_pending()


class HashThreadStream(FastStream):
    sync_every = None


def _writer_class(kind: str) -> Any:
    from hsx.output.shards import ShardWriter
    from hsx.output.shards.writer import _torch_bf16_to_numpy

    if kind not in ("pinned_encode", "fixed"):
        return ShardWriter

    class PinnedEncodeWriter(ShardWriter):
        """`_encode` with a copy into (cached) pinned host memory instead of `.cpu()`."""

        def _encode(self, hs: Any, where: str) -> Any:
            if (
                isinstance(hs, torch.Tensor)
                and hs.is_cuda
                and self.storage_dtype == "bf16"
                and hs.dtype in (torch.bfloat16, torch.float16, torch.float32)
            ):
                t = hs.detach().to(torch.bfloat16).contiguous()
                host = torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=True)
                host.copy_(t)  # synchronous; ~55 GB/s into pinned memory
                return _torch_bf16_to_numpy(host), None
            return super()._encode(hs, where)

    return PinnedEncodeWriter


def _stream_patch(kind: str) -> Any:
    import hsx.output.shards.writer

    stream = {"hash_thread": HashThreadStream, "fast_stream": FastStream, "fixed": FastStream}
    if kind in stream:
        return mock.patch.object(hsx.output.shards.writer, "_DataStream", stream[kind])
    return contextlib.nullcontext()


def write_unit(
    root: Path,
    unit: int,
    layers: list[int],
    h: int,
    samples: Iterable[tuple[int, Any, Any, Any]],
    writer: str = "current",
) -> dict[str, Any]:
    """One unit through ShardWriter; returns the caller's time in add() and commit()."""
    cls = _writer_class(writer)
    t_add = 0.0
    start = time.perf_counter()
    with (
        _stream_patch(writer),
        cls(root, unit, layers=layers, hidden_size=h, storage_dtype="bf16") as w,
    ):
        for idx, ids, mask, hs in samples:
            t = time.perf_counter()
            w.add(idx, ids, mask, hs)
            t_add += time.perf_counter() - t
        t = time.perf_counter()
        res = w.commit()
        t_commit = time.perf_counter() - t
    return {
        "total_s": time.perf_counter() - start,
        "add_s": t_add,
        "commit_s": t_commit,
        "bytes": res.record.bytes,
        "tokens": res.record.tokens,
        "record": res.record,
    }


CASES_CURRENT = [
    ("numpy_bf16", "current"),
    ("torch_cpu", "current"),
    ("torch_cpu_pinned", "current"),
    ("torch_cuda", "current"),
]
CASES_FIXES = [
    ("numpy_bf16", "current"),
    ("numpy_bf16", "hash_thread"),
    ("numpy_bf16", "fast_stream"),
    ("torch_cuda", "current"),
    ("torch_cuda", "pinned_encode"),
    ("torch_cuda", "fixed"),
]


def bench_shardwriter(b: Bench, cases: list[tuple[str, str]] = CASES_CURRENT) -> dict[str, Any]:
    s = b.args.sizes
    h, layers, seq, n = s["hidden"], [2, 16, 29, 32], s["seq"], s["unit_samples"]
    nl = len(layers)
    root = Path(b.args.workdir) / "sw"
    g = torch.Generator().manual_seed(5)
    host_t = torch.randn(seq, nl, h, generator=g).to(torch.bfloat16)
    ids = np.arange(seq, dtype=np.int32) % 1000
    mask = np.ones(seq, np.uint8)
    sources: dict[str, Any] = {
        "numpy_bf16": _np_bf16(host_t),
        "torch_cpu": host_t,
    }
    if b.cuda:
        sources["torch_cpu_pinned"] = host_t.pin_memory()
        sources["torch_cuda"] = host_t.to(b.dev)
    state_bytes = seq * nl * h * 2 * n
    out: dict[str, Any] = {
        "unit_samples": n,
        "sample_tokens": seq,
        "state_bytes_per_unit": state_bytes,
    }
    chunk = _np_u8(host_t)
    raws = []
    for i in range(s["sw_reps"]):
        p = Path(b.args.workdir) / f"raw-sw{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        raws.append(raw_write(p, chunk, state_bytes))
        p.unlink()
    raw_best = max(r["gbps"] for r in raws)
    out["raw_write_fsync"] = {
        "gbps": r3(raw_best),
        "all_gbps": [r3(r["gbps"]) for r in raws],
        "chunk_bytes": chunk.nbytes,
    }
    log(f"raw write+fsync ({chunk.nbytes / MiB:.0f} MiB writes): {raw_best:.2f} GB/s")
    unit = 0
    for src_name, writer in cases:
        if src_name not in sources:
            continue
        src = sources[src_name]
        name = src_name if writer == "current" else f"{src_name}+{writer}"
        runs = []
        for _ in range(s["sw_reps"]):
            shutil.rmtree(root, ignore_errors=True)
            gen = ((i, ids, mask, src) for i in range(n))
            runs.append(write_unit(root, unit, layers, h, gen, writer))
            unit += 1
        verified = None
        if writer != "current":
            verified = _verify(root, runs[-1]["record"], host_t)
        best = min(runs, key=lambda r: r["total_s"])
        out[name] = {
            "gbps": r3(state_bytes / best["total_s"] / GB),
            "add_gbps": r3(state_bytes / best["add_s"] / GB),
            "add_s": r3(best["add_s"]),
            "commit_s": r3(best["commit_s"]),
            "total_s": r3(best["total_s"]),
            "all_total_s": [r3(r["total_s"]) for r in runs],
            "vs_raw": r3(state_bytes / best["total_s"] / GB / raw_best),
            **({"shard_verified": verified} if verified is not None else {}),
        }
        log(
            f"ShardWriter {name}: {out[name]['gbps']} GB/s end to end "
            f"(add() {out[name]['add_s']} s, commit {out[name]['commit_s']} s)"
        )
    shutil.rmtree(root, ignore_errors=True)
    if "torch_cuda" in out and "torch_cpu" in out:
        out["cuda_over_cpu_time"] = r3(out["torch_cuda"]["total_s"] / out["torch_cpu"]["total_s"])
    return out


def _verify(root: Path, record: Any, expect: torch.Tensor) -> bool:
    """A prototype writer's shard passes verification and holds the right states."""
    from hsx.output import Output, ShardReader

    Output(root).verify([record])
    with ShardReader(root / record.shard, record=record) as r:
        first = r.sample(0, backend="torch")["hidden_states"]
        last = r.sample(len(r) - 1, backend="torch")["hidden_states"]
        return bool(torch.equal(first, expect) and torch.equal(last, expect))


def _np_bf16(t: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    return t.contiguous().view(torch.int16).numpy().view(np.dtype(ml_dtypes.bfloat16)).copy()


def _np_u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1).copy()


# --------------------------------------------------------------------------- model


class ModelPhases:
    def __init__(self, b: Bench) -> None:
        self.b = b
        self.model: Any = None
        self.engine: Any = None
        s = b.args.sizes
        self.n_layers = s["layers"]
        self.layers = layers_for(self.n_layers)
        self.h = s["hidden"]
        self.batch, self.seq = s["batch"], s["seq"]

    # ---- build

    def build(self) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, LlamaConfig

        s = self.b.args.sizes
        cfg = LlamaConfig(
            hidden_size=s["hidden"],
            intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            vocab_size=s["vocab"],
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        )
        t = time.perf_counter()
        with torch.device(self.b.dev):
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
        model.eval()
        self.b.sync()
        build_s = time.perf_counter() - t
        self.model = model
        total = sum(p.numel() for p in model.parameters())
        dec = sum(p.numel() for p in model.model.layers.parameters())
        head = model.lm_head.weight.numel()
        self.params = {
            "total": total,
            "decoder_layers": dec,
            "lm_head": head,
            "embed": model.model.embed_tokens.weight.numel(),
        }
        out = {
            "config": {
                k: s[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")
            },
            "dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "params": self.params,
            "build_s": r3(build_s),
            "capture_layers": self.layers,
            "bytes_per_token": len(self.layers) * self.h * 2,
        }
        log(json.dumps(out))
        return out

    def ceilings(self) -> dict[str, Any]:
        res = self.b.res
        tflops = res["matmul"]["best_tflops"]
        p_dec = self.params["decoder_layers"]
        p_head = self.params["lm_head"]
        attn_flops = 4 * (self.seq / 2) * self.h * self.n_layers  # QK^T + PV, causal mean
        bpt = len(self.layers) * self.h * 2
        compute = tflops * 1e12 / (2 * p_dec)
        compute_strict = tflops * 1e12 / (2 * (p_dec + p_head) + attn_flops)
        disk_gbps = res["disk"]["best_gbps"]
        disk = disk_gbps * GB / bpt
        out = {
            "formula_compute": "tokens/s = matmul_TFLOPs*1e12 / (2 * decoder_layer_params)",
            "formula_compute_strict": (
                "tokens/s = matmul_TFLOPs*1e12 / (2*(decoder_layer_params"
                " + lm_head_params) + 4*(seq/2)*hidden*layers)"
            ),
            "formula_disk": "tokens/s = disk_write_fsync_GBps*1e9 / bytes_per_token",
            "matmul_tflops": tflops,
            "bytes_per_token": bpt,
            "compute_tok_s": round(compute),
            "compute_strict_tok_s": round(compute_strict),
            "disk_gbps": disk_gbps,
            "disk_tok_s": round(disk),
            "min_tok_s": round(min(compute, disk)),
            "bound_by": "disk" if disk < compute else "compute",
        }
        if self.b.cuda and "d2h" in res and "pinned" in res["d2h"]:
            out["pinned_d2h_tok_s"] = round(res["d2h"]["pinned"]["gbps"] * GB / bpt)
            out["pageable_d2h_tok_s"] = round(res["d2h"]["pageable_dot_cpu"]["gbps"] * GB / bpt)
        log(json.dumps(out))
        return out

    # ---- direct forward

    def forward(self) -> dict[str, Any]:
        s = self.b.args.sizes
        g = torch.Generator(device=self.b.dev).manual_seed(7)
        ids = torch.randint(0, s["vocab"], (self.batch, self.seq), device=self.b.dev, generator=g)
        mask = torch.ones_like(ids)
        tokens = self.batch * self.seq
        nb = s["fwd_batches"]

        @torch.inference_mode()
        def run(**kw: Any) -> None:
            out = self.model(input_ids=ids, use_cache=False, **kw)
            del out

        variants = {
            "hf_engine_call": {"attention_mask": mask, "output_hidden_states": True},
            "logits_to_keep_1": {
                "attention_mask": mask,
                "output_hidden_states": True,
                "logits_to_keep": 1,
            },
            "no_mask_logits_to_keep_1": {"output_hidden_states": True, "logits_to_keep": 1},
        }
        out: dict[str, Any] = {"batch": self.batch, "seq": self.seq, "batches_timed": nb}
        for name, kw in variants.items():
            t = timeit(self.b, lambda kw=kw: run(**kw), nb, 2)
            tok_s = tokens / float(np.median(t))
            out[name] = {"tok_s": round(tok_s), "best_tok_s": round(tokens / min(t)), **stats(t)}
            log(f"forward {name}: {tok_s:,.0f} tok/s (median of {nb})")
        if self.b.cuda:
            out["max_memory_allocated_gib"] = r3(torch.cuda.max_memory_allocated(self.b.dev) / GiB)
        return out

    # ---- the hf engine

    def make_engine(self) -> Any:
        import transformers

        from hsx_workers.engines.base import EngineConfig
        from hsx_workers.engines.hf_engine import HfEngine
        from hsx_workers.engines.hf_settings import HfSettings

        cfg = EngineConfig(
            model="(in-memory random Llama)",
            layers=self.layers,
            num_layers=self.n_layers,
            hidden_size=self.h,
            max_seq_len=self.seq,
            dtype="bfloat16",
            settings=HfSettings(device=str(self.b.dev), batch_tokens=self.batch * self.seq),
        )
        # HfEngine loads with from_pretrained; hand it the model built on the device instead
        # of a 16 GB save + load round trip (--real-load measures that round trip).
        model = self.model
        with mock.patch.object(
            transformers.AutoModelForCausalLM,
            "from_pretrained",
            new=staticmethod(lambda *a, **k: model),
        ):
            return HfEngine(cfg)

    def requests(self, n: int, seed: int) -> list[Any]:
        from hsx_workers.engines.base import CaptureRequest

        rng = np.random.default_rng(seed)
        vocab = self.b.args.sizes["vocab"]
        return [
            CaptureRequest(
                sample_index=seed * 100000 + i, input_ids=rng.integers(0, vocab, self.seq).tolist()
            )
            for i in range(n)
        ]

    def capture_only(self) -> dict[str, Any]:
        self.engine = self.make_engine()
        s = self.b.args.sizes
        nb = s["fwd_batches"]
        warm = self.requests(self.batch, 1)
        reqs = self.requests(self.batch * nb, 2)

        def consume(rs: list[Any]) -> list[float]:
            times = []
            t = time.perf_counter()
            for i, res in enumerate(self.engine.capture(rs)):
                assert res.hidden_states is not None
                assert tuple(res.hidden_states.shape) == (self.seq, len(self.layers), self.h)
                if (i + 1) % self.batch == 0:
                    self.b.sync()
                    times.append(time.perf_counter() - t)
                    t = time.perf_counter()
            return times

        consume(warm)
        t0 = time.perf_counter()
        times = consume(reqs)
        wall = time.perf_counter() - t0
        tokens = len(reqs) * self.seq
        tok_s = tokens / wall
        ceil = self.b.res["ceilings"]
        out = {
            "requests": len(reqs),
            "tokens": tokens,
            "wall_s": r3(wall),
            "tok_s": round(tok_s),
            "per_batch": stats(times),
            "vs_compute_ceiling": r3(tok_s / ceil["compute_tok_s"]),
            "vs_min_ceiling": r3(tok_s / ceil["min_tok_s"]),
        }
        log(
            f"hf engine capture only: {tok_s:,.0f} tok/s = {out['vs_compute_ceiling']} of the "
            f"compute ceiling"
        )
        return out

    # ---- end to end

    def e2e(self, variant: str, writer: str = "current") -> dict[str, Any]:
        if self.engine is None:
            self.engine = self.make_engine()
        s = self.b.args.sizes
        n_units, per_unit = s["e2e_units"], s["unit_samples"]
        root = Path(self.b.args.workdir) / f"e2e-{variant}"
        shutil.rmtree(root, ignore_errors=True)
        units = [self.requests(per_unit, 10 + u) for u in range(n_units)]
        # a small warm-up unit (pinned allocator, writer thread, file system)
        self._e2e_unit(root, 999, self.requests(self.batch, 9), variant, writer)
        shutil.rmtree(root, ignore_errors=True)
        per = []
        t0 = time.perf_counter()
        for u, reqs in enumerate(units):
            per.append(self._e2e_unit(root, u, reqs, variant, writer))
        wall = time.perf_counter() - t0
        tokens = n_units * per_unit * self.seq
        nbytes = sum(p["bytes"] for p in per)
        shutil.rmtree(root, ignore_errors=True)
        tok_s = tokens / wall
        ceil = self.b.res["ceilings"]
        out = {
            "writer": writer,
            "units": n_units,
            "samples_per_unit": per_unit,
            "tokens": tokens,
            "shard_bytes": nbytes,
            "wall_s": r3(wall),
            "tok_s": round(tok_s),
            "gbps": r3(nbytes / wall / GB),
            "add_s": r3(sum(p["add_s"] for p in per)),
            "commit_s": r3(sum(p["commit_s"] for p in per)),
            "vs_min_ceiling": r3(tok_s / ceil["min_tok_s"]),
            "vs_compute_ceiling": r3(tok_s / ceil["compute_tok_s"]),
            "vs_disk_ceiling": r3(tok_s / ceil["disk_tok_s"]),
        }
        log(
            f"e2e {variant} ({writer} writer): {tok_s:,.0f} tok/s, {out['gbps']} GB/s = "
            f"{out['vs_min_ceiling']} of min(compute, disk) "
            f"(add {out['add_s']} s, commit {out['commit_s']} s)"
        )
        return out

    def _e2e_unit(
        self, root: Path, unit: int, reqs: list[Any], variant: str, writer: str
    ) -> dict[str, Any]:
        mask = np.ones(self.seq, np.uint8)
        eng = self.engine
        cuda = self.b.cuda

        def gpu() -> Iterable[tuple[int, Any, Any, Any]]:
            for res in eng.capture(reqs):
                yield res.sample_index, res.input_ids, mask, res.hidden_states

        def pinned_sync() -> Iterable[tuple[int, Any, Any, Any]]:
            for res in eng.capture(reqs):
                hs = res.hidden_states
                host = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=cuda)
                host.copy_(hs, non_blocking=cuda)
                self.b.sync()
                yield res.sample_index, res.input_ids, mask, host

        def pinned_overlap() -> Iterable[tuple[int, Any, Any, Any]]:
            # Copy each sample into pinned memory on the engine's stream as soon as its
            # batch is queued; hand it to the writer only once the NEXT batch's forward is
            # queued, so the write of batch k runs while the GPU computes batch k+1.
            pending: collections.deque[tuple[Any, Any, Any]] = collections.deque()
            for res in eng.capture(reqs):
                hs = res.hidden_states
                host = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=cuda)
                host.copy_(hs, non_blocking=cuda)
                ev = torch.cuda.Event() if cuda else None
                if ev is not None:
                    ev.record()
                pending.append((res, host, ev))
                while len(pending) > self.batch:
                    yield _ready(*pending.popleft(), mask)
            while pending:
                yield _ready(*pending.popleft(), mask)

        gens = {"gpu_tensors": gpu, "pinned_sync": pinned_sync, "pinned_overlap": pinned_overlap}
        return write_unit(root, unit, self.layers, self.h, gens[variant](), writer)

    # ---- the real from_pretrained round trip

    def real_load(self) -> dict[str, Any]:
        from hsx_workers.engines.base import EngineConfig
        from hsx_workers.engines.hf_engine import HfEngine
        from hsx_workers.engines.hf_settings import HfSettings

        path = Path(self.b.args.workdir) / "llama-random"
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        self.model.save_pretrained(path)
        save_s = time.perf_counter() - t
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        # free the in-memory model before loading a second copy
        ref_ids = torch.randint(0, 1000, (1, 64), device=self.b.dev)
        with torch.inference_mode():
            ref = (
                self.model(input_ids=ref_ids, output_hidden_states=True, use_cache=False)
                .hidden_states[2]
                .float()
                .cpu()
            )
        self.engine = None
        self.model = None
        gc.collect()
        if self.b.cuda:
            torch.cuda.empty_cache()
        cfg = EngineConfig(
            model=str(path),
            layers=self.layers,
            num_layers=self.n_layers,
            hidden_size=self.h,
            max_seq_len=self.seq,
            dtype="bfloat16",
            settings=HfSettings(device=str(self.b.dev)),
        )
        t = time.perf_counter()
        eng = HfEngine(cfg)
        self.b.sync()
        load_s = time.perf_counter() - t
        with torch.inference_mode():
            got = (
                eng.model(input_ids=ref_ids, output_hidden_states=True, use_cache=False)
                .hidden_states[2]
                .float()
                .cpu()
            )
        rel = float((got - ref).norm() / ref.norm())
        eng.close()
        shutil.rmtree(path, ignore_errors=True)
        out = {
            "bytes": size,
            "save_pretrained_s": r3(save_s),
            "save_gbps": r3(size / save_s / GB),
            "hf_engine_load_s": r3(load_s),
            "load_gbps": r3(size / load_s / GB),
            "reloaded_rel_err_layer2": r3(rel),
        }
        log(json.dumps(out))
        return out


def _ready(res: Any, host: Any, ev: Any, mask: Any) -> tuple[int, Any, Any, Any]:
    if ev is not None:
        ev.synchronize()
    return res.sample_index, res.input_ids, mask, host


# --------------------------------------------------------------------------- main


FULL = {
    "hidden": 4096,
    "intermediate": 14336,
    "layers": 32,
    "heads": 32,
    "kv_heads": 8,
    "vocab": 128256,
    "batch": 8,
    "seq": 2048,
    "mm": 8192,
    "fwd_batches": 6,
    "host_buf": 512 * MiB,
    "disk_bytes": 4 * GiB,
    "disk_reps": 2,
    "d2h_pinned": 1 * GiB,
    "d2h_pageable": 256 * MiB,
    "cache_blocks": 8192,
    "conn_requests": 32,
    "conn_mm_per_step": 4,
    "unit_samples": 32,
    "e2e_units": 3,
    "sw_reps": 2,
}
QUICK = {
    "hidden": 256,
    "intermediate": 512,
    "layers": 8,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 1024,
    "batch": 2,
    "seq": 64,
    "mm": 256,
    "fwd_batches": 2,
    "host_buf": 8 * MiB,
    "disk_bytes": 16 * MiB,
    "disk_reps": 2,
    "d2h_pinned": 8 * MiB,
    "d2h_pageable": 4 * MiB,
    "cache_blocks": 64,
    "conn_requests": 4,
    "conn_mm_per_step": 2,
    "unit_samples": 4,
    "e2e_units": 2,
    "sw_reps": 1,
}


def summary(res: dict[str, Any]) -> list[str]:
    lines = []
    c = res.get("ceilings", {})
    if c:
        lines.append(
            f"ceilings: compute {c['compute_tok_s']:,} tok/s ({c['matmul_tflops']} "
            f"TFLOP/s), disk {c['disk_tok_s']:,} tok/s ({c['disk_gbps']} GB/s), "
            f"min {c['min_tok_s']:,} ({c['bound_by']})"
        )
    d = res.get("d2h", {})
    if "pinned" in d:
        lines.append(
            f"D2H: pinned {d['pinned']['gbps']} GB/s, pageable .cpu() "
            f"{d['pageable_dot_cpu']['gbps']} GB/s, pageable preallocated "
            f"{d['pageable_preallocated']['gbps']} GB/s"
        )
    h = res.get("host", {})
    if h:
        lines.append(f"host: sha256 {h['sha256_gbps']} GB/s, memcpy {h['numpy_copyto_gbps']} GB/s")
    f = res.get("forward", {})
    for k in ("hf_engine_call", "logits_to_keep_1", "no_mask_logits_to_keep_1"):
        if k in f:
            lines.append(f"forward {k}: {f[k]['tok_s']:,} tok/s")
    if "hf_capture_only" in res:
        r = res["hf_capture_only"]
        lines.append(
            f"hf capture only: {r['tok_s']:,} tok/s = {r['vs_compute_ceiling']} of compute ceiling"
        )
    for key, r in res.items():
        if key.startswith("e2e_") and isinstance(r, dict):
            lines.append(
                f"{key}: {r['tok_s']:,} tok/s, {r['gbps']} GB/s = "
                f"{r['vs_min_ceiling']} of min ceiling"
            )
    for sec in ("shardwriter", "shardwriter_fixes"):
        for k, v in res.get(sec, {}).items():
            if isinstance(v, dict) and "gbps" in v:
                lines.append(f"{sec} {k}: {v['gbps']} GB/s")
    cn = res.get("connector", {})
    if "gather_d2h" in cn:
        lines.append(
            f"connector gather+D2H: {cn['gather_d2h']['gbps']} GB/s "
            f"(match={cn.get('matches_device_gather')})"
        )
    if "overlap" in cn:
        lines.append(f"matmul slowdown with concurrent copies: {cn['overlap']['slowdown']}")
    return lines


BASELINE = (
    "env,matmul,host,d2h,disk,connector,shardwriter,forward,hf_capture_only,"
    "e2e_gpu_tensors,e2e_pinned_overlap,e2e_pinned_sync"
)
FIXES = (
    "env,matmul,host,d2h,disk,shardwriter_fixes,hf_capture_only,"
    "e2e_gpu_tensors,e2e_gpu_tensors+fixed,e2e_pinned_overlap+fast_stream"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU check of the script)")
    p.add_argument("--out", default=str(campaign_path("gpu-capture-path", "gpu.json")))
    p.add_argument("--workdir", default="/tmp/hsx-bench", help="on the disk to measure")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip later phases when this wall time would be exceeded",
    )
    p.add_argument(
        "--phases",
        default=BASELINE,
        help="comma list; 'baseline' (default) or 'fixes' name the two sets; e2e_<variant>"
        "[+<writer>] with variant in gpu_tensors/pinned_sync/pinned_overlap and writer in "
        f"{'/'.join(WRITERS)}",
    )
    p.add_argument(
        "--real-load",
        action="store_true",
        help="also time save_pretrained + HfEngine's from_pretrained (16 GB)",
    )
    args = p.parse_args(argv)
    args.sizes = dict(QUICK if args.quick else FULL)
    phases = {"baseline": BASELINE, "fixes": FIXES}.get(args.phases, args.phases).split(",")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    b = Bench(args)
    b.res["sizes"] = args.sizes
    b.res["phases"] = phases
    torch.manual_seed(0)
    if b.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False

    simple: dict[str, tuple[Callable[[], Any], float]] = {
        "env": (lambda: bench_env(b), 0),
        "matmul": (lambda: bench_matmul(b), 0),
        "host": (lambda: bench_host(b), 0),
        "d2h": (lambda: bench_d2h(b), 0),
        "disk": (lambda: bench_disk(b), 0),
        "connector": (lambda: bench_connector(b), 20),
        "shardwriter": (lambda: bench_shardwriter(b, CASES_CURRENT), 40),
        "shardwriter_fixes": (lambda: bench_shardwriter(b, CASES_FIXES), 40),
    }
    for name in phases:
        if name in simple:
            fn, need = simple[name]
            b.phase(name, fn, need)
    model_phases = [x for x in phases if x not in simple]
    if model_phases or args.real_load:
        mp = ModelPhases(b)
        b.phase("model", mp.build, 60)
        if mp.model is not None:
            b.phase("ceilings", mp.ceilings)
            for name in model_phases:
                if name == "forward":
                    b.phase(name, mp.forward, 30)
                elif name == "hf_capture_only":
                    b.phase(name, mp.capture_only, 20)
                elif name.startswith("e2e_"):
                    variant, _, writer = name[4:].partition("+")
                    b.phase(name, lambda v=variant, w=writer or "current": mp.e2e(v, w), 30)
                else:
                    raise SystemExit(f"unknown phase {name!r}")
            if args.real_load:
                b.phase("real_load", mp.real_load, 120)
    b.res["summary"] = summary(b.res)
    b.save()
    shutil.rmtree(args.workdir, ignore_errors=True)
    print("\n".join(["", "SUMMARY", *b.res["summary"]]))
    print(
        f"errors: {b.res['errors'] or 'none'}; skipped: {b.res['phases_skipped'] or 'none'}; "
        f"elapsed {b.elapsed():.0f} s"
    )
    return 1 if b.res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
