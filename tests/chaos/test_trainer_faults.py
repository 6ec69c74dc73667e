"""The trainer killed at each step of writing a checkpoint (`HSX_FAULT_POINT`).

`hsx train` runs in its own process on an output written by hand (no engine) and
SIGKILLs itself at its second checkpoint, at one of the checkpoint's fault points; then:

- draft/checkpoints/ holds only whole checkpoints (weights, optimizer, metrics), and
  draft/ one whole draft: each file the very file of one complete checkpoint;
- a second run resumes from the newest complete checkpoint (the one staged in
  draft/.tmp never counts), drops what was staged, logs every step exactly once, and its
  final draft loads as speculators' Eagle3 draft.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.draft import checkpoints, read_metrics, read_train_state
from hsx.output import faults as fault_points
from hsx.output.layout import DRAFT_DIR
from tests.unit.test_trainer import make_output, spec

from .test_faults import report

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
