"""The trainer as a Ray actor: `run()` blocks until training ends; `progress()` and
`stop()` answer meanwhile (the actor has two concurrency slots)."""

from __future__ import annotations

import threading
from typing import Any

from hsx.spec import TrainSpec
from hsx_workers.trainer import DraftTrainer, StepMetrics


class TrainerActor:
    def __init__(self, output: str, spec: dict[str, Any]) -> None:
        self.output = output
        self.spec = TrainSpec.model_validate(spec)
        self._stop = threading.Event()
        self._trainer: DraftTrainer | None = None
        self._last: dict[str, Any] | None = None

    def run(self) -> dict[str, Any]:
        self._trainer = DraftTrainer(self.output, self.spec, on_metrics=self._on_metrics,
                                     stop=self._stop)
        state = self._trainer.run()
        return {"step": state.step, "epoch": state.epoch, "stopped": self._stop.is_set()}

    def _on_metrics(self, metrics: StepMetrics) -> None:
        self._last = dict(metrics.__dict__)

    def progress(self) -> dict[str, Any]:
        trainer = self._trainer
        return {
            "last": self._last,
            "first_step_at": trainer.first_step_at if trainer else None,
            "resumed_from": trainer.resumed_from if trainer else None,
        }

    def stop(self) -> None:
        self._stop.set()
