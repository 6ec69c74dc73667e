"""The draft's measurement without vLLM: each held-out prompt's limit, and the interval of
the mean acceptance length over prompts. vLLM generating as a server does, and the
figure agreeing with vLLM serving the draft: tests/integration/test_eval_as_served.py."""

from __future__ import annotations

import math
import random

import pytest

from hsx_workers.acceptance import EvalPrompt, acceptance_interval, prompt_of


def test_a_prompts_limit_is_its_answers_length() -> None:
    # The tokens before the first loss-masked one; as many as its answer had, however
    # few (a server stops a short answer at its end, not 8 tokens later).
    assert prompt_of([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], 8, 256) == EvalPrompt([1, 2, 3], 2)
    assert prompt_of(list(range(40)), [0] * 4 + [1] * 36, 8, 16) == EvalPrompt(
        [0, 1, 2, 3], 16)  # at most max_tokens
    assert prompt_of(list(range(12)), [1] * 12, 8, 256) == EvalPrompt(list(range(8)), 4)
    assert prompt_of([1, 2], [0, 0], 8, 256) == EvalPrompt([1], 1)
    assert prompt_of([1], [1], 8, 256) is None


def test_the_interval_is_the_ratio_estimators() -> None:
    """1 + sum(accepted) / sum(drafts) over prompts, +- 1.96 standard errors of the
    ratio (delta method); it narrows as 1/sqrt(prompts) and covers the truth."""
    assert acceptance_interval([]) is None
    assert acceptance_interval([(3, 2)]) is None
    assert acceptance_interval([(0, 0), (0, 0)]) is None
    same = acceptance_interval([(4, 8)] * 10)
    assert same == pytest.approx([3.0, 3.0])  # every prompt alike: no spread
    rng = random.Random(0)

    def prompts(n: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(n):
            drafts = rng.randint(1, 12)
            out.append((drafts, sum(rng.random() < 0.6 for _ in range(3 * drafts))))
        return out

    small, large = prompts(100), prompts(1600)
    lo, hi = acceptance_interval(small) or [0.0, 0.0]
    lo4, hi4 = acceptance_interval(large) or [0.0, 0.0]
    assert lo < 2.8 < hi and lo4 < 2.8 < hi4  # 1 + 3 x 0.6
    assert (hi4 - lo4) == pytest.approx((hi - lo) / 4, rel=0.3)
    center = 1 + sum(a for _, a in small) / sum(d for d, _ in small)
    assert math.isclose((lo + hi) / 2, center)
