"""A tiny target whose greedy continuation is predictable, for testing drafts end to end.

A random-weight target makes any draft's acceptance meaningless. This one is trained
briefly (a minute or two on CPU) on a synthetic language built so that a capture bug
shows in vLLM's acceptance length instead of hiding:

- Every sample is a prompt (loss mask 0) and a response (loss mask 1), like a chat:
  `BOS TASK w1 .. wn SEP` then the answer.
- **Copying** (TASK = COPY): the answer starts with w1 .. wn again; which word comes next
  is known only from the prompt, so the target has to look back (induction), and a
  draft reads that from the target's hidden states.
- **A fixed word map** (TASK = MAP): the answer starts with f(w1) .. f(wn) for a fixed
  permutation f of the words.
- **A branching Markov chain**: the answer then continues with a chain in which each
  word has three successors (probabilities 0.65 / 0.25 / 0.10), sampled in the data.
  The target's greedy choice is the likeliest successor, but the data shows all three:
  a draft trained on states paired with the wrong token (states one token early or
  late) cannot tell which successor the data took, and learns the wrong thing.
- **Answers that end** (`ends`, for measuring as a server does): the chain's words
  have levels 0 to `levels`; a word's likeliest successor is a word one level lower,
  and a level-0 word's is the end of the turn (EOT). The target's greedy answer then
  ends a few words into its chain (answers of about 1 to 11 tokens); the data's
  sampled answers end where their chain samples EOT.
- **A final norm with outlier weights**: after training, a few dimensions of the final
  norm get weights NORM_OUTLIER times the others, the rest are spread over [1/2, 2],
  and `lm_head`'s columns are divided by the same factors (the model computes the same
  function), as real models' final norms have a few much larger weights. A capture of
  the *normed* last state then distorts the draft's training targets (speculators
  applies the norm again, which multiplies those dimensions once more), as it does on a
  real model, instead of passing unnoticed.

The language also comes as chats (`write_chat_tokenizer`, `write_language_chats`): a
word-level tokenizer whose words are the language's token ids (`copy w16 w40 =>` is
`COPY 16 40 SEP`) and a chat template that renders a user turn as the prompt and an
assistant turn as the answer, so `regenerate:` can have the target answer a chat dataset
whose answers follow another rule.

A permutation chain (this module's former language) hid all of that: the next token was
a fixed function of the current one, so a draft learned it from the token embeddings
alone, whatever the hidden states said.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from hsx_workers.tiny_models import (
    BOS,
    BOS_ID,
    EOT,
    EOT_ID,
    PAD,
    SPECIAL_TOKENS,
    make_tiny_model,
    save_tokenizer,
)

logger = logging.getLogger(__name__)

FIRST_CONTENT_ID = 16
COPY_ID, MAP_ID, CHAIN_ID, SEP_ID = 5, 6, 7, 8  # tokens of the tiny tokenizer, reused
TASKS = (COPY_ID, MAP_ID, CHAIN_ID)
SUCCESSOR_PROBS = (0.65, 0.25, 0.10)
NORM_OUTLIERS = 8  # final-norm dimensions whose weight is multiplied by NORM_OUTLIER
NORM_OUTLIER = 100.0
NORM_SPREAD = 2.0  # the others' by factors in [1/2, 2]


@dataclass(frozen=True)
class TaskLanguage:
    """Prompts of `words` content tokens; answers that copy, map, then follow a chain."""

    size: int = 96
    seed: int = 0
    min_words: int = 3
    max_words: int = 6
    min_chain: int = 6
    max_chain: int = 18
    ends: bool = False
    """Answers end their turn: a chain runs until it samples EOT (at most `max_chain`
    words, then it is cut without one; `min_chain` is not used). Else chains run
    `min_chain` to `max_chain` words and the target never ends a turn."""
    levels: int = 3  # with `ends`: a word's greedy distance to the end of the turn, at most

    @property
    def words(self) -> list[int]:
        return list(range(FIRST_CONTENT_ID, FIRST_CONTENT_ID + self.size))

    @cached_property
    def word_map(self) -> dict[int, int]:
        """f: the fixed word map of MAP answers (a permutation)."""
        return self._permutation(1)

    @cached_property
    def successors(self) -> dict[int, tuple[int, int, int]]:
        """Each word's three successors in the chain, likeliest first (all distinct);
        with `ends`, the likeliest is a word one level lower, or EOT from level 0."""
        rng = random.Random(self.seed * 7919 + 2)
        if self.ends:
            return self._ending_successors(rng)
        out: dict[int, tuple[int, int, int]] = {}
        for w in self.words:
            choices = [v for v in self.words if v != w]
            first, second, third = rng.sample(choices, 3)
            out[w] = (first, second, third)
        return out

    def _ending_successors(self, rng: random.Random) -> dict[int, tuple[int, int, int]]:
        order = self.words
        rng.shuffle(order)
        level = {w: i % (self.levels + 1) for i, w in enumerate(order)}
        lower = {k: [w for w in order if level[w] == k - 1] for k in range(1, self.levels + 1)}
        out: dict[int, tuple[int, int, int]] = {}
        for w in self.words:
            first = rng.choice(lower[level[w]]) if level[w] else EOT_ID
            second, third = rng.sample([v for v in self.words if v not in (w, first)], 2)
            out[w] = (first, second, third)
        return out

    def _permutation(self, salt: int) -> dict[int, int]:
        ids = self.words
        shuffled = ids[:]
        random.Random(self.seed * 7919 + salt).shuffle(shuffled)
        return dict(zip(ids, shuffled, strict=True))

    # -- sampling (the data) and greedy continuation (what the target says)

    def sample(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of one sample: a prompt, then a sampled answer."""
        task = rng.choice(TASKS)
        words = rng.sample(self.words, rng.randint(self.min_words, self.max_words))
        prompt = [BOS_ID, task, *words, SEP_ID]
        answer = self._head(task, words)
        token = answer[-1] if answer else words[-1]
        length = self.max_chain if self.ends else rng.randint(self.min_chain, self.max_chain)
        for _ in range(length):
            token = rng.choices(self.successors[token], SUCCESSOR_PROBS)[0]
            answer.append(token)
            if token == EOT_ID:
                break
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    def _head(self, task: int, words: list[int]) -> list[int]:
        if task == COPY_ID:
            return list(words)
        if task == MAP_ID:
            return [self.word_map[w] for w in words]
        return []

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        """The target's greedy answer to a prompt `BOS TASK w1..wn SEP`: n tokens, or
        fewer where it ends its turn (`ends`)."""
        if len(prompt) < 4 or prompt[-1] != SEP_ID or prompt[1] not in TASKS:
            raise ValueError(f"not a prompt of this language: {prompt}")
        words = prompt[2:-1]
        out = self._head(prompt[1], words)
        token = out[-1] if out else words[-1]
        while len(out) < n and token != EOT_ID:
            token = self.successors[token][0]
            out.append(token)
        return out[:n]

    def greedy_targets(self, ids: list[int]) -> list[int | None]:
        """For each position of a sample, the token the target should predict next
        (None where nothing is determined: the prompt)."""
        start = ids.index(SEP_ID) + 1
        words = ids[2:start - 1]
        return answer_targets(ids, start, words, self._head(ids[1], words),
                              lambda word: self.successors[word][0])

    def as_json(self) -> dict[str, Any]:
        ending = {"ends": True, "levels": self.levels} if self.ends else {}
        return {"kind": "tasks", "size": self.size, "seed": self.seed,
                "min_words": self.min_words, "max_words": self.max_words,
                "min_chain": self.min_chain, "max_chain": self.max_chain, **ending}


def answer_targets(ids: list[int], start: int, words: list[int], head: list[int],
                   successor: Callable[[int], int]) -> list[int | None]:
    """Per position of a sample whose answer starts at `start` (after its prompt's
    `words`), the token a greedy target predicts next: None in the prompt, then the
    answer's `head`, then each token's likeliest `successor` (the chain)."""
    out: list[int | None] = [None] * (start - 1)
    for t in range(start - 1, len(ids) - 1):
        k = t - (start - 1)
        if k < len(head):
            out.append(head[k])
        else:
            out.append(successor(ids[t] if k > 0 else words[-1]))
    return out


def make_learnable_model(
    path: str | Path, *, language: TaskLanguage | None = None, steps: int = 900,
    batch: int = 32, lr: float = 1e-3, num_layers: int = 4, seed: int = 0,
    min_accuracy: float = 0.97,
) -> Path:
    """A tiny Llama trained on `language` until its greedy answers follow it.

    Writes the model like `make_tiny_model` (bf16 safetensors, tokenizer), with the final
    norm spread (see the module docstring), plus `language.json`; raises RuntimeError if
    the target did not learn the language to `min_accuracy` on the determined positions.
    """
    import torch
    from transformers import AutoModelForCausalLM

    language = language or TaskLanguage(seed=seed)
    out = Path(path)
    if (out / "language.json").exists():
        return out
    make_tiny_model(out, "llama", num_layers=num_layers, seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = random.Random(seed)
    for step in range(steps):
        ids, labels = _batch(language, rng, batch)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            logger.info("learnable target: step %d loss %.3f", step, loss.item())
    model.eval()
    _spread_final_norm(model, seed)
    accuracy = greedy_accuracy(model, language, random.Random(seed + 1))
    if accuracy < min_accuracy:
        raise RuntimeError(f"the target learned the language only to {accuracy:.3f} accuracy")
    model = model.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    model.save_pretrained(out)
    (out / "language.json").write_text(json.dumps(
        {**language.as_json(), "steps": steps, "greedy_accuracy": accuracy}))
    return out


def _batch(language: TaskLanguage, rng: random.Random, n: int) -> tuple[Any, Any]:
    """Padded (input_ids, labels): the loss covers answers only, as in the data.

    Half the rows have chains of 1-3 words: the copied and mapped words, which need the
    target to look back (induction, learnt late), then weigh as much in the loss as the
    chain (learnt early), and the target learns them in a few hundred steps.
    """
    import dataclasses

    import torch

    short = dataclasses.replace(language, min_chain=1, max_chain=3)
    rows = [(language if i % 2 else short).sample(rng) for i in range(n)]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((n, width), BOS_ID, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(
            [tok if m else -100 for tok, m in zip(row, mask, strict=True)])
    return ids, labels


def _spread_final_norm(model: Any, seed: int) -> None:
    """Give the final norm a few outlier weights (NORM_OUTLIER times) and spread the
    others over [1/NORM_SPREAD, NORM_SPREAD], dividing lm_head's columns by the same
    factors: the same function, a real model's kind of norm."""
    import torch

    norm = model.model.norm.weight
    head = model.lm_head.weight
    gen = torch.Generator().manual_seed(seed + 17)
    factors = torch.exp((torch.rand(norm.shape[0], generator=gen) * 2 - 1)
                        * math.log(NORM_SPREAD))
    outliers = torch.randperm(norm.shape[0], generator=gen)[:NORM_OUTLIERS]
    factors[outliers] = NORM_OUTLIER
    with torch.no_grad():
        norm.mul_(factors)
        head.div_(factors)


def greedy_accuracy(model: Any, language: TaskLanguage, rng: random.Random,
                    n: int = 128) -> float:
    """How often the model's argmax is the language's determined next token."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for _ in range(n // 32):
            rows = [language.sample(rng)[0] for _ in range(32)]
            ids, _ = _batch_of(rows)
            pred = model(input_ids=ids).logits.argmax(-1)
            for i, row in enumerate(rows):
                for t, want in enumerate(language.greedy_targets(row)):
                    if want is not None:
                        total += 1
                        hits += int(pred[i, t]) == want
    return hits / total if total else 0.0


def _batch_of(rows: list[list[int]]) -> tuple[Any, int]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), BOS_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids, width


def write_language_dataset(
    path: str | Path, n: int, *, language: TaskLanguage, seed: int = 1
) -> Path:
    """JSONL of `input_ids` + `loss_mask` rows in `language` (answers are the targets)."""
    rng = random.Random(seed)
    out = Path(path)
    with out.open("w") as f:
        for _ in range(n):
            ids, mask = language.sample(rng)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return out


def language_of(model_dir: str | Path) -> TaskLanguage:
    info = json.loads((Path(model_dir) / "language.json").read_text())
    fields = {k: int(info[k]) for k in ("size", "seed", "min_words", "max_words",
                                        "min_chain", "max_chain")}
    return TaskLanguage(**fields, ends=bool(info.get("ends", False)),
                        levels=int(info.get("levels", TaskLanguage.levels)))


# --------------------------------------------------------------------------- as chats

TASK_WORDS = {COPY_ID: "copy", MAP_ID: "map", CHAIN_ID: "chain"}
SEP_WORD = "=>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + message['content'] | trim }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim }}{{ ' =>' }}"
    "{% endif %}"
    "{% endfor %}"
)
"""A user turn is the prompt (`BOS TASK words SEP`), an assistant turn the answer; the
generation prompt adds nothing (SEP already ends the user turn)."""


def _word(token: int) -> str:
    if token in TASK_WORDS:
        return TASK_WORDS[token]
    if token == SEP_ID:
        return SEP_WORD
    return f"w{token}"


def write_chat_tokenizer(model_dir: str | Path, language: TaskLanguage, *,
                         template: str = CHAT_TEMPLATE,
                         image_token: tuple[str, int] | None = None) -> Path:
    """Give a learnable target a word-level tokenizer over its language's ids and
    `template` (replacing the byte-level one `make_tiny_model` wrote); `image_token`
    (its text and id: the image twin's, learnable_vision.py) is a special token too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for token in (*TASK_WORDS, SEP_ID, *language.words):
        vocab[_word(token)] = token
    vocab["<unk>"] = max(vocab.values()) + 1
    specials = list(SPECIAL_TOKENS)
    if image_token is not None:
        vocab[image_token[0]] = image_token[1]
        specials.append(image_token[0])
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOT, pad_token=PAD,
        unk_token="<unk>", model_max_length=8192, clean_up_tokenization_spaces=False,
        additional_special_tokens=specials[len(SPECIAL_TOKENS):],
    )
    tokenizer.chat_template = template
    out = Path(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    save_tokenizer(tokenizer, out)
    return out


def as_chat(ids: list[int], loss_mask: list[int]) -> list[dict[str, str]]:
    """One sample of the language (`TaskLanguage.sample`) as a user and an assistant turn."""
    start = loss_mask.index(1)
    if ids[0] != BOS_ID or ids[start - 1] != SEP_ID:
        raise ValueError(f"not a sample of the language: {ids}")
    return [{"role": "user", "content": " ".join(_word(t) for t in ids[1:start - 1])},
            {"role": "assistant", "content": " ".join(_word(t) for t in ids[start:])}]


def write_language_chats(path: str | Path, n: int, *, language: TaskLanguage,
                         seed: int = 1) -> Path:
    """JSONL of chats (`messages`) whose answers follow `language`'s rules."""
    rng = random.Random(seed)
    out = Path(path)
    with out.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"messages": as_chat(*language.sample(rng))}) + "\n")
    return out
