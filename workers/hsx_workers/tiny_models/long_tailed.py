"""Chats whose token lengths follow a long tail, seeded: the length mix of real chat data
(most conversations a few hundred tokens, a few near the job's limit), for benchmarks
that must not assume every prompt has one length.

A chat's length is counted as ingestion counts it: the tokenizer's chat template
rendered as text, then tokenized without special tokens. Lengths are drawn from a
log-normal law given by its median and the share of chats beyond a tail length, and
capped at `max_tokens` (the job's `max_seq_len`), so no chat is truncated.

Rows carry the chat under `conversations` as `{role, content}` messages: hsx reads that
field (as it reads `messages`), and it is the one field speculators' `prepare-data`
reads from a local JSONL file (it maps `messages` only for its UltraChat preset). Each
chat has one user turn and one assistant turn (after an optional system message), so
speculators' per-assistant-turn rows are one row per chat, with the same token count.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal

from hsx_workers.tiny_models.chat_datasets import write_rows
from hsx_workers.tiny_models.corpus import question, sentence

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ChatField = Literal["conversations", "messages"]


@dataclass
class LongTailedChats:
    """What `make_long_tailed_chats` wrote: the file and each chat's token count."""

    path: Path
    lengths: list[int] = field(default_factory=list, repr=False)
    """Tokens of each row's chat under the tokenizer's chat template, in row order."""

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def long_tailed_lengths(n: int, *, seed: int = 0, median_tokens: int = 600,
                        tail_tokens: int = 8000, tail_fraction: float = 0.01,
                        min_tokens: int = 1, max_tokens: int = 8192) -> list[int]:
    """`n` lengths from a log-normal law with median `median_tokens` whose upper
    `tail_fraction` lies beyond `tail_tokens`, clipped to [min_tokens, max_tokens]."""
    if not 0 < median_tokens < tail_tokens:
        raise ValueError("need 0 < median_tokens < tail_tokens")
    if not 0 < tail_fraction < 0.5:
        raise ValueError("tail_fraction must be in (0, 0.5)")
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError("need 1 <= min_tokens <= max_tokens")
    sigma = math.log(tail_tokens / median_tokens) / NormalDist().inv_cdf(1 - tail_fraction)
    rng = random.Random(seed)
    mu = math.log(median_tokens)
    return [min(max_tokens, max(min_tokens, round(rng.lognormvariate(mu, sigma))))
            for _ in range(n)]


def make_long_tailed_chats(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase | str | Path,
    n: int = 512,
    *,
    seed: int = 0,
    median_tokens: int = 600,
    tail_tokens: int = 8000,
    tail_fraction: float = 0.01,
    max_tokens: int = 8192,
    chat_field: ChatField = "conversations",
) -> LongTailedChats:
    """Write `n` chats as JSONL whose lengths under `tokenizer`'s chat template follow
    `long_tailed_lengths` (defaults: median 600 tokens, 1% beyond 8,000, none beyond
    8,192), deterministically by seed.

    A length below what the template and the user turn take on their own comes out at
    that floor (a few dozen tokens); the others land within a token or two of their draw,
    never above `max_tokens`.
    """
    if chat_field not in ("conversations", "messages"):
        raise ValueError(f"chat_field must be conversations or messages, not {chat_field!r}")
    tok = _tokenizer(tokenizer)
    if not getattr(tok, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    targets = long_tailed_lengths(n, seed=seed, median_tokens=median_tokens,
                                  tail_tokens=tail_tokens, tail_fraction=tail_fraction,
                                  max_tokens=max_tokens)
    rng = random.Random(f"{seed}-text")
    rows: list[dict[str, Any]] = []
    lengths: list[int] = []
    for target in targets:
        messages, length = _chat_of_length(tok, rng, target, max_tokens)
        rows.append({chat_field: messages})
        lengths.append(length)
    out = write_rows(rows, path, "jsonl")
    logger.info("wrote %d chats (%d tokens) to %s", n, sum(lengths), out)
    return LongTailedChats(path=out, lengths=lengths)


def _tokenizer(tokenizer: PreTrainedTokenizerBase | str | Path) -> PreTrainedTokenizerBase:
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _length(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> int:
    """Tokens of a chat as ingestion makes them: template text, no special tokens added."""
    text = tok.apply_chat_template(messages, tokenize=False)
    return len(tok(text, add_special_tokens=False, verbose=False)["input_ids"])


def _text_of_tokens(tok: PreTrainedTokenizerBase, rng: random.Random, tokens: int) -> str:
    """Synthetic sentences cut at the end of their `tokens`-th token."""
    text = ""
    while True:
        # ~4 characters a token or fewer in this corpus: one pass is usually enough.
        while len(text) < 4 * tokens + 16:
            text += sentence(rng) + " "
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = enc["offset_mapping"]
        if len(offsets) > tokens:
            return text[: offsets[tokens - 1][1]].strip()
        text += " ".join(sentence(rng) for _ in range(8)) + " "


def _chat_of_length(tok: PreTrainedTokenizerBase, rng: random.Random, target: int,
                    max_tokens: int) -> tuple[list[dict[str, str]], int]:
    head = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.2 else []
    head.append({"role": "user", "content": question(rng)})
    empty = _length(tok, [*head, {"role": "assistant", "content": ""}])
    content = _text_of_tokens(tok, rng, target - empty) if target > empty else "Yes."
    messages = [*head, {"role": "assistant", "content": content}]
    length = _length(tok, messages)
    while length > max_tokens:  # tokens merged differently inside the template
        over = length - max_tokens
        words = content.split(" ")
        content = " ".join(words[: max(1, len(words) - over)])
        messages[-1] = {"role": "assistant", "content": content}
        length = _length(tok, messages)
    return messages, length
