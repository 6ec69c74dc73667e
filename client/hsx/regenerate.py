"""Regenerated conversations: which turns the target answers, and with which seed.

A job with `regenerate:` (spec.py) has its engines answer each conversation before
capture. This module holds what the worker, ingestion and readers share, with no
engine in it:

- `sample_seed`: the sampling seed of one sample's turn, derived from the job seed, the
  sample index and the turn, so a retried unit asks vLLM the same question with the same
  seed wherever it runs;
- `Conversation`: one sample's messages as the regeneration walks them, turn by turn
  (`turns: last` or `each`), and the result, with its provenance per turn;
- `Regeneration`: what a worker regenerates with, taken from the admitted job spec and
  handed to it with each unit (never read back from the output, whose files whoever can
  write there controls).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Turns = Literal["last", "each"]

SEED_BITS = 63


@dataclass(frozen=True)
class Regeneration:
    """A job's regeneration as its workers run it: its `regenerate:` section, the
    tokenizer (and whether its own code may run) that renders the conversations, the
    chat template's arguments and the length a conversation is cut to. The driver makes
    it from the job spec that passed the checks (`of`)."""

    settings: dict[str, Any]  # the job's `regenerate:` section
    model: str
    tokenizer: str  # the job's `tokenizer`, else its model
    trust_remote_code: bool
    max_seq_len: int
    chat_template_kwargs: dict[str, Any]

    @property
    def turns(self) -> Turns:
        turns: Turns = self.settings.get("turns", "last")
        return turns

    @classmethod
    def of(cls, spec: Any) -> Regeneration | None:
        """The regeneration of job spec `spec` (a JobSpec), None when it regenerates
        nothing."""
        if spec.regenerate is None:
            return None
        return cls(spec.regenerate.model_dump(mode="json"), spec.model,
                   spec.tokenizer or spec.model, spec.trust_remote_code, spec.max_seq_len,
                   dict(spec.chat_template_kwargs))


def sample_seed(job_seed: int, sample_index: int, turn: int = 0) -> int:
    """The seed of turn `turn` of sample `sample_index`: a hash of the three numbers,
    so seeds of neighbouring samples are unrelated and none depends on the unit plan."""
    if job_seed < 0 or sample_index < 0 or turn < 0:
        raise ValueError(f"seed, sample_index and turn must be >= 0, got "
                         f"{job_seed}, {sample_index}, {turn}")
    digest = hashlib.blake2b(f"hsx-regenerate:{job_seed}:{sample_index}:{turn}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


@dataclass
class GeneratedTurn:
    """What the engine answered for one turn."""

    text: str
    tokens: int
    finish_reason: str  # vLLM's: "stop" (an end token) or "length" (max_tokens)
    seed: int


@dataclass
class Conversation:
    """One sample's conversation while its assistant turns are regenerated.

    `original` is the dataset's conversation (ingestion checked its roles and that it
    has an assistant turn). `next_prompt()` gives the messages the next regenerated
    turn answers (None when every turn is done); `answer()` puts the engine's answer in.
    """

    sample_index: int
    original: list[dict[str, Any]]
    turns: Turns
    done: list[GeneratedTurn] = field(default_factory=list)

    def __post_init__(self) -> None:
        assistant = [i for i, m in enumerate(self.original) if m.get("role") == "assistant"]
        if not assistant:
            raise ValueError(f"sample {self.sample_index}: the conversation has no assistant "
                             "turn to regenerate")
        self._targets = assistant if self.turns == "each" else assistant[-1:]

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self._targets)

    def next_prompt(self) -> list[dict[str, Any]] | None:
        """The history before the next regenerated turn (earlier turns regenerated)."""
        if self.finished:
            return None
        return self.messages()[: self._position(len(self.done))]

    def answer(self, turn: GeneratedTurn) -> None:
        if self.finished:
            raise ValueError(f"sample {self.sample_index}: every turn is already answered")
        self.done.append(turn)

    def _position(self, k: int) -> int:
        """Where regenerated turn k stands in `messages()`."""
        return self._targets[k]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as far as regenerated: answered turns replaced, and nothing
        after the last regenerated turn once all are answered."""
        out = [dict(m) for m in self.original]
        for k, turn in enumerate(self.done):
            out[self._targets[k]] = {**out[self._targets[k]], "content": turn.text}
        if self.finished:
            out = out[: self._targets[-1] + 1]
        return out

    @property
    def truncated(self) -> bool:
        """True when a turn stopped at max_tokens."""
        return any(t.finish_reason == "length" for t in self.done)


def dumps_messages(messages: list[dict[str, Any]]) -> str:
    """A conversation as the tables store it (JSON text)."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def loads_messages(text: str) -> list[dict[str, Any]]:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError("stored messages are not a list")
    return value
