"""Where a benchmark's processes spend their time: py-spy samples, grouped by what hsx does.

`Profiler(pid, out)` records one process tree with py-spy (all threads, child
processes too, idle threads left out, so a sample is a thread that ran or held the
GIL) until the `with` block ends; `breakdown(out)` groups the samples by process role
and by the first rule in `RULES` that matches a frame of the stack, innermost first.
py-spy is a profiling tool, not a dependency of hsx: `pip install py-spy`.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import TracebackType
from typing import Any

RATE_HZ = 100

# (category, regex over one frame "function (file:line)"), tried innermost frame first.
RULES: tuple[tuple[str, str], ...] = (
    ("shard: checksum", r"_DataStream\._digest"),
    ("shard: write", r"_DataStream\._write"),
    ("shard: fdatasync", r"_DataStream\._sync"),
    ("shard: commit (fsync, rename, record)", r"ShardWriter\.commit"),
    ("shard: add (encode, queue)", r"ShardWriter\.add"),
    ("spool: read in the actor", r"take_spool_file|_collect \(|load_file"),
    ("spool: write in the engine", r"publish_spool_file|save_file|_write_(spool_file|tensors)"),
    ("connector: gather + copy out", r"gather_to_host|_submit_async_write|extract_from_kv_cache"),
    ("vLLM: model forward", r"execute_model|_model_forward|forward \("),
    ("vLLM: scheduler and engine core", r"EngineCore|Scheduler\.|schedule \("),
    ("actor: vLLM step (output processing)", r"LLMEngine\.step|\bstep \(llm_engine"),
    ("actor: add_request", r"add_request"),
    ("actor: capture loop (hsx)", r"VllmEngine\.capture|ExtractionWorker\._take|_feed \("),
    ("actor: inputs and dispatch", r"run_unit|_rows \("),
)


class Profiler:
    """py-spy on `pid` and its children for the duration of a `with` block."""

    def __init__(self, pid: int, out: Path, rate: int = RATE_HZ) -> None:
        self.pid = pid
        self.out = out
        self.rate = rate
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Profiler:
        beside = Path(sys.executable).with_name("py-spy")
        spy = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        if spy is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        self.proc = subprocess.Popen(
            [spy, "record", "--pid", str(self.pid), "--subprocesses", "--threads",
             "--nonblocking", "--rate", str(self.rate), "--format", "raw",
             "--output", str(self.out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # attached before the timed region starts
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _role(process: str, root_pid: int) -> str:
    """The profiled process is the actor; every process it started is vLLM's."""
    return "actor" if process.startswith(f"process {root_pid}:") else "engine"


def breakdown(raw: Path, root_pid: int, rate: int = RATE_HZ) -> dict[str, Any]:
    """CPU-seconds by role (actor = the profiled process, engine = vLLM's) and category."""
    rules = [(name, re.compile(pattern)) for name, pattern in RULES]
    seconds: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # A child's stacks start with its parents' process frames, then its own.
        own = max(i for i, f in enumerate(frames) if f.startswith("process "))
        role = _role(frames[own], root_pid)
        category = "other"
        for frame in reversed(frames[own + 2:]):
            hit = next((name for name, rx in rules if rx.search(frame)), None)
            if hit is not None:
                category = hit
                break
        seconds[role][category] += int(count)
    return {role: {k: round(v / rate, 2) for k, v in counts.most_common()}
            for role, counts in seconds.items()}
