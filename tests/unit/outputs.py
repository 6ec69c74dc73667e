"""Building hsx outputs by hand in unit tests (no engines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from hsx.layout import INPUTS


def write_inputs_table(root: Path, rows: list[int], samples: list[dict[str, Any]]) -> None:
    """inputs.arrow as ingestion writes it: one row per sample, in `rows` order."""
    table = pa.table({
        "sample_index": pa.array(rows, pa.int64()),
        "input_ids": pa.array([s["input_ids"].tolist() for s in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s["loss_mask"].tolist() for s in samples], pa.list_(pa.uint8())),
        "length": pa.array([len(s["input_ids"]) for s in samples], pa.int32()),
    })
    with pa.OSFile(str(root / INPUTS), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
