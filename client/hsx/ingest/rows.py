"""What a row asks for: pre-tokenized ids (`Sample`), a conversation (`Chat`) or plain
text (`Text`), by the first field it carries; or the reason it cannot be used.

A conversation's messages may hold image parts when the job takes images
(`classify(..., images=True)`): OpenAI's `{"type": "image_url", "image_url": {"url":
...}}`, or `{"type": "image"}` with its source under `image`, `url` or `path`, or none:
then the row's next image from its `images` (or `image`) column, as `datasets` loads an
image column. Such a message's content becomes a list of `{"type": "text", "text"}` and
`{"type": "image"}` parts, the form chat templates of vision-language models render,
and the chat lists each image's source in order (`Chat.images`); images.py reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsx.ingest.sources import BadRow, Row

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names, and the roles themselves, mapped to chat-template roles.
ROLE_ALIASES = {**{r: r for r in ROLES}, "human": "user", "gpt": "assistant"}
ROW_FIELDS = ("input_ids", "messages", "conversations", "prompt", "text")
IMAGE_COLUMNS = ("images", "image")  # a row's images, for parts that carry none
NO_IMAGES = ("holds an image; this job takes no images (a vision-language target takes "
             "them with an `images:` section in the job: docs/MODELS.md)")


@dataclass
class Sample:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    truncated: bool
    messages: list[dict[str, Any]] | None = None  # the parsed conversation of a chat row
    images: list[bytes] | None = None  # a chat's images, as read (images.py), in order
    length: int | None = None  # tokens once its images are expanded (else len(input_ids))

    @property
    def tokens(self) -> int:
        """Tokens the sample has as captured: its images' vision tokens counted."""
        return len(self.input_ids) if self.length is None else self.length


@dataclass
class Chat:
    messages: list[dict[str, Any]]
    assistant: list[int]  # positions of the assistant messages
    images: list[Any] = field(default_factory=list)  # each image part's source, in order


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


_IMAGE_KEYS = ("image", "url", "path")


def _image_source(part: dict[str, Any]) -> tuple[bool, Any]:
    """(whether `part` is an image part, its source: None for one the row's image
    column holds)."""
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        return True, url.get("url") if isinstance(url, dict) else url
    if kind == "image":
        return True, next((part[k] for k in _IMAGE_KEYS if part.get(k) is not None), None)
    return False, None


def _not_parts(j: int, images: list[Any] | None) -> str:
    what = "text parts" if images is None else "text and image parts"
    return f"message {j} content is neither text nor a list of {what}"


def _content_parts(content: list[Any], j: int, images: list[Any] | None
                   ) -> list[dict[str, Any]] | str:
    """A content list with image parts as the template's parts (`images` gets each
    image's source), or the reason it cannot be used; `images` None: none are taken."""
    parts: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            return _not_parts(j, images)
        is_image, source = _image_source(part)
        if is_image:
            if images is None:
                return f"message {j} {NO_IMAGES}"
            images.append(source)
            parts.append({"type": "image"})
        elif part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            return _not_parts(j, images)
    return parts


def _column_images(row: dict[str, Any], sources: list[Any]) -> list[Any] | str:
    """`sources` with each None (a part that carries no image) replaced by the row's next
    image from its image column, or the reason it cannot be."""
    column = next((row[c] for c in IMAGE_COLUMNS if row.get(c) is not None), None)
    if column is not None and not isinstance(column, list | tuple):
        column = [column]
    pending = list(column or [])
    out = []
    for source in sources:
        if source is None:
            if not pending:
                return (f"an image part carries no image and the row's "
                        f"`{'`/`'.join(IMAGE_COLUMNS)}` has no more")
            source = pending.pop(0)
        out.append(source)
    if pending and len(pending) == len(column or []):  # a column no part takes
        return (f"the row's `{'`/`'.join(IMAGE_COLUMNS)}` holds {len(pending)} images but "
                "no message has an image part for them")
    return out


def _parse_conversation(value: Any, name: str, row: dict[str, Any] | None = None,
                        images: bool = False) -> Chat | str:
    if not isinstance(value, list):
        return f"`{name}` is a {type(value).__name__}, not a list of messages"
    if not value:
        return f"the conversation is empty (`{name}` has no messages)"
    messages = []
    sources: list[Any] = []
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
        raw = message.get("content", message.get("value"))
        content: str | list[dict[str, Any]] | None = _content_text(raw)
        if content is None and isinstance(raw, list):
            before = len(sources)
            content = _content_parts(raw, j, sources if images else None)
            if isinstance(content, str):
                return content
            if role == "assistant" and len(sources) > before:
                return (f"message {j} is an assistant message with an image: a draft is "
                        "trained on what the assistant writes, which is text")
        if content is None:
            return f"message {j} content is neither text nor a list of text parts"
        # Keys set to None (a Parquet schema's absent fields) would render as "None".
        extra = {k: v for k, v in message.items()
                 if v is not None and k not in ("role", "from", "content", "value")}
        messages.append({**extra, "role": role, "content": content})
    assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        return "the conversation has no assistant message, so nothing would be trained on"
    found = _column_images(row or {}, sources) if images else []
    if isinstance(found, str):
        return found
    return Chat(messages, assistant, found)


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


def classify(row: Row, vocab_size: int, *, images: bool = False
             ) -> Sample | Chat | Text | str:
    """Turn a row into work (or a reason it is bad), by the first field it carries;
    `images`: the job takes image parts (else a chat with one is a bad row)."""
    if isinstance(row, BadRow):
        return row.reason
    present = {k: v for k, v in row.items() if v is not None}
    if not present:
        return "the row is empty"
    if "input_ids" in present:
        return _parse_pretokenized(present, vocab_size)
    for name in ("messages", "conversations"):
        if name in present:
            return _parse_conversation(present[name], name, present, images)
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
