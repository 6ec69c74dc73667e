"""`ingest`: a dataset's rows, batch by batch, into the output's inputs.arrow (samples)
and errors.arrow (bad rows and why). The rows are tokenized in child processes that
are killed when a row will not end (bounded.py), a batch at a time (slices.py)."""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hsx.ingest.bounded import (
    TokenizingProcess,
    pool_context,
    tokenize_slice,
    warm_tokenizer,
)
from hsx.ingest.images import ImageSettings
from hsx.ingest.slices import SliceSettings, TokenizedRows
from hsx.ingest.sources import (
    DatasetLike,
    DatasetSource,
    FilesSource,
    SourceSlice,
    resolve_source,
)
from hsx.ingest.tokenizer import load_tokenizer, tokenizer_fingerprint
from hsx.output import IngestRecord, Output, PartRecord
from hsx.output.layout import ERRORS_DIR, INPUTS_DIR

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class IngestProgress:
    """How far an ingestion is: rows read and tokenized, and the share of the dataset
    they are (from the sizes of the slices read: bytes of JSON lines, rows of Parquet;
    0.0 while the first slice of a source that cannot be cut is read)."""

    rows: int
    fraction: float
    rows_in_fraction: int = -1  # the rows of the slices `fraction` covers (-1: `rows`)

    @property
    def rows_expected(self) -> int:
        """The dataset's rows as estimated from the slices read whole: their rows over
        their share (0: unknown yet), never fewer than the rows read. (`rows` over the
        same share, with the rows of the slice being read counted but not its weight,
        climbed through each slice and dropped at its end: 514k to 708k on one 500k
        dataset.)"""
        measured = self.rows if self.rows_in_fraction < 0 else self.rows_in_fraction
        if self.fraction <= 0 or measured <= 0:
            return 0
        return max(self.rows, round(measured / self.fraction))


# Good samples in each part of the inputs table: a part is published (and its units can
# start) every few seconds of one process's tokenizing; ~120 parts for a million chats.
ROWS_PER_PART = 8192


def ingest(
    dataset: DatasetLike,
    tokenizer_path: str,
    max_seq_len: int,
    output: Output | str | Path,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    batch_rows: int = 1024,
    progress: Callable[[IngestProgress], None] | None = None,
    keep_messages: bool = False,
    workers: int = 1,
    executor: Executor | None = None,
    rows_per_part: int | None = None,
    job_fingerprint: str = "",
    first_unit_tokens: int = 0,
    on_part: Callable[[PartRecord, np.ndarray], None] | None = None,
    on_start: Callable[[IngestRecord], None] | None = None,
    images: ImageSettings | None = None,
) -> IngestResult:
    """Tokenize every row of `dataset` into the output's inputs and errors tables, in
    parts of `rows_per_part` good samples (docs/FORMAT.md, "Inputs in parts").

    A part appears only once whole (its tables staged, then published, then its record),
    so a reader never sees half of one, and `on_part(record, lengths)` hears of each as
    it appears (the driver plans units from the lengths). An output that holds some
    parts of the same ingestion (ingest.json: the same dataset, tokenizer, settings and
    `job_fingerprint`; else JobMismatch) goes on after the last one: what was published
    is not tokenized again, and `on_part` hears of those parts first. `on_start` hears
    the ingest.json that holds, before any part: the first ingestion's, if this goes
    on with one (its `first_unit_tokens`, the job's plan rule, is then that one's).
    `progress`, if given, is called as rows are tokenized. `keep_messages` (a job that
    regenerates) keeps each row's parsed conversation in the inputs table's `messages`
    column, and refuses rows that carry none. `images` (a job with `images:`) reads the
    images of chat rows (images.py) into the inputs table's `images` column, and counts
    their vision tokens in `length`; without it a row with an image is a bad row.

    The dataset is read as independent slices (`DatasetSource.slices`: byte ranges of
    JSON lines, runs of Parquet row groups, Arrow files). With `workers` > 1 (or an
    `executor`, e.g. one of Ray tasks: hsx_service.ingest_tasks) the slices are
    tokenized in other processes, at most 2 x workers submitted at a time, and written
    in order: the tables are byte for byte those of one process, and memory stays flat
    in the number of rows. A source of one slice is tokenized here whatever the
    workers: no other process would finish it sooner.
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    source = resolve_source(dataset)  # fail on a bad path before loading a tokenizer
    data_fp = source.fingerprint()
    pool_context()  # the children's server imports meanwhile
    # A local tokenizer's files are hashed; only a hub id's is loaded here (to hash it).
    hub = None if Path(tokenizer_path).expanduser().is_dir() else load_tokenizer(
        tokenizer_path, trust_remote_code=trust_remote_code)
    tok_fp = tokenizer_fingerprint(tokenizer_path, tokenizer=hub)
    settings = SliceSettings(tokenizer_path, tok_fp, trust_remote_code, max_seq_len,
                             dict(chat_template_kwargs or {}), keep_messages, batch_rows,
                             images)
    here = TokenizingProcess(settings)
    try:
        here.start()  # the tokenizer loads in the child: a broken one fails now
        if not here.has_chat_template:
            logger.warning("tokenizer %s has no chat template: rows with messages will be "
                           "recorded as errors", tokenizer_path)
        return _ingest(source, data_fp, settings, here, output, progress=progress,
                       workers=workers, executor=executor, rows_per_part=rows_per_part,
                       job_fingerprint=job_fingerprint, first_unit_tokens=first_unit_tokens,
                       on_part=on_part, on_start=on_start)
    finally:
        here.close()


def _ingest(source: DatasetSource, data_fp: str, settings: SliceSettings,
            here: TokenizingProcess, output: Output | str | Path, *,
            progress: Callable[[IngestProgress], None] | None, workers: int,
            executor: Executor | None, rows_per_part: int | None, job_fingerprint: str,
            first_unit_tokens: int, on_part: Callable[[PartRecord, np.ndarray], None] | None,
            on_start: Callable[[IngestRecord], None] | None) -> IngestResult:
    tok_fp, max_seq_len = settings.tokenizer_fingerprint, settings.max_seq_len
    keep_messages = settings.keep_messages
    out = Output.of(output)
    parallel = executor is not None or workers > 1  # JSON lines cut finer
    wanted = IngestRecord(
        job_fingerprint=job_fingerprint, dataset_fingerprint=data_fp,
        tokenizer_fingerprint=tok_fp, max_seq_len=max_seq_len, keep_messages=keep_messages,
        images=settings.images is not None, rows_per_part=rows_per_part or ROWS_PER_PART,
        slice_bytes=_slice_bytes(source, parallel), first_unit_tokens=first_unit_tokens,
        created_at=time.time())
    record = out.start_ingest(wanted)
    record.check_same(wanted, output=str(out))  # the first ingestion's settings hold
    if on_start is not None:
        on_start(record)
    slices = (source.slices(slice_bytes=record.slice_bytes) if record.slice_bytes
              else source.slices())
    total_weight = sum(s.weight for s in slices)

    parts = _PartBuilder(out, record, on_part)
    parts.resume()
    start, skip = parts.next_slice, parts.next_slice_row
    weight_done = sum(s.weight for s in slices[:start])
    rows_done = parts.rows_end  # the rows of the slices weight_done covers
    tokenized = _tokenized(slices[start:] if not parts.ended else [], here, workers,
                           executor, skip, head=parts.before_first)
    try:
        for index, batches in tokenized:
            index += start
            first = parts.rows_end - (skip if index == start else 0)  # sample_index 0
            for batch in batches:
                parts.add(batch, first, index)
                if progress is not None:
                    progress(IngestProgress(parts.rows_end,
                                            _fraction(weight_done, total_weight), rows_done))
            weight_done += slices[index].weight
            rows_done = parts.rows_end
            if progress is not None:
                progress(IngestProgress(parts.rows_end, _fraction(weight_done, total_weight)
                                        if index + 1 < len(slices) else 1.0, rows_done))
        if not parts.ended:
            parts.finish(len(slices))
    except BaseException:
        parts.abort()
        raise
    finally:
        tokenized.close()  # the pool is shut down before ingest returns or raises
    totals = parts.totals
    result = IngestResult(
        num_rows=parts.rows_end,
        num_samples=totals.samples,
        num_errors=totals.errors,
        num_tokens=totals.tokens,
        num_loss_tokens=totals.loss_tokens,
        num_truncated=totals.truncated,
        lengths=_summarize(parts.counts),
        tokenizer_fingerprint=tok_fp,
        dataset_fingerprint=data_fp,
        inputs_path=out.url(INPUTS_DIR),
        errors_path=out.url(ERRORS_DIR),
    )
    logger.info("ingested %s: %d samples, %d errors, %d tokens in %d parts", source,
                result.num_samples, result.num_errors, result.num_tokens, parts.part)
    return result


@dataclass
class _Totals:
    samples: int = 0
    errors: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0


class _PartBuilder:
    """Tokenized batches into the parts of the inputs and errors tables: a part closes
    at its `rows_per_part`-th good sample, and is published with its record (where the
    source goes on after it, so a resumed ingestion starts there)."""

    def __init__(self, out: Output, record: IngestRecord,
                 on_part: Callable[[PartRecord, np.ndarray], None] | None) -> None:
        self.out = out
        self.per = record.rows_per_part
        self.keep_messages = record.keep_messages
        self.images = record.images
        self.on_part = on_part
        self.part = 0  # the part being written
        self._resumed_at = 0  # the first part this ingestion writes (`resume`)
        self.rows_end = 0  # source rows read into published parts and the open one
        self.next_slice = self.next_slice_row = 0  # where the open part's rows go on
        self.ended = False  # the last part is published
        self.totals = _Totals()
        self.counts = np.zeros(record.max_seq_len + 1, dtype=np.int64)
        self._writers: tuple[Any, Any] | None = None
        self._open = _Totals()  # the open part's
        self._open_lengths: list[np.ndarray] = []

    def resume(self) -> None:
        """Take the parts already published (their records, their lengths)."""
        for rec in self.out.part_records():
            lengths = self.out.part_inputs(rec.part).column("length").to_numpy()
            self._published(rec, lengths)
        self._resumed_at = self.part

    def before_first(self) -> bool:
        """This ingestion has published no part yet (a resumed one: none of its own)."""
        return self.part == self._resumed_at

    def _published(self, rec: PartRecord, lengths: np.ndarray) -> None:
        self.part = rec.part + 1
        self.ended = rec.last
        self.rows_end = rec.rows_end
        self.next_slice, self.next_slice_row = rec.next_slice, rec.next_slice_row
        for name in ("samples", "errors", "tokens", "loss_tokens", "truncated"):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(rec, name))
        np.add.at(self.counts, np.minimum(lengths, len(self.counts) - 1), 1)
        if self.on_part is not None:
            self.on_part(rec, lengths)

    def add(self, batch: TokenizedRows, first: int, slice_index: int) -> None:
        """A slice's batch (its sample_index counted from the slice's row `first`)."""
        inputs, errors = _shifted(batch.inputs, first), _shifted(batch.errors, first)
        truncated = batch.truncated_rows + first
        # A part closes at its per-th sample: the open part never holds per samples.
        while inputs.num_rows and self._open.samples + inputs.num_rows >= self.per:
            need = self.per - self._open.samples
            cut = int(inputs.column(0)[need - 1].as_py()) + 1  # the row after its last
            self._write(inputs.slice(0, need), _before(errors, cut),
                        truncated[truncated < cut])
            inputs, errors = inputs.slice(need), _from(errors, cut)
            truncated = truncated[truncated >= cut]
            self._close(cut, slice_index, cut - first, last=False)
        self._write(inputs, errors, truncated)
        self.rows_end = max(self.rows_end, first + batch.first + batch.rows)

    def _write(self, inputs: pa.RecordBatch, errors: pa.RecordBatch,
               truncated: np.ndarray) -> None:
        if self._writers is None:
            self._writers = self.out.part_writers(self.part, messages=self.keep_messages,
                                                  images=self.images)
        self._writers[0].write(inputs)
        self._writers[1].write(errors)
        self._open.samples += inputs.num_rows
        self._open.errors += errors.num_rows
        if inputs.num_rows:
            self._open.tokens += int(pc.sum(inputs.column("length")).as_py())
            self._open.loss_tokens += int(pc.sum(pc.list_flatten(
                inputs.column("loss_mask"))).as_py() or 0)
        self._open.truncated += len(truncated)
        self._open_lengths.append(inputs.column("length").to_numpy())

    def _close(self, rows_end: int, next_slice: int, next_row: int, *, last: bool) -> None:
        if self._writers is None:
            self._writers = self.out.part_writers(self.part, messages=self.keep_messages,
                                                  images=self.images)
        inputs, errors = self._writers
        inputs.commit()
        if self._open.errors:
            errors.commit()
        else:
            errors.abort()
        self._writers = None
        o = self._open
        rec = PartRecord(part=self.part, samples=o.samples, errors=o.errors,
                         rows_end=rows_end, tokens=o.tokens, loss_tokens=o.loss_tokens,
                         truncated=o.truncated, next_slice=next_slice,
                         next_slice_row=next_row, last=last)
        self.out.publish_part(rec)
        lengths = (np.concatenate(self._open_lengths) if self._open_lengths
                   else np.zeros(0, np.int32))
        self._open, self._open_lengths = _Totals(), []
        self._published(rec, lengths)

    def finish(self, slices: int) -> None:
        """The dataset (of `slices` slices) ended: the open part, maybe empty, is the last."""
        self._close(self.rows_end, slices, 0, last=True)

    def abort(self) -> None:
        if self._writers is not None:
            for writer in self._writers:
                writer.abort()
            self._writers = None


def _before(errors: pa.RecordBatch, cut: int) -> pa.RecordBatch:
    return errors.filter(pc.less(errors.column(0), cut)) if errors.num_rows else errors


def _from(errors: pa.RecordBatch, cut: int) -> pa.RecordBatch:
    return (errors.filter(pc.greater_equal(errors.column(0), cut)) if errors.num_rows
            else errors)


# JSON lines slices for several workers: small enough that the last ones leave no worker
# idle for long, and that the slices in flight (2 per worker) hold little memory, the
# same whatever the dataset's size; large enough that a slice's task costs little.
PARALLEL_SLICE_BYTES = 2**20


def _slice_bytes(source: DatasetSource, parallel: bool) -> int:
    """How JSON lines are cut (0: the source's default); for several workers finer (the
    tables do not depend on the cuts)."""
    return PARALLEL_SLICE_BYTES if parallel and isinstance(source, FilesSource) else 0


def _slices(source: DatasetSource, workers: int) -> list[SourceSlice]:
    """The source's slices as `ingest` with `workers` processes cuts them."""
    slice_bytes = _slice_bytes(source, workers > 1)
    return source.slices(slice_bytes=slice_bytes) if slice_bytes else source.slices()


def _fraction(done: int, total: int) -> float:
    return min(done / total, 1.0) if total > 0 else 0.0


def _tokenized(slices: list[SourceSlice], here: TokenizingProcess, workers: int,
               executor: Executor | None, skip: int = 0,
               head: Callable[[], bool] = lambda: False,
               ) -> Generator[tuple[int, Iterable[TokenizedRows]], None, None]:
    """(slice number, its batches) in slice order: tokenized by `here` (this process's
    child: bounded.py), one batch at a time, or by `executor` (else a pool of `workers`
    threads, each with a child of its own), a window of slices at once. The first
    slice's first `skip` rows are read but not tokenized (a resumed ingestion published
    them).

    With an executor, the first slices are tokenized by `here` while `head()` holds
    (`ingest`: until its first part is published, which the caller does as it takes a
    slice's batches), and the executor's children start meanwhile, each loading its
    tokenizer (`warm_tokenizer`); the engines wait for the first part. Then they take
    the slices after the head."""
    if len(slices) < 2 or (executor is None and workers <= 1):
        for index, slc in enumerate(slices):
            yield index, here.batches(slc, skip if index == 0 else 0)
        return
    settings = here.settings
    owned = executor is None
    pool = executor or ThreadPoolExecutor(workers, thread_name_prefix="hsx-tokenize")
    window = 2 * max(workers, 1)
    pending: deque[Future[list[TokenizedRows]]] = deque()
    warming = [pool.submit(warm_tokenizer, settings) for _ in range(max(workers, 1))]
    try:
        first = 0
        while first < len(slices) and head():
            yield first, here.batches(slices[first], skip if first == 0 else 0)
            first += 1
        here.close()  # the executor's children take the rest
        submitted = first
        for index in range(first, len(slices)):
            while submitted < len(slices) and len(pending) < window:
                pending.append(pool.submit(tokenize_slice, slices[submitted], settings,
                                           skip if submitted == 0 else 0))
                submitted += 1
            yield index, pending.popleft().result()
    finally:
        for warm in warming:
            warm.cancel()
        for future in pending:
            future.cancel()
        if owned:
            pool.shutdown(wait=True, cancel_futures=True)


def _shifted(batch: pa.RecordBatch, offset: int) -> pa.RecordBatch:
    """`batch` with `offset` added to its sample_index (column 0)."""
    if not offset or not batch.num_rows:
        return batch
    index = pc.add(batch.column(0), pa.scalar(offset, pa.int64()))
    return pa.RecordBatch.from_arrays([index, *batch.columns[1:]], schema=batch.schema)


def commonest_reasons(errors: pa.Table, n: int = 3) -> list[tuple[str, int]]:
    """The `n` commonest reasons of an errors table, with how many rows each: reasons
    that differ only in their numbers (a row's size, a message's position) count as one,
    said as the first row that gave it."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for reason in errors.column("reason").to_pylist():
        key = re.sub(r"\d+", "#", reason)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, reason)
    ranked = sorted(counts, key=lambda k: -counts[k])[:n]  # stable: the first seen first
    return [(first[k], counts[k]) for k in ranked]


def nothing_to_capture(result: IngestResult, errors: pa.Table, output: str) -> str:
    """Why an ingestion that kept no sample gives nothing to capture: the dataset has no
    rows, or every one is bad, and then the commonest reasons and their counts (the
    errors table, `errors`, of `output` has each row's)."""
    if not result.num_rows:
        return "it has no rows, so there is nothing to capture"
    commonest = commonest_reasons(errors)
    said = [f"{count:,} {'row' if count == 1 else 'rows'}: {reason}"
            for reason, count in commonest]
    other = errors.num_rows - sum(count for _, count in commonest)
    if other:
        said.append(f"{other:,} {'row' if other == 1 else 'rows'} for other reasons")
    return (f"none of its {result.num_rows:,} rows can be used, so there is nothing to "
            f"capture; the commonest reasons: {'; '.join(said)} (each row's reason is in "
            f"the errors table of {output})")


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
