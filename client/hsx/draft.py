"""Reading a draft training's files in an output (draft/metrics.jsonl); see docs/TRAINING.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hsx.layout import DRAFT_METRICS


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
