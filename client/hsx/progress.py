"""Job progress: the numbers a driver reports, and the terminal bar that shows them."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any


@dataclass
class JobProgress:
    samples_total: int
    tokens_total: int
    samples_done: int = 0
    tokens_done: int = 0
    samples_failed: int = 0
    shards: int = 0
    bytes: int = 0
    units_total: int = 0
    units_done: int = 0
    workers: dict[str, str] = field(default_factory=dict)  # name -> state
    worker_units: dict[str, int] = field(default_factory=dict)  # name -> unit it runs
    worker_nodes: dict[str, str] = field(default_factory=dict)  # name -> its Ray node
    # The trainer's workers: rank -> Ray node (an online job's, from its stream; the
    # coordinator adds an offline one's).
    trainer_nodes: dict[int, str] = field(default_factory=dict)
    # An online job: Ray node -> captured bytes there not yet trained on (in the engine's
    # object store, or being read by a trainer worker).
    stream_bytes: dict[str, int] = field(default_factory=dict)
    units_failed: int = 0
    restarts: int = 0
    started_at: float = field(default_factory=time.time)
    # tokens/s over the run so far, counted from the first token of this run
    rate_tokens: int = 0
    rate_since: float | None = None
    # A regenerating job's first stage: samples answered by the target, tokens generated
    samples_generated: int = 0
    tokens_generated: int = 0
    # What the job waits for (GPUs, its turn) and who holds it; None: nothing.
    waiting_for: str | None = None
    # Ingestion beside extraction: dataset rows tokenized so far, of rows_total (an
    # estimate from the share of the dataset read while `ingesting`, exact after).
    rows_tokenized: int = 0
    rows_total: int = 0
    ingesting: bool = False
    # The self-check (docs/MODELS.md): samples checked in the units done, problems found
    # (under `checks: warn`; `on` fails the job at the first).
    samples_checked: int = 0
    check_problems: int = 0
    # The head check (docs/MODELS.md): rows of id N compared with the engine's own next
    # token, and those that agreed.
    head_rows_checked: int = 0
    head_rows_agreed: int = 0

    @classmethod
    def of_ingestion(cls, rows: int, rows_total: int) -> JobProgress:
        """A job whose dataset is being tokenized: `rows` so far, of about `rows_total`."""
        return cls(samples_total=0, tokens_total=0, rows_tokenized=rows,
                   rows_total=rows_total, ingesting=True)

    def tokens_per_s(self) -> float:
        if self.rate_since is None:
            return 0.0
        elapsed = time.time() - self.rate_since
        return self.rate_tokens / elapsed if elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.tokens_per_s()
        if rate <= 0:
            return None
        return max(self.tokens_total - self.tokens_done, 0) / rate

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples_total": self.samples_total,
            "samples_done": self.samples_done,
            "samples_failed": self.samples_failed,
            "tokens_total": self.tokens_total,
            "tokens_done": self.tokens_done,
            "shards": self.shards,
            "bytes": self.bytes,
            "units_total": self.units_total,
            "units_done": self.units_done,
            "tokens_per_s": round(self.tokens_per_s(), 1),
            "eta_s": self.eta_s(),
            "workers": dict(self.workers),
            "worker_units": dict(self.worker_units),
            "units_failed": self.units_failed,
            "restarts": self.restarts,
            "samples_generated": self.samples_generated,
            "tokens_generated": self.tokens_generated,
            "rows_tokenized": self.rows_tokenized,
            "rows_total": self.rows_total,
            "samples_checked": self.samples_checked,
            "check_problems": self.check_problems,
            "head_rows_checked": self.head_rows_checked,
            "head_rows_agreed": self.head_rows_agreed,
            "ingesting": self.ingesting,
        }


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit below it: `1.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ingestion_text(p: JobProgress) -> str:
    """`tokenizing 120,000/~1,000,000 rows`: ingestion as the bar shows it."""
    total = f"/~{p.rows_total:,}" if p.rows_total else ""
    return f"tokenizing {p.rows_tokenized:,}{total} rows"


def console() -> Any:
    """The console for people: stderr, no syntax colouring, long lines kept whole."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


class ProgressBar:
    """A live bar on a terminal (samples, tokens/s, ETA); a line per update otherwise."""

    def __init__(self, title: str, *, enabled: bool | None = None):
        self.title = title
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress: Any = None
        self._task: Any = None
        self._last_line = 0.0
        self._waiting: str | None = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[what]}"),
                TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("{task.fields[extra]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.title, total=None, rate="-", extra="",
                                                 what="samples")
        return self

    def waiting(self, reason: str | None) -> None:
        """A line when what the job waits for changes (never a silent wait)."""
        if reason == self._waiting:
            return
        self._waiting = reason
        if reason:
            self.note(reason)

    def note(self, text: str) -> None:
        """A line above the bar (stderr), under the bar's title."""
        line = f"{self.title}: {text}"
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            console().print(line, markup=False, highlight=False)

    def update(self, p: JobProgress) -> None:
        self.waiting(p.waiting_for)
        rate = f"{p.tokens_per_s():,.0f}"
        starting = sum(state == "starting" for state in p.workers.values())
        extra = f"{p.shards} shards"
        if p.ingesting and p.units_total:
            extra = f"{p.units_done}/{p.units_total} units, " + extra
        if p.samples_generated or p.tokens_generated:
            extra = (f"{p.samples_generated} regenerated ({p.tokens_generated:,} tokens), "
                     + extra)
        if starting:
            extra += f", {starting} engine{'s' if starting > 1 else ''} starting"
        if p.samples_failed:
            extra += f", {p.samples_failed} bad"
        if p.restarts:
            extra += f", {p.restarts} restarts"
        if self._progress is not None and p.ingesting:
            self._progress.update(self._task, total=p.rows_total or None,
                                  completed=p.rows_tokenized, rate=rate, extra=extra,
                                  what="rows tokenized")
        elif self._progress is not None:
            self._progress.update(self._task, total=p.samples_total,
                                  completed=p.samples_done, rate=rate, extra=extra,
                                  what="samples")
        elif p.ingesting:
            if time.monotonic() - self._last_line > 5:
                self._last_line = time.monotonic()
                console().print(f"{self.title}: {ingestion_text(p)}, {extra}")
        elif time.monotonic() - self._last_line > 5 or (
                p.samples_done >= p.samples_total and not p.ingesting):
            self._last_line = time.monotonic()
            console().print(
                f"{self.title}: {p.samples_done}/{p.samples_total} samples, {rate} tok/s, {extra}"
            )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
