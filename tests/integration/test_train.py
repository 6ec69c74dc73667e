"""Draft training for real: the coordinator (uvicorn, local Ray, vLLM CPU engines) runs
an extraction with a `train` section; the TrainerActor follows the shards while they
are committed, is killed once mid-run and resumes its checkpoint, and the draft it
writes is then served by vLLM as the EAGLE-3 draft of its target.

- The learnable target (hsx_workers.learnable: a tiny Llama trained on a permutation
  chain) makes acceptance meaningful: the draft must reach mean acceptance length >= 3
  at k=3 in vLLM, from vLLM's own counters.
- The random tiny target: `hsx train` in a process of its own, killed -9 after its
  first checkpoint and started again, resumes; vLLM loads the draft and reports
  acceptance (no threshold: nothing is predictable about a random target).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hsx.client import JobRefusedError, NotFoundError
from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_DIR
from hsx.wire import JobState, JobStatus, TrainState, TrainStatus
from hsx_service.runner import run_job
from hsx_workers.learnable import ChainLanguage, make_learnable_model, write_language_dataset

from .helpers import worker_processes
from .test_service import Coordinator, start_coordinator

pytestmark = pytest.mark.integration

TRAIN = {
    "draft_vocab_size": 256, "batch_tokens": 1024, "epochs": 1, "lr": 1e-3,
    "checkpoint_every": 10, "log_every": 1,
}


def _eval_draft(output: Path, *extra: str) -> dict[str, Any]:
    """`hsx eval-draft --json` in its own process: vLLM's acceptance counters."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "hsx.cli", "eval-draft", str(output), "--json", *extra],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    # vLLM logs to stdout too; the result is the one JSON line.
    lines = [x for x in done.stdout.splitlines() if x.startswith('{"k"')]
    assert lines, done.stdout[-3000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@pytest.fixture(scope="module")
def learnable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target dir, dataset file): the learnable target and 1500 sequences of its language."""
    base = tmp_path_factory.mktemp("learnable")
    language = ChainLanguage(seed=0)
    target = make_learnable_model(base / "target", language=language, steps=150)
    dataset = write_language_dataset(base / "chains.jsonl", 1500, language=language)
    return target, dataset


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    base = tmp_path_factory.getbasetemp()
    ledger = tmp_path_factory.mktemp("train-ledger") / "ledger.sqlite"
    server = start_coordinator(ledger, [base], ledger.parent / "serve.log")
    yield server
    server.kill()


@dataclass
class TrainedRun:
    output: Path
    job: JobStatus
    training: TrainStatus
    killed_at_checkpoint: int
    statuses: list[TrainStatus]


@pytest.fixture(scope="module")
def trained(
    coordinator: Coordinator, learnable: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> TrainedRun:
    target, dataset = learnable
    output = tmp_path_factory.mktemp("train-out") / "chains"
    client = coordinator.client()
    job = client.submit({
        "model": str(target), "dataset": str(dataset), "output": str(output),
        "max_seq_len": 256, "unit_tokens": 1024, "train": TRAIN,
    }, job_id="chains")
    # Kill the trainer actor once, after its first checkpoint.
    statuses: list[TrainStatus] = []
    killed_at = 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            status = client.train_status(job.id)
        except NotFoundError:  # until the job has started its training
            time.sleep(0.5)
            continue
        statuses.append(status)
        if status.checkpoint_step and not killed_at:
            procs = worker_processes(coordinator.proc.pid, "TrainerActor")
            assert procs, "no TrainerActor process under the coordinator"
            killed_at = status.checkpoint_step
            for p in procs:
                p.send_signal(signal.SIGKILL)
        if status.state.finished:
            break
        time.sleep(0.3)
    final_job = client.wait(job.id, timeout=600)
    training = client.wait_train(job.id, timeout=600)
    return TrainedRun(output, final_job, training, killed_at, statuses)


def test_training_runs_alongside_extraction(trained: TrainedRun) -> None:
    assert trained.job.state == JobState.succeeded, trained.job.last_error
    assert trained.training.state == TrainState.done, trained.training.error
    first = trained.training.first_step_at
    assert first is not None and trained.job.finished_at is not None
    # The trainer's first step (of the run that ended: the resumed one started later
    # still) came before the extraction's end: the first run's steps were logged then.
    first_logged = min(p.time for p in trained.training.history)
    assert first_logged < trained.job.finished_at
    running = [s for s in trained.statuses if s.state == TrainState.running]
    assert running, "the training was never seen running"


def test_loss_decreases(trained: TrainedRun) -> None:
    losses = [p.loss for p in trained.training.history]
    assert len(losses) >= 20
    head, tail = losses[:5], losses[-5:]
    assert sum(tail) / len(tail) < 0.5 * sum(head) / len(head), losses
    acc = trained.training.acc
    assert len(acc) == 3 and acc[0] > 0.9, acc


def test_killed_trainer_resumes_from_its_checkpoint(trained: TrainedRun) -> None:
    assert trained.killed_at_checkpoint >= TRAIN["checkpoint_every"]
    assert trained.training.restarts == 1
    assert trained.training.resumed_from is not None
    assert trained.training.resumed_from >= trained.killed_at_checkpoint
    steps = [p.step for p in trained.training.history]
    # One record per step: the resumed run replays nothing twice and skips nothing.
    assert steps == list(range(1, len(steps) + 1))
    assert trained.training.step == steps[-1]
    checkpoints = sorted(p.name for p in (trained.output / DRAFT_CHECKPOINTS).iterdir())
    assert checkpoints and checkpoints[-1].endswith(f"{trained.training.step:08d}")


def test_draft_is_accepted_by_vllm(trained: TrainedRun) -> None:
    draft = trained.output / DRAFT_DIR
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # the job's [1, 2, 4] minus N
    result = _eval_draft(trained.output, "--k", "3", "--prompts", "8", "--max-tokens", "48")
    assert result["drafts"] > 0
    assert result["mean_acceptance_length"] >= 3.0, result


def test_training_a_job_without_layer_n_is_refused(
    coordinator: Coordinator, learnable: tuple[Path, Path], tmp_path: Path
) -> None:
    target, dataset = learnable
    client = coordinator.client()
    job = client.submit({"model": str(target), "dataset": str(dataset),
                         "output": str(tmp_path / "no-n"), "layers": [1, 2],
                         "max_seq_len": 64}, job_id="no-last-layer")
    with pytest.raises(JobRefusedError) as refused:
        client.train(job.id, {"epochs": 1})
    assert "last layer (id 4" in str(refused.value)
    client.cancel(job.id)


# ------------------------------------------------------------------ the random target


@pytest.fixture(scope="module")
def random_output(tmp_path_factory: pytest.TempPathFactory, make_job: Any,
                  engine_pool: Any) -> Path:
    output = tmp_path_factory.mktemp("train-random") / "out"
    run_job(make_job(output, engine="vllm"), pool=engine_pool)
    return output


def test_hsx_train_killed_and_restarted_resumes(random_output: Path) -> None:
    args = [sys.executable, "-m", "hsx.cli", "train", str(random_output),
            "--set", "batch_tokens=512", "--set", "checkpoint_every=2", "--set", "epochs=2",
            "--set", "draft_vocab_size=256"]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    checkpoints = random_output / DRAFT_CHECKPOINTS
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir()):
            break
        time.sleep(0.1)
    assert first.poll() is None, (first.stdout.read() if first.stdout else b"")[-3000:]
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    saved = max(int(p.name.split("-")[1]) for p in checkpoints.iterdir()
                if p.name.startswith("step-"))
    assert saved >= 2
    second = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from step {saved}" in second.stdout + second.stderr
    state = json.loads((random_output / DRAFT_DIR / "train.json").read_text())
    assert state["state"] == "done" and state["resumed_from"] == saved


def test_random_target_draft_loads_in_vllm(random_output: Path) -> None:
    # Runs after the training above (same module order); the draft is there.
    assert (random_output / DRAFT_DIR / "model.safetensors").exists()
    result = _eval_draft(random_output, "--k", "3", "--prompts", "4", "--max-tokens", "16")
    assert result["drafts"] > 0 and result["draft_tokens"] == 3 * result["drafts"]
    assert 1.0 <= result["mean_acceptance_length"] <= 4.0
    assert len(result["accepted_per_position"]) == 3
