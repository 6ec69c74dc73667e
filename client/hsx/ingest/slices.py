"""A slice of a dataset's rows into tokenized batches: what a process that tokenizes for
an ingestion runs (bounded.py starts and watches it; pipeline.py writes its batches into
the output's tables).

A batch's rows become samples in samples.py; here they are numbered, split into good
samples and bad rows with their reasons, and put into the inputs and errors tables'
record batches.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from hsx import settings as hsx_settings
from hsx.ingest.images import ImageSettings
from hsx.ingest.limits import IngestLimits
from hsx.ingest.rows import Sample
from hsx.ingest.samples import process_rows
from hsx.ingest.sources import Row, SourceSlice
from hsx.ingest.tokenizer import load_tokenizer
from hsx.output.tables import ERRORS_SCHEMA, inputs_schema
from hsx.regenerate import dumps_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_REASON_CHARS = 1000

NOT_A_CHAT = ("regenerate needs a conversation (`messages` or `conversations`) to "
              "answer; this row has none")

# "1" in a process that tokenizes slices for the one that ingests: set in bounded.py's
# child processes, and by the runtime env of Ray's tasks (hsx_service.ingest_tasks).
TOKENIZING_PROCESS_ENV = hsx_settings.TOKENIZING_PROCESS.name


def reason_text(reason: str) -> str:
    """A reason as the errors table can hold it: quoted row content may carry lone
    surrogates (not UTF-8: shown escaped) and be megabytes long (cut)."""
    text = reason.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


@dataclass(frozen=True)
class SliceSettings:
    """What tokenizing a slice needs besides its rows (sent to each process)."""

    tokenizer_path: str
    tokenizer_fingerprint: str  # a process that loaded another version loads it again
    trust_remote_code: bool
    max_seq_len: int
    chat_template_kwargs: dict[str, Any]
    keep_messages: bool
    batch_rows: int
    images: ImageSettings | None = None  # the job takes images (hsx.spec.ImageSpec)


@dataclass
class TokenizedRows:
    """Rows of a slice, tokenized: inputs and errors with sample_index counted from the
    slice's first row, and which samples were truncated (the sums and the histogram
    are taken as the rows go into parts)."""

    rows: int
    inputs: pa.RecordBatch
    errors: pa.RecordBatch
    truncated_rows: np.ndarray  # sample_index of each truncated sample
    first: int  # sample_index of the batch's first row

    @classmethod
    def bad_row(cls, index: int, reason: str, *, keep_messages: bool, images: bool = False
                ) -> TokenizedRows:
        """Row `index` of a slice, recorded as bad for `reason` without being tokenized
        (its tokenizing process was stopped: bounded.py)."""
        return cls(rows=1, inputs=inputs_batch([], [], messages=keep_messages, images=images),
                   errors=pa.RecordBatch.from_arrays(
                       [pa.array([index], pa.int64()), pa.array([reason_text(reason)])],
                       schema=ERRORS_SCHEMA),
                   truncated_rows=np.zeros(0, np.int64), first=index)


def slice_batches(slc: SourceSlice, settings: SliceSettings,
                  tokenizer: PreTrainedTokenizerBase, skip: int = 0, alone_until: int = 0,
                  ) -> Iterator[TokenizedRows]:
    """The slice's rows from row `skip` on, tokenized `settings.batch_rows` at a time;
    the rows before `alone_until` one at a time (bounded.py finds a row that stopped its
    process so)."""
    vocab_size = len(tokenizer)
    first = skip
    rows = itertools.islice(slc.rows(settings.batch_rows), skip, None)
    alone = itertools.islice(rows, max(alone_until - skip, 0))
    for batch in itertools.chain(batched(alone, 1), batched(rows, settings.batch_rows)):
        yield tokenize_batch(batch, first, tokenizer, vocab_size, settings, slc.limits)
        first += len(batch)


def tokenize_batch(batch: list[Row], first: int, tokenizer: PreTrainedTokenizerBase,
                   vocab_size: int, settings: SliceSettings, limits: IngestLimits
                   ) -> TokenizedRows:
    """One batch of rows, the first numbered `first`, within `limits` (the slice's:
    those of the process that cut the source, wherever this runs)."""
    results = process_rows(batch, tokenizer, vocab_size, settings.max_seq_len,
                           settings.chat_template_kwargs, limits, images=settings.images)
    if settings.keep_messages:
        results = [NOT_A_CHAT if isinstance(r, Sample) and r.messages is None
                   else r for r in results]
    good_idx: list[int] = []
    good: list[Sample] = []
    bad_idx: list[int] = []
    bad: list[str] = []
    cut: list[int] = []
    for offset, outcome in enumerate(results):
        if isinstance(outcome, str):
            bad_idx.append(first + offset)
            bad.append(reason_text(outcome))
        else:
            good_idx.append(first + offset)
            good.append(outcome)
            if outcome.truncated:
                cut.append(first + offset)
    return TokenizedRows(
        rows=len(batch),
        inputs=inputs_batch(good_idx, good, messages=settings.keep_messages,
                            images=settings.images is not None),
        errors=pa.RecordBatch.from_arrays(
            [pa.array(bad_idx, pa.int64()), pa.array(bad, pa.string())],
            schema=ERRORS_SCHEMA),
        truncated_rows=np.asarray(cut, dtype=np.int64), first=first)


def batched(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def inputs_batch(indices: list[int], samples: list[Sample], *, messages: bool = False,
                 images: bool = False) -> pa.RecordBatch:
    lengths = np.fromiter((s.tokens for s in samples), dtype=np.int32, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum([len(s.input_ids) for s in samples], out=offsets[1:])
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
    if messages:
        texts = [dumps_messages(s.messages or []) for s in samples]
        columns.append(pa.array(texts, type=pa.string()))
    if images:
        columns.append(pa.array([s.images or [] for s in samples],
                                type=pa.list_(pa.large_binary())))
    return pa.RecordBatch.from_arrays(columns, schema=inputs_schema(messages=messages,
                                                                   images=images))


# A process that tokenizes slices loads the tokenizer once.
_WORKER_TOKENIZER: dict[tuple[str, str, bool], PreTrainedTokenizerBase] = {}


def worker_tokenizer(settings: SliceSettings) -> PreTrainedTokenizerBase:
    """The tokenizer of `settings` in a process that tokenizes slices, loaded once."""
    key = (settings.tokenizer_path, settings.tokenizer_fingerprint,
           settings.trust_remote_code)
    if hsx_settings.TOKENIZING_PROCESS.get():
        one_core_behind_the_engines()
    if key not in _WORKER_TOKENIZER:
        _WORKER_TOKENIZER.clear()
        _WORKER_TOKENIZER[key] = load_tokenizer(
            settings.tokenizer_path, trust_remote_code=settings.trust_remote_code)
    return _WORKER_TOKENIZER[key]


def one_core_behind_the_engines() -> None:
    """How a process that tokenizes for the one that ingests runs: on one core (the
    processes are the parallelism, and tokenizers' own threads in every one would fight
    over the same cores), at the lowest priority (Ray starts its workers at nice 15, the
    engines' own). Called for each slice: a priority is a thread's, and this one runs
    the slice."""
    from hsx.output.shards import background_priority

    tokenize_on_one_thread()  # before the tokenizer runs
    background_priority()


def tokenize_on_one_thread() -> None:
    """From now on this process's tokenizers tokenize a batch on the calling thread
    only (TOKENIZERS_PARALLELISM=false, unless set: they read it at every call), not
    on their pool of Rust threads. For a process that tokenizes beside engines: a batch
    on the pool takes more than a core, and even at the lowest priority those threads
    slow a starting CPU engine (Ray runs it at nice 15, not far above;
    benchmarks/bench_first_commit.py)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
