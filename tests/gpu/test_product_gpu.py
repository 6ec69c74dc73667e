"""The whole product once on GPUs: `hsx serve`, a job over REST, the trainer on a GPU
following the shards, and vLLM (eagle3) measuring the draft it wrote.

Two GPUs: the extraction engine keeps one, the trainer actor takes the other while the
extraction still runs, and the job's last step runs vLLM with the draft on held-out
prompts (draft/eval.json). The target is the learnable tiny model, so the acceptance
length means something.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from hsx.output.layout import DRAFT_EVAL
from hsx.wire import JobState, TrainState
from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

from ..integration.test_service import Coordinator, serve_for_module

SAMPLES = 3000


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    yield from serve_for_module(tmp_path_factory, "gpu")


@pytest.mark.gpus(2)
def test_serve_extract_train_on_gpu_and_measure_the_draft_in_vllm(
    coordinator: Coordinator, tmp_path_factory: pytest.TempPathFactory, record: object
) -> None:
    base = tmp_path_factory.mktemp("gpu-learnable")
    language = TaskLanguage(seed=0)
    target = make_learnable_model(base / "target", language=language)
    dataset = write_language_dataset(base / "tasks.jsonl", SAMPLES, language=language)
    client = coordinator.client()
    started = time.monotonic()
    job = client.submit({
        "model": str(target), "dataset": str(dataset), "output": str(base / "out"),
        "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 8192,
        "vllm": {"gpu_memory_utilization": 0.3},
        "train": {},  # the defaults: what a user gets
    }, job_id="gpu-product")
    final = client.wait(job.id, timeout=900)
    training = client.wait_train(job.id, timeout=900)
    seconds = time.monotonic() - started
    assert final.state == JobState.succeeded, final.last_error
    assert training.state == TrainState.done, training.error
    evaluation = training.eval
    assert evaluation is not None and evaluation.error is None, evaluation
    recorded = json.loads((base / "out" / DRAFT_EVAL).read_text())
    record("gpu-product", seconds=round(seconds, 1), job_tokens=final.tokens_done,
           train_steps=training.step, train_device=getattr(training.plan, "device", None),
           tokens_per_s_train=training.tokens_per_s,
           mean_acceptance_length=evaluation.mean_acceptance_length,
           acceptance_per_position=evaluation.acceptance_per_position,
           eval=recorded)
    assert training.first_step_at is not None and final.finished_at is not None
    assert evaluation.mean_acceptance_length is not None
    assert evaluation.mean_acceptance_length >= 3.0, evaluation
