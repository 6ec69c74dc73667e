"""Validation and step scores: loss, accuracy per draft position, expected acceptance
length, for either kind of draft (hsx.methods).

An EAGLE-3 draft's metrics count, per TTT step k, the positions whose steps 0..k were all
right (`full_acc_{k}`); a block drafter's (DFlash) count each position of a block
(`position_{i}_acc`) and the accepted run of each block plus the target's bonus token
(`eal`), which is its expected acceptance length directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hsx.spec import TrainSpec


@dataclass
class Scores:
    """Sums over packs (and workers): loss x tokens, tokens, right and total per draft
    position (`names`: the metrics' keys), and a block drafter's accepted lengths."""

    names: list[str]
    block: bool = False
    loss_sum: float = 0.0
    tokens: int = 0
    right: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    accepted: float = 0.0  # block drafters: sum of accepted lengths, and blocks counted
    blocks: float = 0.0

    def __post_init__(self) -> None:
        self.right = self.right or [0.0] * len(self.names)
        self.total = self.total or [0.0] * len(self.names)

    @classmethod
    def of(cls, spec: TrainSpec) -> Scores:
        """Empty scores for a draft trained by `spec`."""
        if spec.draft.block:
            # Slot 0 is the anchor (the target's token), given: slots 1.. are proposed.
            return cls([f"position_{i}_acc" for i in range(1, spec.block_size)], block=True)
        return cls([f"full_acc_{k}" for k in range(spec.ttt_steps)])

    def add(self, loss: float, tokens: int, metrics: dict[str, Any]) -> None:
        self.loss_sum += loss * tokens
        self.tokens += tokens
        for k, name in enumerate(self.names):
            self.right[k] += float(metrics[f"{name}_sum"])
            self.total[k] += float(metrics[f"{name}_total"])
        if self.block:
            self.accepted += float(metrics["eal_sum"])
            self.blocks += float(metrics["eal_total"])

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.loss_sum, float(self.tokens), self.accepted, self.blocks,
                             *self.right, *self.total], dtype=torch.float64)

    def from_tensor(self, t: torch.Tensor) -> Scores:
        """Scores like these with the sums of `t` (as_tensor's layout, summed over
        workers)."""
        v, n = t.tolist(), len(self.names)
        return Scores(self.names, self.block, v[0], int(v[1]), v[4:4 + n], v[4 + n:],
                      v[2], v[3])

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def acc(self) -> list[float]:
        """EAGLE-3: P(TTT steps 0..k all right), per k. Block drafter: P(position i of a
        block right), per proposed position."""
        return [r / t if t else 0.0 for r, t in zip(self.right, self.total, strict=True)]

    @property
    def cond_acc(self) -> list[float]:
        """EAGLE-3: P(TTT step k right | steps before it right), per k (a block drafter's
        positions are scored each on its own: `acc`)."""
        if self.block:
            return self.acc
        out, prev = [], 1.0
        for a in self.acc:
            out.append(a / prev if prev > 0 else 0.0)
            prev = a
        return out

    @property
    def expected_acceptance_length(self) -> float:
        """Tokens per verification step the draft would give. EAGLE-3: 1 + the sum of the
        products of the conditional accuracies (= 1 + sum_k P(steps 0..k right)); a
        block drafter: the mean accepted run of its blocks plus the bonus token."""
        if self.block:
            return self.accepted / self.blocks if self.blocks else 1.0
        expected, product = 1.0, 1.0
        for c in self.cond_acc:
            product *= c
            expected += product
        return expected
