"""Whether a process of this host still runs: the ledger's lease asks it of a holder on
the same host (a coordinator killed -9 renews nothing, and a reused pid is told apart by
its start time)."""

from __future__ import annotations

import os
from pathlib import Path


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field on (state, ppid, ...); None: no such process.

    Raises OSError where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    return stat[stat.rindex(")") + 2 :].split()


def process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: clock ticks since boot), or None if unknown."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return None
    return fields[19] if fields is not None and len(fields) > 19 else None


def process_alive(pid: int, started: str | None) -> bool:
    """Whether process `pid` of this host still runs (and is the one that started at
    `started`, when known: pids are reused)."""
    try:
        fields = _proc_stat(pid)
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields is None or (fields and fields[0] in ("Z", "X")):  # gone, or not yet reaped
        return False
    return started is None or len(fields) <= 19 or fields[19] == started
