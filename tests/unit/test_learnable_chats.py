"""The learnable language as chats: ingestion and regeneration see exactly the token ids
the target was trained on, whatever rule the answers follow."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hsx.ingest import generation_prompt, load_tokenizer, tokenize_conversations
from hsx_workers.learnable import (
    SEP_ID,
    TaskLanguage,
    as_chat,
    write_chat_tokenizer,
    write_language_chats,
)
from hsx_workers.tiny_models import build_tokenizer


def test_chats_tokenize_to_the_language_and_prompts_end_at_sep(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)  # what make_tiny_model leaves, replaced below
    language, other = TaskLanguage(seed=0), TaskLanguage(seed=1)
    write_chat_tokenizer(tmp_path, language)
    tokenizer = load_tokenizer(str(tmp_path))
    assert len(tokenizer) <= 512  # the tiny model's vocabulary
    rng = random.Random(3)
    for lang in (language, other):
        for _ in range(50):
            ids, mask = lang.sample(rng)
            chat = as_chat(ids, mask)
            row = tokenize_conversations(tokenizer, [chat], 256)[0]
            assert not isinstance(row, str), row
            assert row[0].tolist() == ids and row[1].tolist() == mask
            prompt = generation_prompt(tokenizer, chat[:1])
            assert prompt == ids[: mask.index(1)] and prompt[-1] == SEP_ID
            answer = ids[mask.index(1):]
            assert tokenizer.decode(answer) == chat[1]["content"]
    # Two languages share prompts and copies; their maps and chains differ.
    path = write_language_chats(tmp_path / "chats.jsonl", 20, language=other)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20 and all(len(r["messages"]) == 2 for r in rows)
    assert language.word_map != other.word_map and language.successors != other.successors
