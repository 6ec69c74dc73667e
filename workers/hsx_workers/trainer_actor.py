"""The trainer of one training run: `run()` blocks until training ends; `progress()` and
`stop()` answer meanwhile (as a Ray actor it has two concurrency slots).

The one training run (hsx_service.training) makes it a Ray actor (the coordinator, `hsx
extract`), or runs it in its own process (`hsx train OUTPUT`). With `spec.workers` > 1
it drives a Ray Train run (`train_distributed`) and takes no GPU itself; its workers
do, placed as `placement` says. Progress then comes from the files the main worker
writes (draft/metrics.jsonl, draft/train.json).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict
from typing import Any

from hsx.draft import draft_folder, read_jsonl, read_train_state
from hsx.output import Output
from hsx.output.layout import DRAFT_METRICS
from hsx.spec import TargetModel, TrainSpec
from hsx_workers.trainer import DraftTrainer, Plan, StepMetrics, train_distributed
from hsx_workers.trainer.draft_trainer import ray_node


class TrainerActor:
    """Trains the draft of `output` (an Output, which carries the storage settings the
    coordinator resolved, or a path: a bucket's draft is trained in this node's working
    folder and uploaded; see hsx.draft). `draft_root`: the local folder the draft is
    trained in (default the output's, `hsx.draft.draft_folder`); `placement`: where
    Ray Train's workers go (`train_distributed`'s `resources` and `label_selector`)."""

    def __init__(self, output: Output | str, spec: dict[str, Any],
                 memory_share: float | None = None, target: TargetModel | None = None,
                 draft_root: str | None = None, placement: dict[str, Any] | None = None
                 ) -> None:
        self.output = Output.of(output)
        self.target = target  # the job's (DraftTrainer's `target`)
        self.memory_share = memory_share  # of the GPU's memory: it shares it with an engine
        self.draft_root = draft_root
        self.root = draft_folder(self.output, draft_root)  # where this node trains it
        self.spec = TrainSpec.model_validate(spec)
        self.placement = placement or {}
        self._stop = threading.Event()
        self._trainer: DraftTrainer | None = None
        self._steps: list[dict[str, Any]] = []  # step records not yet read by progress()
        self._plan: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._started = time.time()
        self._read = 0  # metrics.jsonl records of this run read so far (workers > 1)

    def run(self) -> dict[str, Any]:
        self._started = time.time()
        if self.spec.workers > 1:
            state = train_distributed(self.output, self.spec, stop=self._stop,
                                      draft_root=self.draft_root, target=self.target,
                                      **self.placement)
            return {"step": state["step"], "epoch": state["epoch"],
                    "stopped": state["state"] == "stopped",
                    "resumed_from": state.get("resumed_from"), "best": state.get("best")}
        self._trainer = DraftTrainer(self.output, self.spec, draft_root=self.draft_root,
                                     on_metrics=self._on_metrics, on_plan=self._on_plan,
                                     stop=self._stop, memory_share=self.memory_share,
                                     target=self.target)
        result = self._trainer.run()
        return {"step": result.step, "epoch": result.epoch, "stopped": self._stop.is_set(),
                "resumed_from": self._trainer.resumed_from, "best": self._trainer.best}

    def _on_metrics(self, metrics: StepMetrics) -> None:
        with self._lock:
            self._steps.append(asdict(metrics))

    def _on_plan(self, plan: Plan) -> None:
        self._plan = asdict(plan)

    def progress(self) -> dict[str, Any]:
        """The step records since the last call (`steps`), the newest (`last`), the plan
        once made, where the training stands and what it waits for."""
        trainer = self._trainer
        if trainer is not None:
            with self._lock:
                steps, self._steps = self._steps, []
            return {"steps": steps, "last": asdict(trainer.last) if trainer.last else None,
                    "plan": self._plan, "first_step_at": trainer.first_step_at,
                    "resumed_from": trainer.resumed_from, "node": ray_node(),
                    "waiting_for": trainer.data.waiting_for()}
        # Ray Train's workers: what the main one wrote since this run began.
        state = read_train_state(self.root) or {}
        if float(state.get("time", 0)) < self._started:
            state = {}
        rows = [r for r in read_jsonl(self.root / DRAFT_METRICS)
                if float(r.get("time", 0)) >= self._started]
        steps, self._read = rows[self._read:], len(rows)
        return {"steps": steps, "last": rows[-1] if rows else None, "plan": state.get("plan"),
                "first_step_at": state.get("first_step_at"),
                "resumed_from": state.get("resumed_from"), "nodes": state.get("nodes"),
                "waiting_for": self._waiting_for()}

    def _waiting_for(self, after_s: float = 2.0) -> str | None:
        """An online job's Ray Train workers: what they wait for, as the stream says (one
        worker alone tells it itself: TrainingData.waiting_for)."""
        if not self.spec.online:
            return None
        from hsx_workers.stream import stream_waits

        waits = stream_waits(self.output.location) or {}
        now = time.time()
        late = {rank: now - since for rank, since in waits.items() if now - since >= after_s}
        if not late:
            return None
        workers = ", ".join(str(r) for r in sorted(late))
        return (f"the engines: no captured unit in the online stream for "
                f"{max(late.values()):.0f} s (trainer worker{'s' * (len(late) > 1)} "
                f"{workers}; the trainer takes them faster than they are captured)")

    def stop(self) -> None:
        self._stop.set()
