"""A dataset's slices tokenized as Ray tasks: `RayTasks`, the `concurrent.futures`
Executor that `hsx.ingest.ingest(executor=...)` takes, and `tokenizing_tasks`, which
says when the ingestion of a job uses it and where its tasks may run.

`prepare.Ingestion` asks `tokenizing_tasks` before it ingests. Ray tasks are used when
Ray is connected in the process that ingests (a coordinator connects before its first
job; `hsx extract` only after its ingestion has started, so it takes the local path: a
child process of its own, or a pool of them with HSX_INGEST_WORKERS) and more than one
slice at a time is asked for (one at a time beside a streamed job's CPU engines, on a
cluster without GPUs: they take every core). Each task takes one of Ray's CPUs, so
Ray's accounting keeps them off the CPUs that the engines' placement groups hold. A
slice of a local file can only be read where the file is: those tasks run on the
driver's node; a dataset in a bucket is read from any node (its slices carry the
credentials resolved here), so its tasks run anywhere in the cluster. A task tokenizes
in a child process of its own (hsx.ingest.bounded: killed when a row will not end), which
loads the tokenizer: a node that runs them must see `tokenizer` (or `model`) at its
path, as the engines' nodes see the model. The tables are byte for byte those
of one process whatever runs the slices (`ingest` writes the results in slice order).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future, ThreadPoolExecutor
from typing import Any

from hsx.spec import DatasetSpec
from hsx_service.placement import local_cores

logger = logging.getLogger(__name__)


class RayTasks(Executor):
    """An Executor whose calls run as Ray tasks of one CPU each, at most `max_workers`
    at once (the others wait here, as in a process pool's queue), in Ray workers of
    their own (Ray gives the tasks of one runtime env workers of that env: `env` is
    set in them and nowhere else), on the node `node` (a Ray node id) when one is given.

    A thread per running task waits for it (Ray's own futures call back on a thread of
    Ray's that must not submit tasks, and a task that ends must start the next one). A
    task's exception is raised as itself, Ray's wrapper (with the remote traceback) as
    its `__cause__`. `shutdown(cancel_futures=True)` drops what waits and cancels what
    runs (`ray.cancel`: interrupted at its next Python line). The function must be
    importable where the task runs: a module-level function of an installed package.
    """

    def __init__(self, max_workers: int, *, node: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.node = node
        self._options: dict[str, Any] = {"num_cpus": 1}
        if env:
            self._options["runtime_env"] = {"env_vars": dict(env)}
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            self._options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=node, soft=False)
        self._tasks: dict[Callable[..., Any], Any] = {}  # the function's remote
        self._running: set[Any] = set()  # object refs
        self._cancelled = False
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers, thread_name_prefix="hsx-ray-task")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._threads.submit(self._run, fn, args, kwargs)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> Any:
        import ray
        from ray.exceptions import RayTaskError

        with self._lock:
            if self._cancelled:  # taken from the queue as shutdown cancelled it
                raise CancelledError()
            task = self._tasks.get(fn)
            if task is None:
                task = self._tasks[fn] = ray.remote(fn).options(**self._options)
            ref = task.remote(*args, **kwargs)
            self._running.add(ref)
        try:
            return ray.get(ref)
        except RayTaskError as err:
            if err.cause is None:
                raise
            raise err.cause from err
        finally:
            with self._lock:
                self._running.discard(ref)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            import ray

            with self._lock:
                self._cancelled = True
                running = list(self._running)
            for ref in running:
                ray.cancel(ref)
        self._threads.shutdown(wait=wait, cancel_futures=cancel_futures)


def tokenizing_tasks(dataset: DatasetSpec, workers: int | None, *,
                     beside_engines: bool = False) -> RayTasks | None:
    """The Ray tasks that tokenize the dataset's slices, or None for the local path.

    `workers` (HSX_INGEST_WORKERS, `prepare.ingest_workers`): None (unset) for as many
    at once as Ray has CPUs for them (`tokenizing_cpus`), N for N; 1 is the sequential
    path, in a child of the process that ingests. None too when Ray is not connected here, and
    when the tasks would have fewer than 2 CPUs (or none on the driver's node for a
    local dataset: a task pinned there would never start).

    `beside_engines`: the job's engines run while it is ingested (a streamed job). On a
    cluster without GPUs they are vLLM's CPU build, which computes on every core of its
    node: with `workers` unset one task at a time then, behind them. More tasks take
    cores from a starting engine and delay the first commit (benchmarks/
    bench_first_commit.py). One task keeps ahead of a CPU engine: it tokenizes rows
    faster than the engine captures their tokens. The first part is tokenized by the
    coordinator's own tokenizing child either way, before the engines start
    (`hsx.ingest.pipeline._tokenized`).
    """
    if workers == 1 or "ray" not in sys.modules:  # not connected: not imported for this
        return None
    import ray

    if not ray.is_initialized():
        return None
    from hsx.ingest.slices import TOKENIZING_PROCESS_ENV
    from hsx.ingest.sources import is_bucket_uri

    anywhere = is_bucket_uri(dataset.path)
    node = None if anywhere else ray.get_runtime_context().get_node_id()
    cpus = tokenizing_cpus(node)
    if workers is None and beside_engines and not ray.cluster_resources().get("GPU"):
        count = 1  # behind the CPU engines
    else:
        count = workers or cpus
        if count < 2:
            return None
    if cpus < 1:
        return None
    logger.info("tokenizing %s as Ray tasks, %d at once, %s", dataset.path, count,
                "anywhere in the cluster" if anywhere else "on this node (a local dataset)")
    return RayTasks(count, node=node, env={TOKENIZING_PROCESS_ENV: "1"})


def tokenizing_cpus(node: str | None) -> int:
    """Ray's CPUs that tokenizing tasks may take: those of `node` (else of every alive
    node), less one for each GPU there (an engine's or a trainer's bundle takes a CPU
    beside its GPU, and must not wait for the ingestion to end), the driver's node
    counted at most at its cores (a private Ray started here counts more CPUs than the
    machine has: engine_pool.LOCAL_RAY_MIN_CPUS)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    total = 0
    for info in ray.nodes():
        if not info.get("Alive") or (node is not None and info.get("NodeID") != node):
            continue
        resources = info.get("Resources", {})
        cpus = int(resources.get("CPU", 0))
        if info.get("NodeID") == here:
            cpus = min(cpus, local_cores())
        total += max(cpus - int(resources.get("GPU", 0)), 0)
    return total
