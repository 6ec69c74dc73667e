"""Ingestion: tokenizing a chat dataset on 2 processes against 1, and memory against size.

A chat dataset made with the generator the tests use (`make_chat_dataset`: OpenAI-style
conversations, one bad row per thousand), tokenized with the tiny tokenizer's chat
template into an output's inputs and errors tables, the way a job's preparation
does (`hsx.ingest.ingest`). Each measurement runs in a fresh process:

- `1 worker`   the sequential path: every row tokenized in the process that ingests
               (tokenizers' Rust encode spreads over every core).
- `1 worker, one core`  the same with tokenizers' threads off (TOKENIZERS_PARALLELISM=
               false): one process on one core, as each pool process runs.
- `2 workers`  the dataset read as slices (byte ranges of the JSONL), tokenized by a pool
               of 2 processes, written back in order by the ingesting process.

Ratios: rows/s of 2 workers ÷ 1 worker (target ≥ 1.7 on 2 cores), and ÷ 1 worker on one
core (how the pool scales with processes), all alternating, on the `--rows` dataset.
The wall time counts everything `ingest` does: the tokenizer's load, the pool's start
(its processes fork from a server that imports transformers once), the tables written.
Every run's tables are checked to be byte-identical. CPU seconds of the ingesting
process and of the pool's processes are recorded with each run.

Memory: peak resident memory of the ingesting process (the coordinator's share) and of
the largest pool process, with the workers, on `--small` rows and on `--rows` rows: flat
in the row count means large ÷ small within 1.10.

Run: `python -m benchmarks.bench_ingest [--quick] [--rows N] [--small N] [--reps N] [--profile]`
(results in `results/<date>-ingest/ingest.json`; not part of `run_all.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common

SPEEDUP_TARGET = 1.7
# The sequential path with tokenizers' threads off: one process on one core, as each of
# the pool's processes runs. The pool's scaling is measured against it; the target
# against the sequential path as it runs by default (its encode on every core).
ONE_CORE = "1 worker, one core"
MEMORY_TARGET = 1.10


class Descendants:
    """Polls /proc for this process's descendants (the pool's processes are the fork
    server's children, which getrusage does not count): the largest peak resident
    memory (VmHWM) among them and their CPU seconds, as last seen (0.2 s apart)."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self.cpu_ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Descendants:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_ticks.values()) / os.sysconf("SC_CLK_TCK")

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            parents: dict[int, int] = {}
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    with contextlib.suppress(OSError, IndexError, ValueError):
                        stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                        parents[int(entry.name)] = int(stat[1])
                        if self._below(int(entry.name), parents):
                            self.cpu_ticks[int(entry.name)] = int(stat[11]) + int(stat[12])
                            for line in (entry / "status").read_text().splitlines():
                                if line.startswith("VmHWM:"):
                                    self.peak_kib = max(self.peak_kib, int(line.split()[1]))

    @staticmethod
    def _below(pid: int, parents: dict[int, int]) -> bool:
        me = os.getpid()
        for _ in range(8):
            pid = parents.get(pid, 0)
            if pid == me:
                return True
            if pid <= 1:
                return False
        return False


def child(data: str, tokenizer: str, out: str, workers: int) -> dict[str, Any]:
    """One ingestion in this (fresh) process: what the parent records."""
    from hsx.ingest import ingest

    start = time.perf_counter()
    own = resource.getrusage(resource.RUSAGE_SELF)
    with Descendants() as pool:
        result = ingest(data, tokenizer, 2048, out, workers=workers)
    seconds = time.perf_counter() - start
    own_end = resource.getrusage(resource.RUSAGE_SELF)
    digest = hashlib.sha256()
    for path in sorted([*Path(out).glob("inputs/*.arrow"), *Path(out).glob("errors/*.arrow")]):
        digest.update(path.read_bytes())  # the tables' parts (their records name slices)
    return {
        "workers": workers,
        "rows": result.num_rows,
        "samples": result.num_samples,
        "errors": result.num_errors,
        "tokens": result.num_tokens,
        "seconds": seconds,
        "rows_per_s": result.num_rows / seconds,
        "tables_sha256": digest.hexdigest(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB
        # The largest of the pool's processes (the fork server included: it holds the
        # imports that they share).
        "peak_rss_worker_mib": pool.peak_kib / 1024,
        # CPU seconds of the ingesting process (its tokenizers' threads included) and of
        # the pool's processes together: which side bounds it.
        "cpu_s": round(own_end.ru_utime + own_end.ru_stime - own.ru_utime - own.ru_stime, 2),
        "pool_cpu_s": round(pool.cpu_s, 2),
    }


def measure(data: Path, tokenizer: Path, scratch: Path, workers: int,
            profile: Path | None = None, one_core: bool = False) -> dict[str, Any]:
    """One ingestion in a fresh process; with `profile`, under py-spy (every process of
    the tree, collapsed stacks written there; not a timed run)."""
    out = Path(tempfile.mkdtemp(dir=scratch, prefix=f"out-{workers}-"))
    command = [sys.executable, "-m", __spec__.name, "--child", str(data), str(tokenizer), str(out),
               str(workers)]
    if profile is not None:
        command = ["py-spy", "record", "--subprocesses", "--format", "raw", "--rate", "50",
                   "--output", str(profile), "--", *command]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"} if one_core else None
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"ingestion with {workers} workers failed:\n{proc.stderr[-3000:]}")
    subprocess.run(["rm", "-rf", str(out)], check=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]  # not py-spy's
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def run(*, rows: int, small: int, reps: int, workers: int, out: Path, workdir: Path | None,
        note: str | None, profile: bool = False) -> dict[str, Any]:
    from hsx_workers.tiny_models import build_tokenizer, make_chat_dataset

    machine = common.machine_info()
    scratch = Path(tempfile.mkdtemp(dir=workdir, prefix="hsx-bench-ingest-"))
    try:
        tokenizer = scratch / "tokenizer"
        build_tokenizer(tokenizer)
        datasets = {}
        for n in sorted({rows, small}):
            path = scratch / f"chat-{n}.jsonl"
            started = time.perf_counter()
            make_chat_dataset(path, n=n - n // 1000, seed=0, bad_rows=n // 1000)
            datasets[n] = path
            print(f"dataset of {n:,} rows: {path.stat().st_size / 2**20:,.0f} MiB "
                  f"({time.perf_counter() - started:.0f} s to make)", flush=True)

        many = f"{workers} workers"
        variants = {"1 worker": 1, ONE_CORE: 1, many: workers}
        raw: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for rep in range(reps):
            for name in common.alternating(list(variants), rep):
                record = measure(datasets[rows], tokenizer, scratch, variants[name],
                                 one_core=name == ONE_CORE)
                raw[name].append(record)
                print(f"rep {rep} {name}: {record['rows_per_s']:,.0f} rows/s "
                      f"({record['seconds']:.1f} s), peak {record['peak_rss_mib']:,.0f} MiB",
                      flush=True)
        digests = {r["tables_sha256"] for records in raw.values() for r in records}
        speedup = common.compare(raw[many], raw["1 worker"], "rows_per_s",
                                 SPEEDUP_TARGET if workers == 2 else None)
        scaling = common.compare(raw[many], raw[ONE_CORE], "rows_per_s")

        memory = {"large": raw[many][0]}
        if small != rows:
            memory["small"] = measure(datasets[small], tokenizer, scratch, workers)
        else:
            memory["small"] = memory["large"]
        growth = {
            key: common.ratio(memory["large"][key], memory["small"][key])
            for key in ("peak_rss_mib", "peak_rss_worker_mib")
        }
        section = {
            "date": common.now_iso(),
            "note": note,
            "rows": rows,
            "small_rows": small,
            "reps": reps,
            "workers": workers,
            "cpu_affinity": len(os.sched_getaffinity(0)),
            "raw": raw,
            "identical_tables": len(digests) == 1,
            "speedup": speedup,
            "scaling": scaling,
            "memory": {
                "small": memory["small"],
                "large": memory["large"],
                "growth": growth,
                "target": MEMORY_TARGET,
                "verdict": "PASS" if all(g is not None and g <= MEMORY_TARGET
                                         for g in growth.values()) else "MISS",
            },
        }
        if profile:  # after the timed runs: py-spy's sampling slows what it watches
            stacks = out.with_suffix(".prof.txt")
            section["profile"] = {"file": stacks.name, **measure(
                datasets[rows], tokenizer, scratch, workers, profile=stacks)}
        common.save_section(out, "ingest", section, {**machine,
                                                      "load_end": os.getloadavg()})
        print(common.table(common.RATIO_HEADERS,
                           [common.ratio_row(f"rows/s, {many} ÷ 1", speedup),
                            common.ratio_row(f"rows/s, {many} ÷ 1 on one core", scaling)]))
        print(common.table(
            ["peak memory (MiB)", f"{small:,} rows", f"{rows:,} rows", "large ÷ small"],
            [[label, memory["small"][key], memory["large"][key], growth[key]]
             for label, key in (("ingesting process", "peak_rss_mib"),
                                ("largest worker", "peak_rss_worker_mib"))]))
        print(f"tables identical across runs and worker counts: {len(digests) == 1}")
        return section
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        data, tokenizer, out, workers = argv[1:5]
        print(json.dumps(child(data, tokenizer, out, int(workers))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="20k and 5k rows, 1 repetition")
    p.add_argument("--rows", type=int, help="rows of the dataset measured (default 1,000,000)")
    p.add_argument("--small", type=int, help="rows of the memory baseline (default rows/10)")
    p.add_argument("--reps", type=int, help="repetitions per variant (default 2)")
    p.add_argument("--workers", type=int, default=2,
                   help="processes of the parallel side (default 2)")
    p.add_argument("--out", type=Path,
                   help="results JSON (default results/<date>-ingest/ingest.json)")
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    p.add_argument("--profile", action="store_true",
                   help="one more run of the workers under py-spy (needs py-spy), its "
                        "collapsed stacks next to --out (.prof.txt)")
    args = p.parse_args(argv)
    rows = args.rows or (20_000 if args.quick else 1_000_000)
    run(rows=rows, small=args.small or rows // (4 if args.quick else 10),
        reps=args.reps or (1 if args.quick else 2), workers=args.workers,
        out=args.out or common.campaign_path("ingest", "ingest.json"), workdir=args.workdir,
        note=args.note, profile=args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
