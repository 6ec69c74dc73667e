"""Writer: ShardWriter (stream + sha256 + fsync + commit) against a raw fsynced write.

One shard of realistic size — samples of [T, 4, 4096] bf16 (32 KiB per token), T drawn
from 256..2048 — written two or three ways into the same directory, alternating:

- `hsx-torch`  ShardWriter.add() with CPU torch bf16 tensors (what the extraction worker
               hands it), then commit(): header, fsync, rename into shards/, commit
               record created with link(), directory fsyncs.
- `hsx-numpy`  the same with numpy (ml_dtypes.bfloat16) arrays, which add() copies (the
               caller may reuse them).
- `hsx-spool`  numpy arrays handed over (`add(..., take=True)`): what the vLLM engine's
               worker does with the states it maps from its spool; no copy. Each starts
               on a page, as hidden_states do in a spool file's mapping (spool.py).
- `hsx-direct` `hsx-spool` with direct I/O (HSX_DIRECT_IO=1): the disk reads the
               states from memory; no copy into the page cache.
- `raw`        the same hidden-state bytes with plain `f.write` of each sample's buffer
               into a new file, then `os.fsync` — what a plain writer gets.
- `raw-direct` the page-aligned buffers written with O_DIRECT (no page cache: the disk
               reads them from memory), then `os.fsync` — what the disk can do (report).

Each repetition writes a new file and deletes it afterwards (not timed); fsync makes
the page cache irrelevant to the result. GB/s = bytes of the file / seconds.

Run: `python -m benchmarks.bench_writer [--quick]` (or through run_all.py).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from benchmarks import common

LAYERS = [2, 16, 29, 32]
HIDDEN = 4096
TARGET = 0.9
VARIANTS = ("hsx-torch", "hsx-numpy", "hsx-spool", "hsx-direct", "raw", "raw-direct")

Sample = tuple[np.ndarray, np.ndarray, Any]


def make_samples(total_bytes: int, *, seed: int = 0) -> list[Sample]:
    """(input_ids, loss_mask, hidden_states) until the hidden states reach total_bytes."""
    rng = np.random.default_rng(seed)
    per_token = len(LAYERS) * HIDDEN * 2
    samples: list[Sample] = []
    size = 0
    while size < total_bytes:
        t = int(rng.integers(256, 2049))
        t = min(t, max(1, (total_bytes - size) // per_token))
        hs = rng.standard_normal((t, len(LAYERS), HIDDEN), dtype=np.float32)
        hs_bf16 = hs.astype(ml_dtypes.bfloat16)
        ids = rng.integers(0, 128000, t, dtype=np.int32)
        mask = (rng.random(t) < 0.5).astype(np.uint8)
        samples.append((ids, mask, hs_bf16))
        size += hs_bf16.nbytes
    return samples


def page_aligned(samples: list[Sample]) -> list[Sample]:
    """The same samples with hidden states copied into page-aligned memory, as they lie
    in a spool file's mapping."""
    out = []
    for ids, mask, hs in samples:
        block = np.empty(hs.nbytes + 4096, np.uint8)
        skip = -int(block.ctypes.data) % 4096
        aligned = block[skip : skip + hs.nbytes].view(hs.dtype).reshape(hs.shape)
        aligned[...] = hs
        out.append((ids, mask, aligned))
    return out


def as_torch(samples: list[Sample]) -> list[Sample]:
    """The same samples with hidden states as CPU torch bf16 tensors sharing the memory."""
    import torch

    return [(ids, mask, torch.from_numpy(hs.view(np.int16)).view(torch.bfloat16))
            for ids, mask, hs in samples]


def write_hsx(root: Path, samples: list[Sample], take: bool = False,
              direct: bool = False) -> dict[str, Any]:
    """One shard through ShardWriter; seconds in all, and until the last add() returned.
    `take`: the samples are handed over (nobody writes into them afterwards); `direct`:
    with direct I/O."""
    from hsx.output import ShardWriter

    os.environ["HSX_DIRECT_IO"] = "1" if direct else "0"  # read when the storage is made
    start = time.perf_counter()
    writer = ShardWriter(root, 0, layers=LAYERS, hidden_size=HIDDEN, storage_dtype="bf16")
    for i, (ids, mask, hs) in enumerate(samples):
        writer.add(i, ids, mask, hs, take=take)
    added = time.perf_counter()
    result = writer.commit()
    end = time.perf_counter()
    if not result.won:
        raise RuntimeError("commit lost: the output directory was not fresh")
    return {"seconds": end - start, "bytes": result.record.bytes,
            "add_s": added - start, "commit_s": end - added}


def write_raw(path: Path, samples: list[Sample]) -> dict[str, Any]:
    """The same hidden-state bytes with f.write per sample, then fsync."""
    bufs = [np.asarray(hs).reshape(-1).view(np.uint8) for _, _, hs in samples]
    start = time.perf_counter()
    with open(path, "xb") as f:
        for buf in bufs:
            f.write(buf.data)
        f.flush()
        written = time.perf_counter()
        os.fsync(f.fileno())
        size = f.tell()
    end = time.perf_counter()
    return {"seconds": end - start, "bytes": size, "write_s": written - start,
            "fsync_s": end - written}


def write_raw_direct(path: Path, samples: list[Sample]) -> dict[str, Any]:
    """The same bytes (page-aligned buffers) written with O_DIRECT, then fsync."""
    bufs = [np.asarray(hs).reshape(-1).view(np.uint8) for _, _, hs in samples]
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        offset = 0
        for buf in bufs:
            view = memoryview(buf)
            while view.nbytes:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        written = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    end = time.perf_counter()
    return {"seconds": end - start, "bytes": offset, "write_s": written - start,
            "fsync_s": end - written}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, float], dict[str, Any]]:
    med = {v: common.median([r["gb_per_s"] for r in rs]) for v, rs in runs.items()}
    ratios = {f"{v}/raw": common.compare(runs[v], runs["raw"], "gb_per_s", TARGET)
              for v in ("hsx-torch", "hsx-numpy", "hsx-spool") if v in runs}
    if runs.get("raw-direct") and runs.get("hsx-direct"):
        ratios["hsx-direct/raw"] = common.compare(runs["hsx-direct"], runs["raw"], "gb_per_s")
        ratios["hsx-direct/raw-direct"] = common.compare(
            runs["hsx-direct"], runs["raw-direct"], "gb_per_s")
    return med, ratios


def resummarize(path: Path) -> None:
    """Recompute a results file's writer ratios from its raw runs; print the table."""
    data = common.load_results(path)
    section = data["benchmarks"]["writer"]
    section["gb_per_s_median"], section["ratios"] = summarize(section["runs"])
    machine = section.pop("machine")
    common.save_section(path, "writer", section, machine)
    print_table(section)


def run(*, quick: bool, out: Path, size_mib: int | None = None, reps: int | None = None,
        workdir: Path | None = None, note: str | None = None) -> dict[str, Any]:
    size = (size_mib or (128 if quick else 768)) * common.MiB
    reps = reps or (3 if quick else 5)
    base = workdir or Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-writer-", dir=base))
    machine = common.machine_info()
    print(f"writer: {size / common.MiB:.0f} MiB per shard, {reps} reps, in {work}", flush=True)
    samples = make_samples(size)
    aligned = page_aligned(samples)
    inputs = {"hsx-torch": as_torch(samples), "hsx-numpy": samples,
              "hsx-spool": aligned, "hsx-direct": aligned, "raw": samples,
              "raw-direct": aligned}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        for rep in range(reps):
            for order, variant in enumerate(common.alternating(VARIANTS, rep)):
                target = work / f"{variant}-{rep}"
                if variant == "raw":
                    write = write_raw
                elif variant == "raw-direct":
                    write = write_raw_direct
                else:
                    write = functools.partial(
                        write_hsx, take=variant in ("hsx-spool", "hsx-direct"),
                        direct=variant == "hsx-direct")
                _, cpu, res = common.timed(lambda: write(target, inputs[variant]))  # noqa: B023
                seconds, nbytes = res["seconds"], res["bytes"]
                runs[variant].append({"rep": rep, "order": order, **res, "cpu_s": cpu,
                                      "gb_per_s": nbytes / seconds / 1e9})
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink()
                common.fsync_dir(work)
                print(f"  rep {rep} {variant:9s} {nbytes / seconds / 1e9:6.3f} GB/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med, ratios = summarize(runs)
    result = {
        "date": common.now_iso(), "quick": quick, "reps": reps, "note": note,
        "shard_bytes": size, "samples": len(inputs["raw"]),
        "sample_shape": f"[T in 256..2048, {len(LAYERS)}, {HIDDEN}] bf16",
        "dir": common.filesystem_of(work.parent), "repo_fs": common.filesystem_of(common.REPO),
        "gb_per_s_median": med, "ratios": ratios, "runs": runs,
    }
    machine["loadavg_at_end"] = list(os.getloadavg())
    common.save_section(out, "writer", result, machine)
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    same = result["dir"]["st_dev"] == result["repo_fs"]["st_dev"]
    print(f"\nwriter: {result['shard_bytes'] / common.MiB:.0f} MiB shard, {result['samples']} "
          f"samples {result['sample_shape']}, {result['reps']} reps, in "
          f"{result['dir']['path']} ({result['dir'].get('source', '?')}, "
          f"{'same' if same else 'NOT the same'} file system as the repo)")
    rows = []
    for v, runs in result["runs"].items():
        g = [r["gb_per_s"] for r in runs]
        cpu = common.median([r["cpu_s"] / (r["bytes"] / 1e9) for r in runs])
        rows.append([v, result["gb_per_s_median"][v], min(g), max(g), cpu])
    print(common.table(["variant", "median GB/s", "min", "max", "CPU s/GB"], rows))
    rows = [common.ratio_row(name, e) for name, e in result["ratios"].items()]
    print(common.table(common.RATIO_HEADERS, rows))


def main(argv: list[str] | None = None) -> int:
    return common.size_bench_main(
        argv, __doc__ or "", run,
        quick_help="128 MiB shard, 3 reps",
        size_help="shard size (default 768 MiB)")


if __name__ == "__main__":
    sys.exit(main())
