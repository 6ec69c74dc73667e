"""Dataset ingestion: rows -> token ids, loss masks and lengths, plus a table of bad rows.

`ingest` reads a dataset (JSONL, Parquet, or a Hugging Face `save_to_disk` folder),
tokenizes each row and writes two Arrow IPC files into the output (through
`hsx.output.Output`, which owns their schemas and readers):

- `inputs.arrow`: one row per good sample — sample_index, input_ids, loss_mask, length —
  in ascending sample_index. It travels with the hidden states, so a trainer needs
  nothing but the output location.
- `errors.arrow`: one row per bad row — sample_index, reason — always written, possibly
  empty. Together the two account for every row of the dataset exactly once.

A row carries one of these fields, tried in this order:

- `input_ids` (pre-tokenized; optional `loss_mask` of the same length, else all ones),
- `messages` (OpenAI style `{role, content}`) or `conversations` (ShareGPT style
  `{from, value}`, human -> user, gpt -> assistant): rendered with the tokenizer's chat
  template; the loss mask is 1 exactly on what each assistant turn produces,
- `prompt` or `text`: plain text, tokenized without a template; loss mask all ones.

`sample_index` is a row's 0-based position in the source (across files, in sorted
order), so an error names the line a person can look up. Rows that cannot be used are
recorded with a plain-sentence reason and skipped; the ingestion goes on.

Memory stays constant in the number of rows: rows are read, tokenized and written
`batch_rows` at a time. This module imports no torch, vllm or ray; transformers is
imported inside the functions that load a tokenizer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from hsx.output import Output
from hsx.output.layout import ERRORS, INPUTS
from hsx.output.tables import ERRORS_SCHEMA, INPUTS_SCHEMA, with_messages
from hsx.regenerate import dumps_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names, and the roles themselves, mapped to chat-template roles.
ROLE_ALIASES = {**{r: r for r in ROLES}, "human": "user", "gpt": "assistant"}
ROW_FIELDS = ("input_ids", "messages", "conversations", "prompt", "text")
NO_TEMPLATE = "the tokenizer has no chat template, so the conversation cannot be rendered"


class DatasetNotFoundError(FileNotFoundError):
    """The dataset path does not exist."""


class DatasetFormatError(ValueError):
    """The dataset path exists but is not a format ingestion reads."""


@dataclass(frozen=True)
class LengthSummary:
    """Sample lengths in tokens (after truncation); zeros when there are no samples."""

    min: int
    max: int
    mean: float
    p50: int
    p90: int
    p99: int


@dataclass(frozen=True)
class IngestResult:
    """What `ingest` wrote: counts, length summary and the fingerprints of its inputs."""

    num_rows: int
    num_samples: int
    num_errors: int
    num_tokens: int
    num_loss_tokens: int
    num_truncated: int
    lengths: LengthSummary
    tokenizer_fingerprint: str
    dataset_fingerprint: str
    inputs_path: str
    errors_path: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _BadRow:
    """A row that failed before it could be parsed (malformed JSON, not an object)."""

    reason: str


Row = dict[str, Any] | _BadRow


@dataclass(frozen=True)
class _Source:
    kind: str  # "jsonl" | "parquet" | "hf"
    files: tuple[Path, ...]
    root: Path


_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors write at the start


def _resolve_source(dataset: str | Path) -> _Source:
    path = Path(dataset).expanduser()
    if not path.exists():
        raise DatasetNotFoundError(
            f"dataset {str(dataset)!r} does not exist (expected a .jsonl or .parquet file, "
            "a directory of them, or a `datasets` save_to_disk folder; hub ids are not "
            "read directly)"
        )
    if path.is_file():
        if path.suffix in _JSONL_SUFFIXES:
            return _Source("jsonl", (path,), path)
        if path.suffix == ".parquet":
            return _Source("parquet", (path,), path)
        raise DatasetFormatError(
            f"dataset {str(path)!r}: unsupported file type {path.suffix or '(none)'!r}; "
            "use .jsonl, .json (JSON lines) or .parquet"
        )
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise DatasetFormatError(
            f"dataset {str(path)!r} is a DatasetDict with splits {splits}; point `dataset` "
            f"at one split folder, e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    if (path / "state.json").exists() and (path / "dataset_info.json").exists():
        state = json.loads((path / "state.json").read_text())
        if state.get("_indices_data_files"):
            # Old `datasets` versions saved a select/shuffle as an indices mapping; the
            # row order would then differ from the arrow files' order.
            raise DatasetFormatError(
                f"dataset {str(path)!r} was saved with an indices mapping; re-save it "
                "after `dataset.flatten_indices()`"
            )
        files = tuple(path / f["filename"] for f in state.get("_data_files", []))
        return _Source("hf", files, path)
    parquet = tuple(sorted(path.glob("*.parquet")))
    if parquet:
        return _Source("parquet", parquet, path)
    jsonl = tuple(sorted(p for p in path.iterdir() if p.suffix in _JSONL_SUFFIXES))
    if jsonl:
        return _Source("jsonl", jsonl, path)
    raise DatasetFormatError(
        f"dataset directory {str(path)!r} holds no *.parquet or *.jsonl files and is not a "
        "`datasets` save_to_disk folder (no state.json / dataset_info.json)"
    )


def _parse_json_row(raw: bytes) -> Row:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        # Replacing the bytes would train on text nobody wrote: the row is refused.
        return _BadRow(f"the line is not valid UTF-8 (byte {raw[err.start]:#04x} at "
                       f"offset {err.start})")
    line = line.rstrip("\r\n")
    if not line.strip():
        return _BadRow("the line is empty")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return _BadRow(f"the line is not valid JSON ({err})")
    except RecursionError:
        return _BadRow("the line nests JSON too deeply to be read")
    if not isinstance(row, dict):
        return _BadRow(f"the row is a JSON {type(row).__name__}, not an object")
    return row


def _iter_jsonl(files: Sequence[Path]) -> Iterator[Row]:
    for path in files:
        with path.open("rb") as f:
            head = f.read(4096).removeprefix(_BOM).lstrip()
        if path.suffix == ".json" and head.startswith(b"["):
            # A JSON array file: not streamable, read whole (JSON lines are the norm).
            try:
                rows = json.loads(path.read_bytes().removeprefix(_BOM).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
                raise DatasetFormatError(
                    f"dataset file {str(path)!r} starts like a JSON array but cannot be read "
                    f"as one ({type(err).__name__}: {err}); a JSON lines file (.jsonl) lets "
                    "each bad row be skipped on its own") from None
            for row in rows:
                yield row if isinstance(row, dict) else _BadRow(
                    f"the row is a JSON {type(row).__name__}, not an object")
            continue
        # Bytes, split at \n only (as count_rows counts), each line decoded on its own.
        with path.open("rb") as f:
            for number, line in enumerate(f):
                yield _parse_json_row(line.removeprefix(_BOM) if number == 0 else line)


def _unreadable(path: Path, kind: str, err: Exception) -> DatasetFormatError:
    return DatasetFormatError(
        f"dataset file {str(path)!r} is not a readable {kind} file (truncated or damaged?): "
        f"{str(err).strip() or type(err).__name__}")


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:  # no footer: no row can be located
        raise _unreadable(path, "Parquet", err) from None


def _iter_parquet(path: Path, batch_rows: int) -> Iterator[pa.RecordBatch | _BadRow]:
    """A Parquet file's rows by batch; the rows of a row group that cannot be decoded
    are each a _BadRow (the footer says how many there are)."""
    parquet = _parquet_file(path)
    for group in range(parquet.metadata.num_row_groups):
        expected = parquet.metadata.row_group(group).num_rows
        seen = 0
        try:
            for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group]):
                seen += batch.num_rows
                yield batch
        except (pa.ArrowException, OSError) as err:
            reason = (f"row group {group} of {path.name} cannot be decoded: "
                      f"{str(err).strip() or type(err).__name__}")
            for _ in range(max(expected - seen, 0)):
                yield _BadRow(reason)


def _iter_record_batches(source: _Source, batch_rows: int
                         ) -> Iterator[pa.RecordBatch | _BadRow]:
    if source.kind == "parquet":
        for path in source.files:
            yield from _iter_parquet(path, batch_rows)
        return
    for path in source.files:
        # save_to_disk writes Arrow IPC *stream* files; memory-mapped, no copy.
        try:
            with pa.memory_map(str(path)) as mm:
                reader = pa.ipc.open_stream(mm)
                for batch in reader:
                    for start in range(0, batch.num_rows, batch_rows):
                        yield batch.slice(start, batch_rows)
        except (pa.ArrowException, OSError) as err:  # a stream says nothing of what is left
            raise _unreadable(path, "Arrow stream", err) from None


def iter_rows(dataset: str | Path, *, batch_rows: int = 1024) -> Iterator[Row]:
    """Every row of the dataset in source order; a row that cannot be parsed is a _BadRow."""
    source = _resolve_source(dataset)
    if source.kind == "jsonl":
        yield from _iter_jsonl(source.files)
        return
    for batch in _iter_record_batches(source, batch_rows):
        if isinstance(batch, _BadRow):
            yield batch
            continue
        try:
            yield from batch.to_pylist()
        except UnicodeDecodeError:
            # Writers do not all validate: a string column may hold bytes that are not
            # UTF-8. Only the rows holding them are bad.
            for i in range(batch.num_rows):
                try:
                    yield batch.slice(i, 1).to_pylist()[0]
                except UnicodeDecodeError as err:
                    yield _BadRow(f"a string column holds bytes that are not valid UTF-8 "
                                  f"({err.reason})")


def count_rows(dataset: str | Path) -> int:
    """Rows of the dataset without parsing them: lines of JSONL files (blank ones not
    counted), Parquet footers, Arrow stream files' batches."""
    source = _resolve_source(dataset)
    if source.kind == "parquet":
        return sum(_parquet_file(p).metadata.num_rows for p in source.files)
    if source.kind == "hf":
        return sum(batch.num_rows for batch in _iter_record_batches(source, 1 << 30)
                   if isinstance(batch, pa.RecordBatch))
    rows = 0
    for path in source.files:
        with open(path, "rb") as f:
            for line in f:
                rows += bool(line.strip())
    return rows


def estimate_tokens(
    dataset: str | Path, tokenizer_path: str, max_seq_len: int, *, sample_rows: int = 256,
    chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False,
) -> tuple[float, int, int]:
    """(estimated tokens, rows, rows sampled): the first `sample_rows` rows tokenized as
    ingestion would, their mean tokens per row times the dataset's row count. Quick
    (seconds), for checks before ingestion; a prefix is not a random sample."""
    rows = count_rows(dataset)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    head = list(itertools.islice(iter_rows(dataset), sample_rows))
    results = _process_batch(head, tokenizer, len(tokenizer), max_seq_len,
                             dict(chat_template_kwargs or {}))
    lengths = [len(r.input_ids) for r in results if isinstance(r, _Sample)]
    if not lengths:
        return 0.0, rows, len(head)
    return float(np.mean(lengths)) * rows, rows, len(head)


def _batched(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------- rows


@dataclass
class _Sample:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    truncated: bool
    messages: list[dict[str, Any]] | None = None  # the parsed conversation of a chat row


@dataclass
class _Chat:
    messages: list[dict[str, Any]]
    assistant: list[int]  # positions of the assistant messages


@dataclass
class _Text:
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


def _parse_conversation(value: Any, name: str) -> _Chat | str:
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
    return _Chat(messages, assistant)


def _parse_pretokenized(row: dict[str, Any], vocab_size: int) -> _Sample | str:
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
    return _Sample(ids.astype(np.int32), mask, truncated=False)


def _classify(row: Row, vocab_size: int) -> _Sample | _Chat | _Text | str:
    """Turn a row into work (or a reason it is bad), by the first field it carries."""
    if isinstance(row, _BadRow):
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
            problem = _not_unicode(value)
            if problem:
                return f"`{name}` {problem}"
            return _Text(value)
    return (f"the row has none of the recognised fields ({', '.join(ROW_FIELDS)}); it has "
            f"{', '.join(sorted(present))}")


def _not_unicode(text: str) -> str | None:
    """Why `text` cannot be tokenized as Unicode, or None. JSON's `\\ud800` escapes give
    Python strings with lone surrogates, which a tokenizer refuses for the whole batch."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return (f"holds a lone UTF-16 surrogate ({ord(text[err.start]):#06x} at character "
                f"{err.start}), which is not valid Unicode")
    return None


# ----------------------------------------------------------------------------- chat masks


class _TemplateFailure(Exception):
    pass


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
            generation_prompt: bool, kwargs: dict[str, Any]) -> str:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )
    if not isinstance(text, str):
        raise _TemplateFailure(f"the chat template returned {type(text).__name__}, not text")
    return text


@dataclass
class _Rendered:
    """A chat rendered as text, with the character span of each assistant turn."""

    text: str
    # Per assistant turn: (prefix ending where the turn starts, prefix ending where it
    # ends) when rendering prefixes gives prefixes of the full text; else None.
    prefixes: list[tuple[str, str]] | None
    spans: list[tuple[int, int]] = field(default_factory=list)


def _render_chat(tokenizer: PreTrainedTokenizerBase, chat: _Chat,
                 kwargs: dict[str, Any]) -> _Rendered:
    """Render a chat and locate what each assistant turn produces, in characters.

    Preferred: the turn starts where `render(messages[:i], add_generation_prompt=True)`
    ends and stops where `render(messages[:i+1])` ends, so the mask covers what the model
    generates in that turn (content and end-of-turn token), whatever the template. Some
    templates render earlier turns differently once later ones exist (e.g. dropping
    reasoning); then the prefixes are not prefixes of the full text, and the span is the
    assistant content found in the rendered text.
    """
    try:
        full = _render(tokenizer, chat.messages, False, kwargs)
    except Exception as err:  # a template raises anything (jinja errors, raise_exception)
        raise _TemplateFailure(f"the chat template failed: {type(err).__name__}: {err}"
                               ) from err
    problem = _not_unicode(full)
    if problem:
        raise _TemplateFailure(f"the rendered chat {problem}")
    prefixes = _turn_prefixes(tokenizer, chat, full, kwargs)
    if prefixes is None:
        return _Rendered(full, None, _find_contents(full, chat))
    return _Rendered(full, prefixes, [(len(start), len(end)) for start, end in prefixes])


def _turn_prefixes(tokenizer: PreTrainedTokenizerBase, chat: _Chat, full: str,
                   kwargs: dict[str, Any]) -> list[tuple[str, str]] | None:
    """Per assistant turn, the renderings that end where it starts and where it ends;
    None when they are not prefixes of the full rendering."""
    prefixes = []
    for i in chat.assistant:
        try:
            start = _render(tokenizer, chat.messages[:i], True, kwargs)
            end = _render(tokenizer, chat.messages[: i + 1], False, kwargs)
        except Exception:  # e.g. a template that refuses a conversation without a user turn
            return None
        if not (len(start) <= len(end) and full.startswith(start) and full.startswith(end)):
            return None  # (prefixes of `full`, checked as Unicode with it)
        prefixes.append((start, end))
    return prefixes


def _find_contents(full: str, chat: _Chat) -> list[tuple[int, int]]:
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
            raise _TemplateFailure(
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


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], *, special: bool
            ) -> list[list[int]]:
    if not texts:
        return []
    return list(tokenizer(texts, add_special_tokens=special, return_attention_mask=False,
                          verbose=False)["input_ids"])


def _chat_samples(tokenizer: PreTrainedTokenizerBase, chats: list[_Chat],
                  kwargs: dict[str, Any]) -> list[_Sample | str]:
    """Tokenize a batch of chats; one batched tokenizer call for texts, one for prefixes."""
    if not getattr(tokenizer, "chat_template", None):
        return [NO_TEMPLATE] * len(chats)
    rendered: list[_Rendered | str] = []
    for chat in chats:
        try:
            rendered.append(_render_chat(tokenizer, chat, kwargs))
        except _TemplateFailure as err:
            rendered.append(str(err))
    ok = [r for r in rendered if isinstance(r, _Rendered)]
    full_ids = iter(_encode(tokenizer, [r.text for r in ok], special=False))
    prefix_texts = [t for r in ok if r.prefixes for pair in r.prefixes for t in pair]
    prefix_ids = iter(_encode(tokenizer, prefix_texts, special=False))

    out: list[_Sample | str] = []
    for r in rendered:
        if isinstance(r, str):
            out.append(r)
            continue
        ids = next(full_ids)
        mask: np.ndarray | None = np.zeros(len(ids), dtype=np.uint8)
        for _ in r.prefixes or ():
            start_ids, end_ids = next(prefix_ids), next(prefix_ids)
            if (mask is not None and ids[: len(start_ids)] == start_ids
                    and ids[: len(end_ids)] == end_ids):
                mask[len(start_ids) : len(end_ids)] = 1
            else:
                mask = None  # a token spans a turn boundary: fall back to offsets
        if mask is None or r.prefixes is None:
            try:
                enc = tokenizer(r.text, add_special_tokens=False, return_offsets_mapping=True)
            except NotImplementedError:
                out.append("the chat's assistant tokens cannot be located: the template's "
                           "prefixes do not tokenize as prefixes and the tokenizer gives no "
                           "character offsets")
                continue
            if list(enc["input_ids"]) != list(ids):
                out.append("the tokenizer gives other token ids when asked for character "
                           "offsets, so the assistant tokens cannot be located")
                continue
            mask = _mask_from_offsets(enc["offset_mapping"], r.spans, len(ids))
        out.append(_Sample(np.asarray(ids, dtype=np.int32), mask, truncated=False))
    return out


# ----------------------------------------------------------------------------- writing

MAX_REASON_CHARS = 1000


def _reason_text(reason: str) -> str:
    """A reason as the errors table can hold it: quoted row content may carry lone
    surrogates (not UTF-8: shown escaped) and be megabytes long (cut)."""
    text = reason.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


NOT_A_CHAT = ("regenerate needs a conversation (`messages` or `conversations`) to "
              "answer; this row has none")


def _inputs_batch(indices: list[int], samples: list[_Sample], *, messages: bool = False
                  ) -> pa.RecordBatch:
    lengths = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int32,
                          count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    if samples:
        ids = np.concatenate([s.input_ids for s in samples]).astype(np.int32, copy=False)
        mask = np.concatenate([s.loss_mask for s in samples]).astype(np.uint8, copy=False)
    else:
        ids, mask = np.zeros(0, np.int32), np.zeros(0, np.uint8)
    offsets_arr = pa.array(offsets, type=pa.int32())
    columns = [
        pa.array(indices, type=pa.int64()),
        pa.ListArray.from_arrays(offsets_arr, pa.array(ids, type=pa.int32())),
        pa.ListArray.from_arrays(offsets_arr, pa.array(mask, type=pa.uint8())),
        pa.array(lengths, type=pa.int32()),
    ]
    if not messages:
        return pa.RecordBatch.from_arrays(columns, schema=INPUTS_SCHEMA)
    texts = [dumps_messages(s.messages or []) for s in samples]
    return pa.RecordBatch.from_arrays([*columns, pa.array(texts, type=pa.string())],
                                      schema=with_messages(INPUTS_SCHEMA))


def _summarize(counts: np.ndarray) -> LengthSummary:
    total = int(counts.sum())
    if total == 0:
        return LengthSummary(0, 0, 0.0, 0, 0, 0)
    present = np.nonzero(counts)[0]
    cumulative = np.cumsum(counts)

    def quantile(q: float) -> int:
        return int(np.searchsorted(cumulative, q * total, side="left"))

    mean = float((np.arange(len(counts)) * counts).sum() / total)
    return LengthSummary(int(present[0]), int(present[-1]), round(mean, 2), quantile(0.5),
                         quantile(0.9), quantile(0.99))


# ----------------------------------------------------------------------------- public


def load_tokenizer(tokenizer_path: str, *, trust_remote_code: bool = False
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer ingestion uses (transformers' AutoTokenizer, imported here)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)


def ingest(
    dataset: str | Path,
    tokenizer_path: str,
    max_seq_len: int,
    output: Output | str | Path,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    batch_rows: int = 1024,
    progress: Callable[[int], None] | None = None,
    keep_messages: bool = False,
) -> IngestResult:
    """Tokenize every row of `dataset` into the output's inputs.arrow and errors.arrow.

    Each table appears only once complete (staged, then published whole), so a reader
    never sees half of one. `progress`, if given, is called after each batch
    with the number of rows read so far. `keep_messages` (a job that regenerates)
    keeps each row's parsed conversation in the inputs table's `messages` column, and
    refuses rows that carry none.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    source = _resolve_source(dataset)  # fail on a bad path before loading a tokenizer
    data_fp = dataset_fingerprint(dataset)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    tok_fp = tokenizer_fingerprint(tokenizer_path, tokenizer=tokenizer)
    vocab_size = len(tokenizer)
    kwargs = dict(chat_template_kwargs or {})
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("tokenizer %s has no chat template: rows with messages will be "
                       "recorded as errors", tokenizer_path)

    out = Output.of(output)
    inputs = out.table_writer(INPUTS, messages=keep_messages)
    errors = out.table_writer(ERRORS)
    counts = np.zeros(max_seq_len + 1, dtype=np.int64)
    num_rows = num_errors = num_tokens = num_loss = num_truncated = 0
    try:
        for batch in _batched(iter_rows(dataset, batch_rows=batch_rows), batch_rows):
            results = _process_batch(batch, tokenizer, vocab_size, max_seq_len, kwargs)
            if keep_messages:
                results = [NOT_A_CHAT if isinstance(r, _Sample) and r.messages is None
                           else r for r in results]
            good_idx: list[int] = []
            good: list[_Sample] = []
            bad_idx: list[int] = []
            bad: list[str] = []
            for offset, outcome in enumerate(results):
                if isinstance(outcome, str):
                    bad_idx.append(num_rows + offset)
                    bad.append(_reason_text(outcome))
                else:
                    good_idx.append(num_rows + offset)
                    good.append(outcome)
                    counts[len(outcome.input_ids)] += 1
                    num_tokens += len(outcome.input_ids)
                    num_loss += int(outcome.loss_mask.sum())
                    num_truncated += outcome.truncated
            inputs.write(_inputs_batch(good_idx, good, messages=keep_messages))
            errors.write(pa.RecordBatch.from_arrays(
                [pa.array(bad_idx, pa.int64()), pa.array(bad, pa.string())],
                schema=ERRORS_SCHEMA))
            num_rows += len(batch)
            num_errors += len(bad)
            if progress is not None:
                progress(num_rows)
        inputs.commit()
        errors.commit()
    except BaseException:
        inputs.abort()
        errors.abort()
        raise
    result = IngestResult(
        num_rows=num_rows,
        num_samples=num_rows - num_errors,
        num_errors=num_errors,
        num_tokens=num_tokens,
        num_loss_tokens=num_loss,
        num_truncated=num_truncated,
        lengths=_summarize(counts),
        tokenizer_fingerprint=tok_fp,
        dataset_fingerprint=data_fp,
        inputs_path=inputs.url,
        errors_path=errors.url,
    )
    logger.info("ingested %s (%s): %d samples, %d errors, %d tokens", dataset, source.kind,
                result.num_samples, num_errors, num_tokens)
    return result


def _process_batch(rows: list[Row], tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                   max_seq_len: int, kwargs: dict[str, Any]) -> list[_Sample | str]:
    """One result per row, in row order: a sample, or the reason the row is skipped."""
    work = [_classify(row, vocab_size) for row in rows]
    results: list[_Sample | str | None] = [w if isinstance(w, str | _Sample) else None
                                           for w in work]

    texts = {i: w.text for i, w in enumerate(work) if isinstance(w, _Text)}
    for i, ids in zip(texts, _encode(tokenizer, list(texts.values()), special=True),
                      strict=True):
        results[i] = (_Sample(np.asarray(ids, dtype=np.int32), np.ones(len(ids), np.uint8),
                              truncated=False) if ids else "the text produced no tokens")

    chats = {i: w for i, w in enumerate(work) if isinstance(w, _Chat)}
    chat_at = list(chats)
    for i, sample in zip(chat_at, _chat_samples(tokenizer, list(chats.values()), kwargs),
                         strict=True):
        if isinstance(sample, _Sample) and not sample.loss_mask.any():
            sample = "the chat template renders no tokens for the assistant messages"
        if isinstance(sample, _Sample):
            sample.messages = chats[i].messages
        results[i] = sample

    final: list[_Sample | str] = []
    for i, r in enumerate(results):
        if r is None:
            raise RuntimeError(f"row {i} of the batch was not processed")
        if isinstance(r, _Sample) and len(r.input_ids) > max_seq_len:
            r = _Sample(r.input_ids[:max_seq_len], r.loss_mask[:max_seq_len], truncated=True,
                        messages=r.messages)
            if i in chats and not r.loss_mask.any():
                r = (f"no assistant tokens within the first {max_seq_len} tokens "
                     "(max_seq_len); the row would train on nothing")
        final.append(r)
    return final


def tokenize_conversations(tokenizer: PreTrainedTokenizerBase,
                           conversations: list[list[dict[str, Any]]], max_seq_len: int,
                           chat_template_kwargs: dict[str, Any] | None = None,
                           ) -> list[tuple[np.ndarray, np.ndarray] | str]:
    """(input_ids, loss_mask) of each conversation exactly as ingestion makes them
    (template, assistant mask, truncation), or the reason it cannot be used."""
    rows: list[Row] = [{"messages": c} for c in conversations]
    out: list[tuple[np.ndarray, np.ndarray] | str] = []
    for r in _process_batch(rows, tokenizer, len(tokenizer), max_seq_len,
                            dict(chat_template_kwargs or {})):
        out.append(r if isinstance(r, str) else (r.input_ids, r.loss_mask))
    return out


def generation_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                      chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids a model answers `messages` from: the chat template with the
    generation prompt, tokenized as ingestion tokenizes chats."""
    try:
        text = _render(tokenizer, messages, True, dict(chat_template_kwargs or {}))
    except Exception as err:  # a template raises anything (jinja errors, raise_exception)
        raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from err
    return _encode(tokenizer, [text], special=False)[0]


# ----------------------------------------------------------------------------- fingerprints

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


def dataset_fingerprint(path: str | Path) -> str:
    """Short sha256 of the dataset files' names, sizes and mtimes: cheap, no reading.

    A changed or touched file changes it; that is enough to tell a resumed job that its
    dataset is no longer the one it ingested.
    """
    source = _resolve_source(path)
    root = source.root if source.root.is_dir() else source.root.parent
    files = sorted(p for p in root.rglob("*") if p.is_file()) if source.kind == "hf" else list(
        source.files)
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n"
                      .encode())
    return digest.hexdigest()[:16]
