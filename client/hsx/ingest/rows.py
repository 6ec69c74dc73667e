"""What a row asks for: pre-tokenized ids (`Sample`), a conversation (`Chat`) or plain
text (`Text`), by the first field it carries; or the reason it cannot be used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hsx.ingest.sources import BadRow, Row

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names, and the roles themselves, mapped to chat-template roles.
ROLE_ALIASES = {**{r: r for r in ROLES}, "human": "user", "gpt": "assistant"}
ROW_FIELDS = ("input_ids", "messages", "conversations", "prompt", "text")


@dataclass
class Sample:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    truncated: bool
    messages: list[dict[str, Any]] | None = None  # the parsed conversation of a chat row


@dataclass
class Chat:
    messages: list[dict[str, Any]]
    assistant: list[int]  # positions of the assistant messages


@dataclass
class Text:
    text: str


def _content_text(content: Any) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                part.get("text"), str
            ):
                parts.append(part["text"])
            else:
                return None
        return "".join(parts)
    return None


def _parse_conversation(value: Any, name: str) -> Chat | str:
    if not isinstance(value, list):
        return f"`{name}` is a {type(value).__name__}, not a list of messages"
    if not value:
        return f"the conversation is empty (`{name}` has no messages)"
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {j} is a {type(message).__name__}, not an object"
        raw_role = message.get("role", message.get("from"))
        role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            return (
                f"message {j} has unknown role {raw_role!r} (expected one of "
                f"{', '.join(ROLES)}, or ShareGPT's human/gpt)"
            )
        content = _content_text(message.get("content", message.get("value")))
        if content is None:
            return f"message {j} content is neither text nor a list of text parts"
        # Keys set to None (a Parquet schema's absent fields) would render as "None".
        extra = {k: v for k, v in message.items()
                 if v is not None and k not in ("role", "from", "content", "value")}
        messages.append({**extra, "role": role, "content": content})
    assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        return "the conversation has no assistant message, so nothing would be trained on"
    return Chat(messages, assistant)


def _parse_pretokenized(row: dict[str, Any], vocab_size: int) -> Sample | str:
    raw_ids = row["input_ids"]
    if not isinstance(raw_ids, list | tuple | np.ndarray):
        return f"input_ids is a {type(raw_ids).__name__}, not a list of integers"
    if len(raw_ids) == 0:
        return "input_ids is empty"
    try:
        ids = np.asarray(raw_ids)
    except (ValueError, TypeError):
        return "input_ids is not a flat list of integers"
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        return "input_ids is not a flat list of integers"
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        return (f"input_ids has token id {bad}, outside the tokenizer's vocabulary "
                f"(0..{vocab_size - 1})")
    raw_mask = row.get("loss_mask")
    if raw_mask is None:
        mask = np.ones(len(ids), dtype=np.uint8)
    else:
        if not isinstance(raw_mask, list | tuple | np.ndarray):
            return f"loss_mask is a {type(raw_mask).__name__}, not a list of 0/1 values"
        if len(raw_mask) != len(ids):
            return (f"loss_mask has {len(raw_mask)} entries but input_ids has {len(ids)}; "
                    "they must be the same length")
        try:
            mask_values = np.asarray(raw_mask)
        except (ValueError, TypeError):
            return "loss_mask is not a flat list of 0/1 values"
        if (mask_values.ndim != 1 or mask_values.dtype.kind not in "iub"
                or not np.isin(mask_values, (0, 1)).all()):
            return "loss_mask values must be 0 or 1"
        mask = mask_values.astype(np.uint8)
    return Sample(ids.astype(np.int32), mask, truncated=False)


def classify(row: Row, vocab_size: int) -> Sample | Chat | Text | str:
    """Turn a row into work (or a reason it is bad), by the first field it carries."""
    if isinstance(row, BadRow):
        return row.reason
    present = {k: v for k, v in row.items() if v is not None}
    if not present:
        return "the row is empty"
    if "input_ids" in present:
        return _parse_pretokenized(present, vocab_size)
    for name in ("messages", "conversations"):
        if name in present:
            return _parse_conversation(present[name], name)
    for name in ("prompt", "text"):
        if name in present:
            value = present[name]
            if not isinstance(value, str):
                return f"`{name}` is a {type(value).__name__}, not a string"
            if not value:
                return f"`{name}` is an empty string"
            problem = not_unicode(value)
            if problem:
                return f"`{name}` {problem}"
            return Text(value)
    return (f"the row has none of the recognised fields ({', '.join(ROW_FIELDS)}); it has "
            f"{', '.join(sorted(present))}")


def not_unicode(text: str) -> str | None:
    """Why `text` cannot be tokenized as Unicode, or None. JSON's `\\ud800` escapes give
    Python strings with lone surrogates, which a tokenizer refuses for the whole batch."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"holds a lone UTF-16 surrogate ({ord(text[err.start]):#06x} at character "
                f"{err.start}), which is not valid Unicode")
    return None
