"""Work units: contiguous ranges of the inputs table, each about `unit_tokens` long.

One unit becomes one shard. The plan is a pure function of the sample lengths,
`unit_tokens` and `first_unit_tokens`, so a rerun of the same job maps every sample to
the same unit, and a commit record found in the output says exactly which samples are
done.

The first units ramp up: the first is cut at `first_unit_tokens`, each next one at twice
the last, up to `unit_tokens`. An engine's first shard then takes seconds, not a whole
unit's minute on a CPU, so a job commits soon after its engines start. The rule a job
planned with is recorded (ingest.json's `first_unit_tokens`; 0: no ramp, as drivers
before it planned), and a driver that goes on with that ingestion plans by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FIRST_UNIT_TOKENS = 8192  # a new job's first unit


def first_unit_tokens(unit_tokens: int) -> int:
    """The ramp a new job plans with: FIRST_UNIT_TOKENS, or 0 (none) where its units
    are no bigger."""
    return FIRST_UNIT_TOKENS if unit_tokens > FIRST_UNIT_TOKENS else 0


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


class UnitPlanner:
    """`plan_units` one batch of lengths at a time, for rows that arrive while the job
    runs: `add` returns the units its rows closed, `finish` the last one. Fed the same
    lengths in any batches, it plans exactly what `plan_units` plans from all of them."""

    def __init__(self, unit_tokens: int, first_unit_tokens: int = 0) -> None:
        if unit_tokens <= 0:
            raise ValueError("unit_tokens must be positive")
        if first_unit_tokens < 0:
            raise ValueError("first_unit_tokens must not be negative")
        self.unit_tokens = unit_tokens
        self.rows = 0  # rows seen
        self.units = 0  # units closed
        self._start = 0  # first row of the open unit
        self._tokens = 0  # its tokens
        self._cap = min(unit_tokens, first_unit_tokens or unit_tokens)  # it is cut at

    def add(self, lengths: Sequence[int]) -> list[WorkUnit]:
        closed: list[WorkUnit] = []
        for length in lengths:
            if self.rows > self._start and self._tokens + length > self._cap:
                closed.append(WorkUnit(self.units, self._start, self.rows, self._tokens))
                self.units += 1
                self._start, self._tokens = self.rows, 0
                self._cap = min(self.unit_tokens, 2 * self._cap)
            self._tokens += int(length)
            self.rows += 1
        return closed

    def finish(self) -> list[WorkUnit]:
        """The open unit, if it has rows; no row may be added after."""
        if self.rows == self._start:
            return []
        unit = WorkUnit(self.units, self._start, self.rows, self._tokens)
        self.units += 1
        self._start, self._tokens = self.rows, 0
        return [unit]


def plan_units(lengths: Sequence[int], unit_tokens: int, first_unit_tokens: int = 0
               ) -> list[WorkUnit]:
    """Cut rows into units of at least one sample and at most ~unit_tokens tokens (the
    first ones ramping up from `first_unit_tokens`, if given)."""
    planner = UnitPlanner(unit_tokens, first_unit_tokens)
    return planner.add(lengths) + planner.finish()
