"""Where a test run's CPU goes, by kind of process.

    python3 cpu_by_process.py sample PROCS.json   # beside the run; SIGTERM when it ends
    python3 cpu_by_process.py report PROCS.json   # the table (cpu-*.txt)

`sample` reads /proc every second and keeps, for each process (pid and start time), its
CPU seconds so far and its command line (re-read while it runs: Ray renames its
workers); processes that started before the sampler are left out of the report.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def _boot_time() -> int:
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("btime"))


def sample(path: str) -> None:
    seen: dict[tuple[str, int], list[object]] = {}  # (pid, start) -> [ticks, cmd, comm]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    began = time.time()
    last_dump = began
    while not stop:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat.rsplit(")", 1)[1].split()
                ticks, start = int(fields[11]) + int(fields[12]), int(fields[19])
                entry = seen.setdefault((pid, start), [0, "", ""])
                if entry[0] != ticks or not entry[1]:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
                    entry[1] = cmd or entry[1]
                    entry[2] = stat.split("(", 1)[1].rsplit(")", 1)[0]
                entry[0] = ticks
            except (OSError, IndexError, ValueError):
                continue
        time.sleep(1.0)
        if stop or time.time() - last_dump > 60:
            last_dump = time.time()
            with open(path, "w") as f:
                json.dump({"began": began, "processes": [
                    [pid, start, ticks / HZ, cmd, comm]
                    for (pid, start), (ticks, cmd, comm) in seen.items()]}, f)


def kind(cmd: str, comm: str) -> str:
    if match := re.match(r"ray::(\w+)", cmd):
        return f"ray actor/task {match.group(1)}"
    for name in ("gcs_server", "raylet", "log_monitor", "monitor.py", "dashboard.py"):
        if name in cmd or name in comm:
            return f"ray infra {name}"
    if "multiprocessing.forkserver" in cmd:
        return "forkserver children (bounded tokenizing/templates)"
    if "hsx.cli serve" in cmd or "import hsx.i" in cmd:
        return "coordinator (hsx serve)"
    if "hsx.cli" in cmd:
        words = cmd.split("hsx.cli", 1)[1].split()
        return f"hsx cli {words[0] if words else ''}"
    for name in ("tests.cluster", "tests.integration.serving", "chrom", "weed"):
        if name in cmd:
            return name
    if "xdist" in cmd or "pytest" in cmd:
        return "pytest (in-process work)"
    return f"other {comm}"


def report(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    boot = _boot_time()
    rows = [r for r in data["processes"] if boot + int(r[1]) / HZ >= data["began"] - 5]
    cpu: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for _, _, seconds, cmd, comm in rows:
        name = kind(cmd, comm)
        cpu[name] += seconds
        count[name] += 1
    print(f"total {sum(cpu.values()):.0f} CPU s over {len(rows)} processes")
    print(f"{'CPU s':>8} {'procs':>5}  kind")
    for name, seconds in cpu.most_common(30):
        print(f"{seconds:8.0f} {count[name]:5d}  {name}")


if __name__ == "__main__":
    {"sample": sample, "report": report}[sys.argv[1]](sys.argv[2])
