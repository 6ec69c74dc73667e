"""Synthetic English-like text, seeded: what the tiny tokenizer is trained on and what
the synthetic chats are made of."""

from __future__ import annotations

import random

_WORDS = (  # noqa: SIM905 - a word list reads better as prose
    "the a an this that some every no one two three many few model data token layer "
    "state draft engine shard bucket worker trainer job unit sample batch stream cache "
    "weight vector matrix head block signal river mountain city garden window kitchen "
    "teacher student doctor farmer writer painter engineer pilot sailor runner child "
    "friend neighbour dog cat bird horse fish tree flower stone book letter song story "
    "question answer idea plan reason problem result number word language music light "
    "water fire wind rain snow sun moon star road bridge house door table chair paper "
    "is was will can should might must could would runs reads writes builds makes "
    "takes gives finds keeps moves turns opens closes starts stops learns teaches helps "
    "asks answers explains computes measures checks sends receives stores loads saves "
    "quick slow small large bright dark warm cold early late new old simple careful "
    "quiet loud happy tired clever strange common rare exact rough clear deep "
    "and or but because when while after before if then so yet also still again "
    "in on at by with from to into over under between across through near far "
    "very quite rather almost always often never sometimes today tomorrow here there"
).split()
_QUESTION_STARTS = (
    "Can you explain", "What is", "How does", "Why does", "Tell me about", "Describe",
    "Write a short note on", "Summarize", "Give an example of", "Compare",
)


def sentence(rng: random.Random, lo: int = 3, hi: int = 10) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2048)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....!?;")


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


def question(rng: random.Random) -> str:
    topic = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))
    tail = sentence(rng) if rng.random() < 0.5 else ""
    return f"{rng.choice(_QUESTION_STARTS)} {topic}? {tail}".strip()


def synthetic_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """English-like lines (plus some chat markup) to train the tokenizer on."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 5 == 0:
            lines.append(question(rng))
        else:
            lines.append(paragraph(rng, rng.randint(1, 4)))
    return lines
