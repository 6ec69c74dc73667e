"""How an `hsx` command reports: its exit code, errors on stderr, results on stdout.

A command's result (a job id, a table, JSON) goes to stdout so it can be piped;
progress and messages go to stderr (`hsx.progress.console`).
"""

from __future__ import annotations

from typing import Any

from hsx.progress import console

EXIT_FAILED = 1
EXIT_REFUSED = 2


def error(message: str, code: int) -> int:
    console().print(f"[bold red]hsx: error:[/] {message}")
    return code


def already_complete(samples: int) -> str:
    """What a rerun of a finished job says (the dashboard says the same): it ran, found
    the output complete and extracted nothing, so it has no rate or time of its own."""
    return f"already complete: {samples:,} samples committed by an earlier run"


def result_console() -> Any:
    """A console on stdout: tables and JSON are the command's result, not chatter."""
    from rich.console import Console

    return Console(highlight=False)
