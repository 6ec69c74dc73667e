"""The trainer as a Ray actor: `run()` blocks until training ends; `progress()` and
`stop()` answer meanwhile (the actor has two concurrency slots).

With `spec.workers` > 1 the actor drives a Ray Train run (`train_distributed`) and
takes no GPU itself; its workers do. Progress then comes from the files the main
worker writes (draft/metrics.jsonl, draft/train.json).
"""

from __future__ import annotations

import threading
from typing import Any

from hsx.draft import draft_folder, last_record, read_train_state
from hsx.output import Output
from hsx.output.layout import DRAFT_METRICS
from hsx.spec import TargetModel, TrainSpec
from hsx_workers.trainer import DraftTrainer, StepMetrics, train_distributed


class TrainerActor:
    """Trains the draft of `output` (an Output, which carries the storage settings the
    coordinator resolved, or a path: a bucket's draft is trained in this node's working
    folder and uploaded; see hsx.draft)."""

    def __init__(self, output: Output | str, spec: dict[str, Any],
                 memory_share: float | None = None, target: TargetModel | None = None
                 ) -> None:
        self.output = Output.of(output)
        self.target = target  # the job's (DraftTrainer's `target`)
        self.memory_share = memory_share  # of the GPU's memory: it shares it with an engine
        self.root = draft_folder(self.output)  # where this node trains it
        self.spec = TrainSpec.model_validate(spec)
        self._stop = threading.Event()
        self._trainer: DraftTrainer | None = None
        self._last: dict[str, Any] | None = None

    def run(self) -> dict[str, Any]:
        if self.spec.workers > 1:
            state = train_distributed(self.output, self.spec, stop=self._stop,
                                      target=self.target)
            return {"step": state["step"], "epoch": state["epoch"],
                    "stopped": state["state"] == "stopped"}
        self._trainer = DraftTrainer(self.output, self.spec, on_metrics=self._on_metrics,
                                     stop=self._stop, memory_share=self.memory_share,
                                     target=self.target)
        result = self._trainer.run()
        return {"step": result.step, "epoch": result.epoch, "stopped": self._stop.is_set()}

    def _on_metrics(self, metrics: StepMetrics) -> None:
        self._last = dict(metrics.__dict__)

    def progress(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is not None:
            return {"last": self._last, "first_step_at": trainer.first_step_at,
                    "resumed_from": trainer.resumed_from,
                    "waiting_for": trainer.data.waiting_for()}
        state = read_train_state(self.root) or {}
        return {"last": last_record(self.root / DRAFT_METRICS),
                "first_step_at": state.get("first_step_at"),
                "resumed_from": state.get("resumed_from")}

    def stop(self) -> None:
        self._stop.set()
