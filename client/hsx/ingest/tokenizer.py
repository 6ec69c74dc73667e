"""The tokenizer ingestion uses, its fingerprint, and chats rendered with its chat
template into token ids and a loss mask on what each assistant turn produces.

A chat's renderings (the chat and its turn prefixes) are bounded by limits.py: their
CPU time together (`HSX_TEMPLATE_SECONDS`) and each one's size (`HSX_MAX_ROW_BYTES`).
A row past either is a bad row (`TemplateLimitError`'s message is its reason)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hsx.ingest.limits import (
    MAX_ROW_BYTES_ENV,
    TEMPLATE_SECONDS_ENV,
    TIMED_OUT_ROWS,
    IngestLimits,
    RenderTimeout,
    text_bytes,
    time_limit,
)
from hsx.ingest.rows import Chat, Sample, not_unicode
from hsx.progress import human_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

NO_TEMPLATE = "the tokenizer has no chat template, so the conversation cannot be rendered"


def load_tokenizer(tokenizer_path: str, *, trust_remote_code: bool = False
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer ingestion uses (transformers' AutoTokenizer, imported here)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)


_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json",
)
_TOKENIZER_GLOBS = ("*.tiktoken", "additional_chat_templates/*.jinja")


def tokenizer_fingerprint(tokenizer_path: str | Path, *,
                          tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """Short sha256 of what decides tokenization: vocab/merges files and chat template.

    For a local directory the files are hashed (no tokenizer is loaded). For a hub id
    the loaded tokenizer's serialized form and chat template are hashed instead.
    """
    digest = hashlib.sha256()
    path = Path(tokenizer_path).expanduser()
    if path.is_dir():
        files = [path / name for name in _TOKENIZER_FILES if (path / name).is_file()]
        for pattern in _TOKENIZER_GLOBS:
            files.extend(sorted(path.glob(pattern)))
        if not files:
            names = ", ".join(_TOKENIZER_FILES[:3])
            raise FileNotFoundError(f"{path} holds no tokenizer files ({names}, ...)")
        for f in files:
            digest.update(f.relative_to(path).as_posix().encode() + b"\0")
            digest.update(f.read_bytes())
        return digest.hexdigest()[:16]
    tok = tokenizer or load_tokenizer(str(tokenizer_path))
    backend = getattr(tok, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else
                  json.dumps(sorted(tok.get_vocab().items())).encode())
    digest.update(b"\0" + str(getattr(tok, "chat_template", None) or "").encode())
    return digest.hexdigest()[:16]


class TemplateFailure(Exception):
    pass


class TemplateLimitError(TemplateFailure):
    """The chat template passed a limit of limits.py on a row: it took more than
    `HSX_TEMPLATE_SECONDS` of CPU, rendered more than `HSX_MAX_ROW_BYTES`, or ran out of
    memory. The message says which, of "the row" (a bad row's reason) or of the rows
    `of` names."""

    def __init__(self, problem: str, row: str = "the row") -> None:
        super().__init__(problem, row)
        self.problem, self.row = problem, row

    def __str__(self) -> str:
        return f"the chat template {self.problem.format(row=self.row)}"

    def of(self, row: str) -> TemplateLimitError:
        """The same limit, said of `row` ("one row of the dataset")."""
        return type(self)(self.problem, row)


class TemplateTimeout(TemplateLimitError):
    """The chat template took more than `HSX_TEMPLATE_SECONDS` of CPU on a row."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
            generation_prompt: bool, kwargs: dict[str, Any], max_bytes: int) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except MemoryError:
        raise TemplateLimitError("ran out of memory rendering {row}") from None
    if not isinstance(text, str):
        raise TemplateFailure(f"the chat template returned {type(text).__name__}, not text")
    size = text_bytes(text, max_bytes)
    if size > max_bytes:
        raise TemplateLimitError(
            f"rendered {{row}} as {human_bytes(size)} of text, over the "
            f"{human_bytes(max_bytes)} limit ({MAX_ROW_BYTES_ENV})")
    return text


def timed_out(seconds: float, row: str = "the row") -> TemplateTimeout:
    """The chat template took more than `seconds` of CPU to render `row`."""
    return TemplateTimeout(
        f"took more than {seconds:g} s to render {{row}} ({TEMPLATE_SECONDS_ENV})", row)


@dataclass
class _Rendered:
    """A chat rendered as text, with the character span of each assistant turn."""

    text: str
    # Per assistant turn: (prefix ending where the turn starts, prefix ending where it
    # ends) when rendering prefixes gives prefixes of the full text; else None.
    prefixes: list[tuple[str, str]] | None
    spans: list[tuple[int, int]] = field(default_factory=list)


def _render_chat(tokenizer: PreTrainedTokenizerBase, chat: Chat, kwargs: dict[str, Any],
                 limits: IngestLimits | None = None) -> _Rendered:
    """`_render_turns` within the limits on a row's renderings (`limits`, else this
    process's)."""
    limits = limits or IngestLimits.from_env()
    try:
        with time_limit(limits.template_seconds):
            return _render_turns(tokenizer, chat, kwargs, limits.row_bytes)
    except RenderTimeout:
        raise timed_out(limits.template_seconds) from None


def _render_turns(tokenizer: PreTrainedTokenizerBase, chat: Chat, kwargs: dict[str, Any],
                  max_bytes: int) -> _Rendered:
    """Render a chat and locate what each assistant turn produces, in characters.

    Preferred: the turn starts where `render(messages[:i], add_generation_prompt=True)`
    ends and stops where `render(messages[:i+1])` ends, so the mask covers what the model
    generates in that turn (content and end-of-turn token), whatever the template. Some
    templates render earlier turns differently once later ones exist (e.g. dropping
    reasoning); then the prefixes are not prefixes of the full text, and the span is the
    assistant content found in the rendered text.
    """
    try:
        full = _render(tokenizer, chat.messages, False, kwargs, max_bytes)
    except TemplateFailure:
        raise
    except Exception as err:  # a template raises anything (jinja errors, raise_exception)
        raise TemplateFailure(f"the chat template failed: {type(err).__name__}: {err}"
                               ) from err
    problem = not_unicode(full)
    if problem:
        raise TemplateFailure(f"the rendered chat {problem}")
    prefixes = _turn_prefixes(tokenizer, chat, full, kwargs, max_bytes)
    if prefixes is None:
        return _Rendered(full, None, _find_contents(full, chat))
    return _Rendered(full, prefixes, [(len(start), len(end)) for start, end in prefixes])


def _turn_prefixes(tokenizer: PreTrainedTokenizerBase, chat: Chat, full: str,
                   kwargs: dict[str, Any], max_bytes: int) -> list[tuple[str, str]] | None:
    """Per assistant turn, the renderings that end where it starts and where it ends;
    None when they are not prefixes of the full rendering."""
    prefixes = []
    for i in chat.assistant:
        try:
            start = _render(tokenizer, chat.messages[:i], True, kwargs, max_bytes)
            # A chat's last turn ends it: that rendering is the full one.
            end = (full if i + 1 == len(chat.messages)
                   else _render(tokenizer, chat.messages[: i + 1], False, kwargs, max_bytes))
        except TemplateLimitError:
            raise
        except Exception:  # e.g. a template that refuses a conversation without a user turn
            return None
        if not (len(start) <= len(end) and full.startswith(start) and full.startswith(end)):
            return None  # (prefixes of `full`, checked as Unicode with it)
        prefixes.append((start, end))
    return prefixes


def _find_contents(full: str, chat: Chat) -> list[tuple[int, int]]:
    spans = []
    cursor = 0
    for i in chat.assistant:
        content = chat.messages[i]["content"]
        for needle in (content, content.strip()):
            pos = full.find(needle, cursor) if needle else -1
            if pos >= 0:
                spans.append((pos, pos + len(needle)))
                cursor = pos + len(needle)
                break
        else:
            raise TemplateFailure(
                f"assistant message {i} does not appear in the rendered chat text, so its "
                "tokens cannot be located"
            )
    return spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]],
                       n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=np.uint8)
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=n)
    ends = np.fromiter((e for _, e in offsets), dtype=np.int64, count=n)
    for lo, hi in spans:
        mask[(starts < hi) & (ends > lo) & (ends > starts)] = 1
    return mask


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], *, special: bool
            ) -> list[list[int]]:
    if not texts:
        return []
    return list(tokenizer(texts, add_special_tokens=special, return_attention_mask=False,
                          verbose=False)["input_ids"])


def _encode_with_offsets(tokenizer: PreTrainedTokenizerBase, texts: list[str]
                         ) -> tuple[list[list[int]], list[list[tuple[int, int]]] | None]:
    """Token ids of `texts` and each token's character span; no spans from a tokenizer
    that cannot give them (transformers' Python tokenizers)."""
    if not texts:
        return [], []
    try:
        enc = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                        return_offsets_mapping=True, verbose=False)
    except NotImplementedError:
        return encode(tokenizer, texts, special=False), None
    return list(enc["input_ids"]), list(enc["offset_mapping"])


# Tokenizers whose prefixes tokenized from their last added token were found to differ
# from the prefixes tokenized whole (by id: the check in _prefix_ids).
_WHOLE_PREFIXES: set[int] = set()
PREFIXES_CHECKED = 2
"""Chats of each batch whose turn prefixes are also tokenized whole, to check the cut."""


def _split_points(cuts: frozenset[int], ids: list[int],
                  offsets: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """(character end, token count) after each token of `cuts` (_clean_added) in a
    tokenized text: the text before such a point tokenizes alone as the tokens before
    it."""
    if offsets is None or not cuts:
        return []
    return [(offsets[j][1], j + 1) for j, token in enumerate(ids) if token in cuts]


def _clean_added(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The added tokens where the tokenizer splits its input before normalizing and
    pre-tokenizing it (none for a tokenizer whose cut prefixes were found to differ).
    Added tokens that strip the whitespace beside them are no such point."""
    if id(tokenizer) in _WHOLE_PREFIXES:
        return frozenset()
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(i for i, t in added.items()
                     if not getattr(t, "lstrip", False) and not getattr(t, "rstrip", False))


def _prefix_ids(tokenizer: PreTrainedTokenizerBase, prefixes: list[tuple[str, list[int],
                list[tuple[int, int]]]]) -> list[list[int]]:
    """Token ids of each prefix (text, its full text's ids, their split points), as the
    tokenizer gives them for the prefix alone: the full text's tokens up to the prefix's
    last split point, then the rest of the prefix tokenized (a turn's prefix is most of
    its chat, the rest a few tokens). The first PREFIXES_CHECKED chats' prefixes are
    tokenized whole too; where they differ, every prefix of this tokenizer is."""
    heads: list[list[int]] = []
    tails: list[str] = []
    for text, ids, points in prefixes:
        chars, count = 0, 0
        for end, n in points:
            if end > len(text):
                break
            chars, count = end, n
        heads.append(ids[:count])
        tails.append(text[chars:])
    checked = [text for text, _, _ in prefixes[: 2 * PREFIXES_CHECKED]]
    tail_ids = encode(tokenizer, tails + checked, special=False)
    cut = [head + list(tail) for head, tail in zip(heads, tail_ids, strict=False)]
    if all(cut[i] == list(whole) for i, whole in enumerate(tail_ids[len(tails):])):
        return cut
    logger.warning("the tokenizer's prefixes do not tokenize as their parts: ingestion "
                   "tokenizes each turn prefix whole from now on (slower)")
    _WHOLE_PREFIXES.add(id(tokenizer))
    return [list(ids) for ids in encode(tokenizer, [t for t, _, _ in prefixes], special=False)]


def chat_samples(tokenizer: PreTrainedTokenizerBase, chats: list[Chat],
                  kwargs: dict[str, Any], limits: IngestLimits | None = None, *,
                  raise_over_limit: bool = False) -> list[Sample | str]:
    """Tokenize a batch of chats: one batched tokenizer call for their texts (with each
    token's characters), one for what their turn prefixes add (_prefix_ids). A chat
    whose template passes a limit is a reason like any other, or, with
    `raise_over_limit`, a TemplateLimitError raised (`limits`: else this process's);
    TIMED_OUT_ROWS chats past the time limit raise TemplateTimeout whatever it says."""
    if not getattr(tokenizer, "chat_template", None):
        return [NO_TEMPLATE] * len(chats)
    limits = limits or IngestLimits.from_env()
    rendered: list[_Rendered | str] = []
    timeouts = 0
    for chat in chats:
        try:
            rendered.append(_render_chat(tokenizer, chat, kwargs, limits))
        except TemplateLimitError as err:
            timeouts += isinstance(err, TemplateTimeout)
            if raise_over_limit:
                raise
            if timeouts >= TIMED_OUT_ROWS:
                raise err.of(f"{timeouts} rows of one batch") from None
            rendered.append(str(err))
        except TemplateFailure as err:
            rendered.append(str(err))
    ok = [r for r in rendered if isinstance(r, _Rendered)]
    all_ids, all_offsets = _encode_with_offsets(tokenizer, [r.text for r in ok])
    full = {id(r): (ids, all_offsets[i] if all_offsets is not None else None)
            for i, (r, ids) in enumerate(zip(ok, all_ids, strict=True))}
    prefixes: list[tuple[str, list[int], list[tuple[int, int]]]] = []
    cuts = _clean_added(tokenizer)  # once a batch: some tokenizers add thousands
    for done in ok:
        ids, offsets = full[id(done)]
        points = _split_points(cuts, ids, offsets)
        prefixes.extend((text, ids, points) for pair in done.prefixes or () for text in pair)
    prefix_ids = iter(_prefix_ids(tokenizer, prefixes) if prefixes else [])

    out: list[Sample | str] = []
    for r in rendered:
        if isinstance(r, str):
            out.append(r)
            continue
        ids, offsets = full[id(r)]
        mask: np.ndarray | None = np.zeros(len(ids), dtype=np.uint8)
        for _ in r.prefixes or ():
            start_ids, end_ids = next(prefix_ids), next(prefix_ids)
            if (mask is not None and ids[: len(start_ids)] == start_ids
                    and ids[: len(end_ids)] == end_ids):
                mask[len(start_ids) : len(end_ids)] = 1
            else:
                mask = None  # a token spans a turn boundary: fall back to offsets
        if mask is None or r.prefixes is None:
            if offsets is None:
                out.append("the chat's assistant tokens cannot be located: the template's "
                           "prefixes do not tokenize as prefixes and the tokenizer gives no "
                           "character offsets")
                continue
            mask = _mask_from_offsets(offsets, r.spans, len(ids))
        out.append(Sample(np.asarray(ids, dtype=np.int32), mask, truncated=False))
    return out


def generation_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                      chat_template_kwargs: dict[str, Any] | None = None,
                      limits: IngestLimits | None = None) -> list[int]:
    """The token ids a model answers `messages` from: the chat template with the
    generation prompt, tokenized as ingestion tokenizes chats (within the same limits:
    `limits`, else this process's)."""
    limits = limits or IngestLimits.from_env()
    try:
        with time_limit(limits.template_seconds):
            text = _render(tokenizer, messages, True, dict(chat_template_kwargs or {}),
                           limits.row_bytes)
    except RenderTimeout:
        raise ValueError(str(timed_out(limits.template_seconds))) from None
    except TemplateFailure as err:
        raise ValueError(str(err)) from err
    except Exception as err:  # a template raises anything (jinja errors, raise_exception)
        raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from err
    return encode(tokenizer, [text], special=False)[0]
