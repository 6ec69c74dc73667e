"""Long-tailed chats: seeded, lengths as drawn (median, tail, cap) when measured with the
tokenizer they were made for, and the same lengths when hsx ingests them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from hsx_workers.tiny_models import long_tailed_lengths, make_long_tailed_chats


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer))


def test_same_seed_same_file(tokenizer: Any, tmp_path: Path) -> None:
    shape = {"median_tokens": 80, "tail_tokens": 600, "max_tokens": 640}
    a = make_long_tailed_chats(tmp_path / "a.jsonl", tokenizer, 30, seed=3, **shape)
    b = make_long_tailed_chats(tmp_path / "b.jsonl", tokenizer, 30, seed=3, **shape)
    c = make_long_tailed_chats(tmp_path / "c.jsonl", tokenizer, 30, seed=4, **shape)
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.lengths == b.lengths
    assert c.path.read_bytes() != a.path.read_bytes()
    rows = [json.loads(line) for line in a.path.read_text().splitlines()]
    assert len(rows) == 30
    for row in rows:
        # The field both hsx and speculators' prepare-data read; one assistant turn, last.
        assert list(row) == ["conversations"]
        roles = [m["role"] for m in row["conversations"]]
        assert roles[-2:] == ["user", "assistant"] and roles[:-2] in ([], ["system"])


def test_median_tail_and_cap_measured_with_the_tokenizer(tokenizer: Any, tmp_path: Path
                                                         ) -> None:
    from hsx.ingest import tokenize_conversations

    n = 600
    chats = make_long_tailed_chats(tmp_path / "mix.jsonl", tokenizer, n, seed=0)
    rows = [json.loads(line)["conversations"] for line in chats.path.read_text().splitlines()]
    # Measured as ingestion measures them, independently of the generator's own count.
    measured = [len(ids) for ids, _ in tokenize_conversations(tokenizer, rows, 8192)]
    assert measured == chats.lengths
    assert max(measured) <= 8192
    assert 540 <= statistics.median(measured) <= 660  # median ~600
    beyond = sum(length > 8000 for length in measured) / n
    assert 0.003 <= beyond <= 0.025  # ~1% beyond 8k
    # Each length is its draw, within a token or two, unless below the template's floor.
    drawn = long_tailed_lengths(n, seed=0)
    close = sum(abs(m - d) <= 2 for m, d in zip(measured, drawn, strict=True))
    assert close >= 0.97 * n


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="median_tokens"):
        long_tailed_lengths(3, median_tokens=9000, tail_tokens=8000)
    with pytest.raises(ValueError, match="tail_fraction"):
        long_tailed_lengths(3, tail_fraction=0.7)
