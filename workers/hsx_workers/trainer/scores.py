"""Validation and step scores: loss, accuracy per draft position, expected acceptance
length, as the draft's method counts them (hsx.methods).

speculators' metrics count, per draft position, the positions right (`<name>_sum`) and
scored (`<name>_total`), under the keys the method names (`score_names`: an EAGLE-3
draft's `full_acc_{k}`, the positions whose TTT steps 0..k were all right; a block
drafter's `position_{i}_acc`, each slot of a block); a block drafter's forward also
counts the accepted run of each block plus the target's bonus token (`eal`, the method's
`run_metric`). The method turns them into conditional accuracies and an expected
acceptance length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hsx.methods import DEFAULT_METHOD, DraftMethod, method
from hsx.spec import TrainSpec


@dataclass
class Scores:
    """Sums over packs (and workers): loss x tokens, tokens, right and total per draft
    position (`names`: the metrics' keys), and the accepted runs where the method's
    forward counts them."""

    names: list[str]
    draft: DraftMethod = field(default_factory=lambda: method(DEFAULT_METHOD))
    loss_sum: float = 0.0
    tokens: int = 0
    right: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    accepted: float = 0.0  # the method's run metric: sum of accepted runs, and runs counted
    blocks: float = 0.0

    def __post_init__(self) -> None:
        self.right = self.right or [0.0] * len(self.names)
        self.total = self.total or [0.0] * len(self.names)

    @classmethod
    def of(cls, spec: TrainSpec) -> Scores:
        """Empty scores for a draft trained by `spec`."""
        return cls(spec.draft.score_names(spec), spec.draft)

    def add(self, loss: float, tokens: int, metrics: dict[str, Any]) -> None:
        self.loss_sum += loss * tokens
        self.tokens += tokens
        for k, name in enumerate(self.names):
            self.right[k] += float(metrics[f"{name}_sum"])
            self.total[k] += float(metrics[f"{name}_total"])
        run = self.draft.run_metric
        if run is not None:
            self.accepted += float(metrics[f"{run}_sum"])
            self.blocks += float(metrics[f"{run}_total"])

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.loss_sum, float(self.tokens), self.accepted, self.blocks,
                             *self.right, *self.total], dtype=torch.float64)

    def from_tensor(self, t: torch.Tensor) -> Scores:
        """Scores like these with the sums of `t` (as_tensor's layout, summed over
        workers)."""
        v, n = t.tolist(), len(self.names)
        return Scores(self.names, self.draft, v[0], int(v[1]), v[4:4 + n], v[4 + n:],
                      v[2], v[3])

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def acc(self) -> list[float]:
        """Right ÷ scored, per draft position, as the method's metrics count them."""
        return [r / t if t else 0.0 for r, t in zip(self.right, self.total, strict=True)]

    @property
    def cond_acc(self) -> list[float]:
        """P(position k right | the positions before it right), per k."""
        return self.draft.conditional_accuracies(self.acc)

    @property
    def expected_acceptance_length(self) -> float:
        """Tokens per verification step the draft would give (the method's formula)."""
        run = self.accepted / self.blocks if self.blocks else None
        return self.draft.expected_acceptance_length(self.acc, run)
