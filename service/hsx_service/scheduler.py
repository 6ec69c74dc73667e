"""The coordinator's scheduler: jobs from the ledger, run one after another on Ray.

Routes call `submit`, `get`, `list`, `cancel`, `errors`, `subscribe` — all quick: they
validate, read the ledger and enqueue. One background thread takes the oldest queued
job and runs it to the end with the job driver the CLI uses (`runner.run_job`): prepare
(ingest, plan), then units fed to `replicas` engine actors, restarts and retries
included, then complete.json. Its hooks send progress to the ledger (units, attempts,
commits) and to subscribers (the SSE streams).

On `start` the ledger is reconciled with the outputs — the outputs' commit records are
the truth — and every job that was running when the coordinator stopped is queued
again, ahead of newer ones, so a `kill -9` costs only the units that were in flight.
"""

from __future__ import annotations

import builtins
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from hsx.output import OutputCorrupt, StorageError
from hsx.plan import WorkUnit
from hsx.progress import JobProgress
from hsx.spec import JobSpec, TrainSpec
from hsx.wire import ErrorPage, ErrorRecord, JobState, JobStatus, TrainStatus, WorkerStatus
from hsx_service.errors import JobConflict, JobNotFound, NotReady
from hsx_service.ledger import JobRow, Ledger
from hsx_service.prepare import (
    JobRefused,
    PreparedJob,
    check_estimated_output,
    open_output,
    preflight,
)
from hsx_service.runner import (
    MAX_ATTEMPTS,
    DispatchHooks,
    EnginePool,
    JobCancelled,
    JobFailed,
    check_capacity,
    engine_key,
    ensure_ray,
    run_job,
)
from hsx_service.training import Trainings

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.25  # at most this often per job, for progress (not state) changes


class Scheduler:
    """Runs queued jobs in order; see the module docstring for who calls what."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.ledger = Ledger(settings.ledger_path)
        self.max_attempts = int(getattr(settings, "max_unit_attempts", MAX_ATTEMPTS))
        self.pool = EnginePool()
        self._ready = False
        self._stop = threading.Event()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._live: dict[str, JobProgress] = {}  # running (or last run) job's progress
        self._finished: dict[str, JobProgress] = {}  # numbers of ended jobs, read once
        self._cancel: set[str] = set()
        self._subscribers: dict[str, builtins.list[queue.Queue[JobStatus | None]]] = (
            defaultdict(list)
        )
        self._last_publish: dict[str, float] = {}
        self.trainings = Trainings(self.ledger)

    # ------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self._ready

    def start(self) -> None:
        """Returns at once; Ray and the reconcile happen in the scheduler's thread, and
        `ready` turns True when they are done (until then /readyz answers 503)."""
        self._thread = threading.Thread(target=self._loop, name="hsx-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.trainings.stop()
        self.pool.shutdown()

    def _reconcile(self) -> None:
        """After a restart: running jobs go back to the queue, units agree with outputs."""
        for row in self.ledger.jobs():
            if row.state == JobState.running:
                logger.info("resuming job %s after a coordinator restart", row.id)
                self.ledger.set_state(row.id, JobState.queued)
            if not row.state.finished:
                output = open_output(row.output)
                if output.has_manifest():
                    self.ledger.reconcile_units(row.id, output.committed_units())

    # ------------------------------------------------------------ routes' API

    def submit(self, spec: JobSpec, job_id: str | None) -> tuple[JobStatus, bool]:
        if not self._ready:
            raise NotReady("the coordinator is still starting")
        job_id = job_id or f"job-{uuid.uuid4().hex[:10]}"
        existing = self.ledger.job(job_id)
        if existing is not None:
            return self._same_or_conflict(existing, spec), False
        check_estimated_output(spec, *preflight(spec))
        check_capacity(spec)
        if spec.train is not None:
            draft_root(spec.output)
        location = open_output(spec.output).location
        for other in self.ledger.jobs():
            if not other.state.finished and open_output(other.output).location == location:
                raise JobConflict(f"output {spec.output} is in use by job {other.id}")
        row = self.ledger.insert_job(job_id, spec, spec.output)
        if row is None:  # another request inserted the same id just now
            raced = self.ledger.job(job_id)
            if raced is None:
                raise RuntimeError(f"ledger lost job {job_id}")
            return self._same_or_conflict(raced, spec), False
        with self._wake:
            self._wake.notify_all()
        self._publish(job_id, force=True)
        return self._status(row), True

    def _same_or_conflict(self, row: JobRow, spec: JobSpec) -> JobStatus:
        if row.spec.model_dump() != spec.model_dump():
            raise JobConflict(f"job {row.id} already exists with a different spec")
        return self._status(row)

    def get(self, job_id: str) -> JobStatus:
        return self._status(self._row(job_id))

    def list(self, state: JobState | None = None) -> builtins.list[JobStatus]:
        return [self._status(row) for row in self.ledger.jobs(state)]

    def cancel(self, job_id: str) -> JobStatus:
        row = self._row(job_id)
        if row.state == JobState.queued:
            self.ledger.set_state(job_id, JobState.cancelled)
            self._publish(job_id, force=True, final=True)
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
            raise NotReady("the coordinator is still starting")
        row = self._row(job_id)
        root = draft_root(row.output)
        if row.state in (JobState.failed, JobState.cancelled) and not (
                open_output(row.output).has_manifest()):
            raise JobRefused(f"job {job_id} is {row.state.value} and left no output to train on")
        check_draft_layers(row.spec)
        self.trainings.start(job_id, root, spec)
        return self.train_status(job_id)

    def train_status(self, job_id: str) -> TrainStatus:
        row = self._row(job_id)
        training = self.ledger.training(job_id)
        if training is None:
            raise JobNotFound(
                f"job {job_id} has no training; POST /v1/jobs/{job_id}/train starts one")
        return self.trainings.status(training, draft_root(row.output))

    def subscribe(self, job_id: str) -> queue.Queue[JobStatus | None]:
        row = self._row(job_id)
        q: queue.Queue[JobStatus | None] = queue.Queue()
        with self._lock:
            self._subscribers[job_id].append(q)
        q.put(self._status(row))
        if row.state.finished:
            q.put(None)
        return q

    def unsubscribe(self, job_id: str, q: queue.Queue[JobStatus | None]) -> None:
        with self._lock:
            subs = self._subscribers.get(job_id, [])
            if q in subs:
                subs.remove(q)

    def metrics(self) -> dict[str, float]:
        db = self.ledger
        rows = db._conn().execute(
            "SELECT COALESCE(SUM(samples),0), COALESCE(SUM(failed),0), COALESCE(SUM(tokens),0), "
            "COALESCE(SUM(bytes),0), COUNT(*) FROM commits"
        ).fetchone()
        seconds, count = db.unit_seconds()
        jobs = db.jobs()
        out: dict[str, float] = {
            "hsx_samples_total": rows[0],
            "hsx_samples_failed_total": rows[1],
            "hsx_tokens_total": rows[2],
            "hsx_bytes_total": rows[3],
            "hsx_shards_total": rows[4],
            "hsx_unit_seconds_sum": seconds,
            "hsx_unit_seconds_count": count,
            "hsx_queue_depth": sum(j.state == JobState.queued for j in jobs),
            "hsx_worker_restarts_total": sum(j.restarts for j in jobs),
        }
        for state in JobState:
            out[f'hsx_jobs{{state="{state.value}"}}'] = sum(j.state == state for j in jobs)
        return out

    # ------------------------------------------------------------ status

    def _row(self, job_id: str) -> JobRow:
        row = self.ledger.job(job_id)
        if row is None:
            raise JobNotFound(job_id)
        return row

    def _status(self, row: JobRow) -> JobStatus:
        live = self._live.get(row.id)
        status = JobStatus(
            id=row.id, name=row.spec.name, state=row.state, output=row.output,
            created_at=row.created_at, started_at=row.started_at, finished_at=row.finished_at,
            restarts=row.restarts, last_error=row.last_error, spec=row.spec,
            updated_at=time.time(),
        )
        if live is None:
            live = self._progress_from_output(row)
        if live is not None:
            status.samples_total = live.samples_total
            status.samples_done = live.samples_done
            status.samples_failed = live.samples_failed
            status.tokens_total = live.tokens_total
            status.tokens_done = live.tokens_done
            status.bytes = live.bytes
            status.shards = live.shards
            status.units_total = live.units_total
            status.units_done = live.units_done
            status.units_failed = live.units_failed
            if row.state == JobState.running:
                status.tokens_per_s = round(live.tokens_per_s(), 1)
                status.eta_s = live.eta_s()
                status.workers = [
                    WorkerStatus(name=name, state=state, unit=live.worker_units.get(name))
                    for name, state in sorted(live.workers.items())
                ]
        return status

    def _progress_from_output(self, row: JobRow) -> JobProgress | None:
        """Numbers of a job that is not running now, read back from its output."""
        if row.id in self._finished:
            return self._finished[row.id]
        try:
            output = open_output(row.output)
            if not output.has_manifest():
                return None
            progress = output.totals().progress()
        except (OSError, ValueError, JobRefused, StorageError, OutputCorrupt):
            return None
        progress.units_failed = len(self.ledger.failed_units(row.id))
        if row.state.finished:
            self._finished[row.id] = progress
        return progress

    def _error_records(self, row: JobRow) -> builtins.list[ErrorRecord]:
        output = open_output(row.output)
        if not output.has_manifest():
            return []
        given_up = [(start, end, f"unit {unit} was given up: {error}")
                    for unit, start, end, error in self.ledger.failed_units(row.id)]
        return [ErrorRecord(sample_index=e.sample_index, reason=e.reason)
                for e in output.errors(given_up=given_up)]

    def _publish(self, job_id: str, *, force: bool = False, final: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_publish.get(job_id, 0.0) < PUBLISH_INTERVAL_S:
            return
        self._last_publish[job_id] = now
        with self._lock:
            subs = list(self._subscribers.get(job_id, []))
        if not subs:
            return
        status = self.get(job_id)
        for q in subs:
            q.put(status)
            if final:
                q.put(None)

    # ------------------------------------------------------------ the job thread

    def _loop(self) -> None:
        ensure_ray(getattr(self.settings, "ray_address", None), cpus_needed=1)
        self._reconcile()
        self.trainings.resume_all({
            row.id: root for row in self.ledger.jobs()
            if (root := open_output(row.output).local_root) is not None})
        self._ready = True
        while not self._stop.is_set():
            row = self.ledger.next_queued()
            if row is None:
                with self._wake:
                    self._wake.wait(timeout=1.0)
                continue
            try:
                self._run(row)
            except Exception:  # never let one job's bug stop the scheduler
                logger.exception("job %s: unexpected error", row.id)
                self.ledger.set_state(row.id, JobState.failed, "internal error; see the logs")
                self._publish(row.id, force=True, final=True)

    def _run(self, row: JobRow) -> None:
        job_id = row.id
        self.ledger.set_state(job_id, JobState.running)
        self._publish(job_id, force=True)

        def prepared(job: PreparedJob) -> None:
            self.ledger.plan(job_id, [(u.unit, u.row_start, u.row_end, u.tokens)
                                      for u in job.units])
            self.ledger.reconcile_units(job_id, {u.unit for u in job.units} - {
                u.unit for u in job.pending})
            self._live[job_id] = job.output.totals().progress()
            if row.spec.train is not None and self.ledger.training(job_id) is None:
                # Started now, it follows the shards as they are committed (or waits for
                # the end when `follow` is off).
                self.trainings.start(job_id, draft_root(row.output), row.spec.train)
            # Engines stay warm between jobs on the same config; others give their place.
            self.pool.keep_only(engine_key(row.spec, job.model, job.layers))

        hooks = DispatchHooks(
            on_prepared=prepared,
            on_progress=lambda p: self._on_progress(job_id, p),
            on_unit_done=lambda report: self.ledger.unit_committed(job_id, report),
            on_unit_error=lambda unit, attempt, msg, gave_up: self._on_unit_error(
                job_id, unit, attempt, msg, gave_up),
            on_restart=lambda _name: self.ledger.add_restart(job_id),
            cancelled=lambda: job_id in self._cancel,
        )
        try:
            run_job(row.spec, pool=self.pool, hooks=hooks, max_attempts=self.max_attempts)
        except (JobRefused, JobFailed) as err:
            self._end(job_id, JobState.failed, str(err))
        except JobCancelled:
            self._end(job_id, JobState.cancelled, "cancelled")
        else:
            self._end(job_id, JobState.succeeded, None)

    def _on_progress(self, job_id: str, progress: JobProgress) -> None:
        previous = self._live.get(job_id)
        self._live[job_id] = progress
        # A worker changing state is news; plain counters are throttled.
        changed = previous is None or previous.workers != progress.workers
        self._publish(job_id, force=changed)

    def _on_unit_error(
        self, job_id: str, unit: WorkUnit, attempt: int, message: str, gave_up: bool
    ) -> None:
        self.ledger.unit_failed(job_id, unit.unit, attempt, message, gave_up)
        self.ledger.set_error(job_id, f"unit {unit.unit} attempt {attempt}: {message}")

    def _end(self, job_id: str, state: JobState, error: str | None) -> None:
        live = self._live.get(job_id)
        if live is not None:
            live.workers.clear()
        with self._lock:
            self._cancel.discard(job_id)
        self.ledger.set_state(job_id, state, error)
        self._publish(job_id, force=True, final=True)


def draft_root(output: str) -> Path:
    """The local folder a job's draft is trained into (its output's draft/ lives there).

    JobRefused for an object-store output: the coordinator's trainer publishes
    checkpoints by directory rename and hard links, so it needs a local (or mounted)
    output; `hsx train URI --draft-dir DIR` trains from a bucket into a local folder.
    """
    root = open_output(output).local_root
    if root is None:
        raise JobRefused(
            f"train: {output} is an object store, and the coordinator trains drafts into "
            "the output's draft/ folder on a file system; run `hsx train "
            f"{output} --draft-dir DIR` to train from it into a local folder"
        )
    return root


def check_draft_layers(spec: JobSpec) -> None:
    """Refuse training a job whose layers cannot feed an EAGLE-3 draft (JobRefused)."""
    from hsx.modelinfo import draft_aux_layers, read_model_info

    manifest = open_output(spec.output).read_manifest()
    if manifest is not None:
        layers, n = manifest.layers, manifest.num_layers
    else:
        info = read_model_info(spec.model)
        layers, n = spec.layers or info.default_layers(spec.engine), info.num_layers
    try:
        draft_aux_layers(layers, n)
    except ValueError as err:
        raise JobRefused(f"train: {err}") from None
