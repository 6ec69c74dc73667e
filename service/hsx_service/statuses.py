"""The jobs' statuses: built from the ledger's rows and the running job's progress, posted
on the board, and kept in the ledger for after the end.

The scheduler (scheduler.py) decides what runs and when; it tells `JobStatuses` what
happened — a row changed (`changed`), a run started (`run_started`), progressed
(`progressed`), committed a unit (`unit_committed`), waits for something (`waiting`),
restarted an engine (`restarted`), failed an attempt (`attempt_failed`), ended
(`run_ended`) — and `JobStatuses` does the rest: it builds each job's `JobStatus` and
posts it on the board (board.py), progress at most every PUBLISH_INTERVAL_S and changes
of state at once, so routes and event streams read bytes encoded once. What a job's page
shows after the end is kept in the ledger as the job runs: its numbers, its throughput
curve (a point every CURVE_INTERVAL_S) and what each worker committed. The numbers of a
job that ran under an older hsx are read once from its output.

The run's hooks call it from the thread that drives the engines: memory, the board and
the ledger's queued writes only.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from typing import Any

from hsx.output import OutputCorrupt, StorageError
from hsx.progress import JobProgress
from hsx.wire import (
    JobState,
    JobStatus,
    NodeStatus,
    ResourcePlan,
    WorkerStatus,
    WorkerTotals,
)
from hsx_service.board import StatusBoard
from hsx_service.errors import JobRefused
from hsx_service.ledger import JobRow, Ledger
from hsx_service.policy import redacted
from hsx_service.prepare import open_output

PUBLISH_INTERVAL_S = 0.25  # at most this often per job, for progress (not state) changes
CURVE_INTERVAL_S = 2.0  # a throughput point this often while a job extracts

_STATUS_NUMBERS = ("samples_total", "samples_done", "samples_failed", "tokens_total",
                   "tokens_done", "bytes", "shards", "units_total", "units_done", "units_failed",
                   "samples_generated", "tokens_generated", "rows_tokenized", "rows_total",
                   "samples_checked", "check_problems", "head_rows_checked",
                   "head_rows_agreed")


class JobStatuses:
    """Every job's status on `board`, from `ledger` and what the scheduler tells it."""

    def __init__(self, ledger: Ledger, board: StatusBoard) -> None:
        self.ledger = ledger
        self.board = board
        # The ledger's job rows as last read or written here (replaced, never mutated).
        self.rows: dict[str, JobRow] = {}
        self.plans: dict[str, ResourcePlan] = {}  # where each job's work runs, as planned
        self._waiting: dict[str, str] = {}  # job id -> what its run waits for now
        self._publish_lock = threading.Lock()  # one status built and posted at a time
        self._last_publish: dict[str, float] = {}
        self._live: dict[str, JobProgress] = {}  # progress of the job running now
        # Numbers of jobs not running now (ledger job_totals), and of previous runs.
        self._totals: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # guards _workers
        self._workers: dict[str, dict[str, WorkerTotals]] = {}
        self._run_base: dict[str, tuple[int, float]] = {}  # earlier runs' (tokens, seconds)
        self._at_start: dict[str, int] = {}  # samples the output held when the run started
        self._curve_mark: dict[str, tuple[float, int]] = {}  # last curve point (time, tokens)

    # ------------------------------------------------------------ from the ledger

    def load(self) -> None:
        """What the board shows, from the ledger (at start, and at a take-over: the
        previous holder wrote what this process has not seen)."""
        self._totals = self.ledger.totals()
        with self._lock:
            self._workers = {
                job_id: {w["name"]: WorkerTotals(**w) for w in workers}
                for job_id, workers in self.ledger.worker_totals().items()
            }
        for row in self.ledger.jobs():
            self.rows[row.id] = row
            self.publish(row.id, force=True)

    def mirror(self) -> None:
        """A standby shows the holder's jobs as the ledger has them."""
        try:
            rows = self.ledger.jobs()
            totals = self.ledger.totals()
        except sqlite3.Error:
            return
        for row in rows:
            if self.rows.get(row.id) != row or totals.get(row.id) != self._totals.get(row.id):
                self.rows[row.id] = row
                if row.id in totals:
                    self._totals[row.id] = totals[row.id]
                self.publish(row.id, force=True)

    def changed(self, job_id: str, row: JobRow | None) -> None:
        """The job's row changed (None: not found again in the ledger): post at once."""
        if row is not None:
            self.rows[job_id] = row
        self.publish(job_id, force=True)

    # ------------------------------------------------------------ from a run

    def run_started(self, job_id: str, progress: JobProgress) -> None:
        previous = self._totals.pop(job_id, {})
        self._run_base[job_id] = (int(previous.get("run_tokens", 0)),
                                  float(previous.get("run_seconds", 0.0)))
        self._curve_mark.pop(job_id, None)
        self._at_start[job_id] = progress.samples_done
        self._live[job_id] = progress
        self.publish(job_id, force=True)

    def ingesting(self, job_id: str, rows: int, rows_total: int) -> None:
        """The job's dataset is being tokenized: `rows` so far, of about `rows_total`."""
        self._live[job_id] = JobProgress.of_ingestion(rows, rows_total)
        self.publish(job_id)

    def progressed(self, job_id: str, progress: JobProgress) -> None:
        previous = self._live.get(job_id)
        self._live[job_id] = progress
        # A worker changing state is news; plain counters are throttled.
        changed = previous is None or previous.workers != progress.workers
        self.publish(job_id, force=changed)
        self._curve(job_id, progress)

    def unit_committed(self, job_id: str, report: Any) -> None:
        """A unit's attempt committed (a UnitReport): the worker that won counts it."""
        if not report.won:
            return
        with self._lock:
            workers = self._workers.setdefault(job_id, {})
            w = workers.get(report.worker) or WorkerTotals(name=report.worker or "?")
            workers[w.name] = w.model_copy(update={
                "units": w.units + 1, "samples": w.samples + report.samples,
                "tokens": w.tokens + report.tokens, "bytes": w.bytes + report.bytes,
                "seconds": round(w.seconds + report.seconds, 3)})

    def waiting(self, job_id: str, reason: str | None) -> None:
        """What the job's run waits for now (None: nothing)."""
        if reason is None:
            self._waiting.pop(job_id, None)
        else:
            self._waiting[job_id] = reason
        self.publish(job_id, force=True)

    def restarted(self, job_id: str) -> None:
        """One of the run's engines restarted (the ledger counts it too)."""
        row = self.rows.get(job_id)
        if row is not None:
            self.rows[job_id] = dataclasses.replace(row, restarts=row.restarts + 1)
        self.publish(job_id, force=True)

    def attempt_failed(self, job_id: str, error: str) -> None:
        """An attempt of a unit failed: the job's last error, news at once."""
        row = self.rows.get(job_id)
        if row is not None:
            self.rows[job_id] = dataclasses.replace(row, last_error=error)
        self.publish(job_id, force=True)

    def run_ended(self, job_id: str) -> None:
        """The run ended (its state is written next): its numbers are kept."""
        live = self._live.pop(job_id, None)
        if live is not None:
            self._curve(job_id, live, last=True)
            numbers = self._live_totals(job_id, live)
            self._totals[job_id] = numbers
            self.ledger.put_totals(job_id, numbers)
        self._waiting.pop(job_id, None)

    def forget_runs(self) -> None:
        """No job runs here any more (the coordinator stepped down)."""
        self._live.clear()

    # ------------------------------------------------------------ the status

    def publish(self, job_id: str, *, force: bool = False) -> None:
        """Post the job's status on the board (progress at most every PUBLISH_INTERVAL_S)."""
        now = time.monotonic()
        if not force and now - self._last_publish.get(job_id, 0.0) < PUBLISH_INTERVAL_S:
            return
        self._last_publish[job_id] = now
        row = self.rows.get(job_id)
        if row is None:
            return
        with self._publish_lock:
            status = self._status(self.rows.get(job_id, row))
            previous = self.board.get(job_id)
            if (status.state == JobState.running and previous is not None
                    and previous.status.state == JobState.running):
                # Shown numbers never go back during a run: between two polls of the
                # workers the progress counts committed units only.
                status.samples_done = max(status.samples_done, previous.status.samples_done)
                status.tokens_done = max(status.tokens_done, previous.status.tokens_done)
            self.board.post(status)

    def _status(self, row: JobRow) -> JobStatus:
        live = self._live.get(row.id) if row.state == JobState.running else None
        numbers = self._totals.get(row.id)
        if live is None and numbers is None:
            numbers = self._totals_from_output(row)
        status = JobStatus(
            id=row.id, name=row.spec.name, owner=row.owner, state=row.state,
            output=row.output,
            created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
            restarts=row.restarts, last_error=row.last_error, spec=redacted(row.spec),
            updated_at=time.time(), plan=self.plans.get(row.id),
            waiting_for=self._waiting_for(row),
        )
        if live is not None:
            numbers = self._live_totals(row.id, live)
            status.ingesting = live.ingesting
            status.tokens_per_s = round(live.tokens_per_s(), 1)
            status.eta_s = live.eta_s()
            status.workers = [
                WorkerStatus(name=name, state=state, unit=live.worker_units.get(name))
                for name, state in sorted(live.workers.items())
            ]
            status.nodes = nodes_of(live)
        if numbers is not None:
            for name in _STATUS_NUMBERS:
                setattr(status, name, int(numbers.get(name, 0)))
            status.samples_at_start = int(numbers.get("samples_at_start", 0))
            seconds = float(numbers.get("run_seconds", 0.0))
            if seconds > 0:
                status.tokens_per_s_avg = round(float(numbers.get("run_tokens", 0)) / seconds, 1)
        with self._lock:
            status.worker_totals = sorted(self._workers.get(row.id, {}).values(),
                                          key=lambda w: w.name)
        return status

    def _waiting_for(self, row: JobRow) -> str | None:
        if row.state == JobState.running:
            return self._waiting.get(row.id)
        if row.state == JobState.queued:
            return "its turn: jobs run one at a time, in the order they were submitted"
        return None

    def _live_totals(self, job_id: str, live: JobProgress) -> dict[str, Any]:
        """The numbers of a running job: its progress, plus its earlier runs' time."""
        numbers = {name: getattr(live, name) for name in _STATUS_NUMBERS}
        base_tokens, base_seconds = self._run_base.get(job_id, (0, 0.0))
        ran = time.time() - live.rate_since if live.rate_since is not None else 0.0
        numbers.update(run_tokens=base_tokens + live.rate_tokens, run_seconds=base_seconds + ran,
                       samples_at_start=self._at_start.get(job_id, 0))
        return numbers

    def _totals_from_output(self, row: JobRow) -> dict[str, Any] | None:
        """Numbers of a job the ledger has none for (it ran under an older hsx), read once
        from its output and kept in the ledger."""
        try:
            output = open_output(row.output)
            if not output.has_manifest():
                return None
            progress = output.totals().progress()
        except (OSError, ValueError, JobRefused, StorageError, OutputCorrupt):
            return None
        progress.units_failed = len(self.ledger.failed_units(row.id))
        numbers = {name: getattr(progress, name) for name in _STATUS_NUMBERS}
        if row.state.finished:
            self._totals[row.id] = numbers
            self.ledger.put_totals(row.id, numbers)
        return numbers

    def _curve(self, job_id: str, progress: JobProgress, last: bool = False) -> None:
        """A throughput point every CURVE_INTERVAL_S of dispatching (and at the end)."""
        if progress.rate_since is None:
            return  # engines still starting: nothing extracted in this run yet
        now = time.time()
        mark = self._curve_mark.get(job_id)
        if mark is None:
            mark = self._curve_mark[job_id] = (progress.rate_since,
                                               progress.tokens_done - progress.rate_tokens)
        post = self.board.get(job_id)
        tokens = max(progress.tokens_done, post.status.tokens_done if post else 0)
        elapsed = now - mark[0]
        if elapsed < (0.5 if last else CURVE_INTERVAL_S):
            return
        self._curve_mark[job_id] = (now, tokens)
        self.ledger.add_throughput(job_id, now, max(tokens - mark[1], 0) / elapsed, tokens)
        self.ledger.put_totals(job_id, self._live_totals(job_id, progress))


def nodes_of(progress: JobProgress) -> list[NodeStatus]:
    """Per Ray node: the run's engines, its trainer's workers, the bytes in flight."""
    nodes: dict[str, NodeStatus] = {}

    def node(name: str) -> NodeStatus:
        return nodes.setdefault(name, NodeStatus(node=name))

    for engine, where in sorted(progress.worker_nodes.items()):
        if where:
            node(where).engines.append(engine)
    for rank, where in sorted(progress.trainer_nodes.items()):
        if where:
            node(where).trainer_workers.append(rank)
    for where, size in progress.stream_bytes.items():
        if where:
            node(where).bytes_in_flight += size
    return sorted(nodes.values(), key=lambda n: n.node)
