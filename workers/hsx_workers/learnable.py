"""A tiny target whose next token is predictable, for testing drafts end to end.

A random-weight target makes any draft's acceptance meaningless. This one is trained
briefly (a minute on CPU) on a synthetic language: every sequence starts at a random
content token and then follows a fixed permutation of the content tokens (token t is
always followed by `perm[t]`). Once the target has learned it, its greedy continuation
of any prompt is that chain, so a draft that learned from the target's hidden states
can be accepted k tokens out of k; a capture bug (wrong layer, the final state after
the norm, misaligned tokens) shows as a drop in vLLM's acceptance length.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_workers.tiny_models import BOS_ID, make_tiny_model

logger = logging.getLogger(__name__)

FIRST_CONTENT_ID = 16


@dataclass(frozen=True)
class ChainLanguage:
    """Sequences that follow a fixed permutation of `size` content tokens."""

    size: int = 128
    seed: int = 0

    @property
    def perm(self) -> dict[int, int]:
        ids = list(range(FIRST_CONTENT_ID, FIRST_CONTENT_ID + self.size))
        shuffled = ids[:]
        random.Random(self.seed).shuffle(shuffled)
        return dict(zip(ids, shuffled, strict=True))

    def sequence(self, rng: random.Random, length: int) -> list[int]:
        perm = self.perm
        token = rng.randrange(FIRST_CONTENT_ID, FIRST_CONTENT_ID + self.size)
        out = [BOS_ID, token]
        while len(out) < length:
            token = perm[token]
            out.append(token)
        return out

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        perm, token, out = self.perm, prompt[-1], []
        for _ in range(n):
            token = perm[token]
            out.append(token)
        return out


def make_learnable_model(
    path: str | Path, *, language: ChainLanguage | None = None, steps: int = 300,
    seq_len: int = 48, batch: int = 32, lr: float = 3e-3, num_layers: int = 4, seed: int = 0,
) -> Path:
    """A tiny Llama trained on `language` until its greedy next token follows it.

    Writes the model like `make_tiny_model` (bf16 safetensors, tokenizer) plus
    `language.json`; raises RuntimeError if the target did not learn the chain.
    """
    import torch
    from transformers import AutoModelForCausalLM

    language = language or ChainLanguage(seed=seed)
    out = Path(path)
    if (out / "language.json").exists():
        return out
    make_tiny_model(out, "llama", num_layers=num_layers, seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    for step in range(steps):
        ids = torch.tensor([language.sequence(rng, seq_len) for _ in range(batch)])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            logger.info("learnable target: step %d loss %.3f", step, loss.item())
    model.eval()
    accuracy = _chain_accuracy(model, language, rng)
    if accuracy < 0.99:
        raise RuntimeError(f"the target learned the chain only to {accuracy:.3f} accuracy")
    model = model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    model.save_pretrained(out)
    (out / "language.json").write_text(json.dumps(
        {"size": language.size, "seed": language.seed, "steps": steps,
         "greedy_accuracy": accuracy}))
    return out


def _chain_accuracy(model: Any, language: ChainLanguage, rng: random.Random) -> float:
    import torch

    ids = torch.tensor([language.sequence(rng, 32) for _ in range(64)])
    with torch.no_grad():
        pred = model(input_ids=ids).logits.argmax(-1)
    # Position 1 onwards: the token after a content token is determined.
    return float((pred[:, 1:-1] == ids[:, 2:]).float().mean())


def write_language_dataset(
    path: str | Path, n: int, *, language: ChainLanguage, seq_len: int = 64, seed: int = 1
) -> Path:
    """JSONL of `input_ids` rows in `language` (every token is a training target)."""
    rng = random.Random(seed)
    out = Path(path)
    with out.open("w") as f:
        for _ in range(n):
            length = rng.randrange(seq_len // 2, seq_len + 1)
            f.write(json.dumps({"input_ids": language.sequence(rng, length)}) + "\n")
    return out


def language_of(model_dir: str | Path) -> ChainLanguage:
    info = json.loads((Path(model_dir) / "language.json").read_text())
    return ChainLanguage(size=int(info["size"]), seed=int(info["seed"]))
