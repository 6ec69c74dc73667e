"""Work units: contiguous ranges of the inputs table, each about `unit_tokens` long.

One unit becomes one shard. The plan is a pure function of the sample lengths and
`unit_tokens`, so a rerun of the same job maps every sample to the same unit, and a
commit record found in the output says exactly which samples are done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkUnit:
    unit: int
    row_start: int  # first row of inputs.arrow (inclusive)
    row_end: int  # last row (exclusive)
    tokens: int

    @property
    def samples(self) -> int:
        return self.row_end - self.row_start

    def to_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "rows": [self.row_start, self.row_end], "tokens": self.tokens}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkUnit:
        start, end = data["rows"]
        return cls(unit=int(data["unit"]), row_start=int(start), row_end=int(end),
                   tokens=int(data["tokens"]))


def plan_units(lengths: Sequence[int], unit_tokens: int) -> list[WorkUnit]:
    """Cut rows into units of at least one sample and at most ~unit_tokens tokens."""
    if unit_tokens <= 0:
        raise ValueError("unit_tokens must be positive")
    units: list[WorkUnit] = []
    start = 0
    tokens = 0
    for row, length in enumerate(lengths):
        if row > start and tokens + length > unit_tokens:
            units.append(WorkUnit(len(units), start, row, tokens))
            start, tokens = row, 0
        tokens += int(length)
    if len(lengths) > start:
        units.append(WorkUnit(len(units), start, len(lengths), tokens))
    return units

