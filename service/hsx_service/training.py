"""Draft training of jobs' outputs: one TrainerActor (Ray) per training, watched by a
thread here.

The actor runs `DraftTrainer` (workers/hsx_workers/trainer/); it takes a GPU when the
cluster has one, a CPU otherwise; with `workers` > 1 it drives a Ray Train run whose
workers take them. This side polls its progress, keeps the ledger's `trainings` row
current, and restarts a dead actor (up to MAX_TRAIN_RESTARTS times); the new actor
resumes from the newest checkpoint in `<output>/draft/checkpoints/` (for a bucket
output, the bucket's newest uploaded one: see hsx.draft.BucketDraft). Once the training
is done, a Ray task measures the draft in vLLM on held-out prompts (`evaluating`;
draft/eval.json), running the target as the job does (its tensor parallelism and its
`vllm:` settings). The trainer and the evaluation get their GPUs from the coordinator's
`GpuArbiter` (placement.py) and then from Ray through a placement group; while either
waits, the training's status says for what and who holds it (`waiting_for`). A training
whose plan trains after the extraction waits for the job to end first. What a status
shows beyond the actor's last report (loss curve, validations, plan, best checkpoint,
evaluation) is read from the output's `draft/` folder (`hsx.draft.draft_view`: for a
bucket, a copy of its draft/ as last uploaded), so it survives the coordinator too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.draft import (
    newest_checkpoint,
    read_eval,
    read_metrics,
    read_train_state,
    read_validation,
)
from hsx.online import Stream
from hsx.output import Output
from hsx.output.layout import DRAFT_DIR, DRAFT_METRICS
from hsx.spec import JobSpec, TrainSpec
from hsx.wire import DraftEval, TrainPlan, TrainPoint, TrainState, TrainStatus, ValidationPoint
from hsx_service.engine_config import target_engine_args
from hsx_service.engine_pool import engine_bundles, engine_resources, in_group
from hsx_service.errors import JobConflict
from hsx_service.ledger import Ledger, TrainRow
from hsx_service.placement import EVALUATION, TRAINER, GpuArbiter, Holder, place

logger = logging.getLogger(__name__)

MAX_TRAIN_RESTARTS = 3
POLL_S = 0.5
HISTORY_POINTS = 500


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


class Trainings:
    """Start, watch, restart and report the trainings; see the module docstring."""

    def __init__(self, ledger: Ledger, arbiter: GpuArbiter | None = None,
                 on_change: Callable[[str], None] | None = None):
        self.ledger = ledger
        self.arbiter = arbiter or GpuArbiter()
        self.on_change = on_change
        self._waits: dict[str, str] = {}  # job id -> what its training waits for now
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._live: dict[str, dict[str, Any]] = {}  # job id -> the actor's last progress
        self._actors: dict[str, Any] = {}
        self._stopping = threading.Event()
        # output -> ((mtime, size) of draft/metrics.jsonl, its loss curve): a status poll
        # re-reads the file only when the trainer has appended to it.
        self._history: dict[Path, tuple[tuple[int, int], list[TrainPoint]]] = {}

    def start(self, job_id: str, output: str, spec: TrainSpec, *, job: JobSpec | None = None,
              order: float = 0.0, after: threading.Event | None = None,
              share: float = 0.0) -> None:
        """Train the draft of `output` (a job's output path or URI) in a new actor.

        `job`: the job as it passed the checks, whose target (model, remote code) the
        trainer and the evaluation load and run as its engines do (default: the output's
        model without its own code, TP 1); `order`: the job's place in line for GPUs
        (its submission time); `after`: an event the training waits for before it asks
        for GPUs (the job's end, when its plan trains after the extraction); `share`: the
        part of a GPU an online trainer takes beside the job's engine on it (the plan's
        `train_share`; 0: GPUs of its own).
        """
        with self._lock:
            thread = self._threads.get(job_id)
            if thread is not None and thread.is_alive():
                raise JobConflict(f"job {job_id} is already training; wait for it to end")
            self.ledger.put_training(job_id, spec)
            self._live.pop(job_id, None)
            run = _Run(job_id, output, spec, job, order, after, share)
            thread = threading.Thread(target=self._watch, args=(run,),
                                      name=f"hsx-train-{job_id}", daemon=True)
            self._threads[job_id] = thread
        thread.start()

    def stop(self) -> None:
        """Ask every actor to checkpoint and stop; their rows say `stopped`."""
        self._stopping.set()
        for actor in list(self._actors.values()):
            with contextlib.suppress(Exception):  # a dead actor has nothing to stop
                actor.stop.remote()
        for thread in list(self._threads.values()):
            thread.join(timeout=30)

    def stop_job(self, job_id: str) -> None:
        """Ask the job's trainer to checkpoint and stop (an online job that ended
        otherwise than by its training: no engine captures for it any more)."""
        actor = self._actors.get(job_id)
        if actor is not None:
            with contextlib.suppress(Exception):
                actor.stop.remote()

    def status(self, row: TrainRow, output: Path, draft: str | None = None) -> TrainStatus:
        """`output`: the folder whose draft/ is read; `draft`: where the draft is, as
        users reach it (default that folder's draft/; a bucket's URL for a bucket)."""
        live = self._live.get(row.job_id) or {}
        last = live.get("last") or {}
        history = self._read_history(output)
        if not last and history:
            last = history[-1].model_dump()
        on_disk = read_train_state(output) or {}
        plan = on_disk.get("plan")
        best = on_disk.get("best") or {}
        evaluation = read_eval(output)
        validation = []
        for record in read_validation(output):
            with contextlib.suppress(ValueError):  # a record of another shape
                validation.append(ValidationPoint.model_validate(record))
        return TrainStatus(
            job_id=row.job_id, state=row.state, draft=draft or str(output / DRAFT_DIR),
            step=int(last.get("step", on_disk.get("step", 0))),
            epoch=int(last.get("epoch", on_disk.get("epoch", 0))),
            loss=last.get("loss"), acc=list(last.get("acc") or []),
            tokens_per_s=float(last.get("tokens_per_s", 0.0)),
            wait_fraction=float(last.get("wait_fraction", 0.0)),
            checkpoint_step=newest_checkpoint(output),
            restarts=row.restarts,
            resumed_from=live.get("resumed_from", on_disk.get("resumed_from")),
            first_step_at=live.get("first_step_at", on_disk.get("first_step_at")),
            error=row.error, spec=row.spec, waiting_for=self._waits.get(row.job_id),
            plan=TrainPlan.model_validate(plan) if isinstance(plan, dict) else None,
            warning=on_disk.get("warning"), history=history, validation=validation,
            best_step=best.get("step"),
            best_expected_acceptance_length=best.get("expected_acceptance_length"),
            eval=DraftEval.model_validate(evaluation) if evaluation else None,
            updated_at=row.updated_at,
        )

    def _read_history(self, output: Path) -> list[TrainPoint]:
        try:
            st = (output / DRAFT_METRICS).stat()
        except FileNotFoundError:
            return []
        key = (st.st_mtime_ns, st.st_size)
        cached = self._history.get(output)
        if cached is not None and cached[0] == key:
            return cached[1]
        points = read_history(output)
        self._history[output] = (key, points)
        return points

    # -- the watching thread

    def _set(self, job_id: str, state: TrainState, error: str | None = None,
             restarts: int | None = None) -> None:
        self.ledger.set_training(job_id, state, error, restarts)
        if self.on_change is not None:
            self.on_change(job_id)

    def _wait(self, job_id: str, reason: str | None) -> None:
        """What the training waits for now (None: nothing), shown in its status."""
        if reason is None:
            self._waits.pop(job_id, None)
        else:
            self._waits[job_id] = reason
        if self.on_change is not None:
            self.on_change(job_id)

    def _watch(self, run: _Run) -> None:
        """The training's life: its GPUs, the trainer actors, the evaluation. An error of
        hsx's own fails the training (never a training stuck in a state)."""
        try:
            self._run_training(run)
        except Exception as err:  # a bug here must not leave the training hanging
            logger.exception("training of %s: unexpected error", run.job_id)
            self._set(run.job_id, TrainState.failed,
                      f"internal error: {type(err).__name__}: {err} (see the logs)")

    def _run_training(self, run: _Run) -> None:
        job_id = run.job_id
        trainer = Holder(
            job=job_id, role="trainer", gpus=run.share or self._trainer_gpus(run.spec),
            order=(run.order, TRAINER), ready=run.after,
            until=f"waiting for the extraction of job {job_id} to end: its engines hold the "
                  "GPUs the trainer needs (the plan trains after it)")
        seat = self._seat(run, trainer)
        if seat is None:
            self._set(job_id, TrainState.stopped)
            return
        evaluation = None
        try:
            outcome = self._train(run, seat)
            if outcome == "failed" and run.spec.online:
                # The job's engines capture for this trainer until it says it ended.
                row = self.ledger.training(job_id)
                Stream(Output.of(run.output).location).set_trainer(
                    "failed", error=row.error if row else None)
            if outcome == "done" and run.spec.eval_prompts > 0:
                evaluation = self._evaluation_holder(run)
                # In line before the trainer's GPUs go, so no later job slips in between.
                self.arbiter.enqueue(evaluation)
        finally:
            seat.leave()
        if outcome != "done":
            return
        if evaluation is not None:
            try:
                self._set(job_id, TrainState.evaluating)
                if not self._evaluate(run, evaluation):
                    self._set(job_id, TrainState.stopped)
                    return
            finally:
                self.arbiter.withdraw(evaluation)  # its place in line, if still held
        self._set(job_id, TrainState.done)

    def _train(self, run: _Run, seat: _Seat) -> str:
        """Run trainer actors until one ends (restarting dead ones); the outcome."""
        import ray

        job_id = run.job_id
        row = self.ledger.training(job_id)
        restarts = row.restarts if row else 0
        while not self._stopping.is_set():
            actor = self._new_actor(run, seat)
            self._actors[job_id] = actor
            outcome, error = self._follow(job_id, actor)
            self._actors.pop(job_id, None)
            if outcome == "died":
                restarts += 1
                if restarts > MAX_TRAIN_RESTARTS:
                    self._set(job_id, TrainState.failed,
                              f"the trainer died {restarts} times; last: {error}", restarts)
                    return "failed"
                logger.warning("training of %s: trainer died (%s); restarting from the "
                               "newest checkpoint", job_id, error)
                self._set(job_id, TrainState.starting, error, restarts)
                continue
            ray.kill(actor, no_restart=True)
            if outcome == "failed":
                self._set(job_id, TrainState.failed, error)
            elif outcome == "stopped":
                self._set(job_id, TrainState.stopped)
            return outcome
        self._set(job_id, TrainState.stopped)
        return "stopped"

    def _trainer_gpus(self, spec: TrainSpec) -> int:
        import ray

        if spec.device == "cpu" or ray.cluster_resources().get("GPU", 0) < 1:
            return 0
        return spec.workers

    def _evaluation_holder(self, run: _Run) -> Holder:
        """The evaluation's GPUs: as many as the job's engines use (its TP); none on a
        CPU cluster, where the target runs as one rank (CPU TP binds cores by hand)."""
        import ray

        gpus = ray.cluster_resources().get("GPU", 0) >= 1
        tp = run.job.tensor_parallel_size if run.job is not None and gpus else 1
        return Holder(job=run.job_id, role="evaluation", gpus=tp if gpus else 0,
                      order=(run.order, EVALUATION))

    def _seat(self, run: _Run, holder: Holder) -> _Seat | None:
        """The holder's GPUs: the arbiter's, then Ray's placement group (a bundle a GPU;
        none on a CPU cluster, or for the driver of Ray Train workers, which place
        themselves). None if the coordinator stopped meanwhile."""
        job_id = run.job_id
        on_wait = lambda reason: self._wait(job_id, reason)  # noqa: E731
        if not self.arbiter.acquire(holder, cancelled=self._stopping.is_set, on_wait=on_wait):
            return None
        bundles = engine_bundles(int(holder.gpus), True) if holder.gpus else []
        if holder.role == "trainer" and run.spec.workers > 1:
            bundles = []  # Ray Train places its workers; the arbiter holds their GPUs
        elif holder.role == "trainer" and run.share:
            bundles = engine_bundles(1, True, run.share)  # a part of an engine's GPU
        pg = None
        if bundles:
            pg = place(bundles, holder.describe(), cancelled=self._stopping.is_set,
                       on_wait=on_wait)
            if pg is None:
                self.arbiter.release(holder)
                return None
        return _Seat(self.arbiter, holder, pg)

    def _evaluate(self, run: _Run, holder: Holder) -> bool:
        """vLLM measures the draft on held-out prompts (a Ray task placed as the job's
        engines are: its tensor parallelism, its `vllm:` settings); its result or its
        error lands in draft/eval.json. False when the coordinator stopped meanwhile (the
        next start measures again)."""
        import ray

        from hsx_workers.acceptance import evaluate_draft, record_eval_error

        output, spec = run.output, run.spec
        seat = self._seat(run, holder)
        if seat is None:
            return False
        try:
            gpus, tp = holder.gpus > 0, max(int(holder.gpus), 1)
            resources, backend = engine_resources(tp, gpus)
            engine = target_engine_args(run.job) if run.job is not None else {}
            engine["tensor_parallel_size"] = tp
            if backend is not None:
                engine["distributed_executor_backend"] = backend
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
            options: dict[str, Any] = {"max_retries": 0, "runtime_env": {"env_vars": env}}
            if seat.pg is not None:
                options.update(resources, scheduling_strategy=in_group(seat.pg))
            else:
                options.update(num_cpus=1, num_gpus=0)
            # max_calls 1: the task's process exits after it, and vLLM's memory with it.
            task: Any = ray.remote(max_calls=1)(evaluate_draft)
            ref = task.options(**options).remote(
                Output(output), prompts=spec.eval_prompts, max_tokens=spec.eval_max_tokens,
                k=spec.proposed_tokens, engine=engine,
                target=run.job.model if run.job is not None else None)
            while True:
                ready, _ = ray.wait([ref], timeout=POLL_S)
                if ready:
                    break
                if self._stopping.is_set():
                    with contextlib.suppress(Exception):
                        ray.cancel(ref, force=True)
                    return False
            try:
                result = ray.get(ref)
            except Exception as err:
                cause = getattr(err, "cause", None) or err
                message = (f"{type(cause).__name__}: "
                           f"{str(cause).splitlines()[0] if str(cause) else ''}")
                logger.warning("evaluating the draft of %s failed: %s", output, message)
                record_eval_error(output, message)
                return True
        finally:
            seat.leave()
        logger.info("draft of %s: mean acceptance length %.2f at k=%s", output,
                    result.get("mean_acceptance_length", 0.0), result.get("k"))
        return True

    def _new_actor(self, run: _Run, seat: _Seat) -> Any:
        import ray

        from hsx_workers.trainer_actor import TrainerActor

        # With several workers the actor only drives Ray Train; the workers take the GPUs.
        options: dict[str, Any] = {"max_concurrency": 2, "num_cpus": 1, "num_gpus": 0}
        if seat.pg is not None:
            options.update(num_gpus=run.share or 1, scheduling_strategy=in_group(seat.pg))
        actor_cls: Any = ray.remote(TrainerActor)
        # The Output carries the endpoint and credentials resolved here to the actor.
        # The target is the job's as the ledger holds it (what passed the checks), not
        # what the output's manifest says.
        return actor_cls.options(**options).remote(
            Output(run.output), run.spec.model_dump(mode="json"),
            memory_share=run.share or None,
            target=run.job.target if run.job is not None else None)

    def _follow(self, job_id: str, actor: Any) -> tuple[str, str | None]:
        """Poll the actor until `run` ends: (done | stopped | failed | died, error)."""
        import ray
        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        result_ref = actor.run.remote()
        state = TrainState.starting
        while True:
            ready, _ = ray.wait([result_ref], timeout=POLL_S)
            try:
                progress = ray.get(actor.progress.remote(), timeout=30)
            except (RayActorError, ActorDiedError):
                progress = None
            except Exception:
                progress = None
            if progress is not None:
                self._live[job_id] = progress
                if progress.get("waiting_for") != self._waits.get(job_id):
                    self._wait(job_id, progress.get("waiting_for"))  # the data, who holds it
                if progress.get("last") and state is TrainState.starting:
                    state = TrainState.running
                    self._set(job_id, state)
                elif self.on_change is not None:
                    self.on_change(job_id)
            if not ready:
                continue
            try:
                result = ray.get(result_ref)
            except (RayActorError, ActorDiedError) as err:
                return "died", str(err).splitlines()[0]
            except RayTaskError as err:
                from hsx_workers.trainer import WorkerDied

                cause = err.cause if err.cause is not None else err
                if isinstance(cause, WorkerDied):  # one of its Ray Train workers
                    return "died", str(cause)
                return "failed", f"{type(cause).__name__}: {cause}"
            return ("stopped" if result.get("stopped") else "done"), None

    def wait_idle(self, timeout: float) -> bool:
        """True once no training thread runs (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        for thread in list(self._threads.values()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads.values())


@dataclass
class _Run:
    """One training as asked: whose, of what, and when it may start."""

    job_id: str
    output: str
    spec: TrainSpec
    job: JobSpec | None
    order: float
    after: threading.Event | None
    share: float = 0.0  # of an engine's GPU, for an online trainer beside it (else 0)


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
