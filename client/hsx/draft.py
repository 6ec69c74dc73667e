"""Reading a draft training's files in an output (draft/); see docs/TRAINING.md.

The trainer writes them, the coordinator and `hsx` commands read them here: the step
records (metrics.jsonl), the validations (validation.jsonl), the checkpoints and each
one's metrics, the trainer's state (train.json) and vLLM's evaluation (eval.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx.output.layout import (
    CHECKPOINT_METRICS,
    DRAFT_CHECKPOINTS,
    DRAFT_EVAL,
    DRAFT_METRICS,
    DRAFT_STATE,
    DRAFT_VALIDATION,
)

if TYPE_CHECKING:
    from hsx.output import Output


def draft_folder(output: Output, draft_root: str | Path | None = None) -> Path:
    """The local folder that holds an output's draft/: `draft_root`, else the output's
    own folder. ValueError for an object-store output without `draft_root`: checkpoints
    are published by folder renames and hard links, and vLLM loads a draft from a
    folder, so a draft lives on a file system (`hsx train URI --draft-dir DIR`)."""
    root = Path(draft_root).expanduser() if draft_root is not None else output.local_root
    if root is None:
        raise ValueError(
            f"{output} is an object store: its draft lives in a local folder; name it "
            "with --draft-dir DIR (draft_root), the draft is then DIR/draft"
        )
    return root


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order; a line cut by a crash is skipped."""
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


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent or not (yet) an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_metrics(root: str | Path) -> list[dict[str, Any]]:
    """Every record of draft/metrics.jsonl (one per logged step), in order."""
    return read_jsonl(Path(root) / DRAFT_METRICS)


def read_validation(root: str | Path) -> list[dict[str, Any]]:
    """Every record of draft/validation.jsonl (one per validation), in order."""
    return read_jsonl(Path(root) / DRAFT_VALIDATION)


def read_train_state(root: str | Path) -> dict[str, Any] | None:
    """draft/train.json: state, step, plan, best checkpoint, warning, error."""
    return read_json(Path(root) / DRAFT_STATE)


def read_eval(root: str | Path) -> dict[str, Any] | None:
    """draft/eval.json: the draft's acceptance in vLLM, when it has been measured."""
    return read_json(Path(root) / DRAFT_EVAL)


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


def checkpoint_metrics(path: Path) -> dict[str, Any] | None:
    """A checkpoint's own metrics (its step, validation, last training step)."""
    return read_json(path / CHECKPOINT_METRICS)


def expected_acceptance(validation: dict[str, Any] | None) -> float | None:
    """The expected acceptance length a validation record gives, if it has one."""
    if not validation:
        return None
    value = validation.get("expected_acceptance_length")
    return float(value) if isinstance(value, int | float) else None


def last_record(path: Path, window: int = 1 << 16) -> dict[str, Any] | None:
    """The last whole record of a JSON-lines file, reading only its tail."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - window))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            return row
    return None


def write_json(path: Path, body: dict[str, Any]) -> None:
    """Replace a JSON file atomically (readers see the old or the new content)."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=2))
    os.replace(tmp, path)
