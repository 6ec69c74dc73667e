"""Reader: HiddenStatesDataset iterating every sample against a raw sequential file read.

An hsx output of a few shards (samples of [T, 4, 4096] bf16, written by ShardWriter) is
read whole, alternating:

- `hsx-numpy` / `hsx-torch`  a fresh `HiddenStatesDataset(root, backend=...)` (so every
  shard is mapped anew, as in a new training process), `for sample in ds:`, and the
  per-byte work on `sample["hidden_states"]`.
- `raw-numpy` / `raw-torch`  the same bytes with `readinto` (unbuffered) from each shard
  file, one sample's bytes at a time, into a preallocated staging buffer, then the same
  per-byte work on that buffer. These are the baselines the targets are set against.
- `mmap-numpy` (report only)  the same bytes through a bare `mmap` of each file and
  `np.frombuffer` slices: what any memory-mapping reader could do, so `hsx/mmap` is the
  cost of hsx's own machinery (commit records, readers, per-sample dicts).

Per-byte work (the same on both sides): copy the sample's hidden states into one
preallocated destination buffer — `np.copyto` for numpy, `Tensor.copy_` for torch —
as a trainer's collate or host-to-device staging does. It touches every byte and is
not compute bound.

Warm (the targets): every shard is read once before timing and the output is far
smaller than memory, so all sides read from the page cache; this measures the reader's
overhead (mapping, page faults, per-sample objects), not the disk. Cold (report only):
before each measurement the shards' pages are dropped from the page cache with
`posix_fadvise(DONTNEED)` (only these files; nothing else on the machine is touched),
so the bytes come from the disk. GB/s = hidden-state bytes / seconds.

Run: `python -m benchmarks.bench_reader [--quick]` (or through run_all.py).
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.bench_writer import HIDDEN, LAYERS, make_samples

TARGET = 0.8
WARM_VARIANTS = ("hsx-numpy", "raw-numpy", "hsx-torch", "raw-torch", "mmap-numpy")
COLD_VARIANTS = ("hsx-numpy", "raw-numpy", "mmap-numpy")
PAIRS = {"hsx-numpy/raw-numpy": True, "hsx-torch/raw-torch": True,
         "hsx-numpy/mmap-numpy": False, "mmap-numpy/raw-numpy": False}  # name -> has a target


def build_output(root: Path, total_bytes: int, shards: int) -> list[dict[str, Any]]:
    """An hsx output of `shards` committed shards; returns their commit records."""
    from tests.unit.outputs import make_manifest, write_manifest

    from hsx.output import Output, ShardWriter

    root.mkdir(parents=True)
    units = []
    index = 0
    for unit in range(shards):
        samples = make_samples(total_bytes // shards, seed=unit)
        with ShardWriter(root, unit, layers=LAYERS, hidden_size=HIDDEN,
                         storage_dtype="bf16") as writer:
            for ids, mask, hs in samples:
                writer.add(index, ids, mask, hs)
                index += 1
            writer.commit()
        units.append((index - len(samples), index))
    write_manifest(root, make_manifest(layers=LAYERS, hidden_size=HIDDEN, num_layers=32,
                                       units=units))
    return Output(root).commits()


class Layout:
    """Where each sample's hidden-state bytes lie in each shard (read before timing)."""

    def __init__(self, root: Path) -> None:
        from hsx.output import Output, ShardReader

        self.files: list[tuple[Path, int, list[int]]] = []
        for record in Output(root).commits():
            path = root / record.shard
            with ShardReader(path, record=record) as reader:
                info = reader._tensors["hidden_states"]
                start = reader._data_start + info["data_offsets"][0]
                per_token = len(reader.layers) * reader.hidden_size * 2
                sizes = [int(b - a) * per_token
                         for a, b in zip(reader.offsets[:-1], reader.offsets[1:], strict=True)]
            self.files.append((path, start, sizes))
        self.total = sum(sum(s) for _, _, s in self.files)
        self.largest = max(max(s) for _, _, s in self.files)


def read_hsx_numpy(root: Path, dst: np.ndarray) -> int:
    from hsx.dataset import HiddenStatesDataset

    n = 0
    for sample in HiddenStatesDataset(root, backend="numpy"):
        hs = sample["hidden_states"].reshape(-1).view(np.uint16)
        np.copyto(dst[: hs.size], hs)
        n += hs.nbytes
    return n


def read_hsx_torch(root: Path, dst: Any) -> int:
    from hsx.dataset import HiddenStatesDataset

    n = 0
    for sample in HiddenStatesDataset(root, backend="torch"):
        hs = sample["hidden_states"].reshape(-1)
        dst[: hs.numel()].copy_(hs)
        n += hs.numel() * 2
    return n


def read_mmap(layout: Layout, dst: np.ndarray) -> int:
    """Bare mmap of each shard, numpy slices per sample, the same copy as hsx-numpy."""
    n = 0
    for path, start, sizes in layout.files:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(mm, dtype=np.uint16, count=sum(sizes) // 2, offset=start)
        pos = 0
        for size in sizes:
            k = size // 2
            np.copyto(dst[:k], data[pos : pos + k])
            pos += k
            n += size
        del data
        mm.close()
    return n


def drop_cache(layout: Layout) -> None:
    """Evict these shards' pages from the page cache (they are clean: fsynced at commit)."""
    for path, _, _ in layout.files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_raw(layout: Layout, staging: memoryview, work: Any) -> int:
    """readinto() each sample's bytes, then `work(nbytes)` on the staging buffer."""
    n = 0
    for path, start, sizes in layout.files:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            for size in sizes:
                got = 0
                while got < size:
                    k = f.readinto(staging[got:size])
                    if not k:
                        raise RuntimeError(f"{path} ended early")
                    got += k
                work(size)
                n += size
    return n


def measure(variants: tuple[str, ...], readers: dict[str, Any], layout: Layout, reps: int,
            cold: bool) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(reps):
        for order, variant in enumerate(common.alternating(variants, rep)):
            if cold:
                drop_cache(layout)
            seconds, cpu, nbytes = common.timed(readers[variant])
            if nbytes != layout.total:
                raise RuntimeError(f"{variant} read {nbytes} bytes, expected {layout.total}")
            runs[variant].append({"rep": rep, "order": order, "seconds": seconds,
                                  "cpu_s": cpu, "bytes": nbytes,
                                  "gb_per_s": nbytes / seconds / 1e9})
            print(f"  {'cold' if cold else 'warm'} rep {rep} {variant:10s} "
                  f"{nbytes / seconds / 1e9:6.2f} GB/s", flush=True)
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], targets: bool) -> dict[str, Any]:
    med = {v: common.median([r["gb_per_s"] for r in rs]) for v, rs in runs.items()}
    ratios: dict[str, Any] = {}
    for name, has_target in PAIRS.items():
        a, b = name.split("/")
        if a not in runs or b not in runs:
            continue
        ratios[name] = common.compare(runs[a], runs[b], "gb_per_s",
                                      TARGET if targets and has_target else None)
    return {"gb_per_s_median": med, "ratios": ratios, "runs": runs}


def resummarize(path: Path) -> None:
    """Recompute a results file's reader ratios from its raw runs; print the tables."""
    data = common.load_results(path)
    section = data["benchmarks"]["reader"]
    for cache in ("warm", "cold"):
        section[cache] = summarize(section[cache]["runs"], targets=cache == "warm")
    machine = section.pop("machine")
    common.save_section(path, "reader", section, machine)
    print_table(section)


def run(*, quick: bool, out: Path, size_mib: int | None = None, reps: int | None = None,
        workdir: Path | None = None, note: str | None = None) -> dict[str, Any]:
    import torch

    size = (size_mib or (256 if quick else 1024)) * common.MiB
    shards = 2 if quick else 4
    reps = reps or (3 if quick else 5)
    base = workdir or Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-reader-", dir=base))
    root = work / "output"
    machine = common.machine_info()
    print(f"reader: {size / common.MiB:.0f} MiB in {shards} shards, {reps} reps, in {work}",
          flush=True)
    try:
        build_output(root, size, shards)
        layout = Layout(root)
        staging_buf = bytearray(layout.largest)
        staging = memoryview(staging_buf)
        staging_u16 = np.frombuffer(staging_buf, dtype=np.uint16)
        staging_t = torch.frombuffer(staging_buf, dtype=torch.bfloat16)
        dst_np = np.zeros(layout.largest // 2, np.uint16)
        dst_t = torch.zeros(layout.largest // 2, dtype=torch.bfloat16)

        def np_work(nbytes: int) -> None:
            np.copyto(dst_np[: nbytes // 2], staging_u16[: nbytes // 2])

        def torch_work(nbytes: int) -> None:
            dst_t[: nbytes // 2].copy_(staging_t[: nbytes // 2])

        readers = {
            "hsx-numpy": lambda: read_hsx_numpy(root, dst_np),
            "hsx-torch": lambda: read_hsx_torch(root, dst_t),
            "raw-numpy": lambda: read_raw(layout, staging, np_work),
            "raw-torch": lambda: read_raw(layout, staging, torch_work),
            "mmap-numpy": lambda: read_mmap(layout, dst_np),
        }
        # Warm the page cache: read every shard once.
        for path, _, _ in layout.files:
            with open(path, "rb", buffering=0) as f:
                while f.read(64 * common.MiB):
                    pass
        warm = measure(WARM_VARIANTS, readers, layout, reps, cold=False)
        cold = measure(COLD_VARIANTS, readers, layout, reps, cold=True)
        samples = sum(len(s) for _, _, s in layout.files)
        torch_threads = torch.get_num_threads()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "date": common.now_iso(), "quick": quick, "reps": reps, "note": note,
        "bytes": size, "shards": shards, "samples": samples,
        "sample_shape": f"[T in 256..2048, {len(LAYERS)}, {HIDDEN}] bf16",
        "per_byte_work": "copy into a preallocated buffer (np.copyto / Tensor.copy_)",
        "torch_threads": torch_threads, "dir": common.filesystem_of(work.parent),
        "warm": summarize(warm, targets=True),
        "cold": summarize(cold, targets=False),
    }
    machine["loadavg_at_end"] = list(os.getloadavg())
    common.save_section(out, "reader", result, machine)
    print_table(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\nreader: {result['bytes'] / common.MiB:.0f} MiB in {result['shards']} shards, "
          f"{result['samples']} samples {result['sample_shape']}, {result['reps']} reps; "
          f"per-byte work: {result['per_byte_work']}")
    for cache in ("warm", "cold"):
        part = result[cache]
        rows = []
        for v, runs in part["runs"].items():
            g = [r["gb_per_s"] for r in runs]
            cpu = common.median([r["cpu_s"] / (r["bytes"] / 1e9) for r in runs])
            rows.append([f"{v} ({cache})", part["gb_per_s_median"][v], min(g), max(g), cpu])
        print(common.table(["variant", "median GB/s", "min", "max", "CPU s/GB"], rows))
        rows = [common.ratio_row(f"{name} ({cache})", e) for name, e in part["ratios"].items()]
        print(common.table(common.RATIO_HEADERS, rows))


def main(argv: list[str] | None = None) -> int:
    return common.size_bench_main(
        argv, __doc__ or "", run,
        quick_help="256 MiB in 2 shards, 3 reps",
        size_help="output size (default 1024 MiB)")


if __name__ == "__main__":
    sys.exit(main())
