"""The whole product on GPUs: `hsx serve`, a job over REST with `train: {}` (what a user
gets), the trainer on a GPU, and vLLM (eagle3) measuring the draft it wrote.

- One GPU (the coordinator is shown one: CUDA_VISIBLE_DEVICES): the plan extracts on
  it, then the engine yields it to the trainer, then the evaluation runs on it; the
  training says it waits for the extraction meanwhile.
- Two GPUs: the engine on one, the trainer on the other while the extraction still
  runs (steps logged before the extraction ended), then the evaluation.

The target is the learnable tiny model, so the acceptance length means something.
Numbers go to $HSX_GPU_RESULTS (conftest.py): seconds, the plan, every wait shown, the
overlap, vLLM's acceptance.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hsx.client import NotFoundError
from hsx.output.layout import DRAFT_EVAL
from hsx.wire import JobState, TrainState
from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

from ..integration.test_service import start_coordinator

SAMPLES = 3000
MIN_ACCEPTANCE = 3.5


@dataclass
class Learnable:
    target: Path
    dataset: Path


@pytest.fixture(scope="module")
def learnable(tmp_path_factory: pytest.TempPathFactory) -> Learnable:
    """The learnable target and its tasks; `$HSX_GPU_LEARNABLE` names a folder where
    they were made before (carried to the GPU machine: training the target there costs
    device time)."""
    made = os.environ.get("HSX_GPU_LEARNABLE")
    base = Path(made) if made else tmp_path_factory.mktemp("gpu-learnable")
    language = TaskLanguage(seed=0)
    return Learnable(make_learnable_model(base / "target", language=language),
                     write_language_dataset(base / "tasks.jsonl", SAMPLES, language=language))


def _product_run(gpus: str, learnable: Learnable, tmp_path_factory: pytest.TempPathFactory,
                 record: Any, name: str) -> dict[str, Any]:
    """`hsx serve` seeing `gpus`; one job with `train: {}`; its statuses until the end."""
    base = tmp_path_factory.mktemp(name)
    roots = [tmp_path_factory.getbasetemp(), learnable.target.parent, learnable.dataset.parent]
    server = start_coordinator(base / "ledger.sqlite", roots, base / "serve.log",
                               env={"CUDA_VISIBLE_DEVICES": gpus})
    try:
        client = server.client()
        started = time.monotonic()
        submitted = time.time()
        job = client.submit({
            "model": str(learnable.target), "dataset": str(learnable.dataset),
            "output": str(base / "out"), "layers": [1, 2, 3, 4], "max_seq_len": 256,
            "unit_tokens": 8192, "vllm": {"gpu_memory_utilization": 0.3},
            "train": {},  # the defaults: what a user gets
        }, job_id=name)
        waits: list[tuple[float, str, str]] = []
        shown: dict[str, str | None] = {"job": None, "training": None}
        status = training = None
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline:
            status = client.get(job.id)
            try:
                training = client.train_status(job.id)
            except NotFoundError:
                training = None
            for who, text in (("job", status.waiting_for),
                              ("training", training.waiting_for if training else None)):
                if text != shown[who]:
                    shown[who] = text
                    if text:
                        waits.append((round(time.time() - submitted, 1), who, text))
            if status.state.finished and training is not None and training.state.finished:
                break
            time.sleep(0.5)
        seconds = time.monotonic() - started
    finally:
        server.kill()
    assert status is not None and training is not None
    assert status.state == JobState.succeeded, status.last_error
    assert training.state == TrainState.done, training.error
    evaluation = training.eval
    assert evaluation is not None and evaluation.error is None, evaluation
    recorded = json.loads((base / "out" / DRAFT_EVAL).read_text())
    assert status.finished_at is not None and training.first_step_at is not None
    overlap = sum(1 for p in training.history if p.time < status.finished_at)
    result = {
        "gpus_seen": gpus, "seconds": round(seconds, 1),
        "plan": status.plan.model_dump() if status.plan else None,
        "waits": waits, "job_tokens": status.tokens_done,
        "extraction_tokens_per_s": status.tokens_per_s_avg,
        "extraction_seconds": round(status.finished_at - (status.started_at or submitted), 1),
        "extraction_end_to_first_step_s": round(training.first_step_at - status.finished_at, 1),
        "train_steps_before_extraction_end": overlap, "train_steps": training.step,
        "train_plan": training.plan.model_dump() if training.plan else None,
        "tokens_per_s_train": training.tokens_per_s,
        "best_step": training.best_step,
        "validation": [v.model_dump() for v in training.validation],
        "mean_acceptance_length": evaluation.mean_acceptance_length,
        "acceptance_per_position": evaluation.acceptance_per_position, "eval": recorded,
    }
    record(name, **result)
    return result


@pytest.mark.gpus(1)
def test_one_gpu_extracts_then_trains_then_measures_the_draft(
    learnable: Learnable, tmp_path_factory: pytest.TempPathFactory, record: Any
) -> None:
    run = _product_run("0", learnable, tmp_path_factory, record, "gpu-product-1")
    plan = run["plan"]
    assert plan is not None and (plan["gpus"], plan["replicas"], plan["training"]) == (
        1, 1, "after")
    # The trainer waited for the extraction, said so, and started once the engine yielded.
    assert any(who == "training" and text.startswith("waiting for the extraction")
               for _, who, text in run["waits"]), run["waits"]
    assert run["train_steps_before_extraction_end"] == 0
    assert run["mean_acceptance_length"] >= MIN_ACCEPTANCE, run["eval"]


@pytest.mark.gpus(2)
def test_two_gpus_train_beside_the_extraction_and_measure_the_draft(
    learnable: Learnable, tmp_path_factory: pytest.TempPathFactory, record: Any
) -> None:
    run = _product_run("0,1", learnable, tmp_path_factory, record, "gpu-product-2")
    plan = run["plan"]
    assert plan is not None and (plan["gpus"], plan["replicas"], plan["training"]) == (
        2, 1, "beside")
    assert run["train_steps_before_extraction_end"] > 0, run
    assert run["mean_acceptance_length"] >= MIN_ACCEPTANCE, run["eval"]
