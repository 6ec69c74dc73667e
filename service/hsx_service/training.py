"""The one training run of every entry point.

`TrainingRun` trains a draft from its plan to its records, the same for every entry
point: `hsx train OUTPUT`, `hsx extract` with `train:`, and the coordinator (`Trainings`,
trainings.py). The entry points differ only in where they report (`TrainingHooks`: printed
lines, or the ledger and the job's status) and in what they hand it (`TrainingRequest`).
Its steps:

1. **Its turn and its place**: it waits for what the plan says it follows (the
   extraction's end, when the engines yield their GPUs to it; for `place: apart`, the
   job's engines placed, so it can keep off their nodes), then for its GPUs from the
   `GpuArbiter` and Ray's placement group (placement.py); whoever waits says for what.
2. **The trainer**: a `TrainerActor` (hsx_workers.trainer_actor) that runs
   `DraftTrainer`, or drives the Ray Train run of `workers` > 1 whose workers are placed
   by the spec's `node_labels`, `resources` and `place`. The run follows it (its steps,
   its plan, what it waits for), restarts it when it dies (MAX_TRAIN_RESTARTS times; it
   resumes from its newest checkpoint), and stops it when asked. `hsx train OUTPUT` runs
   the same actor's code in its own process (`here`): no Ray for one worker.
3. **Validation** happens in the trainer at each checkpoint; the best checkpoint is the
   draft (hsx_workers.trainer).
4. **Measurement by vLLM**: a Ray task places the target as the job's engines run it (its
   tensor parallelism, its `vllm:` settings) with the draft (`acceptance.evaluate_draft`;
   `training: evaluating`), when the request carries the job (`hsx train OUTPUT` has no
   job to load the target from, and says how to measure instead).
5. **Records**: draft/ (train.json, metrics, validations, checkpoints, eval.json) are the
   trainer's and the evaluation's; the hooks hear each state.

An online job's training (`train: {online: true}`) is the same run; its trainer's
workers take the job's stream (hsx.online) instead of stored shards. When it fails for
good, the run says so in the stream, so the job's engines stop capturing for it.

The coordinator's side, a run per job reporting into its ledger, is trainings.py's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.draft import (
    read_metrics,
)
from hsx.output import Output
from hsx.spec import JobSpec, TargetModel, TrainSpec
from hsx.wire import (
    ResourcePlan,
    TrainPoint,
    TrainState,
)
from hsx_service.engine_pool import (
    connect_ray,
    engine_bundles,
    engine_resources,
    ensure_ray,
    in_group,
)
from hsx_service.placement import (
    EVALUATION,
    TRAINER,
    GpuArbiter,
    Holder,
    place,
    trains_on_gpus,
)
from hsx_workers.engines.vllm.rules import target_settings
from hsx_workers.engines.vllm.settings import TargetSettings

logger = logging.getLogger(__name__)

MAX_TRAIN_RESTARTS = 3
POLL_S = 0.5
HISTORY_POINTS = 500
NODE_ID_LABEL = "ray.io/node-id"  # Ray's label of every node: its id


def read_history(root: Path) -> list[TrainPoint]:
    """The loss curve from draft/metrics.jsonl, thinned to at most HISTORY_POINTS."""
    points = []
    for row in read_metrics(root):
        try:
            points.append(TrainPoint.model_validate(row))
        except ValueError:
            continue  # a record of another shape
    if len(points) > HISTORY_POINTS:
        stride = -(-len(points) // HISTORY_POINTS)
        points = points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
    return points


# ---------------------------------------------------------------------- the run


@dataclass
class TrainingHooks:
    """Where a training run reports (the CLI prints; the coordinator keeps its ledger)."""

    # starting, running, evaluating, done, failed, stopped; the error; restarts so far
    on_state: Callable[[TrainState, str | None, int], None] | None = None
    on_plan: Callable[[dict[str, Any]], None] | None = None  # the trainer's plan, once
    on_step: Callable[[dict[str, Any]], None] | None = None  # each logged step, in order
    # the trainer's progress at each poll: last step, where its workers run, its waits
    on_progress: Callable[[dict[str, Any]], None] | None = None
    on_waiting: Callable[[str | None], None] | None = None  # what it waits for; None: nothing
    on_eval: Callable[[dict[str, Any]], None] | None = None  # vLLM's measurement, or error
    stopping: Callable[[], bool] | None = None  # the caller asks the run to stop


class EngineNodes:
    """Where a job's engines run, as its driver says (`DispatchHooks.on_engines`), for a
    trainer kept apart from them: None until they are placed; none once the job ended."""

    def __init__(self, extracted: threading.Event) -> None:
        self.extracted = extracted
        self.by_engine: dict[str, str] | None = None

    def placed(self, nodes: dict[str, str]) -> None:
        self.by_engine = dict(nodes)

    def __call__(self) -> set[str] | None:
        if self.by_engine is None:
            return set() if self.extracted.is_set() else None
        return {node for node in self.by_engine.values() if node}


@dataclass
class TrainingRequest:
    """What to train, with what, and when and where it may run."""

    output: str | Output
    spec: TrainSpec
    job: JobSpec | None = None  # the admitted job: its target, and its engines (measure)
    target: TargetModel | None = None  # without a job: the model and its trust flag
    job_id: str = "local"
    order: float = 0.0  # the job's place in line for GPUs (its submission time)
    # What the trainer waits for before it asks for GPUs (the extraction's end, when its
    # plan trains after it), and what it says meanwhile.
    after: threading.Event | None = None
    share: float = 0.0  # of an engine's GPU, for an online trainer beside it (else 0)
    # `place: apart`: the Ray nodes of the job's engines once placed (None until then).
    engine_nodes: Callable[[], set[str] | None] | None = None
    draft_root: str | None = None  # the local folder to train in (default the output's)
    here: bool = False  # in this process (`hsx train OUTPUT`): no actor, no restart
    restarts: int = 0  # the trainer's restarts before this run (a resumed coordinator)

    @property
    def measure(self) -> bool:
        """vLLM measures the draft at the end: the job says how to load its target."""
        return self.job is not None and self.spec.eval_prompts > 0

    @property
    def trained_target(self) -> TargetModel | None:
        return self.job.target if self.job is not None else self.target

    @classmethod
    def of_job(cls, job_id: str, output: str, spec: TrainSpec, job: JobSpec,
               plan: ResourcePlan | None, *, order: float = 0.0,
               extracted: threading.Event | None = None,
               engine_nodes: Callable[[], set[str] | None] | None = None,
               restarts: int = 0) -> TrainingRequest:
        """A job's training as its plan places it: beside the extraction, after it (the
        engines' GPUs are needed: it waits for `extracted`), or online on a share of an
        engine's GPU. `plan` None: the job has ended, nothing to wait for."""
        after, share = None, 0.0
        if plan is not None:
            wanted = trains_on_gpus(job.model_copy(update={"train": spec}), plan.gpus)
            if plan.training == "shared":
                share = plan.train_share
            elif plan.engine_gpus + wanted > plan.gpus:
                after = extracted
        return cls(output, spec, job=job, job_id=job_id, order=order, after=after,
                   share=share, engine_nodes=engine_nodes if plan is not None else None,
                   restarts=restarts)


@dataclass
class TrainingOutcome:
    """How a training run ended."""

    state: TrainState  # done, failed or stopped
    error: str | None = None
    refused: bool = False  # the trainer refused the training (TrainRefused): its words
    died: bool = False  # the trainer's process (or a Ray Train worker) died: restarted
    exception: BaseException | None = None  # what the trainer raised, in this process
    result: dict[str, Any] = field(default_factory=dict)  # step, epoch, resumed_from, best
    eval: dict[str, Any] | None = None  # vLLM's measurement (or {"error": ...})
    restarts: int = 0


class TrainingRun:
    """One training from its plan to its records (see the module docstring)."""

    def __init__(self, request: TrainingRequest, hooks: TrainingHooks | None = None,
                 arbiter: GpuArbiter | None = None) -> None:
        self.request = request
        self.hooks = hooks or TrainingHooks()
        self.arbiter = arbiter or GpuArbiter()
        self._stop = threading.Event()
        self._trainer: _Trainer | None = None
        self.restarts = request.restarts
        self.plan_told = False
        self._engine_nodes: set[str] | None = None  # the job's engines' (`place: apart`)

    def stop(self) -> None:
        """Ask the trainer to checkpoint and stop (its run ends `stopped`)."""
        self._stop.set()
        trainer = self._trainer
        if trainer is not None:
            trainer.stop()

    def stopping(self) -> bool:
        if self._stop.is_set():
            return True
        return self.hooks.stopping is not None and self.hooks.stopping()

    def run(self) -> TrainingOutcome:
        """Train (waiting for its turn, restarting a dead trainer), then measure."""
        req = self.request
        # `hsx extract` of a job found complete has not connected Ray yet.
        if not req.here and req.job is not None:
            connect_ray(req.job)
        elif not req.here:
            ensure_ray(None, cpus_needed=1)
        trainer = Holder(
            job=req.job_id, role="trainer",
            gpus=req.share or (0 if req.here else self._trainer_gpus()),
            order=(req.order, TRAINER), ready=req.after,
            until=f"waiting for the extraction of job {req.job_id} to end: its engines hold "
                  "the GPUs the trainer needs (the plan trains after it)")
        self._state(TrainState.starting)
        seat = self._seat(trainer) if not req.here else _Seat(self.arbiter, trainer, None)
        if seat is None:
            return self._end(TrainingOutcome(TrainState.stopped))
        evaluation = None
        try:
            outcome = self._train(seat)
            if outcome.state is TrainState.failed and req.spec.online:
                _tell_stream_failed(req.output, outcome.error)
            if outcome.state is TrainState.done and req.measure:
                evaluation = self._evaluation_holder()
                # In line before the trainer's GPUs go, so no later job slips in between.
                self.arbiter.enqueue(evaluation)
        finally:
            seat.leave()
        if outcome.state is not TrainState.done or evaluation is None:
            return self._end(outcome)
        try:
            self._state(TrainState.evaluating)
            outcome.eval = self._evaluate(evaluation)
            if outcome.eval is None:
                outcome.state = TrainState.stopped
        finally:
            self.arbiter.withdraw(evaluation)  # its place in line, if still held
        return self._end(outcome)

    # -- reporting

    def _state(self, state: TrainState, error: str | None = None) -> None:
        if self.hooks.on_state is not None:
            self.hooks.on_state(state, error, self.restarts)

    def _end(self, outcome: TrainingOutcome) -> TrainingOutcome:
        outcome.restarts = self.restarts
        self._state(outcome.state, outcome.error)
        return outcome

    def _waiting(self, reason: str | None) -> None:
        if self.hooks.on_waiting is not None:
            self.hooks.on_waiting(reason)

    def _progress(self, progress: dict[str, Any]) -> None:
        hooks = self.hooks
        plan = progress.get("plan")
        if plan and not self.plan_told and hooks.on_plan is not None:
            self.plan_told = True
            hooks.on_plan(plan)
        for step in progress.get("steps") or []:
            if hooks.on_step is not None:
                hooks.on_step(step)
        if hooks.on_progress is not None:
            hooks.on_progress(progress)

    # -- the trainer

    def _train(self, seat: _Seat) -> TrainingOutcome:
        """Run trainers until one ends (restarting dead ones); the outcome."""
        req = self.request
        while not self.stopping():
            if req.engine_nodes is not None and self.restarts > req.restarts:
                moved = req.engine_nodes()  # an engine restarted on another node since
                self._engine_nodes = set(moved) if moved else self._engine_nodes
            trainer = self._trainer = (_LocalTrainer(self._trainer_args(seat)) if req.here
                                       else _ActorTrainer(self._new_actor(seat)))
            if self._stop.is_set():  # asked while it started
                trainer.stop()
            outcome = self._follow(trainer)
            self._trainer = None
            if not outcome.died:
                trainer.close()
                return outcome
            self.restarts += 1
            if self.restarts > MAX_TRAIN_RESTARTS or req.here:
                return TrainingOutcome(
                    TrainState.failed,
                    f"the trainer died {self.restarts} times; last: {outcome.error}")
            logger.warning("training of %s: trainer died (%s); restarting from the newest "
                           "checkpoint", req.job_id, outcome.error)
            self._state(TrainState.starting, outcome.error)
        return TrainingOutcome(TrainState.stopped)

    def _follow(self, trainer: _Trainer) -> TrainingOutcome:
        """Poll the trainer until it ends: done, stopped, failed, or died (`died`)."""
        running = False
        asked = False
        try:
            while True:
                ended = trainer.wait(POLL_S)
                progress = trainer.progress()
                if progress is not None:
                    if progress.get("last") and not running:
                        running = True
                        self._state(TrainState.running)
                    self._progress(progress)
                if self.stopping() and not asked:
                    asked = True
                    trainer.stop()
                if ended is not None:
                    return ended
        except KeyboardInterrupt:  # `hsx train` interrupted: checkpoint, then stop
            trainer.stop()
            ended = None
            while ended is None:
                ended = trainer.wait(POLL_S)
            raise

    def _trainer_gpus(self) -> int:
        import ray

        spec = self.request.spec
        if spec.device == "cpu" or ray.cluster_resources().get("GPU", 0) < 1:
            return 0
        return spec.workers

    def _selector(self) -> dict[str, str]:
        """Ray's label selector of the trainer's nodes: the spec's labels, and for
        `place: apart` none of the nodes the job's engines run on."""
        spec, nodes = self.request.spec, self._engine_nodes
        selector = dict(spec.node_labels)
        if spec.place == "apart" and nodes:
            selector[NODE_ID_LABEL] = f"!in({','.join(sorted(nodes))})"
        return selector

    def _trainer_args(self, seat: _Seat) -> dict[str, Any]:
        req = self.request
        placement = {"resources": dict(req.spec.resources), "label_selector": self._selector()}
        return {"output": Output.of(req.output), "spec": req.spec.model_dump(mode="json"),
                "memory_share": req.share or None, "target": req.trained_target,
                "draft_root": req.draft_root,
                "placement": placement if req.spec.workers > 1 else None}

    def _new_actor(self, seat: _Seat) -> Any:
        import ray

        from hsx_workers.nodes import on_this_node
        from hsx_workers.trainer_actor import TrainerActor

        req = self.request
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": 1, "num_gpus": 0}
        if req.spec.workers > 1:
            # It only drives Ray Train, whose workers take the CPUs and GPUs: on this
            # node, where the job's driver runs.
            options.update(num_cpus=0, scheduling_strategy=on_this_node())
        elif seat.pg is not None:
            options.update(num_gpus=req.share or 1, scheduling_strategy=in_group(seat.pg))
        else:
            options.update(resources=dict(req.spec.resources))
            selector = self._selector()
            if selector:
                options["label_selector"] = selector
        actor_cls: Any = ray.remote(TrainerActor)
        # The Output carries the endpoint and credentials resolved here to the actor. The
        # target is the job's as the ledger holds it (what passed the checks), not what
        # the output's manifest says.
        return actor_cls.options(**options).remote(**self._trainer_args(seat))

    # -- its turn and its place

    def _seat(self, holder: Holder) -> _Seat | None:
        """The holder's GPUs: the arbiter's, then Ray's placement group (a bundle a GPU;
        none on a CPU cluster, or for the driver of Ray Train workers, which place
        themselves). None if the run was stopped meanwhile."""
        req = self.request
        apart = holder.role == "trainer" and req.spec.place == "apart"
        if apart and req.engine_nodes is not None and not self._wait_for_engines():
            return None
        if not self.arbiter.acquire(holder, cancelled=self.stopping, on_wait=self._waiting):
            return None
        bundles = engine_bundles(int(holder.gpus), True) if holder.gpus else []
        selector: dict[str, str] = {}
        if holder.role == "trainer" and req.spec.workers > 1:
            bundles = []  # Ray Train places its workers; the arbiter holds their GPUs
        elif holder.role == "trainer" and req.share:
            bundles = engine_bundles(1, True, req.share)  # a part of an engine's GPU
        elif holder.role == "trainer" and bundles:
            bundles = [{**b, **req.spec.resources} for b in bundles]
            selector = self._selector()
        pg = None
        if bundles:
            pg = place(bundles, holder.describe(), cancelled=self.stopping,
                       on_wait=self._waiting, label_selector=selector)
            if pg is None:
                self.arbiter.release(holder)
                return None
        return _Seat(self.arbiter, holder, pg)

    def _wait_for_engines(self) -> bool:
        """`place: apart`: the trainer is placed once the job's engines are, off their
        nodes. False if the run was stopped meanwhile."""
        get = self.request.engine_nodes
        told = False
        while get is not None and (nodes := get()) is None:
            if self.stopping():
                return False
            if not told:
                told = True
                self._waiting("waiting for the job's engines to be placed: the trainer "
                              "runs apart from them (train.place: apart)")
            time.sleep(POLL_S)
        if told:
            self._waiting(None)
        self._engine_nodes = set(nodes) if get is not None and nodes else None
        return True

    # -- the measurement

    def _evaluation_holder(self) -> Holder:
        """The evaluation's GPUs: as many as the job's engines use (its TP); none on a
        CPU cluster, where the target runs as one rank (CPU TP binds cores by hand)."""
        import ray

        req = self.request
        gpus = ray.cluster_resources().get("GPU", 0) >= 1
        tp = req.job.tensor_parallel_size if req.job is not None and gpus else 1
        return Holder(job=req.job_id, role="evaluation", gpus=tp if gpus else 0,
                      order=(req.order, EVALUATION))

    def _evaluate(self, holder: Holder) -> dict[str, Any] | None:
        """vLLM measures the draft on held-out prompts (a Ray task placed as the job's
        engines are: its tensor parallelism, its `vllm:` settings); its result or its
        error lands in draft/eval.json. None when the run was stopped meanwhile (the
        next start measures again)."""
        import ray

        from hsx_workers.acceptance import evaluate_draft, record_eval_error

        req = self.request
        seat = self._seat(holder)
        if seat is None:
            return None
        try:
            options: dict[str, Any] = {"max_retries": 0, "runtime_env": {"env_vars": {
                "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}}}
            resources, _ = engine_resources(max(int(holder.gpus), 1), holder.gpus > 0)
            if seat.pg is not None:
                options.update(resources, scheduling_strategy=in_group(seat.pg))
            else:
                options.update(num_cpus=1, num_gpus=0)
            # max_calls 1: the task's process exits after it, and vLLM's memory with it.
            task: Any = ray.remote(max_calls=1)(evaluate_draft)
            ref = task.options(**options).remote(
                Output.of(req.output), draft_root=req.draft_root,
                **evaluation_args(req, holder))
            while True:
                ready, _ = ray.wait([ref], timeout=POLL_S)
                if ready:
                    break
                if self.stopping():
                    with contextlib.suppress(Exception):
                        ray.cancel(ref, force=True)
                    return None
            try:
                result: dict[str, Any] = ray.get(ref)
            except Exception as err:
                cause = getattr(err, "cause", None) or err
                message = (f"{type(cause).__name__}: "
                           f"{str(cause).splitlines()[0] if str(cause) else ''}")
                logger.warning("evaluating the draft of %s failed: %s", req.output, message)
                record_eval_error(Output.of(req.output), message)
                result = {"error": message}
        finally:
            seat.leave()
        if self.hooks.on_eval is not None:
            self.hooks.on_eval(result)
        if "error" not in result:
            logger.info("draft of %s: mean acceptance length %.2f at k=%s", req.output,
                        result.get("mean_acceptance_length", 0.0), result.get("k"))
        return result


def evaluation_args(request: TrainingRequest, holder: Holder) -> dict[str, Any]:
    """`evaluate_draft`'s arguments for a job's draft: the spec's prompts and k, and the
    target loaded as the job's engines load it (its TP the evaluation's GPUs, its
    `vllm:` arguments, its own code only if the job trusts it)."""
    spec, job = request.spec, request.job
    gpus, tp = holder.gpus > 0, max(int(holder.gpus), 1)
    _, backend = engine_resources(tp, gpus)
    engine = (target_settings(job, tensor_parallel_size=tp,
                              distributed_executor_backend=backend) if job is not None else
              TargetSettings(tensor_parallel_size=tp, distributed_executor_backend=backend))
    return {"prompts": spec.eval_prompts, "max_tokens": spec.eval_max_tokens,
            "k": spec.proposed_tokens, "engine": engine,
            "target": job.model if job is not None else None}


def _tell_stream_failed(output: str | Output, error: str | None) -> None:
    """An online job's training failed for good: its engines stop capturing for it."""
    from hsx_workers.stream import DriverStream

    try:
        DriverStream(Output.of(output).location).set_trainer("failed", error=error)
    except Exception as err:  # Ray gone: the job's driver is gone with it
        logger.warning("could not tell the online stream the training failed: %s", err)


class _Trainer:
    """The trainer as the run drives it: a Ray actor, or its code in this process."""

    def wait(self, timeout: float) -> TrainingOutcome | None:
        raise NotImplementedError

    def progress(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


class _ActorTrainer(_Trainer):
    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.result_ref = actor.run.remote()

    def wait(self, timeout: float) -> TrainingOutcome | None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        from hsx_workers.trainer import TrainRefused, WorkerDied

        ready, _ = ray.wait([self.result_ref], timeout=timeout)
        if not ready:
            return None
        try:
            result = ray.get(self.result_ref)
        except (RayActorError, ActorDiedError) as err:
            return TrainingOutcome(TrainState.failed, str(err).splitlines()[0], died=True)
        except RayTaskError as err:
            cause = err.cause if err.cause is not None else err
            if isinstance(cause, WorkerDied):  # one of its Ray Train workers
                return TrainingOutcome(TrainState.failed, str(cause), died=True)
            return TrainingOutcome(TrainState.failed, f"{type(cause).__name__}: {cause}",
                                   refused=isinstance(cause, TrainRefused))
        return TrainingOutcome(TrainState.stopped if result.get("stopped")
                               else TrainState.done, result=result)

    def progress(self) -> dict[str, Any] | None:
        import ray

        try:
            progress: dict[str, Any] = ray.get(self.actor.progress.remote(), timeout=30)
        except Exception:  # a dead or busy actor: its end tells why
            return None
        return progress

    def stop(self) -> None:
        with contextlib.suppress(Exception):  # a dead actor has nothing to stop
            self.actor.stop.remote()

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


class _LocalTrainer(_Trainer):
    """The trainer in this process (`hsx train OUTPUT`), on a thread of its own."""

    def __init__(self, args: dict[str, Any]) -> None:
        from hsx_workers.trainer_actor import TrainerActor

        self.trainer = TrainerActor(**args)
        self.outcome: TrainingOutcome | None = None
        self.thread = threading.Thread(target=self._run, name="hsx-trainer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from hsx_workers.trainer import TrainRefused

        try:
            result = self.trainer.run()
            self.outcome = TrainingOutcome(TrainState.stopped if result.get("stopped")
                                           else TrainState.done, result=result)
        except BaseException as err:  # the run reports it
            self.outcome = TrainingOutcome(TrainState.failed, f"{type(err).__name__}: {err}",
                                           refused=isinstance(err, TrainRefused),
                                           exception=err)

    def wait(self, timeout: float) -> TrainingOutcome | None:
        self.thread.join(timeout)
        return None if self.thread.is_alive() else self.outcome

    def progress(self) -> dict[str, Any] | None:
        return self.trainer.progress()

    def stop(self) -> None:
        self.trainer.stop()


@dataclass
class _Seat:
    """GPUs held for the trainer or the evaluation: the arbiter's, and Ray's group."""

    arbiter: GpuArbiter
    holder: Holder
    pg: Any

    def leave(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # Ray may be gone
                remove_placement_group(self.pg)
        self.arbiter.release(self.holder)
