"""Rows into samples, one batch at a time, exactly as ingestion makes them (`process_rows`:
template, assistant mask, truncation, or the reason a row is skipped), and what other
callers need of it: `tokenize_conversations` (regenerated answers, benchmarks) and
`estimate_tokens` (the checks before ingestion; in a child process of its own at a
coordinator's submit: estimate.py)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hsx.ingest.images import ImageRefused, ImageSettings, read_image
from hsx.ingest.limits import IngestLimits, RenderTimeout, time_limit
from hsx.ingest.rows import Chat, Sample, Text, classify
from hsx.ingest.sources import DatasetLike, DatasetSource, FilesSource, Row, resolve_source
from hsx.ingest.tokenizer import TemplateLimitError, chat_samples, encode, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def process_rows(rows: list[Row], tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 max_seq_len: int, kwargs: dict[str, Any], limits: IngestLimits | None = None,
                 *, raise_over_limit: bool = False, images: ImageSettings | None = None
                 ) -> list[Sample | str]:
    """One result per row, in row order: a sample, or the reason the row is skipped. A
    chat whose template passes a limit (`limits`, else this process's: limits.py) is
    skipped too, or with `raise_over_limit` raises TemplateLimitError. `images`: the
    job's (hsx.spec.ImageSpec), else a chat with an image part is a bad row."""
    work = [classify(row, vocab_size, images=images is not None) for row in rows]
    results: list[Sample | str | None] = [w if isinstance(w, str | Sample) else None
                                           for w in work]

    texts = {i: w.text for i, w in enumerate(work) if isinstance(w, Text)}
    for i, ids in zip(texts, encode(tokenizer, list(texts.values()), special=True),
                      strict=True):
        results[i] = (Sample(np.asarray(ids, dtype=np.int32), np.ones(len(ids), np.uint8),
                              truncated=False) if ids else "the text produced no tokens")

    chats = {i: w for i, w in enumerate(work) if isinstance(w, Chat)}
    chat_at = list(chats)
    samples = chat_samples(tokenizer, list(chats.values()), kwargs, limits,
                           raise_over_limit=raise_over_limit)
    for i, sample in zip(chat_at, samples, strict=True):
        if isinstance(sample, Sample) and not sample.loss_mask.any():
            sample = "the chat template renders no tokens for the assistant messages"
        if isinstance(sample, Sample):
            sample.messages = chats[i].messages
            if chats[i].images and images is not None:
                sample = with_images(sample, chats[i].images, images, max_seq_len,
                                     limits or IngestLimits.from_env())
        results[i] = sample

    final: list[Sample | str] = []
    for i, r in enumerate(results):
        if r is None:
            raise RuntimeError(f"row {i} of the batch was not processed")
        if isinstance(r, Sample) and r.tokens > max_seq_len:  # (images: with_images)
            r = Sample(r.input_ids[:max_seq_len], r.loss_mask[:max_seq_len], truncated=True,
                        messages=r.messages)
            if i in chats and not r.loss_mask.any():
                r = (f"no assistant tokens within the first {max_seq_len} tokens "
                     "(max_seq_len); the row would train on nothing")
        final.append(r)
    return final


def with_images(sample: Sample, sources: list[Any], images: ImageSettings, max_seq_len: int,
                limits: IngestLimits) -> Sample | str:
    """A chat's sample with its images read (images.py, within the row's CPU time) and
    counted as the model's processor expands them: `length` is its tokens as captured,
    each image's vision tokens included. One longer than `max_seq_len` loses its text
    after its last image; one whose images end past it is a bad row (an image is never
    cut)."""
    policy = images.policy
    if len(sources) > policy.max_per_row:
        return (f"the row holds {len(sources)} images, over images.max_per_row "
                f"({policy.max_per_row})")
    ids = sample.input_ids.tolist()
    tokens = images.tokens()  # once a process; one that cannot load fails the ingestion
    try:
        with time_limit(limits.template_seconds):
            read = [read_image(source, policy, k) for k, source in enumerate(sources)]
            expansions = [tokens.expansion(image.decoded()) for image in read]
            expanded = len(tokens.expand(ids, expansions))
    except RenderTimeout:
        return (f"its images took more than {limits.template_seconds:g} s of CPU to read "
                "and process (HSX_TEMPLATE_SECONDS)")
    except (ImageRefused, ValueError) as err:
        return str(err)
    mask, truncated = sample.loss_mask, False
    if expanded > max_seq_len:
        last = max(i for i, t in enumerate(ids) if t == tokens.image_token_id)
        images_end = last + 1 + expanded - len(ids)  # its last vision token, plus one
        if images_end > max_seq_len:
            return (f"its images end at token {images_end:,} once expanded, past max_seq_len "
                    f"({max_seq_len:,}); an image is never cut")
        keep = len(ids) - (expanded - max_seq_len)
        ids, mask, truncated, expanded = ids[:keep], mask[:keep], True, max_seq_len
        if not mask.any():
            return (f"no assistant tokens within the first {max_seq_len} tokens "
                    "(max_seq_len) once its images are expanded; the row would train on "
                    "nothing")
    return Sample(np.asarray(ids, dtype=np.int32), mask, truncated=truncated,
                  messages=sample.messages, images=[image.data for image in read],
                  length=expanded)


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


@dataclass
class EstimateSample:
    """The rows an estimate tokenizes, read (`read_estimate_sample`), and what their
    tokens are scaled by: runs of rows with their bytes from places spread over a
    JSON lines dataset (`total_bytes` is the files'), else one run of its first rows."""

    runs: list[tuple[list[Row], int]]
    rows: int  # the dataset's
    total_bytes: int
    spread: bool

    @property
    def sampled(self) -> int:
        return sum(len(run) for run, _ in self.runs)


def estimate_tokens(
    dataset: DatasetLike, tokenizer_path: str, max_seq_len: int, *, sample_rows: int = 256,
    chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False,
    limits: IngestLimits | None = None, images: ImageSettings | None = None,
) -> TokenEstimate:
    """The dataset's tokens, estimated from about `sample_rows` rows tokenized as
    ingestion would. Quick (seconds), for checks before ingestion. A sample row whose
    chat template passes a limit (limits.py: `limits`, else this process's) raises
    TemplateLimitError: the dataset's rows are like it, and ingestion would drop them.

    JSON lines: the rows come in equal runs from the starts of up to ESTIMATE_SLICES of
    the source's slices (cut by bytes), spread from its first to its last, so that a
    dataset sorted by length, or files of different lengths, are not judged by their
    first rows; their mean tokens per byte times the source's bytes is the estimate.
    Each run reads a few lines at an offset. Other sources (Parquet, whose slices are
    row groups a read decompresses whole; a hub dataset) are judged by their first rows
    times their row count."""
    limits = limits or IngestLimits.from_env()
    sample = read_estimate_sample(resolve_source(dataset), sample_rows, limits)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
    return estimate_from_sample(sample, tokenizer, max_seq_len, chat_template_kwargs, limits,
                                images)


def read_estimate_sample(source: DatasetSource, sample_rows: int, limits: IngestLimits
                         ) -> EstimateSample:
    """The rows `estimate_tokens` tokenizes (see there), read within `limits`, and the
    dataset's row count."""
    rows = source.count_rows()
    slices = [replace(s, limits=limits) for s in source.slices()] if (
        isinstance(source, FilesSource) and source.kind == "jsonl") else []
    if len(slices) < 2:
        head = list(itertools.islice(source.rows(limits=limits), sample_rows))
        return EstimateSample([(head, 0)], rows, 0, spread=False)
    k = min(ESTIMATE_SLICES, len(slices), sample_rows)
    chosen = sorted({round(i * (len(slices) - 1) / max(k - 1, 1)) for i in range(k)})
    per = -(-sample_rows // len(chosen))
    runs = []
    for index in chosen:
        run = list(itertools.islice(slices[index].rows(batch_rows=per), per))
        runs.append((run, sum(_json_line_bytes(r) for r in run)))
    total = sum(s.weight for s in slices)  # the files' bytes
    return EstimateSample(runs, rows, total, spread=True)


def estimate_from_sample(sample: EstimateSample, tokenizer: PreTrainedTokenizerBase,
                         max_seq_len: int, chat_template_kwargs: dict[str, Any] | None = None,
                         limits: IngestLimits | None = None,
                         images: ImageSettings | None = None) -> TokenEstimate:
    """The sample's rows tokenized, scaled to the dataset (see `estimate_tokens`)."""
    kwargs = dict(chat_template_kwargs or {})

    def tokens_of(run: list[Row]) -> int:
        try:
            results = process_rows(run, tokenizer, len(tokenizer), max_seq_len, kwargs,
                                   limits, raise_over_limit=True, images=images)
        except TemplateLimitError as err:
            raise err.of("one row of the dataset") from None
        return sum(r.tokens for r in results if isinstance(r, Sample))

    if not sample.spread:
        head = sample.runs[0][0] if sample.runs else []
        tokens = tokens_of(head) / len(head) * sample.rows if head else 0.0
        return TokenEstimate(tokens, sample.rows, len(head), spread=False)
    densities = [tokens_of(run) / size for run, size in sample.runs if size]
    tokens = float(np.mean(densities)) * sample.total_bytes if densities else 0.0
    return TokenEstimate(tokens, sample.rows, sample.sampled, spread=True)


def _json_line_bytes(row: Row) -> int:
    """About the bytes of a JSON line that parses to `row` (a bad row's: its reason's)."""
    if isinstance(row, dict):
        return len(json.dumps(row, ensure_ascii=False).encode()) + 1
    return len(str(row)) + 1
