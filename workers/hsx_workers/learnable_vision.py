"""The learnable target's vision-language twin: a tiny Llava whose replies depend on the
image, for measuring what image prompts are worth to a draft.

A text prompt `BOS TASK w1..wn SEP` is answered as the text target answers it
(learnable.py: copy or map, then the branching chain). An image prompt
`BOS <image> TASK w1..wn SEP` (the placeholder becomes the image's 16 vision tokens) is
answered by the rule of the image's colour, one of `COLOURS`:

- the head maps each word through the colour's own permutation (COPY and MAP alike),
  so the next word is known only from the prompt and the image together;
- the chain's likeliest successor is the colour's: of each word's three successors
  (the text language's), colour k puts 0.65 on successor k, the others on the rest.

So a draft that never saw an image prompt proposes the text rule where the image says
otherwise (the head, and the chain for two colours of three), unless it reads the
colour from the target's states at the answer's positions. The images are small PNGs
of one colour in a shape, of several sizes: the colour is what the tower must see.

`make_learnable_vision_model` trains it (the whole Llava: tower, projector and text
model, in transformers on CPU, a few minutes); `write_vision_chats` writes chats of it
with a share of image prompts, the images as files beside them.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from hsx_workers.learnable import (
    CHAIN_ID,
    COPY_ID,
    MAP_ID,
    SEP_ID,
    SUCCESSOR_PROBS,
    TASKS,
    TaskLanguage,
    _word,
    answer_targets,
    write_chat_tokenizer,
)
from hsx_workers.tiny_models import BOS_ID, make_tiny_model
from hsx_workers.tiny_models.vision import LLAVA_IMAGE_TOKEN, LLAVA_IMAGE_TOKENS, write_png

logger = logging.getLogger(__name__)

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 70), "blue": (50, 70, 220)}
SHAPES = ("square", "disc", "cross")
SIZES = ((56, 56), (64, 48), (48, 72), (90, 60))
IMAGE_ID = 511  # the tiny Llava's <image>: its vocabulary's last id


@dataclass(frozen=True)
class VisionLanguage:
    """TaskLanguage's prompts, answered by an image's colour when they hold one."""

    text: TaskLanguage = field(default_factory=TaskLanguage)

    @property
    def colours(self) -> list[str]:
        return list(COLOURS)

    @cached_property
    def colour_maps(self) -> list[dict[int, int]]:
        """Each colour's permutation of the words (none is the text's word map)."""
        return [self.text._permutation(10 + k) for k in range(len(COLOURS))]

    def successor(self, word: int, colour: int, rank: int = 0) -> int:
        """The rank-th likeliest successor of `word` under `colour`."""
        options = self.text.successors[word]
        return options[(colour + rank) % len(options)]

    def sample(self, rng: random.Random, colour: int | None
               ) -> tuple[list[int], list[int]]:
        """(input_ids with one placeholder for an image, loss mask): a text sample
        (colour None, TaskLanguage's) or one of an image of `colour`."""
        if colour is None:
            return self.text.sample(rng)
        lang = self.text
        task = rng.choice(TASKS)
        words = rng.sample(lang.words, rng.randint(lang.min_words, lang.max_words))
        prompt = [BOS_ID, IMAGE_ID, task, *words, SEP_ID]
        answer = self._head(task, words, colour)
        token = answer[-1] if answer else words[-1]
        for _ in range(rng.randint(lang.min_chain, lang.max_chain)):
            rank = rng.choices(range(3), SUCCESSOR_PROBS)[0]
            token = self.successor(token, colour, rank)
            answer.append(token)
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    def _head(self, task: int, words: list[int], colour: int) -> list[int]:
        if task in (COPY_ID, MAP_ID):
            return [self.colour_maps[colour][w] for w in words]
        return []

    def greedy_targets(self, ids: list[int], colour: int | None) -> list[int | None]:
        """Per position of a sample (its placeholder expanded or not), the token the
        target should predict next; None where nothing is determined."""
        if colour is None:
            return self.text.greedy_targets(ids)
        start = ids.index(SEP_ID) + 1
        task_at = max(i for i, t in enumerate(ids[:start]) if t == IMAGE_ID) + 1
        words = ids[task_at + 1:start - 1]
        return answer_targets(ids, start, words, self._head(ids[task_at], words, colour),
                              lambda word: self.successor(word, colour))

    def as_json(self) -> dict[str, Any]:
        return {"kind": "vision-tasks", "text": self.text.as_json(), "colours": COLOURS}


def image_path(folder: Path, colour: int, variant: int) -> Path:
    """One of the pool of images of `colour`: a shape and a size (`variant`)."""
    name = list(COLOURS)[colour]
    path = folder / f"{name}-{variant:02d}.png"
    if not path.exists():
        shape = SHAPES[variant % len(SHAPES)]
        size = SIZES[(variant // len(SHAPES)) % len(SIZES)]
        write_png(path, COLOURS[name], shape, size)
    return path


IMAGE_VARIANTS = len(SHAPES) * len(SIZES)


WORDS = 32  # the language's words: fewer than the text target's 96, learnt sooner


def make_learnable_vision_model(
    path: str | Path, *, language: VisionLanguage | None = None, steps: int = 2000,
    batch: int = 32, lr: float = 1e-3, num_layers: int = 4, seed: int = 0,
    min_accuracy: float = 0.95,
) -> Path:
    """A tiny Llava trained until its greedy answers follow `language`, text and image
    prompts alike; RuntimeError if it did not reach `min_accuracy` on either. Written as
    `make_tiny_model` writes Llava (vLLM's layout, its processor), with the word-level
    chat tokenizer of the language (`<image>` its image token), and `language.json`.

    The vision tower keeps its random (seeded) weights: its features of images of
    different colours differ already, and the projector and the text model learn to
    read them (a backward pass through the tower would double a step's cost). Measured
    on the 2-core machine, loaded, one torch thread: 2,000 steps in 42 min, greedy
    accuracy 1.0 on text and on image prompts (1,200 steps of 64 words: 0.82 / 0.78)."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    language = language or VisionLanguage(TaskLanguage(size=WORDS, seed=seed))
    out = Path(path)
    if (out / "language.json").exists():
        return out
    make_tiny_model(out, "llava", num_layers=num_layers, seed=seed)
    write_vision_chat_tokenizer(out, language.text)
    processor = AutoProcessor.from_pretrained(str(out))
    images = out / "training-images"
    images.mkdir(exist_ok=True)
    pixels = {(c, v): processor.image_processor(
        images=[_rgb(image_path(images, c, v))], return_tensors="pt")["pixel_values"][0]
        for c in range(len(COLOURS)) for v in range(IMAGE_VARIANTS)}
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pixels = {key: value.to(device) for key, value in pixels.items()}
    model: Any = LlavaForConditionalGeneration.from_pretrained(
        str(out), dtype=torch.float32).to(device)
    model.train()
    model.model.vision_tower.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = random.Random(seed)
    for step in range(steps):
        inputs = {k: v.to(device) for k, v in _batch(language, rng, batch, pixels,
                                                     labels=True).items()}
        loss = model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            logger.info("learnable vision target: step %d loss %.3f", step, loss.item())
    model.eval()
    accuracy = {kind: greedy_accuracy(model, language, random.Random(seed + 1), pixels,
                                      images=kind == "image") for kind in ("text", "image")}
    if min(accuracy.values()) < min_accuracy:
        raise RuntimeError(f"the target learned the language only to {accuracy}")
    from hsx_workers.tiny_models.vision import save_llava

    model = model.to(device="cpu", dtype=torch.bfloat16)
    save_llava(model, out)
    (out / "language.json").write_text(json.dumps(
        {**language.as_json(), "steps": steps, "greedy_accuracy": accuracy}))
    return out


def _rgb(path: Path) -> Any:
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


def _expanded(ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """A sample with its placeholder expanded into the image's vision tokens."""
    if IMAGE_ID not in ids:
        return ids, mask
    at = ids.index(IMAGE_ID)
    return (ids[:at] + [IMAGE_ID] * LLAVA_IMAGE_TOKENS + ids[at + 1:],
            mask[:at] + [0] * LLAVA_IMAGE_TOKENS + mask[at + 1:])


def _batch(language: VisionLanguage, rng: random.Random, n: int,
           pixels: dict[tuple[int, int], Any], *, labels: bool) -> dict[str, Any]:
    """Padded inputs of n samples, half of them image prompts: input_ids (expanded),
    attention mask, the images' pixel values, and labels on the answers."""
    import dataclasses

    import torch

    short = dataclasses.replace(language.text, min_chain=1, max_chain=3)
    mixed = VisionLanguage(short)
    rows, images = [], []
    for i in range(n):
        colour = rng.randrange(len(COLOURS)) if i % 2 else None
        ids, mask = (language if i % 4 < 2 else mixed).sample(rng, colour)
        rows.append(_expanded(ids, mask))
        if colour is not None:
            images.append(pixels[(colour, rng.randrange(IMAGE_VARIANTS))])
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.full((n, width), BOS_ID, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    label_t = torch.full((n, width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(rows):
        ids_t[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        label_t[i, :len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask,
                                                                               strict=True)])
    out: dict[str, Any] = {"input_ids": ids_t, "attention_mask": attention,
                           "pixel_values": torch.stack(images)}
    if labels:
        out["labels"] = label_t
    return out


def greedy_accuracy(model: Any, language: VisionLanguage, rng: random.Random,
                    pixels: dict[tuple[int, int], Any], *, images: bool, n: int = 96
                    ) -> float:
    """How often the model's argmax is the language's determined next token, on text
    prompts or on image prompts."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for _ in range(n // 32):
            samples = []
            for _ in range(32):
                colour = rng.randrange(len(COLOURS)) if images else None
                ids, _ = _expanded(*language.sample(rng, colour))
                samples.append((ids, colour))
            width = max(len(ids) for ids, _ in samples)
            ids_t = torch.full((32, width), BOS_ID, dtype=torch.long)
            for i, (ids, _) in enumerate(samples):
                ids_t[i, :len(ids)] = torch.tensor(ids)
            extra: dict[str, Any] = {}
            if images:
                extra["pixel_values"] = torch.stack([
                    pixels[(c, rng.randrange(IMAGE_VARIANTS))] for _, c in samples
                    if c is not None])
            device = next(model.parameters()).device
            pred = model(input_ids=ids_t.to(device),
                         **{k: v.to(device) for k, v in extra.items()}).logits.argmax(-1)
            for i, (ids, colour) in enumerate(samples):
                for t, want in enumerate(language.greedy_targets(ids, colour)):
                    if want is not None:
                        total += 1
                        hits += int(pred[i, t]) == want
    return hits / total if total else 0.0


# --------------------------------------------------------------------------- as chats

VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ ' ' + message['content'] | trim }}{% endgeneration %}"
    "{% elif message['content'] is string %}"
    "{{ message['content'] | trim }}{{ ' =>' }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + LLAVA_IMAGE_TOKEN + " ' }}"
    "{% else %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{{ ' =>' }}"
    "{% endif %}"
    "{% endfor %}"
)
"""learnable.CHAT_TEMPLATE, with a user turn's content also as parts: an image part is
`<image>` before the prompt's words."""


def write_vision_chat_tokenizer(model_dir: str | Path, language: TaskLanguage) -> Path:
    """The learnable target's word-level tokenizer with `<image>` (the Llava's image
    token, IMAGE_ID) and VISION_CHAT_TEMPLATE."""
    return write_chat_tokenizer(model_dir, language, template=VISION_CHAT_TEMPLATE,
                                image_token=(LLAVA_IMAGE_TOKEN, IMAGE_ID))


def as_vision_chat(ids: list[int], mask: list[int], image: str | None
                   ) -> list[dict[str, Any]]:
    """A sample of the language as a user turn (with its image, by path, when it has
    one) and an assistant turn."""
    start = mask.index(1)
    prompt = [t for t in ids[1:start - 1] if t != IMAGE_ID]
    words = " ".join(_word(t) for t in prompt)
    user: str | list[dict[str, Any]] = words
    if image is not None:
        user = [{"type": "image_url", "image_url": {"url": image}},
                {"type": "text", "text": words}]
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": " ".join(_word(t) for t in ids[start:])}]


def write_vision_chats(path: str | Path, n: int, *, language: VisionLanguage,
                       image_share: float, seed: int = 1) -> Path:
    """JSONL of `n` chats of the language, `image_share` of them image prompts (their
    images in `<stem>-images/` beside the file, by relative path)."""
    out = Path(path)
    folder = out.parent / f"{out.stem}-images"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with out.open("w") as f:
        for _ in range(n):
            colour = rng.randrange(len(COLOURS)) if rng.random() < image_share else None
            ids, mask = language.sample(rng, colour)
            image = None
            if colour is not None:
                picture = image_path(folder, colour, rng.randrange(IMAGE_VARIANTS))
                image = f"{folder.name}/{picture.name}"
            f.write(json.dumps({"messages": as_vision_chat(ids, mask, image)}) + "\n")
    return out


def language_of(model_dir: str | Path) -> VisionLanguage:
    info = json.loads((Path(model_dir) / "language.json").read_text())
    text = info["text"]
    size, seed, min_words, max_words, min_chain, max_chain = (int(text[k]) for k in (
        "size", "seed", "min_words", "max_words", "min_chain", "max_chain"))
    return VisionLanguage(TaskLanguage(size=size, seed=seed, min_words=min_words,
                                       max_words=max_words, min_chain=min_chain,
                                       max_chain=max_chain))


__all__ = ["CHAIN_ID", "COLOURS", "VisionLanguage", "language_of",
           "make_learnable_vision_model", "write_vision_chats"]
