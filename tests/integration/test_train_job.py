"""Draft training through the coordinator: a job (the learnable target, layers
[1, 2, 3, 4]: 3 auxiliary layers) with a `train` section starts its trainer while its
engines extract, the trainer is killed once and resumes, the validation and the best
checkpoint show in `GET /v1/jobs/{id}/train`, and vLLM measures the draft on held-out
prompts as the job's last step (draft/eval.json, in the status too).

The job is `offline_run` (tests/integration/learnable_jobs.py), also the comparator of
test_online.py's online job. `hsx train` on its own, with no options: test_train.py.
Several Ray Train workers under the coordinator, killed with it and resumed:
tests/chaos/test_trainer_faults.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsx.client import JobRefusedError
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR, DRAFT_EVAL
from hsx.wire import JobState, TrainState

from .helpers import Learnable, published_step
from .learnable_jobs import TRAIN, OfflineRun, Server

# The limits below guard against a hang only: on a 2-core machine without AVX-512 (vLLM's
# CPU build prefills the tiny models ~15x slower there) this module took 28 minutes.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]


def test_training_runs_alongside_extraction(offline_run: OfflineRun) -> None:
    assert offline_run.job.state == JobState.succeeded, offline_run.job.last_error
    assert offline_run.training.state == TrainState.done, offline_run.training.error
    assert offline_run.training.first_step_at is not None
    # The coordinator starts the trainer once the job's plan is whole, while the engines
    # extract, not once the extraction has ended; the trainer then trains on each shard
    # as its commit lands (test_trainer.py's test_follows_shards_committed_while_it_trains).
    # Whether its first step also comes before the last commit is a race between the
    # extraction and the trainer's start on one shared core, not hsx's doing: this test
    # once asked for it (then with 2 Ray Train workers, extracting 1.5x the rows in bf16
    # to lengthen the extraction) and lost the race by 8 s in CI on 2026-12-04.
    assert offline_run.started_while_extracting, "the training started only after the extraction"
    seen = {s.state for s in offline_run.statuses}
    assert {TrainState.running, TrainState.evaluating} <= seen, seen


def test_the_trainer_resumes_after_a_kill(offline_run: OfflineRun) -> None:
    training = offline_run.training
    assert training.plan is not None and training.plan.workers == 1
    assert training.plan.steps == TRAIN["steps"] == training.step
    assert offline_run.killed_at_checkpoint >= 1
    assert training.restarts == 1
    assert training.resumed_from is not None
    assert training.resumed_from >= offline_run.killed_at_checkpoint
    steps = [p.step for p in training.history]
    # One record per step: the resumed run replays nothing twice and skips nothing.
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == training.step
    losses = [p.loss for p in training.history]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_validation_and_best_checkpoint_in_the_status(offline_run: OfflineRun) -> None:
    training = offline_run.training
    assert training.validation, "no validation in the status"
    assert [v.step for v in training.validation] == sorted({v.step for v in training.validation})
    best = max(training.validation, key=lambda v: v.expected_acceptance_length)
    assert training.best_step == best.step == published_step(offline_run.output)
    assert training.best_expected_acceptance_length == pytest.approx(
        best.expected_acceptance_length)
    for v in training.validation:
        assert len(v.acc) == len(v.cond_acc) == 3 and v.tokens > 0
    checkpoints = sorted((offline_run.output / DRAFT_CHECKPOINTS).iterdir())
    for ckpt in checkpoints:  # each keeps its own metrics
        kept = json.loads((ckpt / "metrics.json").read_text())
        assert kept["step"] == int(ckpt.name.split("-")[1]) and kept["validation"]


def test_the_job_measures_its_draft_in_vllm(offline_run: OfflineRun) -> None:
    evaluation = offline_run.training.eval
    assert evaluation is not None and evaluation.error is None, evaluation
    assert evaluation.prompts == TRAIN["eval_prompts"] and evaluation.k == 3
    assert evaluation.prompt_source == "held-out samples"
    assert evaluation.drafts > 0 and len(evaluation.acceptance_per_position) == 3
    assert evaluation.mean_acceptance_length is not None
    assert evaluation.mean_acceptance_length >= 2.5, evaluation
    assert json.loads((offline_run.output / DRAFT_EVAL).read_text())["drafts"] == evaluation.drafts
    config = json.loads((offline_run.output / DRAFT_DIR / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 3


def test_training_a_job_without_layer_n_is_refused(
    learnable_server: Server, learnable: Learnable, tmp_path: Path
) -> None:
    client = learnable_server.coordinator().client()
    job = client.submit({"model": str(learnable.target), "dataset": str(learnable.dataset),
                         "output": str(tmp_path / "no-n"), "layers": [1, 2],
                         "max_seq_len": 64}, job_id="no-last-layer")
    with pytest.raises(JobRefusedError) as refused:
        client.train(job.id, {"steps": 10})
    assert "last layer (id 4" in str(refused.value)
    client.cancel(job.id)
