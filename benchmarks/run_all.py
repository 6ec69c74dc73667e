"""Run every ratio benchmark, each in its own process, then print a summary of the verdicts.

From the repository's root (benchmarks/ is a package: each script imports its helpers
and the tests' fixtures, `tests.unit.outputs`, as modules, with no `sys.path` edits):

    python -m benchmarks.run_all            # full run -> results/<date>-cpu/cpu.json
    python -m benchmarks.run_all --quick    # smoke run -> results/<date>-cpu/cpu-quick.json
    python -m benchmarks.run_all --only writer reader

Targets are reported as PASS/MISS, never asserted: the exit status is 0 unless a
benchmark itself failed to run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

# name -> script; run in this order (the cheap, I/O-only ones first).
BENCHMARKS = {
    "writer": "bench_writer.py",
    "reader": "bench_reader.py",
    "connector": "bench_connector.py",
    "pipeline": "bench_pipeline.py",
    "api": "bench_api.py",  # coordinator under polling load (run if present)
}
SECTIONS = {"writer": "writer", "reader": "reader", "connector": "connector",
            "pipeline": "pipeline", "api": "api_polling"}


def summary_rows(results: dict[str, Any], names: list[str]) -> list[list[Any]]:
    """One row per ratio, from the sections of the benchmarks named."""
    rows: list[list[Any]] = []
    benchmarks = results.get("benchmarks", {})
    for name in names:
        section = benchmarks.get(SECTIONS[name])
        if not section:
            continue
        if name == "pipeline":
            for model, m in section.get("models", {}).items():
                rows += [[f"pipeline/{model}", *common.ratio_row(r, e)]
                         for r, e in m["ratios"].items()]
        elif name == "reader":
            for cache in ("warm", "cold"):
                rows += [[f"reader ({cache})", *common.ratio_row(r, e)]
                         for r, e in section.get(cache, {}).get("ratios", {}).items()]
        elif name in ("writer", "connector"):
            rows += [[name, *common.ratio_row(r, e)] for r, e in section["ratios"].items()]
        else:
            rows += [[name, what, "-", "-", "-", "-", v]
                     for what, v in section.get("verdicts", {}).items()]
    return rows


def resummarize(out: Path, names: list[str]) -> None:
    """Recompute ratios of the results file from its raw runs (no benchmark is run)."""
    from benchmarks import bench_pipeline, bench_reader, bench_writer

    sections = common.load_results(out).get("benchmarks", {})
    modules: dict[str, Any] = {"writer": bench_writer, "reader": bench_reader,
                               "pipeline": bench_pipeline}
    for name in names:
        if name in modules and SECTIONS[name] in sections:
            modules[name].resummarize(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    p.add_argument("--out", type=Path,
                   help="results JSON (default results/<date>-cpu/cpu[-quick].json)")
    p.add_argument("--note", help="free text stored with the results (e.g. 'shared machine')")
    p.add_argument("--resummarize", action="store_true",
                   help="recompute the ratios of --out from its raw runs; run nothing")
    args = p.parse_args(argv)
    out = (args.out or common.campaign_path("cpu", "cpu-quick.json" if args.quick else "cpu.json"))
    names = args.only or list(BENCHMARKS)
    if args.resummarize:
        resummarize(out, names)
        print(f"\nsummary ({out}):")
        print(common.table(["benchmark", *common.RATIO_HEADERS],
                           summary_rows(common.load_results(out), names)))
        return 0
    failed: list[str] = []
    ran: list[str] = []
    for name in names:
        script = common.BENCH_DIR / BENCHMARKS[name]
        if not script.exists():
            print(f"== {name}: {script.name} not found, skipped", flush=True)
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{script.stem}", "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        if args.note and name != "api":
            cmd += ["--note", args.note]
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        rc = subprocess.call(cmd, cwd=common.REPO)
        print(f"== {name}: exit {rc} after {time.monotonic() - start:.0f} s", flush=True)
        ran.append(name)
        if rc != 0:
            failed.append(name)

    rows = summary_rows(common.load_results(out), [n for n in ran if n not in failed])
    print(f"\nsummary ({out}):")
    print(common.table(["benchmark", *common.RATIO_HEADERS], rows))
    if failed:
        print(f"benchmarks that failed to run: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
