"""Validation and step scores: loss, accuracy per TTT step, expected acceptance length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Scores:
    """Sums over packs (and workers): loss x tokens, tokens, right and total per TTT step."""

    ttt_steps: int
    loss_sum: float = 0.0
    tokens: int = 0
    right: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.right = self.right or [0.0] * self.ttt_steps
        self.total = self.total or [0.0] * self.ttt_steps

    def add(self, loss: float, tokens: int, metrics: dict[str, Any]) -> None:
        self.loss_sum += loss * tokens
        self.tokens += tokens
        for k in range(self.ttt_steps):
            self.right[k] += float(metrics[f"full_acc_{k}_sum"])
            self.total[k] += float(metrics[f"full_acc_{k}_total"])

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.loss_sum, float(self.tokens), *self.right, *self.total],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, ttt_steps: int) -> Scores:
        v = t.tolist()
        return cls(ttt_steps, v[0], int(v[1]), v[2:2 + ttt_steps], v[2 + ttt_steps:])

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def acc(self) -> list[float]:
        """P(TTT steps 0..k all right), per k."""
        return [r / t if t else 0.0 for r, t in zip(self.right, self.total, strict=True)]

    @property
    def cond_acc(self) -> list[float]:
        """P(TTT step k right | steps before it right), per k."""
        out, prev = [], 1.0
        for a in self.acc:
            out.append(a / prev if prev > 0 else 0.0)
            prev = a
        return out

    @property
    def expected_acceptance_length(self) -> float:
        """Tokens per verification step a k-token draft would give: 1 + sum of the
        products of the conditional accuracies (= 1 + sum_k P(steps 0..k right))."""
        expected, product = 1.0, 1.0
        for c in self.cond_acc:
            product *= c
            expected += product
        return expected
