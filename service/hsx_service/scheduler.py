"""The coordinator's scheduler: jobs from the ledger, run one after another on Ray.

Routes call `submit`, `cancel`, `errors`, `throughput` — all quick: they validate, read
the ledger and enqueue — and read statuses from `board` (board.py): a GET or an event
stream costs no SQLite and no status building, whatever the number of clients. One
background thread takes the oldest queued job and runs it to the end with the job driver
the CLI uses (`runner.run_job`): prepare (ingest, plan), then units fed to `replicas`
engine actors, restarts and retries included, then complete.json. Its hooks write the
ledger's bookkeeping of the run (units, attempts, restarts: written behind, ledger.py),
count it in the metrics (metrics.py) and tell the job's statuses (`statuses`,
statuses.py), which post them on the board and keep what a job's page shows after the
end; so the thread that drives the engines never waits on SQLite or on clients.

This module decides what runs and when: the lease, the job thread, the queue, cancels,
trainings. What a job's status says, and when it is posted, is statuses.py's.

On `start` the ledger is reconciled with the outputs — the outputs' commit records are
the truth — and every job that was running when the coordinator stopped is queued
again, ahead of newer ones, so a `kill -9` costs only the units that were in flight.

Lifecycle. A coordinator first takes the ledger's lease (ledger.py): a second
coordinator on a held ledger refuses to start, naming the holder, or with `standby`
waits, showing the holder's jobs read-only (its routes that change something answer
503 naming the holder), and takes over when the holder stops. Two threads run while the
lease is held:

- `hsx-lease` (the supervisor) renews the lease every quarter of its time to live, and
  keeps a job thread alive: if that thread dies (a bug that escaped it), a new one is
  started, which queues the job that was running again — no restart of the coordinator
  needed. When a renewal finds the lease taken over (this process stalled past its
  expiry), it steps down: dispatch stops, the engines and trainers are stopped, every
  ledger write of this process fails from then on (fenced), and it waits as a standby.
- `hsx-scheduler` (the job thread) connects Ray, reconciles, then runs queued jobs one at
  a time. A job whose run raised is failed with the error, except when Ray itself was
  lost (the driver's connection died): then Ray is reconnected and the job queued again,
  up to MAX_RUNNER_RESTARTS times.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from hsx.draft import draft_view
from hsx.modelinfo import ModelConfigError, read_model_info
from hsx.output.layout import DRAFT_DIR
from hsx.plan import WorkUnit
from hsx.progress import JobProgress
from hsx.spec import JobSpec, TrainSpec
from hsx.wire import (
    ErrorPage,
    ErrorRecord,
    JobState,
    JobStatus,
    Throughput,
    ThroughputPoint,
    TrainState,
    TrainStatus,
)
from hsx_service.admission import Admission
from hsx_service.board import StatusBoard
from hsx_service.dispatch import DispatchHooks
from hsx_service.engine_config import fit_to_model
from hsx_service.engine_pool import EnginePool, engine_key, ensure_ray
from hsx_service.errors import (
    JobCancelled,
    JobConflict,
    JobFailed,
    JobNotFound,
    JobRefused,
    NotReady,
)
from hsx_service.ledger import JobRow, LeaseLost, Ledger, LedgerHeld
from hsx_service.metrics import JobMetrics, is_recent
from hsx_service.placement import GpuArbiter, plan_for_cluster
from hsx_service.prepare import (
    PreparedJob,
    check_estimated_output,
    open_output,
    preflight,
    warm_preflight,
)
from hsx_service.resume import check_same_job, manifest_expected
from hsx_service.runner import MAX_ATTEMPTS, run_job
from hsx_service.statuses import JobStatuses
from hsx_service.training import EngineNodes, TrainingRequest
from hsx_service.trainings import Trainings

logger = logging.getLogger(__name__)

CURVE_POINTS = 600  # most points `throughput` returns
SUPERVISE_TICK_S = 1.0  # the supervisor looks at the lease and the job thread this often
MAX_RUNNER_RESTARTS = 3  # a job whose runner lost Ray more often than this fails
START_RETRY_S = 5.0  # a job thread that could not start (Ray unreachable) tries again


class Scheduler:
    """Runs queued jobs in order; see the module docstring for who calls what."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.ledger = Ledger(settings.ledger_path)
        self.max_attempts = int(getattr(settings, "max_unit_attempts", MAX_ATTEMPTS))
        # The one owner of the cluster's GPUs here: engines, trainers and evaluations ask it
        # (placement.py); a request that waits wakes the job thread, which lets idle
        # engines go.
        self.arbiter = GpuArbiter(on_waiter=self._wake_up)
        self.pool = EnginePool(arbiter=self.arbiter)
        self._ready = False
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None  # the job thread
        self._supervisor: threading.Thread | None = None
        self._ttl = float(getattr(settings, "lease_ttl_s", 20.0))
        self._lost = threading.Event()  # the lease was taken over: step down
        self._standby: str | None = None  # why this coordinator waits, while it does
        self._stepped_down: str | None = None  # why it lost the lease, until it holds it again
        self._thread_ended = False  # the job thread returned (rather than died)
        self._trainings_resumed = False
        self._current: str | None = None  # the job the job thread runs now
        self._runner_restarts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._cancel: set[str] = set()
        self.trainings = Trainings(self.ledger, self.arbiter)
        self.board = StatusBoard()
        self.statuses = JobStatuses(self.ledger, self.board)
        # job id -> set once the job has ended: a training planned `after` waits for it
        self._extracted: dict[str, threading.Event] = {}
        # job id -> where its engines run (a trainer kept apart reads it)
        self._engine_nodes: dict[str, EngineNodes] = {}
        self.job_metrics = JobMetrics()
        self.statuses.load()

    # ------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self._ready

    def start(self) -> None:
        """Take the ledger's lease — raise LedgerHeld if a live coordinator holds it,
        unless `standby` — and return; Ray and the reconcile happen in the job thread,
        and `ready` turns True when they are done (until then /readyz answers 503)."""
        if not getattr(self.settings, "standby", False):
            self._acquire()
        self._supervisor = threading.Thread(target=self._supervise, name="hsx-lease",
                                            daemon=True)
        self._supervisor.start()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        for thread in (self._supervisor, self._thread):
            if thread is not None:
                thread.join(timeout=30)
        self.trainings.stop()
        self.pool.shutdown()
        self.ledger.close()  # gives the lease up: a successor starts at once

    def not_ready(self) -> NotReady:
        """What a route that needs a ready coordinator answers now (503)."""
        return NotReady(self._standby or "the coordinator is still starting")

    def _acquire(self) -> None:
        was_standby = self._standby is not None
        self.ledger.acquire(self._ttl, getattr(self.settings, "address", None))
        if was_standby:
            self.statuses.load()
        self._standby = None
        self._stepped_down = None
        self._lost.clear()
        self._trainings_resumed = False

    def _supervise(self) -> None:
        """Hold the lease (waiting for it as a standby), renew it, keep a job thread."""
        renewed = time.monotonic()
        while not self._stop.is_set():
            if self._lost.is_set():  # a write of the job thread found the lease taken over
                self._step_down("a ledger write found this coordinator's lease taken over")
                continue
            if not self.ledger.holds_lease:
                try:
                    self._acquire()
                    renewed = time.monotonic()
                except LedgerHeld as err:
                    # A coordinator that stepped down keeps saying why while it waits.
                    why = f"{self._stepped_down}; " if self._stepped_down else ""
                    self._standby = (f"standby: {why}{err.holder.describe()} holds the "
                                     "ledger; this coordinator takes over when it stops")
                    self.statuses.mirror()
                    self._stop.wait(SUPERVISE_TICK_S)
                    continue
                except sqlite3.Error:
                    logger.warning("cannot read the ledger's lease; trying again", exc_info=True)
                    self._stop.wait(SUPERVISE_TICK_S)
                    continue
            self._keep_job_thread()
            if self._stop.wait(SUPERVISE_TICK_S):
                break
            if time.monotonic() - renewed >= self._ttl / 4:
                try:
                    self.ledger.renew(self._ttl)
                    renewed = time.monotonic()
                except LeaseLost as err:
                    self._step_down(str(err))
                except sqlite3.Error:  # busy for 30 s: the next tick tries again
                    logger.warning("cannot renew the ledger's lease; trying again",
                                   exc_info=True)

    def _keep_job_thread(self) -> None:
        """Start the job thread; start a new one if it died (its job is queued again)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            return
        if thread is not None and not self._thread_ended:
            job_id = self._current
            logger.error("the scheduler's job thread died%s; starting a new one",
                         f" while running job {job_id}" if job_id else "")
            self._ready = False
            self._reset_engines()
            if job_id is not None:
                self._runner_died(job_id, "the scheduler's job thread died")
        elif thread is not None:
            self._stop.wait(START_RETRY_S)  # it ended without starting: wait a little
        self._thread_ended = False
        self._thread = threading.Thread(target=self._loop, name="hsx-scheduler", daemon=True)
        self._thread.start()

    def _step_down(self, reason: str) -> None:
        """The lease was taken over: stop running jobs and become a standby."""
        logger.error("stepping down: %s", reason)
        self._ready = False
        self._lost.set()
        self._stepped_down = reason
        self._standby = f"standby: {reason}"
        with self._wake:
            self._wake.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join()  # dispatch stops at once; units already running end first
        self._thread = None
        self.trainings.stop()
        self.trainings = Trainings(self.ledger, self.arbiter)
        self._reset_engines()
        self.statuses.forget_runs()
        self._current = None
        self._lost.clear()  # the job thread, which it told to stop, is gone

    def _reset_engines(self) -> None:
        """Stop this process's engines (a dead runner may have left units on them)."""
        with contextlib.suppress(Exception):  # Ray itself may be what failed
            self.pool.shutdown()
        self.pool = EnginePool(arbiter=self.arbiter)

    def _wake_up(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _runner_died(self, job_id: str, reason: str) -> None:
        """Queue the job again (the next run resumes it), or fail it after too many."""
        count = self._runner_restarts[job_id] = self._runner_restarts.get(job_id, 0) + 1
        try:
            if count > MAX_RUNNER_RESTARTS:
                self._end(job_id, JobState.failed,
                          f"its runner died {count} times; last: {reason}")
            else:
                logger.warning("job %s: %s; it runs again", job_id, reason)
                self._end(job_id, JobState.queued, f"runner restarted: {reason}")
        except LeaseLost:
            self._lost.set()

    def _reconcile(self) -> None:
        """After a restart: running jobs go back to the queue, units agree with outputs."""
        for row in self.ledger.jobs():
            if row.state == JobState.running:
                logger.info("resuming job %s after a coordinator restart", row.id)
                self._set_state(row.id, JobState.queued)
            if not row.state.finished:
                output = open_output(row.output)
                if output.has_manifest():
                    self.ledger.reconcile_units(row.id, output.committed_units())

    # ------------------------------------------------------------ routes' API

    def submit(self, spec: JobSpec, job_id: str | None,
               owner: str | None = None) -> tuple[JobStatus, bool]:
        if not self._ready:
            raise self.not_ready()
        spec = fit_to_model(spec)
        job_id = job_id or f"job-{uuid.uuid4().hex[:10]}"
        existing = self.ledger.job(job_id)
        if existing is not None:
            return self._same_or_conflict(existing, spec), False
        admission = Admission(self.settings, self.board, self.ledger, owner)
        admission.check_active_jobs()
        admission.check_output_place(spec)
        admission.check_quota(None)
        info, layers, output = preflight(spec)
        check_same_job(output.read_manifest(), spec, info, layers, output)
        estimate = check_estimated_output(spec, info, layers, output,
                                          quota_bytes=admission.job_quota())
        admission.check_quota(estimate)
        plan_for_cluster(spec)  # what this cluster can never provide is refused now
        row = self.ledger.insert_job(job_id, spec, spec.output, owner)
        if row is None:  # another request inserted the same id just now
            raced = self.ledger.job(job_id)
            if raced is None:
                raise RuntimeError(f"ledger lost job {job_id}")
            return self._same_or_conflict(raced, spec), False
        self.statuses.changed(job_id, row)
        with self._wake:
            self._wake.notify_all()
        return self.get(job_id), True

    def _same_or_conflict(self, row: JobRow, spec: JobSpec) -> JobStatus:
        if row.spec.model_dump() != spec.model_dump():
            raise JobConflict(f"job {row.id} already exists with a different spec")
        return self.get(row.id)

    def get(self, job_id: str) -> JobStatus:
        """The job's status as last posted on the board."""
        post = self.board.get(job_id)
        if post is None:
            raise JobNotFound(job_id)
        return post.status

    def list(self, state: JobState | None = None) -> builtins.list[JobStatus]:
        return [post.status for post in self.board.list(state)]

    def cancel(self, job_id: str) -> JobStatus:
        if self._standby is not None:
            raise self.not_ready()
        row = self._row(job_id)
        if row.state == JobState.queued:
            self._set_state(job_id, JobState.cancelled)
        elif row.state == JobState.running:
            self.ledger.request_cancel(job_id)
            with self._lock:
                self._cancel.add(job_id)
        return self.get(job_id)

    def errors(self, job_id: str, offset: int, limit: int) -> ErrorPage:
        records = self._error_records(self._row(job_id))
        page = records[offset : offset + limit]
        return ErrorPage(items=page, total=len(records), offset=offset, limit=limit)

    def train(self, job_id: str, spec: TrainSpec) -> TrainStatus:
        """Start (or restart, resuming its checkpoint) the draft training of a job."""
        if not self._ready:
            raise self.not_ready()
        row = self._row(job_id)
        if spec.online:
            raise JobRefused("online: an online training is given in the job's `train:` "
                             "section when it is submitted (its engines feed the trainer); "
                             "this call trains on the job's stored shards")
        if row.state in (JobState.failed, JobState.cancelled) and not (
                open_output(row.output).has_manifest()):
            raise JobRefused(f"job {job_id} is {row.state.value} and left no output to train on")
        check_draft_layers(row.spec, spec)
        self._start_training(row, spec)
        return self.train_status(job_id)

    def _start_training(self, row: JobRow, spec: TrainSpec) -> None:
        """Train the job's draft as its plan places it (`TrainingRequest.of_job`): on a
        cluster whose GPUs the engines take, only once the extraction has ended."""
        check_manifest_is_the_jobs(row)
        plan = None
        if not row.state.finished:
            plan = self.statuses.plans.get(row.id) or plan_for_cluster(row.spec)
        extracted = self._extracted.setdefault(row.id, threading.Event())
        self.trainings.start(TrainingRequest.of_job(
            row.id, row.output, spec, row.spec, plan, order=row.created_at,
            extracted=extracted, engine_nodes=self._engines_of(row.id)))

    def _engines_of(self, job_id: str) -> EngineNodes:
        """Where the job's engines run, as its runs say (one record for all its runs)."""
        extracted = self._extracted.setdefault(job_id, threading.Event())
        return self._engine_nodes.setdefault(job_id, EngineNodes(extracted))

    def train_status(self, job_id: str) -> TrainStatus:
        row = self._row(job_id)
        training = self.ledger.training(job_id)
        if training is None:
            raise JobNotFound(
                f"job {job_id} has no training; POST /v1/jobs/{job_id}/train starts one")
        output = open_output(row.output)
        where = None if output.local_root is not None else output.url(DRAFT_DIR)
        return self.trainings.status(training, draft_view(output), where)

    def throughput(self, job_id: str) -> Throughput:
        """The job's tokens/s over time (kept after it ends), at most CURVE_POINTS points."""
        status = self.get(job_id)
        points = [ThroughputPoint(at=at, tokens_per_s=round(rate, 1), tokens_done=tokens)
                  for at, rate, tokens in thin_curve(self.ledger.throughput(job_id),
                                                     CURVE_POINTS)]
        return Throughput(job_id=job_id, tokens_per_s_avg=status.tokens_per_s_avg, points=points)

    def collect_metrics(self) -> Iterator[Metric]:
        """The metric families of one /metrics scrape (metrics.py)."""
        now = time.time()
        statuses = self.list()
        by_id = {s.id: s for s in statuses}
        trainings: builtins.list[TrainStatus] = []
        for row in self.ledger.trainings():
            job = by_id.get(row.job_id)
            if job is None or not (row.state in (TrainState.starting, TrainState.running)
                                   or is_recent(job, now)):
                continue
            try:
                root = draft_view(open_output(job.output))
                trainings.append(self.trainings.status(row, root))
            except OSError:
                logger.warning("metrics: cannot read the training of %s", row.job_id,
                               exc_info=True)
        return self.job_metrics.families(statuses, trainings, self._ready, now,
                                         gpus=(self.arbiter.holders(), self.arbiter.waiters()))

    # ------------------------------------------------------------ rows

    def _row(self, job_id: str) -> JobRow:
        row = self.statuses.rows.get(job_id) or self.ledger.job(job_id)
        if row is None:
            raise JobNotFound(job_id)
        return row

    def _set_state(self, job_id: str, state: JobState, error: str | None = None) -> None:
        """Write a state change, refresh the row from the ledger, post the status."""
        self.ledger.set_state(job_id, state, error)
        self.statuses.changed(job_id, self.ledger.job(job_id))

    def _error_records(self, row: JobRow) -> builtins.list[ErrorRecord]:
        output = open_output(row.output)
        if not output.has_manifest():
            # A job that kept no row (each one bad) has no manifest, but its ingestion's
            # errors say why: what its failure tells the user to read.
            table = output.ingest_errors()
            return [ErrorRecord(sample_index=i, reason=r) for i, r in zip(
                table.column("sample_index").to_pylist(), table.column("reason").to_pylist(),
                strict=True)]
        given_up = [(start, end, f"unit {unit} was given up: {error}")
                    for unit, start, end, error in self.ledger.failed_units(row.id)]
        return [ErrorRecord(sample_index=e.sample_index, reason=e.reason)
                for e in output.errors(given_up=given_up)]

    # ------------------------------------------------------------ the job thread

    def _loop(self) -> None:
        """The job thread: connect Ray, reconcile, then run queued jobs one at a time.

        It ends when the coordinator stops or loses the lease; a return is a clean end,
        an exception escaping it a death that the supervisor repairs.
        """
        try:
            ensure_ray(getattr(self.settings, "ray_address", None), cpus_needed=1)
            warm_preflight()
            self._reconcile()
            if not self._trainings_resumed:
                self._trainings_resumed = True
                rows = {row.id: row for row in self.ledger.jobs()}
                for training in self.ledger.trainings():
                    row = rows.get(training.job_id)
                    if row is not None and not training.state.finished:
                        logger.info("resuming the training of %s", row.id)
                        try:
                            self._start_training(row, training.spec)
                        except JobRefused as err:  # the cluster can no longer run it
                            self.ledger.set_training(row.id, TrainState.failed, str(err))
        except LeaseLost:
            self._lost.set()
            self._thread_ended = True
            return
        except Exception:
            logger.exception("the scheduler cannot start (Ray or the ledger); trying again")
            self._thread_ended = True
            return
        self._ready = True
        while not self._stop.is_set() and not self._lost.is_set():
            # Engines kept warm yield their GPUs to trainings and evaluations that wait.
            self.pool.release_idle()
            row = self.ledger.next_queued()
            if row is None:
                with self._wake:
                    self._wake.wait(timeout=1.0)
                continue
            self._current = row.id
            try:
                self._run(row)
            except LeaseLost as err:
                logger.warning("job %s: %s", row.id, err)
                self._lost.set()
            except Exception as err:  # never let one job's bug stop the scheduler
                self._run_failed(row.id, err)
            self._current = None  # (left set when the thread dies: the supervisor reads it)
        self._thread_ended = True

    def _run_failed(self, job_id: str, err: Exception) -> None:
        """A run raised what `_run` does not handle: Ray lost, a dataset, or a bug."""
        from hsx.ingest import DatasetError

        try:
            if isinstance(err, DatasetError):
                self._end(job_id, JobState.failed, f"dataset: {err}")
            elif _ray_lost(err):
                self._reset_engines()
                with contextlib.suppress(Exception):
                    import ray

                    ray.shutdown()  # the next run connects again (ensure_ray)
                self._runner_died(job_id, f"Ray was lost ({type(err).__name__}: {err})")
            else:
                logger.error("job %s: unexpected error", job_id, exc_info=err)
                self._end(job_id, JobState.failed,
                          f"internal error: {type(err).__name__}: {err} (see the logs)")
        except LeaseLost:
            self._lost.set()

    def _run(self, row: JobRow) -> None:
        job_id = row.id
        self._set_state(job_id, JobState.running)
        try:
            plan = self.statuses.plans[job_id] = plan_for_cluster(row.spec)
        except JobRefused as err:  # the cluster shrank since the submit
            self._end(job_id, JobState.failed, str(err))
            return

        def planned(job: PreparedJob, units: list[WorkUnit], ingested: bool) -> None:
            self.ledger.plan(job_id, [(u.unit, u.row_start, u.row_end, u.tokens)
                                      for u in units])
            self.ledger.reconcile_units(job_id, {u.unit for u in units} & job.committed)
            if ingested and row.spec.train is not None and \
                    self.ledger.training(job_id) is None:
                # Started once the plan is whole, it follows the shards as they are
                # committed (or waits for the end when `follow` is off, or when its plan
                # trains after extracting).
                self._start_training(row, row.spec.train)

        def prepared(job: PreparedJob) -> None:
            progress = job.totals().progress()
            progress.ingesting = job.ingestion is not None
            self._start_run(job_id, progress)
            # Engines stay warm between jobs on the same config; others give their place.
            self.pool.keep_only(engine_key(row.spec, job.model, job.layers,
                                           plan.engine_memory), plan.replicas)
            # A job whose dataset is still being tokenized hears of its units as they
            # are planned (on_planned); its ingestion shows in its progress.
            planned(job, job.units, job.ingestion is None)

        hooks = DispatchHooks(
            on_prepared=prepared,
            on_planned=planned,
            on_ingest=lambda p: self.statuses.ingesting(job_id, p.rows, p.rows_expected),
            on_progress=lambda p: self.statuses.progressed(job_id, self._with_trainer(
                job_id, p)),
            on_engines=self._engines_of(job_id).placed,
            on_unit_done=lambda report: self._on_unit_done(job_id, report),
            on_unit_error=lambda unit, attempt, msg, gave_up: self._on_unit_error(
                job_id, unit, attempt, msg, gave_up),
            on_restart=lambda _name: self._on_restart(job_id),
            # A coordinator that lost its lease stops dispatching, as for a cancel.
            cancelled=lambda: job_id in self._cancel or self._lost.is_set(),
            on_waiting=lambda reason: self.statuses.waiting(job_id, reason),
        )
        try:
            run_job(row.spec, pool=self.pool, hooks=hooks, max_attempts=self.max_attempts,
                    job_id=job_id, submitted_at=row.created_at, plan=plan)
        except (JobRefused, JobFailed) as err:
            self._end(job_id, JobState.failed, str(err))
        except JobCancelled:
            self._end(job_id, JobState.cancelled, "cancelled")
        else:
            self._end(job_id, JobState.succeeded, None)

    # The hooks below run in the thread that drives the engines: memory, the board and
    # queued ledger writes only.

    def _with_trainer(self, job_id: str, progress: JobProgress) -> JobProgress:
        """The run's progress, with where its trainer's workers run when the stream did
        not say (an offline job's)."""
        if not progress.trainer_nodes:
            progress.trainer_nodes = dict(enumerate(self.trainings.trainer_nodes(job_id)))
        return progress

    def _start_run(self, job_id: str, progress: JobProgress) -> None:
        self.statuses.run_started(job_id, progress)
        self.job_metrics.run_started(job_id, progress.tokens_done, progress.samples_done,
                                     progress.bytes, progress.shards)

    def _on_unit_done(self, job_id: str, report: Any) -> None:
        self.ledger.unit_committed(job_id, report)
        self.job_metrics.unit_done(job_id, report)
        self.statuses.unit_committed(job_id, report)

    def _on_restart(self, job_id: str) -> None:
        self.ledger.add_restart(job_id)
        self.statuses.restarted(job_id)

    def _on_unit_error(
        self, job_id: str, unit: WorkUnit, attempt: int, message: str, gave_up: bool
    ) -> None:
        error = f"unit {unit.unit} attempt {attempt}: {message}"
        self.ledger.unit_failed(job_id, unit.unit, attempt, message, gave_up)
        self.ledger.set_error(job_id, error)
        self.job_metrics.unit_failed(job_id)
        self.statuses.attempt_failed(job_id, error)

    def _end(self, job_id: str, state: JobState, error: str | None) -> None:
        self.statuses.run_ended(job_id)
        with self._lock:
            self._cancel.discard(job_id)
        self._set_state(job_id, state, error)  # applies the queued writes first
        if state.finished:
            self._extracted.setdefault(job_id, threading.Event()).set()
        train = self._row(job_id).spec.train
        if state in (JobState.cancelled, JobState.failed) and train is not None and \
                train.online:
            self.trainings.stop_job(job_id)  # its engines no longer capture for it


def _ray_lost(err: BaseException) -> bool:
    """Whether `err` means this process lost Ray (not that a job went wrong)."""
    if isinstance(err, ConnectionError):
        return True
    if "ray" not in sys.modules:  # never imported: not what failed
        return False
    from ray.exceptions import RaySystemError, RpcError

    return isinstance(err, RaySystemError | RpcError)


def check_manifest_is_the_jobs(row: JobRow) -> None:
    """Refuse to train on an output whose manifest is not the job's own, field by field
    (`resume.manifest_expected`): the trainer reads the layers, the sizes and the plan
    from it (the model and its code come from the job itself), and whoever can write the
    output could otherwise have changed it since the extraction."""
    manifest = open_output(row.output).read_manifest()
    if manifest is None:
        return
    spec = row.spec
    try:
        info = read_model_info(spec.model)
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    layers = info.job_layers(spec.layers, spec.engine, spec.layers_method)
    differs = manifest.differences(manifest_expected(spec, info, layers))
    if differs:
        raise JobRefused(f"{row.output}: its manifest's {', '.join(differs)} differ from job "
                         f"{row.id}'s (another job wrote it, or it was changed since); the "
                         "coordinator trains only on what the job itself made")


def thin_curve(points: builtins.list[tuple[float, float, int]],
               most: int) -> builtins.list[tuple[float, float, int]]:
    """At most `most` points: consecutive points averaged in equal groups (the last point
    of each group keeps its time and tokens, the rate is the group's mean)."""
    if len(points) <= most:
        return points
    size = -(-len(points) // most)
    out = []
    for i in range(0, len(points), size):
        group = points[i : i + size]
        out.append((group[-1][0], sum(p[1] for p in group) / len(group), group[-1][2]))
    return out


def check_draft_layers(spec: JobSpec, train: TrainSpec | None = None) -> None:
    """Refuse training a job whose layers cannot feed a draft of the training's method
    (`train`, else the job's own `train:`): JobRefused naming what is missing."""
    from hsx.methods import draft_aux_layers
    from hsx.modelinfo import read_model_info

    method = (train or spec.train or TrainSpec()).method
    manifest = open_output(spec.output).read_manifest()
    if manifest is not None:
        layers, n = manifest.layers, manifest.num_layers
    else:
        info = read_model_info(spec.model)
        layers = info.job_layers(spec.layers, spec.engine, spec.layers_method)
        n = info.num_layers
    try:
        draft_aux_layers(layers, n, method)
    except ValueError as err:
        raise JobRefused(f"train: {err}") from None
