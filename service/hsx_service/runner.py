"""The job driver: prepared work units, fed to ExtractionWorker actors on Ray.

`run_job` is the one job driver: `hsx extract` calls it in one process tree, and the
coordinator's scheduler calls it with hooks that keep its ledger and its subscribers
up to date. It prepares the job (preflight, ingestion, plan: prepare.py), starts (or
joins) Ray, gets `replicas` workers from an `EnginePool` (engine_pool.py), and `execute`
hands each idle worker the next pending unit (the dispatcher: dispatch.py) — workers
pull, so a slow engine never holds up the others. A worker that dies (its process
killed, its engine dead, its Ray node lost) is restarted by Ray and its units go back to
the queue for the other workers; one that cannot come back (its node gone, no room left)
is asked again now and then while the others finish the job. A unit that fails
`max_attempts` times fails the job. When every unit is committed it publishes
complete.json. Whatever happens, the output stays consistent: a unit is done exactly
when its commit record exists.

It owns the driver alone: the names it uses are imported from their owners (the
engine pool's from engine_pool.py, the dispatcher's hooks and result from dispatch.py,
the job's outcomes from errors.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hsx import __version__
from hsx.output import OutputCorrupt, OutputTotals, StorageError
from hsx.output.shards.encoding import HIDDEN_DTYPE, NUMPY_DTYPES
from hsx.output.storage import is_disk_full
from hsx.spec import JobSpec
from hsx.wire import ResourcePlan
from hsx_service.dispatch import (
    Dispatch,
    DispatchHooks,
    DispatchResult,
    disk_full_message,
    failed_units_message,
)
from hsx_service.engine_config import engine_config_for
from hsx_service.engine_pool import EnginePool, Waits, connect_ray, group_node
from hsx_service.errors import JobCancelled, JobFailed, JobRefused
from hsx_service.online import OnlineFeed
from hsx_service.placement import ClusterShape, engine_selector, plan_job
from hsx_service.prepare import PreparedJob, prepare

MAX_ATTEMPTS = 3


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
    samples_checked: int = 0  # by the self-check, over every committed unit
    check_problems: int = 0  # what it found (under `checks: warn`)
    head_rows_checked: int = 0  # rows of id N against the engine's next token
    head_rows_agreed: int = 0

    @classmethod
    def of(cls, totals: OutputTotals, output: str, seconds: float, **extra: Any) -> JobSummary:
        return cls(output=output, samples=totals.samples, errors=totals.errors,
                   tokens=totals.tokens, bytes=totals.bytes, shards=totals.units_done,
                   seconds=seconds, samples_checked=totals.samples_checked,
                   check_problems=totals.check_problems,
                   head_rows_checked=totals.head_rows_checked,
                   head_rows_agreed=totals.head_rows_agreed, **extra)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_job(
    spec: JobSpec,
    *,
    pool: EnginePool | None = None,
    hooks: DispatchHooks | None = None,
    max_attempts: int = MAX_ATTEMPTS,
    job_id: str = "local",
    submitted_at: float | None = None,
    plan: ResourcePlan | None = None,
    connect: bool | None = None,
) -> JobSummary:
    """Run a job to completion: prepare, dispatch the pending units, publish complete.json.

    Raises JobRefused before anything heavy starts; JobFailed (units given up, engines
    that cannot start) or JobCancelled (`hooks.cancelled`) after. A job found complete
    returns at once (`nothing_to_do`). Without a `pool` one is made and shut down after.
    `job_id` and `submitted_at` name the job and its place in line to the pool's GPU
    arbiter; `plan` is where its engines run (made here from the cluster if not given).
    A job not yet on Ray (`connect`; default: without a `pool`; `hsx extract` gives one
    and asks for it) connects it while its first part is tokenized, not after, so its
    engines start sooner (benchmarks/bench_first_commit.py).
    """
    hooks = hooks or DispatchHooks()
    started = time.time()
    try:
        job = prepare(spec, on_ingest=hooks.on_ingest, cancelled=hooks.cancelled,
                      while_first_part=(lambda: connect_ray(spec))
                      if (pool is None if connect is None else connect) else None)
    except (StorageError, OutputCorrupt) as err:  # the output failed while being prepared
        raise JobRefused(f"output: {err}") from err
    except OSError as err:
        if is_disk_full(err):
            raise JobFailed(disk_full_message(spec.output, err)) from err
        raise
    ingestion = job.ingestion
    try:
        if hooks.on_prepared is not None:
            hooks.on_prepared(job)
        if job.complete and (not job.pending or online_job(spec)) and ingestion is None:
            return JobSummary.of(job.output.totals(), str(job.output), time.time() - started,
                                 nothing_to_do=True)
        result = DispatchResult()
        if job.pending or ingestion is not None:
            owned = pool is None
            pool = pool or EnginePool()
            try:
                result = execute(job, pool, hooks, max_attempts, job_id=job_id,
                                 submitted_at=submitted_at or started, plan=plan)
            finally:
                if owned:
                    pool.shutdown()
        if ingestion is not None and ingestion.done:
            ingestion.raise_error()  # the dataset, the output's size, a cancel
        if result.fatal is not None:
            raise JobFailed(result.fatal)
        if result.cancelled:
            raise JobCancelled("cancelled")
        if result.failed_units:
            raise JobFailed(
                failed_units_message(result.failed_units, len(job.units), max_attempts))
        if result.online is not None:
            return finish_online(job, started, result)
        return finish(job, started, restarts=result.restarts)
    except (StorageError, OutputCorrupt) as err:  # committed units stay valid
        raise JobFailed(f"output: {err}") from err
    except OSError as err:
        if is_disk_full(err):
            raise JobFailed(disk_full_message(job.output, err)) from err
        raise
    finally:
        if ingestion is not None:
            ingestion.stop()  # when the job ended first (engines that cannot start)


def finish(job: PreparedJob, started: float, *, restarts: int = 0) -> JobSummary:
    """Every unit is committed: drop what attempts left behind, publish complete.json."""
    # Every unit is committed: no attempt (of this driver or another) can commit now,
    # so whatever no record names is garbage.
    job.output.clean_orphans(final=True)
    summary = JobSummary.of(job.output.totals(), str(job.output), time.time() - started,
                            restarts=restarts)
    checks = {"mode": job.spec.checks, "samples": summary.samples_checked,
              "problems": summary.check_problems, "head_rows": summary.head_rows_checked,
              "head_agreed": summary.head_rows_agreed}
    job.output.mark_complete({**summary.as_dict(), "checks": checks,
                              "hsx_version": __version__, "completed_at": time.time()})
    return summary


def online_job(spec: JobSpec) -> bool:
    """The job's training is fed by its engines (hsx.online): no shard is stored."""
    return spec.trains_online


def finish_online(job: PreparedJob, started: float, result: DispatchResult) -> JobSummary:
    """An online job's trainer ended: its stream goes, complete.json says what was
    captured (no shard is stored)."""
    online = result.online
    if online is None:
        raise RuntimeError("finish_online is for an online job's result")
    if online.ended == "failed":
        raise JobFailed(f"the online training failed: {online.error or 'see its status'}; "
                        "the engines stopped capturing for it")
    totals = job.output.totals()
    summary = JobSummary.of(totals, str(job.output), time.time() - started,
                            restarts=result.restarts)
    summary.samples = job.manifest.num_samples
    summary.tokens = job.manifest.tokens_total
    job.output.mark_complete({
        **summary.as_dict(), "online": {"captures": online.captures,
                                        "trainer": online.ended},
        "hsx_version": __version__, "completed_at": time.time()})
    return summary


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
    connect_ray(spec)
    plan = plan or plan_job(spec, ClusterShape.of_ray())
    config = engine_config_for(spec, job.model, job.layers, plan.engine_memory)
    if hooks.on_plan is not None:
        hooks.on_plan(plan)
    online = online_feed(job) if online_job(spec) else None  # refused before any engine
    try:
        slots = pool.slots(spec.engine, config, plan.replicas, spec, job=job_id,
                           order=submitted_at,
                           waits=Waits(cancelled=hooks.cancelled, on_wait=hooks.on_waiting),
                           part=1.0 - plan.train_share, label_selector=engine_selector(spec))
        for slot in slots:  # placed: where each runs, before it has started
            slot.node = slot.node or (group_node(slot.placement_group)
                                      if slot.placement_group is not None else "")
        if hooks.on_engines is not None:
            hooks.on_engines({s.name: s.node for s in slots})
        result = Dispatch(job, pool, hooks, slots, max_attempts, online=online).run()
        result.online = online
        return result
    finally:
        pool.park()
        if online is not None:
            # What it still holds is freed; a trainer still reading stops at its next step
            # (a rerun's trainer resumes from its checkpoint).
            online.stream.close()


def online_feed(job: PreparedJob) -> OnlineFeed:
    """The feed of an online job's units and its stream (a Ray actor on this node);
    JobRefused when Ray's object stores cannot hold its buffer."""
    import ray

    from hsx_workers.stream import DriverStream

    spec = job.spec
    train = spec.train
    if train is None:
        raise RuntimeError("an online job has a train section")
    width = NUMPY_DTYPES[HIDDEN_DTYPE[spec.storage_dtype]].itemsize
    per_token = len(job.layers) * job.manifest.hidden_size * width
    stream = DriverStream(job.output.location)
    feed = OnlineFeed(stream, train.buffer_bytes, per_token, workers=train.workers)
    feed.planned(job.units, whole=False)
    # The buffer lives in the object stores of the engines' nodes (and of the trainer's
    # while it reads): more than all of them hold would spill to disk.
    largest = max((u.tokens for u in job.units), default=0) * per_token
    need = max(feed.buffer_bytes, largest)
    store = int(ray.cluster_resources().get("object_store_memory", 0))
    if store and need > store:
        stream.close()
        raise JobRefused(
            f"train.buffer_bytes: the online stream needs {need / 2**20:,.0f} MiB (the "
            f"buffer, {feed.buffer_bytes / 2**20:,.0f} MiB, or the largest unit, "
            f"{largest / 2**20:,.0f} MiB) of Ray's object stores, the cluster's hold "
            f"{store / 2**20:,.0f} MiB; lower train.buffer_bytes and unit_tokens, or give "
            "Ray's nodes more object store memory (`ray start --object-store-memory`)")
    return feed
