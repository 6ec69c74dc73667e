"""Where a job's engines, its trainer and its evaluation run: the one owner of the
cluster's GPUs in a coordinator (or an `hsx extract` process).

Three parts:

- `plan_job(spec, cluster)` (pure): from the spec and the cluster's resources, how many
  engines on how many GPUs, whether the trainer runs beside the extraction or after it,
  what the evaluation needs — or `JobRefused`, naming what this cluster can never
  provide. The coordinator calls it at submit and when the job runs, and shows the
  result (`JobStatus.plan`).
- `GpuArbiter`: every GPU user (an engine, a trainer, an evaluation) asks it before Ray
  is asked, and waits until its GPUs are free in the arbiter's books, saying what it
  waits for and who holds it. Requests are served in a fixed order: jobs by submission,
  and within a job its engines, then its trainer, then its evaluation — so on one GPU a
  job extracts, trains and is measured before the next job's engines take the GPU. An
  engine the pool keeps warm between jobs is marked idle; the job thread releases idle
  engines when anything waits (`blocked_by_idle`).
- `place(bundles, ...)`: a Ray placement group, waited for the same way: when Ray cannot
  place it although the arbiter's books say the GPUs are free, something outside this
  coordinator uses them, and the wait says so.

On a CPU cluster nothing here waits: CPU engines share the cores (`replicas` x TP ranks
must fit the machine's cores when TP > 1, which vLLM's CPU build binds by hand).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hsx.spec import JobSpec
from hsx.wire import NodePlan, ResourcePlan
from hsx_service.errors import JobRefused
from hsx_workers.engines.vllm.rules import binds_cpu_cores, engine_memory

logger = logging.getLogger(__name__)

POLL_S = 0.5
# Ray takes a moment to place a group after a holder released its GPUs; a placement
# that takes longer than this is a wait worth telling.
PLACE_QUIET_S = 3.0

Cancelled = Callable[[], bool]
OnWait = Callable[[str | None], None]


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class NodeShape:
    """One Ray node: its id, address, resources (CPU, GPU and custom ones) and labels."""

    id: str
    address: str = ""
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def short(self) -> str:
        return f"{self.id[:8]} ({self.address})" if self.address else self.id[:8]


@dataclass(frozen=True)
class ClusterShape:
    """What a plan is made from: the cluster's GPUs, logical CPUs, and the cores CPU
    engines bind to (known for a cluster of one node on this machine, else None); its
    nodes, when read from Ray (a plan then says what runs on which node)."""

    gpus: int
    cpus: int
    cores: int | None = None
    nodes: tuple[NodeShape, ...] = ()

    @classmethod
    def of_ray(cls) -> ClusterShape:
        import ray

        resources = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cores: int | None = None
        if len(nodes) == 1:
            here = ray.util.get_node_ip_address()
            node = nodes[0]
            if node.get("NodeManagerAddress") == here:
                cores = local_cores()
            else:
                cores = int(node.get("Resources", {}).get("CPU", 0)) or None
        shapes = tuple(NodeShape(
            str(n.get("NodeID", "")), str(n.get("NodeManagerAddress", "")),
            {k: float(v) for k, v in (n.get("Resources") or {}).items()
             if not k.startswith("node:") and k not in ("memory", "object_store_memory")},
            {k: str(v) for k, v in (n.get("Labels") or {}).items()}) for n in nodes)
        return cls(gpus=int(resources.get("GPU", 0)), cpus=int(resources.get("CPU", 0)),
                   cores=cores, nodes=shapes)


def local_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gpus(n: float) -> str:
    return f"{n:g} GPU" if n <= 1 else f"{n:g} GPUs"


def trains_on_gpus(spec: JobSpec, cluster_gpus: int) -> int:
    """GPUs the job's trainer takes: its workers on a GPU cluster (0 on CPU)."""
    train = spec.train
    if train is None or train.device == "cpu" or cluster_gpus < 1:
        return 0
    return train.workers


def plan_job(spec: JobSpec, cluster: ClusterShape) -> ResourcePlan:
    """The job's plan on this cluster, or JobRefused naming the field it cannot meet."""
    if cluster.gpus < 1:
        return _plan_on_cpus(spec, cluster)
    gpus, tp, train = cluster.gpus, spec.tensor_parallel_size, spec.train
    if tp > gpus:
        raise JobRefused(
            f"tensor_parallel_size: one engine needs {_gpus(tp)}, but the Ray cluster has "
            f"{gpus}; lower tensor_parallel_size to {gpus} or less, or add GPUs")
    train_gpus = trains_on_gpus(spec, gpus)
    if train_gpus > gpus:
        raise JobRefused(
            f"train.workers: {train_gpus} training workers need a GPU each, but the Ray "
            f"cluster has {gpus}; set train.workers to {gpus} or less")
    if spec.replicas is None:
        beside = (gpus - train_gpus) // tp
        replicas = beside if beside >= 1 else gpus // tp
    else:
        replicas = spec.replicas
        if replicas * tp > gpus:
            raise JobRefused(
                f"replicas: {replicas} engines x tensor_parallel_size {tp} need "
                f"{_gpus(replicas * tp)}, but the Ray cluster has {gpus}; set replicas to "
                f"{gpus // tp} or less (or leave it out: as many as fit)")
    engine_gpus = replicas * tp
    training = "none"
    eval_gpus = 0
    share = 0.0
    if train is not None:
        training = "beside" if engine_gpus + train_gpus <= gpus else "after"
        eval_gpus = tp if train.eval_prompts > 0 else 0
        if train.online and training == "after":
            # The trainer takes the states as the engines capture them, so it cannot
            # wait for their GPUs: it takes a part of one of them.
            training, share, train_gpus = "shared", train.gpu_share, 0
    if train is not None and training == "shared" and train.workers > 1:
        raise JobRefused(
            f"train.workers: {train.workers} online training workers need a GPU each beside "
            f"the engines', but the engines take every GPU of the cluster ({gpus}); set "
            "replicas lower, train.workers to 1 (it shares an engine's GPU), or add GPUs")
    if train is not None and training == "shared" and train.place == "apart":
        raise JobRefused(
            "train.place: apart, but the engines take every GPU of the cluster and the "
            "online trainer would share one of theirs; add a node with GPUs for the "
            "trainer, set replicas lower, or use place: any")
    plan = ResourcePlan(gpus=gpus, replicas=replicas, tensor_parallel_size=tp,
                        engine_gpus=engine_gpus, train_gpus=train_gpus, eval_gpus=eval_gpus,
                        training=training, train_share=share,
                        engine_memory=engine_memory(spec.vllm.gpu_memory_utilization, share),
                        train_place=train.place if train is not None else "any")
    plan.nodes = place_on_nodes(spec, plan, cluster)
    plan.summary = _summary(plan)
    return plan


# ------------------------------------------------------------------ nodes


def engine_needs(plan: ResourcePlan) -> dict[str, float]:
    """What one engine takes of a node (its placement group's bundles together)."""
    tp = plan.tensor_parallel_size
    if plan.gpus < 1:
        return {"CPU": float(tp)}
    return {"GPU": round(tp * (1.0 - plan.train_share), 6), "CPU": float(tp)}


def trainer_needs(spec: JobSpec, plan: ResourcePlan) -> dict[str, float]:
    """What one trainer worker takes of a node: a CPU, its GPU on a GPU cluster, and
    the spec's custom resources."""
    train = spec.train
    needs: dict[str, float] = {"CPU": 1.0}
    if plan.train_gpus:
        needs["GPU"] = 1.0
    if train is not None:
        needs.update(train.resources)
    return needs


def labels_match(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node with `labels` meets Ray's label `selector` (`value`, `!value`,
    `in(a,b)`, `!in(a,b)`)."""
    for key, want in selector.items():
        negate = want.startswith("!")
        want = want[1:] if negate else want
        values = ({v.strip() for v in want[want.index("(") + 1 : -1].split(",")}
                  if want.endswith(")") else {want})
        if (labels.get(key) in values) == negate:
            return False
    return True


def engine_selector(spec: JobSpec) -> dict[str, str]:
    """The label selector of the job's engines: a trainer kept `apart` on labelled nodes
    keeps those nodes for itself, so the engines go where its labels do not match
    (`hsx-role: trainer` -> `hsx-role: !trainer`); else anywhere."""
    train = spec.train
    if train is None or train.place != "apart":
        return {}
    selector = {}
    for key, value in train.node_labels.items():
        selector[key] = value[1:] if value.startswith("!") else f"!{value}"
    return selector


def _fits(free: dict[str, float], needs: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in needs.items())


def _take(free: dict[str, float], needs: dict[str, float]) -> None:
    for k, v in needs.items():
        free[k] = free.get(k, 0.0) - v


def place_on_nodes(spec: JobSpec, plan: ResourcePlan, cluster: ClusterShape
                   ) -> list[NodePlan]:
    """Which node runs each engine and each trainer worker (first fit: the engines on
    the nodes the trainer cannot use first), or JobRefused naming what no node has. Empty
    when the cluster's nodes are not known. An engine no single node holds (TP ranks
    across nodes) is not named; the trainer is placed where its workers have room beside
    the engines, or (`apart`) on nodes without them."""
    if not cluster.nodes:
        return []
    train = spec.train
    nodes = list(cluster.nodes)
    free = {n.id: dict(n.resources) for n in nodes}
    placed = {n.id: NodePlan(node=n.id, address=n.address) for n in nodes}
    labels = dict(train.node_labels) if train is not None else {}
    worker = trainer_needs(spec, plan)

    def trainer_may(n: NodeShape) -> bool:
        return labels_match(n.labels, labels) and all(
            n.resources.get(k, 0.0) > 0 for k in worker)

    needs = engine_needs(plan)
    engines_may = engine_selector(spec)
    for i in range(plan.replicas):
        # The nodes the trainer may not use first, then those with the most room.
        order = sorted((n for n in nodes if labels_match(n.labels, engines_may)),
                       key=lambda n: (trainer_may(n), -free[n.id].get("CPU", 0.0)))
        node = next((n for n in order if _fits(free[n.id], needs)), None)
        if node is not None:
            _take(free[node.id], needs)
            placed[node.id].engines.append(f"engine-{i}")
    if train is not None and plan.training != "none":
        if plan.training == "shared":
            first = next((n for n in nodes if placed[n.id].engines), None)
            if first is not None:
                placed[first.id].trainer_workers.append(0)
        else:
            _place_trainer(spec, plan, nodes, free, placed, worker)
    return [p for p in placed.values() if p.engines or p.trainer_workers]


def _place_trainer(spec: JobSpec, plan: ResourcePlan, nodes: list[NodeShape],
                   free: dict[str, dict[str, float]], placed: dict[str, NodePlan],
                   worker: dict[str, float]) -> None:
    train = spec.train
    if train is None:
        return
    labels = dict(train.node_labels)
    apart = train.place == "apart"
    if labels and not any(labels_match(n.labels, labels) for n in nodes):
        seen = sorted({f"{k}={v}" for n in nodes for k, v in n.labels.items()
                       if not k.startswith("ray.io/")})
        raise JobRefused(
            f"train.node_labels: no node of the Ray cluster has "
            f"{', '.join(f'{k}={v}' for k, v in labels.items())} (its nodes' labels: "
            f"{', '.join(seen) or 'none'})")
    for name, amount in train.resources.items():
        if not any(n.resources.get(name, 0.0) >= amount for n in nodes):
            raise JobRefused(
                f"train.resources: no node of the Ray cluster has {amount:g} {name} (a "
                "custom resource its nodes are started with: `ray start --resources`)")
    eligible = [n for n in nodes if labels_match(n.labels, labels)
                and not (apart and placed[n.id].engines)
                and all(n.resources.get(k, 0.0) > 0 for k in worker)]
    # Offline after the extraction, the engines have yielded what they held.
    room = {n.id: dict(n.resources) if plan.training == "after" else dict(free[n.id])
            for n in eligible}
    for rank in range(train.workers):
        node = next((n for n in eligible if _fits(room[n.id], worker)), None)
        if node is None:
            if apart or labels or train.resources:
                where = " without the job's engines" if apart else ""
                if labels:
                    where += " labelled " + ", ".join(f"{k}={v}" for k, v in labels.items())
                needs = ", ".join(f"{v:g} {k}" for k, v in worker.items())
                raise JobRefused(
                    f"train.{'place' if apart else 'workers'}: {train.workers} trainer "
                    f"worker{'s' * (train.workers > 1)} need {needs} each on nodes{where}; "
                    f"the cluster has room for {rank} there")
            return  # Ray finds room as the cluster frees it (or grows)
        _take(room[node.id], worker)
        placed[node.id].trainer_workers.append(rank)


def _plan_on_cpus(spec: JobSpec, cluster: ClusterShape) -> ResourcePlan:
    tp = spec.tensor_parallel_size
    replicas = spec.replicas or 1
    ranks = replicas * tp
    if binds_cpu_cores(tp) and cluster.cores is not None and ranks > cluster.cores:
        fit = cluster.cores // tp
        fix = (f"set replicas to {fit}" if fit >= 1
               else f"lower tensor_parallel_size to {cluster.cores}")
        raise JobRefused(
            f"replicas: {replicas} engines x tensor_parallel_size {tp} = {ranks} CPU engine "
            f"ranks, and vLLM's CPU build binds each rank to cores of its own: they need "
            f"{ranks} cores, this machine has {cluster.cores}; {fix}")
    if ranks > cluster.cpus:
        raise JobRefused(
            f"replicas: {replicas} engines x tensor_parallel_size {tp} need {ranks} CPUs, "
            f"but the Ray cluster has {cluster.cpus}")
    train = spec.train
    if train is not None and train.device == "cuda":
        raise JobRefused("train.device: cuda, but the Ray cluster has no GPU; use auto or cpu")
    plan = ResourcePlan(gpus=0, replicas=replicas, tensor_parallel_size=tp,
                        training="none" if train is None else "beside",
                        train_place=train.place if train is not None else "any")
    plan.nodes = place_on_nodes(spec, plan, cluster)
    plan.summary = _summary(plan)
    return plan


def _summary(plan: ResourcePlan) -> str:
    engines = f"{plan.replicas} engine{'s' if plan.replicas != 1 else ''}"
    if plan.tensor_parallel_size > 1:
        engines += f" x TP {plan.tensor_parallel_size}"
    if plan.gpus < 1:
        text = f"CPU cluster: {engines} on CPUs"
        if plan.training != "none":
            text += "; the trainer beside them on a CPU; then the evaluation on a CPU"
        return text + _by_node(plan)
    text = f"{_gpus(plan.gpus)}: {engines} on {plan.engine_gpus}"
    trainer = f"the trainer on {_gpus(plan.train_gpus)}" if plan.train_gpus else \
        "the trainer on a CPU"
    if plan.training == "beside":
        text += f"; {trainer} beside them, following the shards"
    elif plan.training == "shared":
        text += (f"; the online trainer shares a GPU with them: it takes {plan.train_share:g} "
                 f"of it (and of its memory), vLLM {plan.engine_memory:g} of each GPU's memory")
    elif plan.training == "after":
        text += (f"; when the extraction ends the engines yield their GPUs and {trainer} "
                 "trains")
    if plan.eval_gpus:
        tp = (f" (TP {plan.tensor_parallel_size})" if plan.tensor_parallel_size > 1 else "")
        text += f"; then vLLM measures the draft on {_gpus(plan.eval_gpus)}{tp}"
    return text + _by_node(plan)


def _by_node(plan: ResourcePlan) -> str:
    """The plan's nodes in words, when it spans several or keeps the trainer apart."""
    if not (len(plan.nodes) > 1 or plan.train_place == "apart"):
        return ""
    where = []
    for node in plan.nodes:
        parts = list(node.engines)
        if node.trainer_workers:
            parts.append("trainer worker" + "s" * (len(node.trainer_workers) > 1) + " "
                         + ", ".join(map(str, node.trainer_workers)))
        where.append(f"node {node.node[:8]}: {' + '.join(parts)}")
    apart = " (the trainer apart from the engines)" if plan.train_place == "apart" else ""
    return f"; by node{apart}: " + "; ".join(where)


# ------------------------------------------------------------------ the arbiter


@dataclass(eq=False)
class Holder:
    """One GPU user: an engine, a trainer or an evaluation of a job."""

    job: str
    role: str  # engine-0, trainer, evaluation
    gpus: float  # a part of one GPU for an online trainer sharing it, and its engine
    order: tuple[float, int]  # (the job's submission time, 0 engines | 1 trainer | 2 evaluation)
    idle: bool = False  # an engine kept warm that no job uses now
    # In line, but not served before this is set (a trainer planned after the extraction),
    # and what it waits for until then.
    ready: threading.Event | None = None
    until: str = ""

    @property
    def eligible(self) -> bool:
        return self.ready is None or self.ready.is_set()

    def describe(self) -> str:
        role = self.role if self.role.startswith("engine") else f"the {self.role}"
        return f"{role} of job {self.job}" + (" (idle, kept warm)" if self.idle else "")


ENGINE, TRAINER, EVALUATION = 0, 1, 2


@dataclass
class GpuArbiter:
    """The GPUs of the cluster in this process's books: who holds them, who waits."""

    total: Callable[[], int] = field(default=lambda: _cluster_gpus())
    _held: list[Holder] = field(default_factory=list)
    _waiting: list[Holder] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    # Called (outside the arbiter's lock) when a request starts waiting: the job thread
    # wakes up to release idle engines.
    on_waiter: Callable[[], object] | None = None

    def enqueue(self, holder: Holder) -> None:
        """Take `holder`'s place in line now (`acquire` then waits from there): what it
        does before it gives up GPUs of its own (the trainer, before its evaluation asks)
        keeps a later job from slipping in between."""
        if holder.gpus <= 0:
            return
        with self._cond:
            if holder not in self._waiting:
                self._waiting.append(holder)
                self._waiting.sort(key=lambda h: h.order)

    def acquire(self, holder: Holder, *, cancelled: Cancelled | None = None,
                on_wait: OnWait | None = None, poll_s: float = POLL_S) -> bool:
        """Wait until `holder` is ready, its GPUs are free and nobody earlier in line
        waits; hold them.

        `on_wait(reason)` hears what it waits for whenever that changes, and None once
        held. False if `cancelled()` turned true while it waited (nothing held).
        """
        if holder.gpus <= 0:
            if holder.ready is not None:  # nothing to hold, but it still waits its turn
                return self._wait_ready(holder, cancelled, on_wait, poll_s)
            return True
        shown: str | None = None
        told = False  # the job thread heard that this request waits
        self.enqueue(holder)
        try:
            while True:
                with self._cond:
                    total = self.total()
                    if self._grantable(holder, total):
                        self._held.append(holder)
                        break
                    reason = self._reason(holder, total)
                if cancelled is not None and cancelled():
                    return False
                if reason != shown:
                    logger.info("%s: %s", holder.describe(), reason)
                    shown = reason
                    if on_wait is not None:
                        on_wait(reason)
                if holder.eligible and not told:
                    told = True
                    if self.on_waiter is not None:
                        self.on_waiter()
                with self._cond:
                    self._cond.wait(poll_s)
        finally:
            with self._cond:
                if holder in self._waiting:
                    self._waiting.remove(holder)
                self._cond.notify_all()
        if shown is not None and on_wait is not None:
            on_wait(None)
        return True

    def _wait_ready(self, holder: Holder, cancelled: Cancelled | None, on_wait: OnWait | None,
                    poll_s: float) -> bool:
        if holder.ready is None or holder.ready.is_set():
            return True
        if on_wait is not None:
            on_wait(holder.until or "waiting")
        while not holder.ready.wait(poll_s):
            if cancelled is not None and cancelled():
                return False
        if on_wait is not None:
            on_wait(None)
        return True

    def withdraw(self, holder: Holder) -> None:
        """Leave the line without waiting (an enqueued request that will not acquire)."""
        with self._cond:
            if holder in self._waiting:
                self._waiting.remove(holder)
                self._cond.notify_all()

    def release(self, holder: Holder) -> None:
        with self._cond:
            if holder in self._held:
                self._held.remove(holder)
                self._cond.notify_all()

    def holders(self) -> list[Holder]:
        with self._cond:
            return list(self._held)

    def waiters(self) -> list[Holder]:
        with self._cond:
            return list(self._waiting)

    def blocked_by_idle(self) -> bool:
        """Something waits while an idle engine holds GPUs: the pool should let it go."""
        with self._cond:
            return any(h.eligible for h in self._waiting) and any(h.idle for h in self._held)

    def waits_ahead_of(self, order: tuple[float, int]) -> bool:
        """Whether a request earlier in line than `order` waits (warm engines of a later
        job then yield to it instead of being reused)."""
        with self._cond:
            return any(h.eligible and h.order < order for h in self._waiting)

    def _free(self, total: int) -> float:
        return round(total - sum(h.gpus for h in self._held), 6)

    def _grantable(self, holder: Holder, total: int) -> bool:
        first = next((h for h in self._waiting if h.eligible and h.gpus <= total), None)
        return first is holder and self._free(total) >= holder.gpus

    def _reason(self, holder: Holder, total: int) -> str:
        if not holder.eligible:
            return holder.until or "waiting"
        need = f"waiting for {_gpus(holder.gpus)}"
        ahead = [h for h in self._waiting
                 if h.eligible and h.order < holder.order and h is not holder]
        held = sorted(self._held, key=lambda h: h.order)
        who = ", ".join(h.describe() for h in held[:4]) + (
            f" and {len(held) - 4} more" if len(held) > 4 else "")
        text = f"{need} of {total}: held by {who}" if held else f"{need} of {total}"
        if ahead and self._free(total) >= holder.gpus:
            text += f"; {ahead[0].describe()} waits ahead of it"
        return text


def _cluster_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


# ------------------------------------------------------------------ Ray placement


def place(bundles: list[dict[str, float]], who: str, *, cancelled: Cancelled | None = None,
          on_wait: OnWait | None = None, poll_s: float = POLL_S,
          label_selector: dict[str, str] | None = None) -> Any:
    """A PACK placement group of `bundles`, each on a node `label_selector` admits (Ray's
    label syntax), once Ray has placed it (None if cancelled first). While Ray cannot
    place it, `on_wait` hears what the cluster has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy="PACK", bundle_label_selector=(
        [dict(label_selector) for _ in bundles] if label_selector else None))
    ready = pg.ready()
    shown: str | None = None
    since = time.monotonic()
    while True:
        done, _ = ray.wait([ready], timeout=poll_s)
        if done:
            break
        if cancelled is not None and cancelled():
            remove_placement_group(pg)
            return None
        if time.monotonic() - since < PLACE_QUIET_S:
            continue
        reason = (f"waiting for Ray to place {who} ({_bundles(bundles)}): the cluster has "
                  f"{_resources(ray.cluster_resources())}, "
                  f"{_resources(ray.available_resources())} free; what this coordinator "
                  "does not hold is used by something else on the cluster")
        if reason != shown:
            if shown is None:
                logger.warning("%s", reason)
            shown = reason
            if on_wait is not None:
                on_wait(reason)
    if shown is not None and on_wait is not None:
        on_wait(None)
    return pg


def _bundles(bundles: list[dict[str, float]]) -> str:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return _resources(total)


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in ("GPU", "CPU")
                     if k in resources or k == "GPU")


def plan_for_cluster(spec: JobSpec) -> ResourcePlan:
    """`plan_job` on the Ray cluster this process is connected to."""
    return plan_job(spec, ClusterShape.of_ray())
