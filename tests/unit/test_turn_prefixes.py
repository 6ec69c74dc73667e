"""Turn prefixes tokenized from the full text's last added token (tokenizer.py,
`_prefix_ids`): the same token ids, so the same loss masks, as each prefix tokenized
whole, which is what defines them; and a cut that would differ is caught."""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx.ingest import load_tokenizer
from hsx.ingest import tokenizer as tokenizing
from hsx.ingest.rows import Chat, classify
from hsx_workers.tiny_models.chat_datasets import _conversation

# Role and content with no separator: BPE merges across the turn boundary, so some
# prefixes are not token prefixes of the chat (the offsets decide those masks).
RUN_TOGETHER = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}{{ m['content'] }}"
                "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>"
                "assistant{% endif %}")


def _variant(src: Path, dst: Path, *, template: str | None = None,
             rstrip: str | None = None) -> Any:
    """The tiny tokenizer with another template, or with one added token that swallows
    the whitespace after it (no point to cut at)."""
    shutil.copytree(src, dst)
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    if rstrip is not None:
        config = json.loads((dst / "tokenizer.json").read_text())
        for token in config["added_tokens"]:
            if token["content"] == rstrip:
                token["rstrip"] = True
        (dst / "tokenizer.json").write_text(json.dumps(config))
    return load_tokenizer(str(dst))


@pytest.fixture(scope="module")
def chats(tiny_tokenizer: Path) -> list[Chat]:
    rng = random.Random(3)
    vocab = len(load_tokenizer(str(tiny_tokenizer)))
    out = [classify({"messages": _conversation(rng, i)}, vocab) for i in range(300)]
    # Contents with the whitespace that templates and cuts treat differently.
    out.append(classify({"messages": [
        {"role": "user", "content": "  spaced  \n\n"},
        {"role": "assistant", "content": "\n\nanswer with a trailing newline\n"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": " x"}]}, vocab))
    assert all(isinstance(c, Chat) for c in out)
    return out  # type: ignore[return-value]


@pytest.fixture()
def whole() -> Iterator[set[int]]:
    """The set of tokenizers whose prefixes are tokenized whole, restored afterwards."""
    before = set(tokenizing._WHOLE_PREFIXES)
    yield tokenizing._WHOLE_PREFIXES
    tokenizing._WHOLE_PREFIXES.clear()
    tokenizing._WHOLE_PREFIXES.update(before)


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, str) or isinstance(y, str):
            assert x == y
        else:
            np.testing.assert_array_equal(x.input_ids, y.input_ids)
            np.testing.assert_array_equal(x.loss_mask, y.loss_mask)


@pytest.mark.parametrize("variant", ["default", "run-together", "rstrip"])
def test_cut_prefixes_give_the_masks_of_whole_prefixes(
        variant: str, tiny_tokenizer: Path, tmp_path: Path, chats: list[Chat],
        whole: set[int]) -> None:
    tok = _variant(tiny_tokenizer, tmp_path / "tok",
                   template=RUN_TOGETHER if variant == "run-together" else None,
                   rstrip="<|end_header_id|>" if variant == "rstrip" else None)
    fast = tokenizing.chat_samples(tok, chats, {})
    assert id(tok) not in whole, "the cut was refused: the check found a difference"
    whole.add(id(tok))
    _same(fast, tokenizing.chat_samples(tok, chats, {}))
    assert any(not isinstance(s, str) and s.loss_mask.any() for s in fast)


def test_cut_prefixes_are_short_to_tokenize(tiny_tokenizer: Path, chats: list[Chat],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What is tokenized for the prefixes is what follows their last added token (a
    handful of characters), not the prefixes again."""
    tok = load_tokenizer(str(tiny_tokenizer))
    seen: list[int] = []
    encode = tokenizing.encode

    def counting(tokenizer: Any, texts: list[str], *, special: bool) -> list[list[int]]:
        seen.append(sum(map(len, texts)))
        return encode(tokenizer, texts, special=special)

    monkeypatch.setattr(tokenizing, "encode", counting)
    tokenizing.chat_samples(tok, chats, {})
    rendered = sum(len(tokenizing._render_chat(tok, c, {}).text) for c in chats)
    assert seen and sum(seen) < rendered / 4


def test_a_cut_that_differs_is_caught(tiny_tokenizer: Path, whole: set[int],
                                      caplog: pytest.LogCaptureFixture) -> None:
    """A split point where the tokenizer does not split (inside a token): the checked
    prefixes differ, and every prefix is tokenized whole from then on."""
    tok = load_tokenizer(str(tiny_tokenizer))
    text = "<|start_header_id|>user<|end_header_id|>\n\nunderstanding<|eot_id|>"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    k = next(i for i, (s, e) in enumerate(enc["offset_mapping"]) if e - s >= 2
             and s >= text.index("understanding"))
    wrong = [(enc["offset_mapping"][k][0] + 1, k)]  # as if the tokenizer split there
    prefix = text[: text.index("<|eot_id|>")]
    with caplog.at_level(logging.WARNING, logger="hsx.ingest.tokenizer"):
        got = tokenizing._prefix_ids(tok, [(prefix, ids, wrong), (text, ids, wrong)])
    assert got == tokenizing.encode(tok, [prefix, text], special=False)
    assert id(tok) in whole
    assert "tokenizes each turn prefix whole" in caplog.text
