"""The engines jobs run on: Ray actors that each own one engine, kept by configuration.

`engine_config_for` says which engine a job asks for; jobs with equal `engine_key`s share
engines, so several jobs on the same model in one process (tests, a service) reuse warm
engines instead of starting new ones. `EnginePool.slots` gives a job its `replicas`
workers (`EngineSlot`s): the warm ones, and new ones once the pool's GPU arbiter and Ray
have their GPUs (placement.py), each in a placement group of its own (`engine_bundles`;
`engine_resources` and `in_group` say what the process that builds the engine takes in
it, for the draft's evaluation too: training.py; the environment vLLM reads there is the
vllm engine's rule, `engine_env`). When a job ends the pool parks its engines (idle,
kept warm) and stops the idle ones when something waits for their GPUs.
`ensure_ray` connects Ray, or starts a local one sized so a job's engines fit, its
authentication token in an owner-only file (`private_ray_token`).

Who calls what: the job driver (runner.py) asks the pool for a job's slots and parks them
after; the dispatcher (dispatch.py) feeds the slots units, up to DISPATCH_DEPTH each; the
coordinator (scheduler.py) keeps only the engines the next job needs and lets idle ones go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

from hsx import settings
from hsx.modelinfo import ModelInfo
from hsx.plan import WorkUnit
from hsx.spec import JobSpec
from hsx_service.engine_config import engine_config_for
from hsx_service.errors import JobCancelled
from hsx_service.placement import ENGINE, ClusterShape, GpuArbiter, Holder, place, plan_job
from hsx_service.prepare import preflight
from hsx_workers.engines.vllm.rules import engine_env

if TYPE_CHECKING:
    from hsx_workers.engines.base import EngineConfig
    from hsx_workers.engines.factory import AnyEngineConfig
    from hsx_workers.engines.vllm.settings import VllmSettings

logger = logging.getLogger(__name__)

DISPATCH_DEPTH = 2
"""Units queued on one worker at a time: while one commits or finishes its last
requests, the next one's requests already keep the engine busy (worker.py)."""
LOCAL_RAY = "local"  # ray_address that asks for a private local Ray
LOCAL_RAY_MIN_CPUS = 8  # a local Ray started here has at least these logical CPUs
STOP_GRACE_S = 30.0  # an engine asked to shut down gets this long before it is killed


def on_vllm(config: AnyEngineConfig) -> TypeGuard[EngineConfig[VllmSettings]]:
    """Whether `config` is a vllm engine's (its settings typed as such from here on)."""
    from hsx_workers.engines.vllm.settings import VllmSettings

    return isinstance(config.settings, VllmSettings)


def engine_key(spec: JobSpec, model: ModelInfo, layers: list[int],
               memory: float | None = None) -> tuple[Any, ...]:
    """Jobs with equal keys can share engines (EnginePool keeps actors by this key)."""
    return (spec.engine, repr(engine_config_for(spec, model, layers, memory)))


# A busy machine can keep a new local Ray node from registering within the 30 s that
# ray.init() allows it (ray/_private/node.py, a constant); that start is tried again.
RAY_START_ATTEMPTS = 3
RAY_START_TIMEOUT = "timed out during startup"


def _init_ray(ray: Any, kwargs: dict[str, Any]) -> None:
    """ray.init(**kwargs); a local node that timed out registering is started again."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as err:  # ray raises a bare Exception for this one
            if RAY_START_TIMEOUT not in str(err) or attempt == RAY_START_ATTEMPTS:
                raise
            ray.shutdown()
            logger.warning("Ray's local node did not register within Ray's 30 s (is the "
                           "machine busy?); starting it again (attempt %d of %d)",
                           attempt + 1, RAY_START_ATTEMPTS)


def private_ray_token(*, make: bool) -> Path | None:
    """The file of Ray's authentication token, owner-only (0600): its mode narrowed when
    others may read it, and, with `make` (a local Ray is about to start), made here when
    missing as Ray makes it (32 random bytes as hex), in an owner-only folder. None where
    Ray reads no file (`RAY_AUTH_TOKEN` set, or `RAY_AUTH_MODE=disabled`).

    Ray 2.60 turns token authentication on for a local cluster that `ray.init()` starts
    and writes the token to `~/.ray/auth_token` with the umask's mode (0644): any user of
    the machine could read it and run code on the cluster."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or os.environ.get(
            "RAY_AUTH_TOKEN"):
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not make and not path.exists():
        return None
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        info = os.stat(path)
        if info.st_uid == os.geteuid() and info.st_mode & 0o077:
            os.chmod(path, 0o600)
            logger.warning("Ray's token file %s was readable by other users; now 0600", path)
        return path
    with os.fdopen(fd, "w") as token:
        token.write(secrets.token_hex(32))
    return path


def ensure_ray(address: str | None, cpus_needed: int) -> None:
    import ray

    if ray.is_initialized():
        return
    # A local Ray may start (or a `ray start` cluster of this machine be joined, which
    # takes the token as well): its token file is made owner-only before Ray makes it.
    local = address == LOCAL_RAY or (not address and not os.environ.get("RAY_ADDRESS"))
    private_ray_token(make=local)
    if local and os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("RAY_AUTH_MODE=disabled: the local Ray started here lets anyone who "
                       "reaches its ports run code on it")
    kwargs: dict[str, Any] = {
        "ignore_reinit_error": True,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": settings.RAY_LOG_TO_DRIVER.get(),
    }
    if address and address != LOCAL_RAY:
        kwargs["address"] = address
    elif not os.environ.get("RAY_ADDRESS") or address == LOCAL_RAY:
        # A local Ray sized so jobs fit even on a small machine: CPU engines share the
        # cores, and each engine's placement group reserves `tp` of these logical CPUs.
        kwargs["num_cpus"] = max(os.cpu_count() or 1, cpus_needed, LOCAL_RAY_MIN_CPUS)
        if address == LOCAL_RAY:
            kwargs["address"] = LOCAL_RAY  # a private one, whatever runs here
    try:
        _init_ray(ray, kwargs)
    except ValueError as err:
        # Without an address ray.init() joins the cluster a `ray start --head` left on
        # this machine (as on many GPU nodes), which takes no sizing.
        if "existing cluster" not in str(err) or "num_cpus" not in kwargs:
            raise
        del kwargs["num_cpus"]
        ray.init(**kwargs)
        resources = ray.cluster_resources()
        logger.warning(
            "joined the Ray cluster already running on this machine (CPUs: %d, GPUs: %d); "
            "`ray_address: local` in the job (HSX_RAY_ADDRESS=local for hsx serve) starts "
            "a private one instead", int(resources.get("CPU", 0)),
            int(resources.get("GPU", 0)))


def connect_ray(spec: JobSpec) -> None:
    """Ray as the job asks (`ray_address`), started sized for its engines if need be."""
    ensure_ray(spec.ray_address, (spec.replicas or 1) * spec.tensor_parallel_size)


@dataclass
class EngineSlot:
    """One worker of a job: an actor that owns one engine, and the units it holds."""

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
    node: str = ""  # the Ray node it runs on, as it last said (readiness, a report)

    @property
    def unit(self) -> WorkUnit | None:
        """The oldest unit this worker holds (the one it works on first)."""
        return next(iter(self.inflight.values()), None)


def engine_bundles(tp: int, gpus: bool, part: float = 1.0) -> list[dict[str, float]]:
    """The placement-group bundles of one engine.

    GPU nodes: one bundle per TP rank, a GPU (`part` of one when an online trainer
    shares it) and a CPU each, packed; with TP > 1 vLLM's Ray executor places its rank
    workers on them and the engine's own actor takes no resources of its own. CPU
    machines: one bundle of `tp` CPUs (vLLM's Ray executor refuses the CPU platform, so
    ranks are processes of the multiprocessing executor).
    """
    if not gpus:
        return [{"CPU": float(tp)}]
    return [{"GPU": part, "CPU": 1.0} for _ in range(tp)]


def engine_resources(tp: int, gpus: bool, part: float = 1.0
                     ) -> tuple[dict[str, Any], Literal["ray", "mp"] | None]:
    """What the process that builds a vLLM engine (the engine's actor, the evaluation's
    task) takes inside the engine's placement group, and the executor vLLM must use.

    GPU, TP 1: the GPU itself (`part` of it). GPU, TP > 1: nothing; vLLM's Ray executor
    puts its ranks on the group's bundles (this is what spans nodes; each rank takes
    VLLM_RAY_PER_WORKER_GPUS = `part`: `slots`). CPU: the `tp` CPUs, ranks as
    processes of the multiprocessing executor (inside a placement group vLLM would pick
    its Ray executor, which refuses the CPU platform).
    """
    if not gpus:
        return {"num_cpus": tp, "num_gpus": 0}, ("mp" if tp > 1 else None)
    if tp == 1:
        return {"num_cpus": 1, "num_gpus": part}, None
    return {"num_cpus": 0, "num_gpus": 0}, "ray"


def group_node(pg: Any) -> str:
    """The Ray node of a placed group's first bundle ('' if Ray does not say)."""
    from ray.util.placement_group import placement_group_table

    try:
        nodes = placement_group_table(pg).get("bundles_to_node_id") or {}
    except Exception:  # a group removed meanwhile
        return ""
    return str(nodes.get(0, "")) if isinstance(nodes, dict) else ""


def in_group(pg: Any) -> Any:
    """The scheduling strategy of the process that owns an engine in `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0,
        placement_group_capture_child_tasks=True)


@dataclass
class Waits:
    """How a wait for resources is told and ended: `on_wait(reason)` hears what it waits
    for (None once it stops waiting); `cancelled()` ends it."""

    cancelled: Callable[[], bool] | None = None
    on_wait: Callable[[str | None], None] | None = None


@dataclass
class EnginePool:
    """Ray actors that each own one engine, kept by engine configuration."""

    actors: dict[tuple[Any, ...], list[EngineSlot]] = field(default_factory=dict)
    restarts: int = 0
    arbiter: GpuArbiter = field(default_factory=GpuArbiter)

    def __post_init__(self) -> None:
        # In the service the scheduler hands idle engines' GPUs on (its loop calls
        # release_idle when the arbiter says a request waits). A pool without one
        # (run_job(pool=...), jobs one after another in one process) does it itself, on
        # the waiting thread: else a job would wait forever for the GPU of an engine the
        # pool keeps warm for a job that has ended.
        if self.arbiter.on_waiter is None:
            self.arbiter.on_waiter = self.release_idle

    def slots(self, engine: str, config: AnyEngineConfig, replicas: int, spec: JobSpec, *,
              job: str = "local", order: float = 0.0, waits: Waits | None = None,
              part: float = 1.0, label_selector: dict[str, str] | None = None
              ) -> list[EngineSlot]:
        """`replicas` workers of this engine configuration for `job`: the warm ones, and
        new ones once the arbiter and Ray have their GPUs (meanwhile `waits` hears what
        they wait for), on nodes `label_selector` admits; each rank takes `part` of a GPU
        (less than 1 when the job's online trainer shares it: its plan's 1 -
        train_share). Raises JobCancelled if `waits` says cancelled while waiting."""
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
        kvcache_gib = config.settings.options.cpu_kvcache_gib if on_vllm(config) else 1
        while len(have) < replicas:
            index = len(have)
            name = f"engine-{index}"
            env = engine_env(kvcache_gib, tp=tp, gpus=bool(gpus), part=part, replica=index,
                             replicas=replicas)
            fault_point = settings.FAULT_POINT.raw()
            if fault_point:  # crash tests: the workers are the ones to die
                env[settings.FAULT_POINT.name] = fault_point
            holder = None
            if gpus:
                holder = Holder(job=job, role=name, gpus=round(tp * part, 6),
                                order=(order, ENGINE))
                if not self.arbiter.acquire(holder, cancelled=waits.cancelled,
                                            on_wait=waits.on_wait):
                    raise JobCancelled("cancelled while waiting for GPUs")
            pg = place(engine_bundles(tp, bool(gpus), part), f"{name} of job {job}",
                       cancelled=waits.cancelled, on_wait=waits.on_wait,
                       label_selector=label_selector)
            if pg is None:
                if holder is not None:
                    self.arbiter.release(holder)
                raise JobCancelled("cancelled while waiting for Ray to place an engine")
            resources, backend = engine_resources(tp, bool(gpus), part)
            options: dict[str, Any] = {
                "max_restarts": -1,
                "max_task_retries": 0,
                # run_unit calls wait side by side (DISPATCH_DEPTH); progress() and
                # stop_job() answer meanwhile.
                "max_concurrency": DISPATCH_DEPTH + 2,
                "runtime_env": {"env_vars": env},
                "scheduling_strategy": in_group(pg),
                **resources,
            }
            actor_config: AnyEngineConfig = config
            if backend is not None and on_vllm(config):
                actor_config = dataclasses.replace(config, settings=config.settings.model_copy(
                    update={"distributed_executor_backend": backend}))
            actor_cls: Any = ray.remote(ExtractionWorker)
            actor = actor_cls.options(**options).remote(engine, actor_config, name)
            have.append(EngineSlot(name=name, actor=actor, ready_ref=actor.ready.remote(),
                              placement_group=pg, holder=holder))
        return have[:replicas]

    def start(self, spec: JobSpec, timeout: float = 600.0) -> None:
        """Start the engines a job will use and wait until they serve (warm-up)."""
        import ray

        info, layers, _ = preflight(spec)
        connect_ray(spec)
        plan = plan_job(spec, ClusterShape.of_ray())
        config = engine_config_for(spec, info, layers, plan.engine_memory)
        slots = self.slots(spec.engine, config, plan.replicas, spec, job="warm-up",
                           part=1.0 - plan.train_share)
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
            slots = self.actors[key]
            idle = [s for s in slots if s.holder is not None and s.holder.idle]
            if not idle:  # (an empty list may be one that a job's `slots` call is filling)
                continue
            for slot in idle:
                logger.info("%s yields its GPU to %s", slot.name, waiters)
            self._stop(idle)
            slots[:] = [s for s in slots if s not in idle]  # in place: that call may hold it
            if not slots:
                del self.actors[key]
        return True

    def shutdown(self) -> None:
        self._stop([slot for slots in self.actors.values() for slot in slots])
        self.actors.clear()

    def _stop(self, slots: list[EngineSlot]) -> None:
        """Shut the engines down (vLLM gives its GPU memory back), kill their actors,
        free their placement groups, and only then their GPUs in the arbiter's books: what
        gets them next finds them empty. No slots, no call to Ray: a Ray call in a
        process where Ray is not connected starts a local one (`ray.wait([])` too)."""
        if not slots:
            return
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
