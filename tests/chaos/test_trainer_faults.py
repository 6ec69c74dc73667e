"""The trainer's faults: killed mid-checkpoint, and its coordinator killed while it trains.

The trainer killed at each step of writing a checkpoint (`HSX_FAULT_POINT`):

`hsx train` runs in its own process on an output written by hand (no engine) and
SIGKILLs itself at its second checkpoint, at one of the checkpoint's fault points; then:

- draft/checkpoints/ holds only whole checkpoints (weights, optimizer, metrics), and
  draft/ one whole draft: each file the very file of one complete checkpoint;
- a second run resumes from the newest complete checkpoint (the one staged in
  draft/.tmp never counts), drops what was staged, logs every step exactly once, and its
  final draft loads as speculators' Eagle3 draft.

The coordinator killed -9 while its trainer runs a Ray Train run of 2 workers (`hsx
serve` processes, the session's warm engine extracts the output beforehand): a
coordinator started again on the same ledger resumes the training on 2 workers from its
last checkpoint and finishes it, each step once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.draft import checkpoints, read_metrics, read_train_state
from hsx.output import faults as fault_points
from hsx.output.layout import DRAFT_DIR
from hsx_workers.tiny_models import make_chat_dataset
from tests.unit.test_trainer import make_output, spec

from .audit import audit
from .test_faults import UNIT_TOKENS, report

STEPS = 8  # checkpoints every 2 steps (tests.unit.test_trainer.spec), 2 kept
CHECKPOINT_FILES = ("model.safetensors", "config.json", "trainer_state.pt", "metrics.json")


def _whole_draft(draft: Path) -> int:
    """The step of the complete checkpoint whose files draft/ holds (asserting it is one)."""
    whole = {}
    for ckpt in checkpoints(draft.parent):
        assert {p.name for p in ckpt.iterdir()} >= set(CHECKPOINT_FILES), ckpt
        whole[ckpt] = int(json.loads((ckpt / "metrics.json").read_text())["step"])
    holders = [c for c in whole
               if os.path.samefile(c / "model.safetensors", draft / "model.safetensors")]
    assert len(holders) == 1, f"draft/ holds no complete checkpoint's weights: {sorted(whole)}"
    for name in ("config.json", "config.py"):
        if (draft / name).exists():
            assert (draft / name).read_bytes() == (holders[0] / name).read_bytes(), name
    return whole[holders[0]]


@pytest.mark.parametrize("point", fault_points.CHECKPOINT_POINTS)
def test_trainer_killed_mid_checkpoint_resumes_from_the_last_whole_one(
    point: str, tmp_path: Path, tiny_llama: Path,
) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    draft = root / DRAFT_DIR
    env = {**os.environ, fault_points.ENV: f"{point}:2"}  # the second checkpoint (step 4)
    settings = spec(max_steps=STEPS)
    overrides = [f"--set={k}={v}" for k, v in settings.model_dump(exclude_unset=True).items()]
    killed = subprocess.run([sys.executable, "-m", "hsx.cli", "train", str(root), *overrides],
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]

    saved = [int(p.name.split("-")[1]) for p in checkpoints(root)]
    staged = sorted(p.name for p in (draft / ".tmp").iterdir())
    published = _whole_draft(draft)
    if point == "after_checkpoint_write":  # staged, never renamed: not a checkpoint
        assert (saved, staged, published) == ([2], ["step-00000004"], 2)
    elif point == "after_checkpoint_rename":  # a checkpoint, not yet the draft
        assert (saved, staged, published) == ([2, 4], [], 2)
    else:
        assert (saved, staged, published) == ([2, 4], [], 4)

    from hsx_workers.trainer import DraftTrainer

    trainer = DraftTrainer(root, settings)
    state = trainer.run()
    assert trainer.resumed_from == saved[-1] and state.step == STEPS
    assert [int(m["step"]) for m in read_metrics(root)] == list(range(1, STEPS + 1))
    assert not list((draft / ".tmp").iterdir())
    assert _whole_draft(draft) == STEPS
    assert (read_train_state(root) or {})["state"] == "done"

    from speculators.models.eagle3 import Eagle3DraftModel

    loaded = Eagle3DraftModel.from_pretrained(str(draft))  # the draft as published
    assert loaded.config.draft_vocab_size == settings.draft_vocab_size
    report(f"trainer killed {point}", {"faults": 1, "checkpoints_left": saved,
                                       "staged_left": staged, "draft_at_kill": published,
                                       "resumed_from": trainer.resumed_from,
                                       "final_step": state.step})


# The killed coordinator's trainer runs on until Ray reaps what the dead driver owned:
# ~4 s on a loaded machine, where 40 steps of ~0.1 s once finished in that time and left
# nothing to resume. 160 steps keep the run going ~15 s past the first checkpoint.
TRAIN = {"max_steps": 160, "batch_tokens": 48, "checkpoint_every": 4, "keep_checkpoints": 2,
         "draft_vocab_size": 128, "val_fraction": 0.0, "eval_prompts": 0, "device": "cpu",
         "workers": 2}


@pytest.mark.integration
def test_a_coordinator_killed_while_it_trains_resumes_the_training(
    make_job: Any, engine_pool: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """kill -9 of `hsx serve` after the first checkpoint of its training on 2 Ray Train
    workers (gloo); the trainer it owns goes with it, and the workers with the trainer. A
    coordinator started again on the ledger picks the training up from that checkpoint
    and finishes it on 2 workers; the extraction's output passes the audit."""
    import ray

    from hsx.wire import JobState, TrainState
    from hsx_service.runner import run_job
    from tests.integration.test_service import start_coordinator

    dataset = make_chat_dataset(tmp_path / "chat.jsonl", n=16, seed=3, bad_rows=2)
    spec = make_job(tmp_path / "out", dataset=str(dataset.path), unit_tokens=UNIT_TOKENS)
    run_job(spec, pool=engine_pool)  # the session's warm engine: the coordinator starts none
    output = Path(spec.output)
    roots, ledger = [tmp_path_factory.getbasetemp()], tmp_path / "ledger.sqlite"
    # Both coordinators join this session's Ray by its address (the trainer, owned by
    # the killed one, goes with it): without one, a coordinator joined the newest Ray
    # on the machine, the other pytest worker's `ray start` cluster, which ended under it.
    ray_env = {"HSX_RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    first = start_coordinator(ledger, roots, tmp_path / "serve-1.log", env=ray_env)
    try:
        client = first.client()
        # The output is this test's own extraction, not a job of this coordinator's.
        job = client.submit({**spec.model_dump(mode="json"), "train": TRAIN,
                             "resume_foreign": True}, job_id="trained")
        assert client.wait(job.id, timeout=300).state == JobState.succeeded  # nothing to do
        deadline = time.monotonic() + 300
        while not checkpoints(output):
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint in time: {first.log.read_text()[-3000:]}")
            time.sleep(0.05)
    finally:
        first.kill()
    killed_at = int(checkpoints(output)[-1].name.split("-")[1])
    at_kill = read_train_state(output) or {}
    assert at_kill.get("state") == "running" and killed_at < TRAIN["max_steps"], at_kill

    second = start_coordinator(ledger, roots, tmp_path / "serve-2.log", env=ray_env)
    try:
        training = second.client().wait_train(job.id, timeout=600)
    finally:
        second.kill()
    assert training.state == TrainState.done, training.error
    assert training.plan is not None and training.plan.workers == 2
    assert training.resumed_from is not None and training.resumed_from >= killed_at
    assert training.step == TRAIN["max_steps"]
    steps = [int(m["step"]) for m in read_metrics(output)]
    assert steps == list(range(1, TRAIN["max_steps"] + 1))  # each step logged once
    assert _whole_draft(output / DRAFT_DIR) == TRAIN["max_steps"]
    figures = audit(output, dataset)  # the extraction's output is untouched
    report("coordinator killed while training", {
        "faults": 1, "killed_after_checkpoint": killed_at,
        "resumed_from": training.resumed_from, "final_step": training.step, **figures})
