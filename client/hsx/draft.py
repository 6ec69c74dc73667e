"""Reading a draft training's files in an output (draft/metrics.jsonl); see docs/TRAINING.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hsx.output.layout import DRAFT_CHECKPOINTS, DRAFT_METRICS


def read_metrics(root: str | Path) -> list[dict[str, Any]]:
    """Every record of draft/metrics.jsonl, in order; a line cut by a crash is skipped."""
    path = Path(root) / DRAFT_METRICS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def checkpoints(root: str | Path) -> list[Path]:
    """The draft's checkpoint folders, oldest first. Each is whole: a checkpoint is
    published by renaming its finished folder into draft/checkpoints/."""
    folder = Path(root) / DRAFT_CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if checkpoint_step(p) is not None)


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder named by `hsx.output.layout.checkpoint_name`, else None."""
    prefix, _, step = path.name.partition("-")
    return int(step) if prefix == "step" and step.isdigit() else None
