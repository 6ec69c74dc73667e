"""Draft training through the coordinator: a job (the learnable target, layers
[1, 2, 3, 4]: 3 auxiliary layers) with a `train` section of 2 Ray Train workers (gloo)
starts its trainer while its engines extract, the trainer is killed once and resumes,
the validation and the best checkpoint show in `GET /v1/jobs/{id}/train`, and vLLM
measures the draft on held-out prompts as the job's last step (draft/eval.json, in the
status too).

`hsx train` on its own, with no options: test_train.py. The two modules share the
learnable target (tests/integration/conftest.py) and run side by side under `make test`.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsx.client import JobRefusedError, NotFoundError
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR, DRAFT_EVAL
from hsx.wire import JobState, JobStatus, TrainState, TrainStatus

from .helpers import Learnable, published_step, worker_processes
from .test_service import Coordinator, serve_for_module

# The limits below guard against a hang only: on a 2-core machine without AVX-512 (vLLM's
# CPU build prefills the tiny models ~15x slower there) this module took 28 minutes.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

TRAIN = {"workers": 2, "steps": 80, "eval_prompts": 16}


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory,
                learnable: Learnable) -> Iterator[Coordinator]:
    # Under pytest-xdist the learnable target and its rows lie outside this worker's tmp.
    yield from serve_for_module(tmp_path_factory, "train", learnable.target.parent)


@dataclass
class TrainedRun:
    output: Path
    job: JobStatus
    training: TrainStatus
    killed_at_checkpoint: int
    statuses: list[TrainStatus]
    # A training status was seen while the job's engines had units left to commit.
    started_while_extracting: bool


@pytest.fixture(scope="module")
def trained(coordinator: Coordinator, learnable: Learnable,
            tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    output = tmp_path_factory.mktemp("train-out") / "tasks"
    client = coordinator.client()
    job = client.submit({
        "model": str(learnable.target), "dataset": str(learnable.dataset),
        "output": str(output), "layers": [1, 2, 3, 4], "max_seq_len": 256,
        "unit_tokens": 8192, "train": TRAIN,
    }, job_id="tasks")
    # Kill the trainer actor (the driver of the Ray Train run) once, after its first
    # checkpoint; its workers go with it.
    statuses: list[TrainStatus] = []
    started_while_extracting = False
    killed_at = 0
    deadline = time.monotonic() + 2400
    while time.monotonic() < deadline:
        extracting = _extracting(client.get(job.id))
        try:
            status = client.train_status(job.id)
        except NotFoundError:  # until the job has started its training
            time.sleep(0.5)
            continue
        statuses.append(status)
        started_while_extracting |= extracting
        if status.checkpoint_step and not killed_at:
            procs = worker_processes(coordinator.proc.pid, "TrainerActor")
            assert procs, "no TrainerActor process under the coordinator"
            killed_at = status.checkpoint_step
            for p in procs:
                p.send_signal(signal.SIGKILL)
        if status.state.finished:
            break
        time.sleep(0.3)
    final_job = client.wait(job.id, timeout=2400)
    training = client.wait_train(job.id, timeout=2400)
    return TrainedRun(output, final_job, training, killed_at, statuses,
                      started_while_extracting)


def _extracting(job: JobStatus) -> bool:
    """The job runs and its engines have units left to commit."""
    return job.state == JobState.running and (
        job.units_total == 0 or job.units_done < job.units_total)


def test_training_runs_alongside_extraction(trained: TrainedRun) -> None:
    assert trained.job.state == JobState.succeeded, trained.job.last_error
    assert trained.training.state == TrainState.done, trained.training.error
    assert trained.training.first_step_at is not None
    # The coordinator starts the trainer once the job's plan is whole, while the engines
    # extract, not once the extraction has ended; the trainer then trains on each shard
    # as its commit lands (test_trainer.py's test_follows_shards_committed_while_it_trains).
    # Whether its first step also comes before the last commit is a race between the
    # extraction and the start of 2 Ray Train workers on one shared core (a minute or
    # more), not hsx's doing: this test once asked for it, extracting 1.5x the rows in
    # bf16 to lengthen the extraction, and lost the race by 8 s in CI on 2026-12-04.
    assert trained.started_while_extracting, "the training started only after the extraction"
    seen = {s.state for s in trained.statuses}
    assert {TrainState.running, TrainState.evaluating} <= seen, seen


def test_two_workers_train_and_resume_after_a_kill(trained: TrainedRun) -> None:
    training = trained.training
    assert training.plan is not None and training.plan.workers == 2
    assert training.plan.steps == TRAIN["steps"] == training.step
    assert trained.killed_at_checkpoint >= 1
    assert training.restarts == 1
    assert training.resumed_from is not None
    assert training.resumed_from >= trained.killed_at_checkpoint
    steps = [p.step for p in training.history]
    # One record per step: the resumed run replays nothing twice and skips nothing.
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == training.step
    losses = [p.loss for p in training.history]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_validation_and_best_checkpoint_in_the_status(trained: TrainedRun) -> None:
    training = trained.training
    assert training.validation, "no validation in the status"
    assert [v.step for v in training.validation] == sorted({v.step for v in training.validation})
    best = max(training.validation, key=lambda v: v.expected_acceptance_length)
    assert training.best_step == best.step == published_step(trained.output)
    assert training.best_expected_acceptance_length == pytest.approx(
        best.expected_acceptance_length)
    for v in training.validation:
        assert len(v.acc) == len(v.cond_acc) == 3 and v.tokens > 0
    checkpoints = sorted((trained.output / DRAFT_CHECKPOINTS).iterdir())
    for ckpt in checkpoints:  # each keeps its own metrics
        kept = json.loads((ckpt / "metrics.json").read_text())
        assert kept["step"] == int(ckpt.name.split("-")[1]) and kept["validation"]


def test_the_job_measures_its_draft_in_vllm(trained: TrainedRun) -> None:
    evaluation = trained.training.eval
    assert evaluation is not None and evaluation.error is None, evaluation
    assert evaluation.prompts == TRAIN["eval_prompts"] and evaluation.k == 3
    assert evaluation.prompt_source == "held-out samples"
    assert evaluation.drafts > 0 and len(evaluation.acceptance_per_position) == 3
    assert evaluation.mean_acceptance_length is not None
    assert evaluation.mean_acceptance_length >= 2.5, evaluation
    assert json.loads((trained.output / DRAFT_EVAL).read_text())["drafts"] == evaluation.drafts
    config = json.loads((trained.output / DRAFT_DIR / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 3


def test_training_a_job_without_layer_n_is_refused(
    coordinator: Coordinator, learnable: Learnable, tmp_path: Path
) -> None:
    client = coordinator.client()
    job = client.submit({"model": str(learnable.target), "dataset": str(learnable.dataset),
                         "output": str(tmp_path / "no-n"), "layers": [1, 2],
                         "max_seq_len": 64}, job_id="no-last-layer")
    with pytest.raises(JobRefusedError) as refused:
        client.train(job.id, {"steps": 10})
    assert "last layer (id 4" in str(refused.value)
    client.cancel(job.id)
