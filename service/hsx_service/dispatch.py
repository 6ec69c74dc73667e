"""The dispatcher: one job's pending units fed to its workers until none is left.

`Dispatch` is one run of `runner.execute` over the workers the engine pool gave the job
(engine_pool.py). Its methods are the steps of that run, over the state they share (the
queue, the attempts, the live counts, the job's progress and result):

- `dispatch` hands a worker units up to DISPATCH_DEPTH (workers pull, so a slow engine
  never holds up the others); a unit retried `alone` gets a worker to itself;
- `unit_done` counts a committed unit into the progress;
- `fail_slot` fails an attempt of every unit a dead worker held, queues them again (or
  gives one up after `max_attempts`), and `restart`s the worker; when the first
  SAME_FAILURE_UNITS units given up all failed alike and none committed, the engines
  cannot run the job, and dispatch stops;
- `stop_for_full_disk` stops dispatch when the output's disk is full, `stop_for_check`
  when a unit's self-check tripped (`checks: on`; no retry: the same states trip again);
- `emit` tells `hooks.on_progress` where the job stands;
- `run` is the loop: it waits on Ray for the workers' answers and calls the steps.

Only `run` and the steps that talk to Ray (`restart` with `kill`, the readiness and unit
answers, the progress poll) import `ray`, inside them: the steps run on plain objects.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hsx.online import EPOCH_STRIDE
from hsx.output import CommitRecord
from hsx.output.storage import is_disk_full
from hsx.plan import WorkUnit
from hsx.progress import JobProgress
from hsx.regenerate import Regeneration
from hsx.wire import ResourcePlan
from hsx_service.engine_pool import DISPATCH_DEPTH, EnginePool, EngineSlot
from hsx_service.errors import JobFailed
from hsx_service.online import OnlineFeed
from hsx_service.prepare import PreparedJob
from hsx_workers.selfcheck import is_check_failure
from hsx_workers.state_faults import fault_of_environment

logger = logging.getLogger(__name__)

POLL_S = 0.5  # the longest wait for an answer; the workers' progress is asked this often
START_GRACE_S = 120.0  # the longest the first ready engine waits for the others
# A restarted worker is asked whether it is ready up to READY_CHECKS times (pauses growing
# by READY_PAUSE_S to READY_PAUSE_MAX_S: about 3 minutes in all) before the job fails, when
# no other engine is left; while others run the job, it is asked every READY_PAUSE_MAX_S
# for as long as the job runs (a lost node's engine waits for room in the cluster).
READY_CHECKS = 100
READY_PAUSE_S = 0.2
READY_PAUSE_MAX_S = 2.0
# Units given up with one and the same error before any unit committed: what every unit
# meets is the engines' environment (a package missing, a kernel the GPU lacks), not
# the units, so the job stops there instead of restarting engines for each of its units.
SAME_FAILURE_UNITS = 2


@dataclass
class DispatchHooks:
    """What a driver wants to hear while a job runs (the CLI: progress; the service: all)."""

    # The job is prepared (its output has a manifest and a plan, or its ingestion has
    # started: PreparedJob.ingestion); no engine started yet.
    on_prepared: Callable[[PreparedJob], None] | None = None
    # (job, units, ingested): the ingestion planned these units; `ingested` once it
    # ended and the manifest is published (the job's plan is whole).
    on_planned: Callable[[PreparedJob, list[WorkUnit], bool], None] | None = None
    # A new job's dataset is being tokenized: how far (hsx.ingest.IngestProgress).
    on_ingest: Callable[[Any], None] | None = None
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
    # The Ray node of each of the job's engines (name -> node id), once they are placed
    # and whenever one moves (a trainer kept apart from them reads it).
    on_engines: Callable[[dict[str, str]], None] | None = None


@dataclass
class DispatchResult:
    failed_units: dict[int, str] = field(default_factory=dict)  # unit -> last error
    cancelled: bool = False
    restarts: int = 0
    fatal: str | None = None  # what stopped the whole job (a full disk), not one unit
    online: OnlineFeed | None = None  # an online job's feed, as it ended


class Dispatch:
    """One job's units fed to its workers (`run`); see the module docstring for the steps."""

    def __init__(self, job: PreparedJob, pool: EnginePool, hooks: DispatchHooks,
                 slots: list[EngineSlot], max_attempts: int,
                 online: OnlineFeed | None = None) -> None:
        self.job = job
        self.pool = pool
        self.hooks = hooks
        self.slots = slots
        self.max_attempts = max_attempts
        self.result = DispatchResult()
        self.progress = job.totals().progress()
        # An online job (online.py): its units come from the feed, epoch after epoch,
        # and each one's shard goes to its stream (the second return value of run_unit,
        # by unit ref), not to the output.
        self.online = online
        self.payloads: dict[Any, Any] = {}
        self.queue: deque[WorkUnit] = deque(job.pending if online is None else ())
        if online is not None:
            online.planned(job.units, whole=job.ingestion is None)
        # A job whose dataset is still being tokenized: its units come from the ingestion
        # (`take_planned`), and this run shows the ingestion's progress with its own.
        self.feed = job.ingestion
        self.fed = self.feed is None
        if self.feed is not None:
            self.feed.dispatching = True
            self.progress.ingesting = True
        self.attempts: dict[int, int] = {}
        self.committed_here = 0  # units this run committed (SAME_FAILURE_UNITS)
        self.alone: set[int] = set()  # units that were on a failed worker: retried one at a time
        # unit -> (samples, tokens) captured, (samples, tokens) regenerated, while it runs
        self.live: dict[int, tuple[int, int, int, int]] = {}
        self.last_poll = 0.0
        self.gate_open = False  # units are handed out once the engines have started (run)
        self.first_ready: float | None = None
        self.online_waiting: str | None = None  # what the online feed last said it waits for

    # ------------------------------------------------------------ the steps

    def take_planned(self) -> None:
        """The units the ingestion planned since the last call go to the queue (those
        an earlier run committed to the progress), with how far the ingestion is; when
        it ended on an error (the dataset, the output, a cancel), dispatch stops: the
        units out end, and the driver raises the ingestion's error."""
        feed = self.feed
        if feed is None or self.fed:
            return
        done = feed.done  # read first: a unit planned after it is taken next round
        new = feed.take()
        job, progress = self.job, self.progress
        job.units.extend(new)
        job.manifest = feed.manifest
        fresh = [u for u in new if u.unit not in job.committed]
        job.pending.extend(fresh)
        if self.online is not None:
            self.online.planned(new, whole=done and feed.error is None)
        elif not (self.result.cancelled or self.result.fatal):
            self.queue.extend(fresh)
        progress.units_total = len(job.units)
        progress.samples_total = job.manifest.num_samples
        progress.tokens_total = job.manifest.tokens_total
        if feed.progress is not None:
            progress.rows_tokenized = feed.progress.rows
            progress.rows_total = feed.progress.rows_expected
        if done:
            self.fed = True
            progress.ingesting = False
            if feed.error is not None:
                logger.warning("the ingestion stopped: %s", feed.error)
                self.queue.clear()
            else:
                progress.rows_total = progress.rows_tokenized = (
                    job.manifest.num_samples + job.manifest.num_errors)
        if new or done:
            if self.hooks.on_planned is not None:
                self.hooks.on_planned(job, new, done and feed.error is None)
            self.emit(True)

    def feeding(self) -> bool:
        """Units may still come from the ingestion, and dispatch goes on."""
        return not self.fed and not self.result.cancelled and self.result.fatal is None

    def emit(self, extra_live: bool) -> None:
        shown = JobProgress(**{**self.progress.__dict__, "workers": {}})
        if extra_live:
            # What is shown includes the units still running, as far as they got.
            live = self.live.values()
            shown.samples_done += sum(c[0] for c in live)
            shown.tokens_done += sum(c[1] for c in live)
            shown.rate_tokens += sum(c[1] for c in live)
            shown.samples_generated += sum(c[2] for c in live)
            shown.tokens_generated += sum(c[3] for c in live)
        for slot in self.slots:
            shown.workers[slot.name] = slot.state
            shown.worker_nodes[slot.name] = slot.node
            if slot.unit is not None:
                shown.worker_units[slot.name] = slot.unit.unit
        if self.online is not None:
            shown.trainer_nodes, shown.stream_bytes = self.online.where()
        if self.hooks.on_progress is not None:
            self.hooks.on_progress(shown)

    def fail_slot(self, slot: EngineSlot, err: BaseException, kill: bool) -> None:
        """Every unit the worker held failed an attempt; restart the worker."""
        message = _first_line(err)
        if not slot.inflight:
            raise JobFailed(f"{slot.name}: {message}") from err
        retry = []
        for ref, unit in list(slot.inflight.items()):
            try:
                # The attempt may have committed before its worker died: then it is done.
                # (An online unit's shard went down with its worker: it is captured again.)
                record = None if self.online is not None else \
                    self.job.output.read_commit(unit.unit)
            except FileNotFoundError:
                record = None
            if record is not None:
                self.unit_done(slot, ref, record_report(record, slot.name))
                continue
            self.payloads.pop(ref, None)
            attempt = self.attempts[unit.unit] = self.attempts.get(unit.unit, 0) + 1
            gave_up = attempt >= self.max_attempts
            logger.warning("unit %d failed on %s (attempt %d): %s",
                           unit.unit, slot.name, attempt, message)
            if self.hooks.on_unit_error is not None:
                self.hooks.on_unit_error(unit, attempt, message, gave_up)
            self.live.pop(unit.unit, None)
            if self.online is not None and gave_up:  # a retried one is still coming
                self.online.answered(unit.unit)
            if gave_up:
                self.result.failed_units[unit.unit] = message
                self.progress.units_failed += 1
            else:
                self.alone.add(unit.unit)
                retry.append(unit)
        if self.failing_alike() and self.result.fatal is None:
            failed = self.result.failed_units
            self.result.fatal = (
                f"{failed_units_message(failed, len(self.job.units), self.max_attempts)}; "
                "none committed and each failed the same way, so the engines cannot run "
                "this job and dispatch stopped (a rerun, once the cause is fixed, captures "
                "every uncommitted unit)")
            logger.error("%s", self.result.fatal)
            self.queue.clear()
            if self.online is not None:
                for unit in retry:
                    self.online.answered(unit.unit)
            retry.clear()
        self.queue.extendleft(reversed(retry))
        slot.inflight.clear()
        self.restart(slot, kill)

    def failing_alike(self) -> bool:
        """SAME_FAILURE_UNITS units or more were given up, all with one error, and no
        unit has committed in this run."""
        failed = self.result.failed_units
        return (not self.committed_here and len(failed) >= SAME_FAILURE_UNITS
                and len(set(failed.values())) == 1)

    def stop_for_full_disk(self, slot: EngineSlot, ref: Any, err: BaseException) -> None:
        """The output's disk is full: no unit can commit. Dispatch stops, the units
        in flight end (they fail alike or commit), the job fails naming ENOSPC."""
        unit = slot.inflight.pop(ref)
        self.payloads.pop(ref, None)
        message = _first_line(err)
        logger.error("unit %d: the output is full: %s", unit.unit, message)
        self.live.pop(unit.unit, None)
        self.result.failed_units[unit.unit] = message
        if self.hooks.on_unit_error is not None:
            self.hooks.on_unit_error(unit, self.attempts.get(unit.unit, 0) + 1, message, True)
        if self.result.fatal is None:
            self.result.fatal = disk_full_message(self.job.output, err)
        self.queue.clear()
        slot.state = "busy" if slot.inflight else "idle"

    def stop_for_check(self, slot: EngineSlot, ref: Any, err: BaseException) -> None:
        """A unit's self-check tripped: the states are wrong, and a retry would capture
        them the same way. The job fails at once with the check's message: nothing is
        retried or dispatched; the worker already stopped the job's other units it held,
        and the other workers are told to stop theirs (their units then fail here with
        the same words)."""
        unit = slot.inflight.pop(ref)
        self.payloads.pop(ref, None)
        message = _first_line(err)
        if self.result.fatal is None:
            for other in self.slots:
                if other is not slot and other.inflight:
                    other.actor.stop_job.remote(self.job.output, message)
        logger.error("%s", message)
        self.live.pop(unit.unit, None)
        self.result.failed_units[unit.unit] = message
        self.progress.units_failed += 1
        if self.hooks.on_unit_error is not None:
            self.hooks.on_unit_error(unit, self.attempts.get(unit.unit, 0) + 1, message, True)
        if self.result.fatal is None:
            self.result.fatal = message
        self.queue.clear()
        slot.state = "busy" if slot.inflight else "idle"

    def unit_done(self, slot: EngineSlot, ref: Any, report: Any) -> None:
        self.moved(slot, report.node)
        unit = slot.inflight.pop(ref)
        self.committed_here += 1
        self.alone.discard(unit.unit)
        slot.state = "busy" if slot.inflight else "idle"
        slot.units_run += 1
        self.live.pop(unit.unit, None)
        progress = self.progress
        if self.online is not None:
            self.online.committed(unit.unit, report.bytes, slot.node, self.payloads.pop(ref))
            if unit.unit >= EPOCH_STRIDE:  # an epoch after the first: the same data again
                progress.rate_tokens += report.tokens
                if self.hooks.on_unit_done is not None:
                    self.hooks.on_unit_done(report)
                return
        progress.units_done += 1
        progress.shards += 1
        progress.samples_done += report.samples + len(report.errors)
        progress.samples_failed += len(report.errors)
        progress.tokens_done += report.tokens
        progress.bytes += report.bytes
        progress.rate_tokens += report.tokens
        progress.samples_generated += report.generated
        progress.tokens_generated += report.generated_tokens
        checks = getattr(report, "checks", None) or {}
        progress.samples_checked += int(checks.get("samples", 0))
        progress.check_problems += int(checks.get("problems", 0))
        progress.head_rows_checked += int(checks.get("head_rows", 0))
        progress.head_rows_agreed += int(checks.get("head_agreed", 0))
        if self.hooks.on_unit_done is not None:
            self.hooks.on_unit_done(report)

    def restart(self, slot: EngineSlot, kill: bool) -> None:
        self.pool.restarts += 1
        self.result.restarts += 1
        self.progress.restarts += 1
        if kill:
            import ray

            ray.kill(slot.actor, no_restart=False)
        slot.state = "starting"
        slot.ever_ready = True  # it served before: its readiness checks are a restart's
        slot.ready_failures = 0
        slot.ready_ref = slot.actor.ready.remote()
        if self.hooks.on_restart is not None:
            self.hooks.on_restart(slot.name)

    def dispatch(self, slot: EngineSlot) -> bool:
        """Hand the slot units up to its depth; a unit retried alone gets a slot to itself."""
        spec = self.job.spec
        # What a worker takes from the job: the admitted spec's, never its output's.
        job = {"checks": spec.checks, "fault": fault_of_environment(),
               "regenerate": Regeneration.of(spec)}
        sent = False
        while self.queue and len(slot.inflight) < DISPATCH_DEPTH:
            if any(u.unit in self.alone for u in slot.inflight.values()):
                break
            if self.queue[0].unit in self.alone and slot.inflight:
                break
            unit = self.queue.popleft()
            if self.online is None:
                ref = slot.actor.run_unit.remote(self.job.output, spec.storage_dtype, unit,
                                                 spec.checksum, **job)
            else:  # the report, and the shard's bytes for the stream
                ref, payload = slot.actor.run_unit.options(num_returns=2).remote(
                    self.job.output, spec.storage_dtype, unit, spec.checksum,
                    self.online.rows_of(unit.unit), **job)
                self.payloads[ref] = payload
            slot.inflight[ref] = unit
            slot.state = "busy"
            sent = True
        return sent

    def all_started(self) -> bool:
        """Engines that start together begin together: a job with `replicas: 2` should
        not be finished by the first engine while the second is still loading (a slow
        starter holds the others back for START_GRACE_S at most). A worker Ray is
        restarting (it served before: a job earlier on this pool lost it) holds nobody
        back."""
        return all(s.state != "starting" or s.ever_ready for s in self.slots)

    # ------------------------------------------------------------ the loop

    def run(self) -> DispatchResult:
        """Dispatch, wait for an answer, handle it, poll progress; until no unit is left
        (or the job is cancelled, or its disk is full)."""
        import ray

        self.gate_open = self.all_started()
        self.emit(False)
        while self.working():
            self.take_planned()
            if not self.working():  # the ingestion ended, and every unit was done by then
                break
            self.open_gate()
            if self.cancel_asked():
                continue
            if self.online is not None and self.take_online():
                continue  # nothing to capture for the trainer now, nothing in flight
            if self.feed is not None and self.feeding() and not self.queue and not any(
                    s.inflight or s.state == "starting" for s in self.slots):
                self.feed.wait(POLL_S)  # every engine is ready for units not planned yet
                continue
            if self.gate_open and self.dispatch_all():
                if self.progress.rate_since is None:
                    self.progress.rate_since = time.time()
                self.emit(False)
            waiting = self.awaited()
            if not waiting:  # every engine is between two readiness checks
                continue
            done, _ = ray.wait(list(waiting), num_returns=1, timeout=POLL_S)
            for ref in done:
                slot = waiting[ref]
                if slot.state == "starting":
                    self.ready_answered(slot, ref)
                elif ref in slot.inflight:  # else it failed with its worker in this round
                    self.unit_answered(slot, ref)
            self.poll()
        self.emit(False)
        return self.result

    def working(self) -> bool:
        """Units are in flight, or queued or still to be planned, and dispatch goes on;
        for an online job, until its trainer ended."""
        going = not self.result.cancelled and self.result.fatal is None
        return any(s.inflight for s in self.slots) or self.feeding() or bool(
            self.queue and going) or (
            self.online is not None and going and not self.online.finished())

    def take_online(self) -> bool:
        """An online job: queue what the feed hands out for the engines' free depth, and
        say what dispatch waits for. True when there is nothing to do but wait (the
        caller waits here POLL_S and goes round again)."""
        online = self.online
        if online is None or not self.gate_open:
            return False
        serving = [s for s in self.slots if s.state in ("idle", "busy")]
        room = sum(DISPATCH_DEPTH - len(s.inflight) for s in serving) - len(self.queue)
        if not (self.result.cancelled or self.result.fatal):
            self.queue.extend(online.take(room))
        reason = online.waiting_for
        if reason != self.online_waiting:
            self.online_waiting = reason
            if self.hooks.on_waiting is not None:
                self.hooks.on_waiting(reason)
        idle = not self.queue and not any(s.inflight or s.state == "starting"
                                          for s in self.slots)
        if idle and not online.finished():
            time.sleep(POLL_S)
        return idle

    def open_gate(self) -> None:
        if not self.gate_open:
            self.gate_open = self.all_started() or (
                self.first_ready is not None
                and time.monotonic() - self.first_ready > START_GRACE_S
            )

    def cancel_asked(self) -> bool:
        """The job was cancelled just now: dispatch stops (the units out end first)."""
        if not (self.hooks.cancelled is not None and self.hooks.cancelled()
                and not self.result.cancelled):
            return False
        self.result.cancelled = True
        self.queue.clear()
        self.emit(False)
        return True

    def dispatch_all(self) -> bool:
        """Every serving worker gets units up to its depth; True if any was sent."""
        dispatched = False
        for slot in self.slots:
            if slot.state in ("idle", "busy"):
                dispatched = self.dispatch(slot) or dispatched
        return dispatched

    def awaited(self) -> dict[Any, EngineSlot]:
        """What to wait on, by object ref: readiness checks due, units in flight.

        Empty when every engine is between two readiness checks: it has slept until the
        first is due, or POLL_S. Raises JobFailed when no engine is left at all.
        """
        waiting: dict[Any, EngineSlot] = {}
        now = time.monotonic()
        for slot in self.slots:
            if slot.state == "starting" and slot.ready_ref is None and now >= slot.check_at:
                slot.ready_ref = slot.actor.ready.remote()
            if slot.state == "starting" and slot.ready_ref is not None:
                waiting[slot.ready_ref] = slot
            for ref in slot.inflight:
                waiting[ref] = slot
        pausing = [s.check_at for s in self.slots
                   if s.state == "starting" and s.ready_ref is None]
        if not waiting and not pausing:
            raise JobFailed("no engine is running and work remains")
        if not waiting:
            time.sleep(max(0.0, min(min(pausing) - now, POLL_S)))
        return waiting

    def ready_answered(self, slot: EngineSlot, ref: Any) -> None:
        """A starting worker answered whether it is ready."""
        import ray
        from ray.exceptions import NodeDiedError, RayActorError

        if ref is not slot.ready_ref:
            return  # a unit of the worker before its restart: already failed
        try:
            node = ray.get(ref)
        except (RayActorError, NodeDiedError) as err:
            self.not_ready(slot, err)
            return
        self.moved(slot, node if isinstance(node, str) else "")
        slot.state = "idle"
        slot.ready_failures = 0
        slot.ever_ready = True
        if self.first_ready is None:
            self.first_ready = time.monotonic()

    def moved(self, slot: EngineSlot, node: str) -> None:
        """The worker said which Ray node it runs on (readiness, a unit's report). Ray
        restarts a worker whose node died elsewhere, and when it held no unit then, no
        call failed to tell: its first report after says where it is now."""
        if node and node != slot.node:
            slot.node = node
            if self.hooks.on_engines is not None:
                self.hooks.on_engines({s.name: s.node for s in self.slots})

    def not_ready(self, slot: EngineSlot, err: BaseException) -> None:
        if not slot.ever_ready:
            # It never served: the engine cannot start (bad model, no memory).
            raise JobFailed(f"{slot.name} could not start: {_first_line(err)}") from err
        # While Ray restarts a dead worker (its node lost: until the cluster has room for
        # it), calls to it fail at once: this is the same restart, asked again after a
        # pause, without holding up the other engines. An engine that no longer starts
        # ends the job only when no other is left.
        slot.ready_failures += 1
        others = any(s.state in ("idle", "busy") for s in self.slots if s is not slot)
        if slot.ready_failures > READY_CHECKS and not others:
            raise JobFailed(f"{slot.name} did not start again after it failed, and "
                            f"no other engine is left: {_first_line(err)}") from err
        slot.ready_ref = None
        slot.check_at = time.monotonic() + min(
            READY_PAUSE_S * slot.ready_failures, READY_PAUSE_MAX_S)

    def unit_answered(self, slot: EngineSlot, ref: Any) -> None:
        """A unit the worker held ended: committed, or failed with its worker."""
        import ray
        from ray.exceptions import NodeDiedError, RayActorError, RayTaskError

        try:
            report = ray.get(ref)
        except (RayActorError, NodeDiedError) as err:  # its process or its node died
            self.fail_slot(slot, err, kill=False)
            return
        except RayTaskError as err:  # a unit raised: restart the engine, retry its units
            if is_disk_full(err):
                self.stop_for_full_disk(slot, ref, err)
            elif is_check_failure(err):
                self.stop_for_check(slot, ref, err)
            else:
                self.fail_slot(slot, err, kill=True)
            return
        self.unit_done(slot, ref, report)

    def poll(self) -> None:
        """Every POLL_S: ask the busy workers how far their units got, and emit that."""
        import ray
        from ray.exceptions import GetTimeoutError, NodeDiedError, RayActorError, RayTaskError

        if time.monotonic() - self.last_poll < POLL_S:
            return
        self.last_poll = time.monotonic()
        busy = [s for s in self.slots if s.inflight]
        refs = [s.actor.progress.remote() for s in busy]
        try:
            for slot, units in zip(busy, ray.get(refs, timeout=POLL_S), strict=True):
                held = {u.unit for u in slot.inflight.values()}
                for unit, counts in units.items():
                    if unit in held:
                        c = [int(x) for x in counts] + [0, 0]  # older workers: 2
                        self.live[unit] = (c[0], c[1], c[2], c[3])
        except (GetTimeoutError, RayActorError, RayTaskError, NodeDiedError):
            pass
        self.emit(True)


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


def disk_full_message(output: Any, err: BaseException) -> str:
    """The one message of a job stopped by a full output file system."""
    return (f"output: no space left on device (ENOSPC) on {output}: free space there and "
            f"run the job again; every committed unit is kept ({_first_line(err)})")


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


def failed_units_message(failed: dict[int, str], total: int, max_attempts: int) -> str:
    last = failed[max(failed)]
    return (
        f"{len(failed)} of {total} units failed {max_attempts} times and were given up "
        f"(units {sorted(failed)[:10]}); last error: {last}"
    )
