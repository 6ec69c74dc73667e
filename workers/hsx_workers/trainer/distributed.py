"""`train_distributed`: one `DraftTrainer` per Ray Train worker (DDP; gloo on CPU, NCCL
on GPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hsx.draft import draft_folder
from hsx.output import Output
from hsx.output.layout import DRAFT_DIR, DRAFT_STATE, DRAFT_STOP
from hsx.output.local_storage import make_output_dirs
from hsx.spec import TargetModel, TrainSpec
from hsx_workers.trainer.draft_trainer import DraftTrainer
from hsx_workers.trainer.plan import TrainRefused

NODE_DEATH_S = 60.0  # Ray declares a silent node dead after ~30 s of missed heartbeats


class WorkerDied(RuntimeError):
    """A Ray Train worker's process died: a new run resumes from the newest checkpoint."""


def _train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: its rank's DraftTrainer (torch.distributed is set up)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    spec = TrainSpec.model_validate(config["spec"])
    target = TargetModel(**config["target"]) if config.get("target") else None
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(config.get("threads", 1))))
    trainer = DraftTrainer(config["output"], spec, draft_root=config["draft_root"],
                           rank=ctx.get_world_rank(),
                           world=ctx.get_world_size(), device=device,
                           poll_interval=float(config.get("poll_interval", 0.5)),
                           target=target)
    trainer.run()


def train_distributed(
    output: str | Path | Output, spec: TrainSpec, *, draft_root: str | Path | None = None,
    use_gpu: bool | None = None, stop: threading.Event | None = None,
    poll_interval: float = 0.5, target: TargetModel | None = None,
    resources: dict[str, float] | None = None, label_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Train on `spec.workers` Ray Train workers (DDP; gloo on CPU, NCCL on GPU).

    Needs a connected Ray. Each worker trains on its own units; the main one writes
    metrics, validations and checkpoints into `<output>/draft/` (or `<draft_root>/draft/`)
    as `DraftTrainer` does alone; every worker must reach that folder (one host, or a
    shared file system). `stop` asks the workers to checkpoint and stop (through
    draft/.stop); `target` is `DraftTrainer`'s. Each worker takes a CPU (and a GPU), the
    custom `resources` besides, on a node that `label_selector` admits (Ray's syntax:
    the spec's `node_labels`, and the nodes of the engines left out for `place: apart`).
    Returns train.json's final content.
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    output = Output.of(output)
    root = draft_folder(output, draft_root)
    if use_gpu is None:
        use_gpu = spec.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    if spec.device == "cuda" and not use_gpu:
        raise TrainRefused("device cuda was asked for but the Ray cluster has no GPU")
    (root / DRAFT_STOP).unlink(missing_ok=True)
    make_output_dirs(root / DRAFT_DIR)
    trainer = TorchTrainer(
        _train_worker,
        # The Output itself: it carries the storage settings resolved here.
        train_loop_config={"output": output, "draft_root": str(root),
                           "spec": spec.model_dump(mode="json"),
                           "target": dataclasses.asdict(target) if target else None,
                           "poll_interval": poll_interval, "threads": 1},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": 1, **(resources or {})},
                                     label_selector=label_selector or None),
        run_config=RunConfig(name=f"hsx-train-{os.getpid()}-{int(time.time())}",
                             storage_path=str(root / DRAFT_DIR / ".ray"),
                             failure_config=FailureConfig(max_failures=0)),
    )
    done = threading.Event()

    def relay_stop() -> None:
        while not done.is_set():
            if stop is not None and stop.wait(0.5):
                (root / DRAFT_STOP).touch()
                return
            if stop is None:
                return

    watcher = threading.Thread(target=relay_stop, name="hsx-train-stop", daemon=True)
    watcher.start()
    try:
        trainer.fit()
    except Exception as err:
        cause = _root_cause(err)
        if isinstance(cause, TrainRefused):
            raise cause from None
        message = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if _died(err) or _node_lost(root):
            raise WorkerDied(f"a training worker died: {message}") from err
        raise RuntimeError(f"distributed training failed: {message}") from err
    finally:
        done.set()
        (root / DRAFT_STOP).unlink(missing_ok=True)
    state = json.loads((root / DRAFT_STATE).read_text())
    return dict(state)


def _died(err: BaseException) -> bool:
    """Whether one of the run's workers died (its process or its node), by what Ray Train
    says of each worker."""
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError

    seen = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, RayActorError | NodeDiedError | WorkerCrashedError):
            return True
        failures = getattr(e, "worker_failures", None)
        more = list(failures.values()) if isinstance(failures, dict) else []
        more += [getattr(e, "controller_failure", None), getattr(e, "cause", None),
                 e.__cause__]
        todo += [m for m in more if isinstance(m, BaseException)]
    return False


def _node_lost(root: Path) -> bool:
    """Whether a node one of the run's workers ran on died (train.json's `nodes`). A
    worker whose peer's node dies fails first, in its collective, before Ray declares the
    node dead (its heartbeats time out): NODE_DEATH_S is waited for that."""
    import ray

    try:
        nodes = set(json.loads((root / DRAFT_STATE).read_text()).get("nodes") or [])
    except (OSError, ValueError):
        return False
    deadline = time.monotonic() + NODE_DEATH_S
    while nodes:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if nodes - alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return False


def _root_cause(err: BaseException) -> BaseException:
    """The worker's own exception inside Ray Train's wrappers (a worker group's first
    failure, a controller's failure, a task's cause), where one is there."""
    seen = set()
    while id(err) not in seen:
        seen.add(id(err))
        failures = getattr(err, "worker_failures", None)
        nxt = (next(iter(failures.values())) if isinstance(failures, dict) and failures
               else getattr(err, "controller_failure", None) or getattr(err, "cause", None)
               or err.__cause__)
        if not isinstance(nxt, BaseException):
            break
        err = nxt
    return err
