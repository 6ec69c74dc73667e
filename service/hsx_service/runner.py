"""The job driver: prepared work units, fed to ExtractionWorker actors on Ray.

`run_job` is the one job driver: `hsx extract` calls it in one process tree, and the
coordinator's scheduler calls it with hooks that keep its ledger and its subscribers
up to date. It prepares the job (preflight, ingestion, plan: prepare.py), starts (or
joins) Ray, gets `replicas` workers from an `EnginePool` (engine_pool.py), and `execute`
hands each idle worker the next pending unit — workers
pull, so a slow engine never holds up the others. A worker that dies (its process
killed, its engine dead, its Ray node lost) is restarted by Ray and its units go back to
the queue for the other workers; one that cannot come back (its node gone, no room left)
is asked again now and then while the others finish the job. A unit that fails
`max_attempts` times fails the job. When every unit is committed it publishes
complete.json. Whatever happens, the output stays consistent: a unit is done exactly
when its commit record exists.

The names drivers use are all importable from here: the engine pool's, the
dispatcher's hooks and result, and the job's outcomes (`JobFailed`, `JobCancelled`).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hsx import __version__
from hsx.output import CommitRecord, OutputCorrupt, OutputTotals, StorageError
from hsx.output.storage import is_disk_full
from hsx.plan import WorkUnit
from hsx.progress import JobProgress
from hsx.spec import JobSpec
from hsx.wire import ResourcePlan
from hsx_service.engine_pool import (
    DISPATCH_DEPTH,
    EnginePool,
    EngineSlot,
    Waits,
    engine_bundles,
    engine_config_for,
    engine_key,
    engine_resources,
    ensure_ray,
    in_group,
    target_engine_args,
)
from hsx_service.errors import JobCancelled, JobFailed
from hsx_service.placement import ClusterShape, plan_job
from hsx_service.prepare import JobRefused, PreparedJob, prepare

# The names drivers, tests and benchmarks import from here, the engine pool's among them.
__all__ = [
    "DISPATCH_DEPTH",
    "MAX_ATTEMPTS",
    "DispatchHooks",
    "DispatchResult",
    "EnginePool",
    "JobCancelled",
    "JobFailed",
    "JobSummary",
    "engine_bundles",
    "engine_config_for",
    "engine_key",
    "engine_resources",
    "ensure_ray",
    "execute",
    "finish",
    "in_group",
    "run_job",
    "target_engine_args",
]

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
POLL_S = 0.5
START_GRACE_S = 120.0
# A restarted worker is asked whether it is ready up to READY_CHECKS times (pauses growing
# by READY_PAUSE_S to READY_PAUSE_MAX_S: about 3 minutes in all) before the job fails, when
# no other engine is left; while others run the job, it is asked every READY_PAUSE_MAX_S
# for as long as the job runs (a lost node's engine waits for room in the cluster).
READY_CHECKS = 100
READY_PAUSE_S = 0.2
READY_PAUSE_MAX_S = 2.0


@dataclass
class JobSummary:
    output: str
    samples: int
    errors: int
    tokens: int
    bytes: int
    shards: int
    seconds: float
    nothing_to_do: bool = False
    restarts: int = 0

    @classmethod
    def of(cls, totals: OutputTotals, output: str, seconds: float, **extra: Any) -> JobSummary:
        return cls(output=output, samples=totals.samples, errors=totals.errors,
                   tokens=totals.tokens, bytes=totals.bytes, shards=totals.units_done,
                   seconds=seconds, **extra)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)



def _first_line(err: BaseException) -> str:
    """The remote error's own message, without Ray's traceback around it."""
    cause = getattr(err, "cause", None)
    if cause is not None:
        return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    text = str(err)
    # An actor that died in its constructor: Ray's message embeds the error line.
    for line in reversed(text.splitlines()):
        stripped = line.strip()
        if re.match(r"^[\w.]*(Error|Exception|Failed|Dead)\b.*: ", stripped):
            return stripped
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


@dataclass
class DispatchHooks:
    """What a driver wants to hear while a job runs (the CLI: progress; the service: all)."""

    # The job is prepared (its output has a manifest and a plan); no engine started yet.
    on_prepared: Callable[[PreparedJob], None] | None = None
    on_progress: Callable[[JobProgress], None] | None = None
    on_unit_done: Callable[[Any], None] | None = None  # UnitReport
    # (unit, attempt, message, gave_up): an attempt failed; gave_up after the last one.
    on_unit_error: Callable[[WorkUnit, int, str, bool], None] | None = None
    on_restart: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] | None = None
    # Where the job's engines run (placement.plan_job), before any engine starts.
    on_plan: Callable[[ResourcePlan], None] | None = None
    # What the job waits for (GPUs, Ray's placement) and who holds it; None once it stops.
    on_waiting: Callable[[str | None], None] | None = None


@dataclass
class DispatchResult:
    failed_units: dict[int, str] = field(default_factory=dict)  # unit -> last error
    cancelled: bool = False
    restarts: int = 0
    fatal: str | None = None  # what stopped the whole job (a full disk), not one unit


def run_job(
    spec: JobSpec,
    *,
    pool: EnginePool | None = None,
    hooks: DispatchHooks | None = None,
    max_attempts: int = MAX_ATTEMPTS,
    job_id: str = "local",
    submitted_at: float | None = None,
    plan: ResourcePlan | None = None,
) -> JobSummary:
    """Run a job to completion: prepare, dispatch the pending units, publish complete.json.

    Raises JobRefused before anything heavy starts; JobFailed (units given up, engines
    that cannot start) or JobCancelled (`hooks.cancelled`) after. A job found complete
    returns at once (`nothing_to_do`). Without a `pool` one is made and shut down after.
    `job_id` and `submitted_at` name the job and its place in line to the pool's GPU
    arbiter; `plan` is where its engines run (made here from the cluster if not given).
    """
    hooks = hooks or DispatchHooks()
    started = time.time()
    try:
        job = prepare(spec)
    except (StorageError, OutputCorrupt) as err:  # the output failed while being prepared
        raise JobRefused(f"output: {err}") from err
    except OSError as err:
        if is_disk_full(err):
            raise JobFailed(disk_full_message(spec.output, err)) from err
        raise
    if hooks.on_prepared is not None:
        hooks.on_prepared(job)
    try:
        if job.complete and not job.pending:
            return JobSummary.of(job.output.totals(), str(job.output), time.time() - started,
                                 nothing_to_do=True)
        result = DispatchResult()
        if job.pending:
            owned = pool is None
            pool = pool or EnginePool()
            try:
                result = execute(job, pool, hooks, max_attempts, job_id=job_id,
                                 submitted_at=submitted_at or started, plan=plan)
            finally:
                if owned:
                    pool.shutdown()
        if result.fatal is not None:
            raise JobFailed(result.fatal)
        if result.cancelled:
            raise JobCancelled("cancelled")
        if result.failed_units:
            raise JobFailed(
                failed_units_message(result.failed_units, len(job.units), max_attempts))
        return finish(job, started, restarts=result.restarts)
    except (StorageError, OutputCorrupt) as err:  # committed units stay valid
        raise JobFailed(f"output: {err}") from err
    except OSError as err:
        if is_disk_full(err):
            raise JobFailed(disk_full_message(job.output, err)) from err
        raise


def disk_full_message(output: Any, err: BaseException) -> str:
    """The one message of a job stopped by a full output file system."""
    return (f"output: no space left on device (ENOSPC) on {output}: free space there and "
            f"run the job again; every committed unit is kept ({_first_line(err)})")


def finish(job: PreparedJob, started: float, *, restarts: int = 0) -> JobSummary:
    """Every unit is committed: drop what attempts left behind, publish complete.json."""
    # Every unit is committed: no attempt (of this driver or another) can commit now,
    # so whatever no record names is garbage.
    job.output.clean_orphans(final=True)
    summary = JobSummary.of(job.output.totals(), str(job.output), time.time() - started,
                            restarts=restarts)
    job.output.mark_complete(
        {**summary.as_dict(), "hsx_version": __version__, "completed_at": time.time()}
    )
    return summary


def failed_units_message(failed: dict[int, str], total: int, max_attempts: int) -> str:
    last = failed[max(failed)]
    return (
        f"{len(failed)} of {total} units failed {max_attempts} times and were given up "
        f"(units {sorted(failed)[:10]}); last error: {last}"
    )


def execute(
    job: PreparedJob, pool: EnginePool, hooks: DispatchHooks, max_attempts: int = MAX_ATTEMPTS,
    *, job_id: str = "local", submitted_at: float = 0.0, plan: ResourcePlan | None = None,
) -> DispatchResult:
    """Feed the job's pending units to its workers until none is left (or cancelled).

    Each worker holds up to DISPATCH_DEPTH units, so its engine never drains between
    them. A worker that fails (its process died, or a unit raised) is restarted, and
    every unit it held counts an attempt and is retried alone on a worker, so a unit
    that kills engines is told apart from the units that were beside it. A unit that
    fails `max_attempts` times is given up: it stays uncommitted (a rerun retries it)
    and the others go on. On cancel, dispatch stops and the units already handed out
    end by committing; nothing half-written becomes visible either way. Its engines come
    from `pool` once the pool's GPU arbiter and Ray have their GPUs (placement.py), and
    are parked (idle, kept warm) when it ends.
    """
    spec = job.spec
    job.output.clean_orphans()  # what lost attempts left; another driver may be running
    config = engine_config_for(spec, job.model, job.layers)
    ensure_ray(spec.ray_address, (spec.replicas or 1) * spec.tensor_parallel_size)
    plan = plan or plan_job(spec, ClusterShape.of_ray())
    if hooks.on_plan is not None:
        hooks.on_plan(plan)
    try:
        slots = pool.slots(spec.engine, config, plan.replicas, spec, job=job_id,
                           order=submitted_at,
                           waits=Waits(cancelled=hooks.cancelled, on_wait=hooks.on_waiting))
        return _dispatch(job, pool, hooks, slots, max_attempts)
    finally:
        pool.park()


def _dispatch(job: PreparedJob, pool: EnginePool, hooks: DispatchHooks, slots: list[EngineSlot],
              max_attempts: int) -> DispatchResult:
    """execute's loop over the job's workers (see there)."""
    import ray
    from ray.exceptions import GetTimeoutError, NodeDiedError, RayActorError, RayTaskError

    spec = job.spec
    result = DispatchResult()
    progress = job.output.totals().progress()
    queue: deque[WorkUnit] = deque(job.pending)
    attempts: dict[int, int] = {}
    alone: set[int] = set()  # units that were on a failed worker: retried one at a time
    # unit -> (samples, tokens) captured, (samples, tokens) regenerated, while it runs
    live: dict[int, tuple[int, int, int, int]] = {}
    last_poll = 0.0

    def emit(extra_live: bool) -> None:
        shown = JobProgress(**{**progress.__dict__, "workers": {}})
        if extra_live:
            # What is shown includes the units still running, as far as they got.
            shown.samples_done += sum(c[0] for c in live.values())
            shown.tokens_done += sum(c[1] for c in live.values())
            shown.rate_tokens += sum(c[1] for c in live.values())
            shown.samples_generated += sum(c[2] for c in live.values())
            shown.tokens_generated += sum(c[3] for c in live.values())
        for slot in slots:
            shown.workers[slot.name] = slot.state
            if slot.unit is not None:
                shown.worker_units[slot.name] = slot.unit.unit
        if hooks.on_progress is not None:
            hooks.on_progress(shown)

    def fail_slot(slot: EngineSlot, err: BaseException, kill: bool) -> None:
        """Every unit the worker held failed an attempt; restart the worker."""
        message = _first_line(err)
        if not slot.inflight:
            raise JobFailed(f"{slot.name}: {message}") from err
        retry = []
        for ref, unit in list(slot.inflight.items()):
            try:
                # The attempt may have committed before its worker died: then it is done.
                record = job.output.read_commit(unit.unit)
            except FileNotFoundError:
                record = None
            if record is not None:
                unit_done(slot, ref, record_report(record, slot.name))
                continue
            attempts[unit.unit] = attempts.get(unit.unit, 0) + 1
            gave_up = attempts[unit.unit] >= max_attempts
            logger.warning("unit %d failed on %s (attempt %d): %s",
                           unit.unit, slot.name, attempts[unit.unit], message)
            if hooks.on_unit_error is not None:
                hooks.on_unit_error(unit, attempts[unit.unit], message, gave_up)
            live.pop(unit.unit, None)
            if gave_up:
                result.failed_units[unit.unit] = message
                progress.units_failed += 1
            else:
                alone.add(unit.unit)
                retry.append(unit)
        queue.extendleft(reversed(retry))
        slot.inflight.clear()
        restart(slot, kill)

    def stop_for_full_disk(slot: EngineSlot, ref: Any, err: BaseException) -> None:
        """The output's disk is full: no unit can commit. Dispatch stops, the units
        in flight end (they fail alike or commit), the job fails naming ENOSPC."""
        unit = slot.inflight.pop(ref)
        message = _first_line(err)
        logger.error("unit %d: the output is full: %s", unit.unit, message)
        live.pop(unit.unit, None)
        result.failed_units[unit.unit] = message
        if hooks.on_unit_error is not None:
            hooks.on_unit_error(unit, attempts.get(unit.unit, 0) + 1, message, True)
        if result.fatal is None:
            result.fatal = disk_full_message(job.output, err)
        queue.clear()
        slot.state = "busy" if slot.inflight else "idle"

    def unit_done(slot: EngineSlot, ref: Any, report: Any) -> None:
        unit = slot.inflight.pop(ref)
        alone.discard(unit.unit)
        slot.state = "busy" if slot.inflight else "idle"
        slot.units_run += 1
        live.pop(unit.unit, None)
        progress.units_done += 1
        progress.shards += 1
        progress.samples_done += report.samples + len(report.errors)
        progress.samples_failed += len(report.errors)
        progress.tokens_done += report.tokens
        progress.bytes += report.bytes
        progress.rate_tokens += report.tokens
        progress.samples_generated += report.generated
        progress.tokens_generated += report.generated_tokens
        if hooks.on_unit_done is not None:
            hooks.on_unit_done(report)

    def restart(slot: EngineSlot, kill: bool) -> None:
        pool.restarts += 1
        result.restarts += 1
        progress.restarts += 1
        if kill:
            ray.kill(slot.actor, no_restart=False)
        slot.state = "starting"
        slot.ever_ready = True  # it served before: its readiness checks are a restart's
        slot.ready_failures = 0
        slot.ready_ref = slot.actor.ready.remote()
        if hooks.on_restart is not None:
            hooks.on_restart(slot.name)

    def dispatch(slot: EngineSlot) -> bool:
        """Hand the slot units up to its depth; a unit retried alone gets a slot to itself."""
        sent = False
        while queue and len(slot.inflight) < DISPATCH_DEPTH:
            if any(u.unit in alone for u in slot.inflight.values()):
                break
            if queue[0].unit in alone and slot.inflight:
                break
            unit = queue.popleft()
            ref = slot.actor.run_unit.remote(job.output, spec.storage_dtype, unit,
                                             spec.checksum)
            slot.inflight[ref] = unit
            slot.state = "busy"
            sent = True
        return sent

    # Engines that start together begin together: a job with `replicas: 2` should not
    # be finished by the first engine while the second is still loading. A slow
    # starter holds the others back for START_GRACE_S at most.
    # A worker Ray is restarting (it served before: a job earlier on this pool lost it)
    # holds nobody back.
    def all_started() -> bool:
        return all(s.state != "starting" or s.ever_ready for s in slots)

    gate_open = all_started()
    first_ready: float | None = None

    emit(False)
    while any(s.inflight for s in slots) or (queue and not result.cancelled
                                              and result.fatal is None):
        if not gate_open:
            gate_open = all_started() or (
                first_ready is not None and time.monotonic() - first_ready > START_GRACE_S
            )
        if hooks.cancelled is not None and hooks.cancelled() and not result.cancelled:
            result.cancelled = True
            queue.clear()
            emit(False)
            continue
        dispatched = False
        if gate_open:
            for slot in slots:
                if slot.state in ("idle", "busy"):
                    dispatched = dispatch(slot) or dispatched
        if dispatched:
            if progress.rate_since is None:
                progress.rate_since = time.time()
            emit(False)
        waiting: dict[Any, EngineSlot] = {}
        now = time.monotonic()
        for slot in slots:
            if slot.state == "starting" and slot.ready_ref is None and now >= slot.check_at:
                slot.ready_ref = slot.actor.ready.remote()
            if slot.state == "starting" and slot.ready_ref is not None:
                waiting[slot.ready_ref] = slot
            for ref in slot.inflight:
                waiting[ref] = slot
        pausing = [s.check_at for s in slots if s.state == "starting" and s.ready_ref is None]
        if not waiting and not pausing:
            raise JobFailed("no engine is running and work remains")
        if not waiting:  # every engine is between two readiness checks
            time.sleep(max(0.0, min(min(pausing) - now, POLL_S)))
            continue
        done, _ = ray.wait(list(waiting), num_returns=1, timeout=POLL_S)
        for ref in done:
            slot = waiting[ref]
            if slot.state == "starting":
                if ref is not slot.ready_ref:
                    continue  # a unit of the worker before its restart: already failed
                try:
                    ray.get(ref)
                    slot.state = "idle"
                    slot.ready_failures = 0
                    slot.ever_ready = True
                except (RayActorError, NodeDiedError) as err:
                    if not slot.ever_ready:
                        # It never served: the engine cannot start (bad model, no memory).
                        raise JobFailed(f"{slot.name} could not start: {_first_line(err)}") from err
                    # While Ray restarts a dead worker (its node lost: until the cluster
                    # has room for it), calls to it fail at once: this is the same restart,
                    # asked again after a pause, without holding up the other engines. An
                    # engine that no longer starts ends the job only when no other is left.
                    slot.ready_failures += 1
                    others = any(s.state in ("idle", "busy") for s in slots if s is not slot)
                    if slot.ready_failures > READY_CHECKS and not others:
                        raise JobFailed(f"{slot.name} did not start again after it failed, and "
                                        f"no other engine is left: {_first_line(err)}") from err
                    slot.ready_ref = None
                    slot.check_at = time.monotonic() + min(
                        READY_PAUSE_S * slot.ready_failures, READY_PAUSE_MAX_S)
                    continue
                if first_ready is None:
                    first_ready = time.monotonic()
                continue
            if ref not in slot.inflight:
                continue  # failed with its worker earlier in this round
            try:
                report = ray.get(ref)
            except (RayActorError, NodeDiedError) as err:  # its process or its node died
                fail_slot(slot, err, kill=False)
                continue
            except RayTaskError as err:  # a unit raised: restart the engine, retry its units
                if is_disk_full(err):
                    stop_for_full_disk(slot, ref, err)
                else:
                    fail_slot(slot, err, kill=True)
                continue
            unit_done(slot, ref, report)
        if time.monotonic() - last_poll >= POLL_S:
            last_poll = time.monotonic()
            busy = [s for s in slots if s.inflight]
            refs = [s.actor.progress.remote() for s in busy]
            try:
                for slot, units in zip(busy, ray.get(refs, timeout=POLL_S), strict=True):
                    held = {u.unit for u in slot.inflight.values()}
                    for unit, counts in units.items():
                        if unit in held:
                            c = [int(x) for x in counts] + [0, 0]  # older workers: 2
                            live[unit] = (c[0], c[1], c[2], c[3])
            except (GetTimeoutError, RayActorError, RayTaskError, NodeDiedError):
                pass
            emit(True)
    emit(False)
    return result


def record_report(record: CommitRecord, worker: str) -> Any:
    """A UnitReport of a unit found committed (its worker died before reporting it)."""
    from hsx_workers.worker import UnitReport

    answers = record.regenerations
    return UnitReport(unit=record.unit, won=True, samples=record.samples,
                      tokens=record.tokens, bytes=record.bytes,
                      errors=[e.model_dump() for e in record.errors], worker=worker,
                      generated=answers.rows if answers else 0,
                      generated_tokens=answers.tokens if answers else 0,
                      truncated=answers.truncated if answers else 0)
