"""The job driver: prepared work units, fed to ExtractionWorker actors on Ray.

`run_job` is the one job driver: `hsx extract` calls it in one process tree, and the
coordinator's scheduler calls it with hooks that keep its ledger and its subscribers
up to date. It prepares the job (preflight, ingestion, plan: prepare.py), starts (or
joins) Ray, gets `replicas` workers from an `EnginePool`, and hands each idle worker the
next pending unit — workers pull, so a slow engine never holds up the others. A worker
that dies (its process killed, its engine dead, its Ray node lost) is restarted by Ray and
its units go back to the queue for the other workers; one that cannot come back (its
node gone, no room left) is asked again now and then while the others finish the job. A
unit that fails `max_attempts` times fails the job. When every unit
is committed it publishes complete.json. Whatever happens, the output stays consistent:
a unit is done exactly when its commit record exists.

The `EnginePool` keeps actors by engine configuration, so several jobs on the same
model in one process (tests, a service) reuse warm engines instead of starting new ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hsx import __version__
from hsx.modelinfo import ModelInfo
from hsx.output import CommitRecord, OutputCorrupt, OutputTotals, StorageError, faults
from hsx.output.storage import is_disk_full
from hsx.plan import WorkUnit
from hsx.progress import JobProgress
from hsx.spec import JobSpec
from hsx.wire import ResourcePlan
from hsx_service.placement import ENGINE, ClusterShape, GpuArbiter, Holder, place, plan_job
from hsx_service.prepare import JobRefused, PreparedJob, preflight, prepare

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
POLL_S = 0.5
START_GRACE_S = 120.0


class JobFailed(RuntimeError):
    """The job stopped; committed units stay valid and a rerun resumes the rest."""


class JobCancelled(RuntimeError):
    """The job was cancelled: dispatch stopped, the units handed out committed."""


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


def engine_config_for(spec: JobSpec, model: ModelInfo, layers: list[int]) -> Any:
    from hsx_workers.engines.base import EngineConfig

    options: dict[str, Any] = {"cpu_kvcache_gib": spec.vllm.cpu_kvcache_gib}
    if spec.vllm.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = spec.vllm.max_num_batched_tokens
    if spec.vllm.enforce_eager:
        options["enforce_eager"] = True
    options["gpu_memory_utilization"] = spec.vllm.gpu_memory_utilization
    options["max_inflight_tokens"] = spec.vllm.max_inflight_tokens
    if spec.vllm.engine_args():
        options["engine_args"] = spec.vllm.engine_args()
    if spec.regenerate is not None:
        options["generates"] = True  # sampling with per-request seeds (vllm_engine.py)
    return EngineConfig(
        model=spec.model,
        layers=layers,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        max_seq_len=spec.max_seq_len,
        tensor_parallel_size=spec.tensor_parallel_size,
        trust_remote_code=spec.trust_remote_code,
        dtype=spec.vllm.dtype,
        options=options,
        storage_dtype=spec.storage_dtype,
    )


def target_engine_args(spec: JobSpec) -> dict[str, Any]:
    """vLLM's arguments for the job's target outside capture (the draft's evaluation):
    as the job's engines load it — tensor parallelism, dtype, memory share, remote code
    and the job's own `vllm:` engine arguments."""
    return {
        "tensor_parallel_size": spec.tensor_parallel_size,
        "dtype": spec.vllm.dtype,
        "trust_remote_code": spec.trust_remote_code,
        "gpu_memory_utilization": spec.vllm.gpu_memory_utilization,
        **spec.vllm.engine_args(),
    }


def engine_key(spec: JobSpec, model: ModelInfo, layers: list[int]) -> tuple[Any, ...]:
    """Jobs with equal keys can share engines (EnginePool keeps actors by this key)."""
    return (spec.engine, repr(engine_config_for(spec, model, layers)))


def ensure_ray(address: str | None, cpus_needed: int) -> None:
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {
        "ignore_reinit_error": True,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": os.environ.get("HSX_RAY_LOG_TO_DRIVER", "0") == "1",
    }
    if address:
        kwargs["address"] = address
    elif not os.environ.get("RAY_ADDRESS"):
        # A local Ray sized so jobs fit even on a small machine: CPU engines share the
        # cores, and each engine's placement group reserves `tp` of these logical CPUs.
        kwargs["num_cpus"] = max(os.cpu_count() or 1, cpus_needed, LOCAL_RAY_MIN_CPUS)
    ray.init(**kwargs)


def _cpu_binding(replica: int, replicas: int, tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND giving each engine rank its own cores, when there are enough.

    vLLM's CPU build refuses TP>1 on a small machine unless threads are bound by hand.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_rank = len(cores) // (replicas * tp)
    if per_rank < 1:
        return None
    ranks = []
    for rank in range(tp):
        first = (replica * tp + rank) * per_rank
        chosen = cores[first : first + per_rank]
        ranks.append(f"{chosen[0]}-{chosen[-1]}" if len(chosen) > 1 else str(chosen[0]))
    return "|".join(ranks)


DISPATCH_DEPTH = 2
"""Units queued on one worker at a time: while one commits or finishes its last
requests, the next one's requests already keep the engine busy (worker.py)."""


@dataclass
class _Slot:
    name: str
    actor: Any
    state: str = "starting"  # starting | idle | busy
    ready_ref: Any = None
    # The units this worker holds, in dispatch order: object ref of run_unit -> unit.
    inflight: dict[Any, WorkUnit] = field(default_factory=dict)
    units_run: int = 0
    placement_group: Any = None
    holder: Holder | None = None  # its GPUs in the arbiter's books (GPU clusters)
    ready_failures: int = 0  # readiness checks of the current restart that failed
    ever_ready: bool = False  # it served once: a failed readiness check is a restart's
    check_at: float = 0.0  # when to ask a restarting worker again (ready_ref is None)

    @property
    def unit(self) -> WorkUnit | None:
        """The oldest unit this worker holds (the one it works on first)."""
        return next(iter(self.inflight.values()), None)


# A restarted worker is asked whether it is ready up to READY_CHECKS times (pauses growing
# by READY_PAUSE_S to READY_PAUSE_MAX_S: about 3 minutes in all) before the job fails, when
# no other engine is left; while others run the job, it is asked every READY_PAUSE_MAX_S
# for as long as the job runs (a lost node's engine waits for room in the cluster).
READY_CHECKS = 100
READY_PAUSE_S = 0.2
READY_PAUSE_MAX_S = 2.0
LOCAL_RAY_MIN_CPUS = 8
STOP_GRACE_S = 30.0  # an engine asked to shut down gets this long before it is killed


def engine_bundles(tp: int, gpus: bool) -> list[dict[str, float]]:
    """The placement-group bundles of one engine.

    GPU nodes: one bundle per TP rank, a GPU and a CPU each, packed; with TP > 1 vLLM's
    Ray executor places its rank workers on them and the engine's own actor takes no
    resources of its own. CPU machines: one bundle of `tp` CPUs (vLLM's Ray executor
    refuses the CPU platform, so ranks are processes of the multiprocessing executor).
    """
    if not gpus:
        return [{"CPU": float(tp)}]
    return [{"GPU": 1.0, "CPU": 1.0} for _ in range(tp)]


def engine_resources(tp: int, gpus: bool) -> tuple[dict[str, Any], str | None]:
    """What the process that builds a vLLM engine (the engine's actor, the evaluation's
    task) takes inside the engine's placement group, and the executor vLLM must use.

    GPU, TP 1: the GPU itself. GPU, TP > 1: nothing; vLLM's Ray executor puts its ranks
    on the group's bundles (this is what spans nodes). CPU: the `tp` CPUs, ranks as
    processes of the multiprocessing executor (inside a placement group vLLM would pick
    its Ray executor, which refuses the CPU platform).
    """
    if not gpus:
        return {"num_cpus": tp, "num_gpus": 0}, ("mp" if tp > 1 else None)
    if tp == 1:
        return {"num_cpus": 1, "num_gpus": 1}, None
    return {"num_cpus": 0, "num_gpus": 0}, "ray"


def in_group(pg: Any) -> Any:
    """The scheduling strategy of the process that owns an engine in `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0,
        placement_group_capture_child_tasks=True)


@dataclass
class EnginePool:
    """Ray actors that each own one engine, kept by engine configuration."""

    actors: dict[tuple[Any, ...], list[_Slot]] = field(default_factory=dict)
    restarts: int = 0
    arbiter: GpuArbiter = field(default_factory=GpuArbiter)

    def slots(self, engine: str, config: Any, replicas: int, spec: JobSpec, *,
              job: str = "local", order: float = 0.0, waits: Waits | None = None,
              ) -> list[_Slot]:
        """`replicas` workers of this engine configuration for `job`: the warm ones, and
        new ones once the arbiter and Ray have their GPUs (meanwhile `waits` hears what
        they wait for). Raises JobCancelled if `waits` says cancelled while waiting."""
        import ray

        from hsx_workers.worker import ExtractionWorker

        waits = waits or Waits()
        key = (engine, repr(config))
        have = self.actors.setdefault(key, [])
        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus and have and self.arbiter.waits_ahead_of((order, ENGINE)):
            # Warm engines yield to what waits ahead of this job (an earlier job's trainer
            # or evaluation); this job's engines then wait for their turn.
            self._stop(have)
            have.clear()
        for slot in have[:replicas]:
            if slot.holder is not None:
                slot.holder.job, slot.holder.idle = job, False
        tp = config.tensor_parallel_size
        while len(have) < replicas:
            index = len(have)
            name = f"engine-{index}"
            env = {
                "VLLM_CPU_KVCACHE_SPACE": str(config.options.get("cpu_kvcache_gib", 1)),
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            }
            if os.environ.get(faults.ENV):  # crash tests: the workers are the ones to die
                env[faults.ENV] = os.environ[faults.ENV]
            if not gpus:
                binding = _cpu_binding(index, replicas, tp)
                if binding:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = binding
            holder = None
            if gpus:
                holder = Holder(job=job, role=name, gpus=tp, order=(order, ENGINE))
                if not self.arbiter.acquire(holder, cancelled=waits.cancelled,
                                            on_wait=waits.on_wait):
                    raise JobCancelled("cancelled while waiting for GPUs")
            pg = place(engine_bundles(tp, bool(gpus)), f"{name} of job {job}",
                       cancelled=waits.cancelled, on_wait=waits.on_wait)
            if pg is None:
                if holder is not None:
                    self.arbiter.release(holder)
                raise JobCancelled("cancelled while waiting for Ray to place an engine")
            resources, backend = engine_resources(tp, bool(gpus))
            options: dict[str, Any] = {
                "max_restarts": -1,
                "max_task_retries": 0,
                # run_unit calls wait side by side (DISPATCH_DEPTH); progress() answers.
                "max_concurrency": DISPATCH_DEPTH + 2,
                "runtime_env": {"env_vars": env},
                "scheduling_strategy": in_group(pg),
                **resources,
            }
            actor_config = config
            if backend is not None:
                actor_config = dataclasses.replace(
                    config, options={**config.options, "distributed_executor_backend": backend})
            actor_cls: Any = ray.remote(ExtractionWorker)
            actor = actor_cls.options(**options).remote(engine, actor_config, name)
            have.append(_Slot(name=name, actor=actor, ready_ref=actor.ready.remote(),
                              placement_group=pg, holder=holder))
        return have[:replicas]

    def start(self, spec: JobSpec, timeout: float = 600.0) -> None:
        """Start the engines a job will use and wait until they serve (warm-up)."""
        import ray

        info, layers, _ = preflight(spec)
        ensure_ray(spec.ray_address, (spec.replicas or 1) * spec.tensor_parallel_size)
        config = engine_config_for(spec, info, layers)
        replicas = plan_job(spec, ClusterShape.of_ray()).replicas
        slots = self.slots(spec.engine, config, replicas, spec, job="warm-up")
        starting = [s for s in slots if s.state == "starting"]
        ray.get([s.ready_ref for s in starting], timeout=timeout)
        for slot in starting:
            slot.state = "idle"
            slot.ever_ready = True
        self.park()

    def keep_only(self, key: tuple[Any, ...] | None, replicas: int | None = None) -> None:
        """Stop every engine but the first `replicas` of `key` (engines hold GPUs and
        memory)."""
        for other in [k for k in self.actors if k != key]:
            self._stop(self.actors.pop(other))
        if key in self.actors and replicas is not None:
            self._stop(self.actors[key][replicas:])
            del self.actors[key][replicas:]

    def park(self) -> None:
        """No job uses the engines now: their GPUs show as idle, and go to whatever waits
        for them (`release_idle`)."""
        for slots in self.actors.values():
            for slot in slots:
                if slot.holder is not None:
                    slot.holder.idle = True

    def release_idle(self) -> bool:
        """Stop the engines no job uses, when something waits for GPUs. True if it did."""
        if not self.arbiter.blocked_by_idle():
            return False
        waiters = ", ".join(h.describe() for h in self.arbiter.waiters())
        for key in list(self.actors):
            idle = [s for s in self.actors[key] if s.holder is not None and s.holder.idle]
            for slot in idle:
                logger.info("%s yields its GPU to %s", slot.name, waiters)
            self._stop(idle)
            self.actors[key] = [s for s in self.actors[key] if s not in idle]
            if not self.actors[key]:
                del self.actors[key]
        return True

    def shutdown(self) -> None:
        self._stop([slot for slots in self.actors.values() for slot in slots])
        self.actors.clear()

    def _stop(self, slots: list[_Slot]) -> None:
        """Shut the engines down (vLLM gives its GPU memory back), kill their actors,
        free their placement groups, and only then their GPUs in the arbiter's books: what
        gets them next finds them empty."""
        import ray
        from ray.exceptions import ActorHandleNotFoundError
        from ray.util.placement_group import remove_placement_group

        serving = [s for s in slots if s.state in ("idle", "busy")]
        with contextlib.suppress(Exception):  # a dead actor, or Ray gone: killed below
            closing = [s.actor.shutdown.remote() for s in serving]
            ray.wait(closing, num_returns=len(closing), timeout=STOP_GRACE_S)
        for slot in slots:
            try:
                ray.kill(slot.actor, no_restart=True)
                if slot.placement_group is not None:
                    remove_placement_group(slot.placement_group)
            except ActorHandleNotFoundError:
                pass  # its Ray session ended (Ray lost, or shut down and started again)
            finally:
                if slot.holder is not None:
                    self.arbiter.release(slot.holder)


@dataclass
class Waits:
    """How a wait for resources is told and ended: `on_wait(reason)` hears what it waits
    for (None once it stops waiting); `cancelled()` ends it."""

    cancelled: Callable[[], bool] | None = None
    on_wait: Callable[[str | None], None] | None = None


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


def _dispatch(job: PreparedJob, pool: EnginePool, hooks: DispatchHooks, slots: list[_Slot],
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

    def fail_slot(slot: _Slot, err: BaseException, kill: bool) -> None:
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

    def stop_for_full_disk(slot: _Slot, ref: Any, err: BaseException) -> None:
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

    def unit_done(slot: _Slot, ref: Any, report: Any) -> None:
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

    def restart(slot: _Slot, kill: bool) -> None:
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

    def dispatch(slot: _Slot) -> bool:
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
        waiting: dict[Any, _Slot] = {}
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
