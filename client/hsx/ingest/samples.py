"""Rows into samples, one batch at a time, exactly as ingestion makes them (`process_rows`:
template, assistant mask, truncation, or the reason a row is skipped), and what other
callers need of it: `tokenize_conversations` (regenerated answers, benchmarks) and
`estimate_tokens` (the checks before ingestion)."""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hsx.ingest.rows import Chat, Sample, Text, classify
from hsx.ingest.sources import DatasetLike, FilesSource, Row, resolve_source
from hsx.ingest.tokenizer import chat_samples, encode, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def process_rows(rows: list[Row], tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 max_seq_len: int, kwargs: dict[str, Any]) -> list[Sample | str]:
    """One result per row, in row order: a sample, or the reason the row is skipped."""
    work = [classify(row, vocab_size) for row in rows]
    results: list[Sample | str | None] = [w if isinstance(w, str | Sample) else None
                                           for w in work]

    texts = {i: w.text for i, w in enumerate(work) if isinstance(w, Text)}
    for i, ids in zip(texts, encode(tokenizer, list(texts.values()), special=True),
                      strict=True):
        results[i] = (Sample(np.asarray(ids, dtype=np.int32), np.ones(len(ids), np.uint8),
                              truncated=False) if ids else "the text produced no tokens")

    chats = {i: w for i, w in enumerate(work) if isinstance(w, Chat)}
    chat_at = list(chats)
    for i, sample in zip(chat_at, chat_samples(tokenizer, list(chats.values()), kwargs),
                         strict=True):
        if isinstance(sample, Sample) and not sample.loss_mask.any():
            sample = "the chat template renders no tokens for the assistant messages"
        if isinstance(sample, Sample):
            sample.messages = chats[i].messages
        results[i] = sample

    final: list[Sample | str] = []
    for i, r in enumerate(results):
        if r is None:
            raise RuntimeError(f"row {i} of the batch was not processed")
        if isinstance(r, Sample) and len(r.input_ids) > max_seq_len:
            r = Sample(r.input_ids[:max_seq_len], r.loss_mask[:max_seq_len], truncated=True,
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
    for r in process_rows(rows, tokenizer, len(tokenizer), max_seq_len,
                            dict(chat_template_kwargs or {})):
        out.append(r if isinstance(r, str) else (r.input_ids, r.loss_mask))
    return out


ESTIMATE_SLICES = 16  # the estimate's sample comes from this many places of a dataset


class TokenEstimate(NamedTuple):
    tokens: float
    rows: int
    sampled: int  # rows tokenized
    spread: bool  # sampled over the whole dataset (else its first rows)


def estimate_tokens(
    dataset: DatasetLike, tokenizer_path: str, max_seq_len: int, *, sample_rows: int = 256,
    chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False,
) -> TokenEstimate:
    """The dataset's tokens, estimated from about `sample_rows` rows tokenized as
    ingestion would. Quick (seconds), for checks before ingestion.

    JSON lines: the rows come in equal runs from the starts of up to ESTIMATE_SLICES of
    the source's slices (cut by bytes), spread from its first to its last, so that a
    dataset sorted by length, or files of different lengths, are not judged by their
    first rows; their mean tokens per byte times the source's bytes is the estimate.
    Each run reads a few lines at an offset. Other sources (Parquet, whose slices are
    row groups a read decompresses whole; a hub dataset) are judged by their first rows
    times their row count."""
    source = resolve_source(dataset)
    rows = source.count_rows()
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)

    def tokens_of(sample: list[Row]) -> int:
        results = process_rows(sample, tokenizer, len(tokenizer), max_seq_len,
                                 dict(chat_template_kwargs or {}))
        return sum(len(r.input_ids) for r in results if isinstance(r, Sample))

    slices = source.slices() if isinstance(source, FilesSource) and source.kind == "jsonl" \
        else []
    if len(slices) < 2:
        head = list(itertools.islice(source.rows(), sample_rows))
        tokens = tokens_of(head) / len(head) * rows if head else 0.0
        return TokenEstimate(tokens, rows, len(head), spread=False)
    k = min(ESTIMATE_SLICES, len(slices), sample_rows)
    chosen = sorted({round(i * (len(slices) - 1) / max(k - 1, 1)) for i in range(k)})
    per = -(-sample_rows // len(chosen))
    densities: list[float] = []
    sampled = 0
    for index in chosen:
        run = list(itertools.islice(slices[index].rows(batch_rows=per), per))
        size = sum(_json_line_bytes(r) for r in run)
        if size:
            densities.append(tokens_of(run) / size)
        sampled += len(run)
    total = sum(s.weight for s in slices)  # the files' bytes
    tokens = float(np.mean(densities)) * total if densities else 0.0
    return TokenEstimate(tokens, rows, sampled, spread=True)


def _json_line_bytes(row: Row) -> int:
    """About the bytes of a JSON line that parses to `row` (a bad row's: its reason's)."""
    if isinstance(row, dict):
        return len(json.dumps(row, ensure_ascii=False).encode()) + 1
    return len(str(row)) + 1
