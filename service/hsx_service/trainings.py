"""The coordinator's trainings: a `TrainingRun` (training.py, the one training run of
every entry point) per job, on a thread of its own, whose hooks keep the ledger's
`trainings` row and the live progress a status shows. What a status shows beyond the
trainer's last report (loss curve, validations, plan, best checkpoint, evaluation) is
read from the output's `draft/` folder (`hsx.draft.draft_view`: for a bucket, a copy of
its draft/ as last uploaded), so it survives the coordinator too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hsx.draft import newest_checkpoint, read_eval, read_train_state, read_validation
from hsx.output.layout import DRAFT_DIR, DRAFT_METRICS
from hsx.wire import DraftEval, TrainPlan, TrainPoint, TrainState, TrainStatus, ValidationPoint
from hsx_service.errors import JobConflict
from hsx_service.ledger import Ledger, TrainRow
from hsx_service.placement import GpuArbiter
from hsx_service.training import TrainingHooks, TrainingRequest, TrainingRun, read_history

logger = logging.getLogger(__name__)


class Trainings:
    """The coordinator's trainings: a `TrainingRun` per job, on a thread of its own,
    reporting into the ledger; their statuses."""

    def __init__(self, ledger: Ledger, arbiter: GpuArbiter | None = None,
                 on_change: Callable[[str], None] | None = None):
        self.ledger = ledger
        self.arbiter = arbiter or GpuArbiter()
        self.on_change = on_change
        self._waits: dict[str, str] = {}  # job id -> what its training waits for now
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._runs: dict[str, TrainingRun] = {}
        self._live: dict[str, dict[str, Any]] = {}  # job id -> the trainer's last progress
        self._stopping = threading.Event()
        # output -> ((mtime, size) of draft/metrics.jsonl, its loss curve): a status poll
        # re-reads the file only when the trainer has appended to it.
        self._history: dict[Path, tuple[tuple[int, int], list[TrainPoint]]] = {}

    def start(self, request: TrainingRequest) -> None:
        """Train as `request` says (a job's output, with its spec), on a new thread."""
        job_id = request.job_id
        with self._lock:
            thread = self._threads.get(job_id)
            if thread is not None and thread.is_alive():
                raise JobConflict(f"job {job_id} is already training; wait for it to end")
            self.ledger.put_training(job_id, request.spec)
            row = self.ledger.training(job_id)
            request.restarts = row.restarts if row else 0
            self._live.pop(job_id, None)
            run = TrainingRun(request, self._hooks(job_id), self.arbiter)
            self._runs[job_id] = run
            thread = threading.Thread(target=self._watch, args=(run,),
                                      name=f"hsx-train-{job_id}", daemon=True)
            self._threads[job_id] = thread
        thread.start()

    def _hooks(self, job_id: str) -> TrainingHooks:
        def on_state(state: TrainState, error: str | None, restarts: int) -> None:
            self._set(job_id, state, error, restarts)

        def on_progress(progress: dict[str, Any]) -> None:
            self._live[job_id] = progress
            if progress.get("waiting_for") != self._waits.get(job_id):
                self._wait(job_id, progress.get("waiting_for"))  # the data, who holds it
            elif self.on_change is not None:
                self.on_change(job_id)

        return TrainingHooks(on_state=on_state, on_progress=on_progress,
                             on_waiting=lambda reason: self._wait(job_id, reason),
                             stopping=self._stopping.is_set)

    def stop(self) -> None:
        """Ask every trainer to checkpoint and stop; their rows say `stopped`."""
        self._stopping.set()
        for run in list(self._runs.values()):
            run.stop()
        for thread in list(self._threads.values()):
            thread.join(timeout=30)

    def stop_job(self, job_id: str) -> None:
        """Ask the job's trainer to checkpoint and stop (an online job that ended
        otherwise than by its training: no engine captures for it any more)."""
        run = self._runs.get(job_id)
        if run is not None:
            run.stop()

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

    def trainer_nodes(self, job_id: str) -> list[str]:
        """The Ray node of each of the job's trainer workers, by rank, as it last said."""
        live = self._live.get(job_id) or {}
        nodes = live.get("nodes") or ([live["node"]] if live.get("node") else [])
        return [str(n) for n in nodes]

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

    def _watch(self, run: TrainingRun) -> None:
        """The training's life. An error of hsx's own fails the training (never a
        training stuck in a state)."""
        job_id = run.request.job_id
        try:
            run.run()
        except Exception as err:  # a bug here must not leave the training hanging
            logger.exception("training of %s: unexpected error", job_id)
            self._set(job_id, TrainState.failed,
                      f"internal error: {type(err).__name__}: {err} (see the logs)")

    def wait_idle(self, timeout: float) -> bool:
        """True once no training thread runs (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        for thread in list(self._threads.values()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads.values())
