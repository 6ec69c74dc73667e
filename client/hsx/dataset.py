"""`HiddenStatesDataset`: a trainer's view of an hsx output, finished or still growing.

Only committed shards are read (see `hsx.output`): a sample becomes visible when the
commit record of its unit appears, never half-written. The output may be a local
directory (shards memory-mapped, zero-copy) or an object-store prefix such as
`s3://bucket/prefix` (each shard's index fetched once when it is opened, then one ranged
GET per sample: random access costs one request, and nothing but the open shards'
indexes is cached). The dataset is a plain class with `__len__`/`__getitem__`, so
`torch.utils.data.DataLoader` takes it as a map-style dataset without this module
importing torch; it pickles without its open files or connections, so DataLoader
workers (fork or spawn) each open shards lazily for themselves.

Indices: `ds[i]` counts committed samples in unit order. Units can commit out of order,
so while a job is still running `refresh()` may shift indices; a finished output (or a
dataset that is never refreshed) has stable ones. To consume a running job, iterate
with `follow=True`: it yields each shard's samples once, as the shard appears.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools
import logging
import operator
import os
import pickle
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, SupportsIndex

from hsx.output import CommitRecord, Manifest, Output, ShardReader
from hsx.output.shards import MODALITY_MASK
from hsx.regenerate import loads_messages

logger = logging.getLogger(__name__)

BackendChoice = Literal["auto", "torch", "numpy"]

DEFAULT_MAX_OPEN_SHARDS = 64
"""Shards kept mapped per process. Each mapping holds a file descriptor, so an output of
thousands of shards must not keep them all open."""


class _Index(NamedTuple):
    """Commit records in unit order, each one's first global index, and the total."""

    order: tuple[CommitRecord, ...]
    starts: tuple[int, ...]
    total: int


class HiddenStatesDataset:
    """Samples of an hsx output: {"input_ids", "loss_mask", "hidden_states", "sample_index"}.

    `uri` is a path, a `file://` URI, an object-store URI (`s3://bucket/prefix`,
    credentials and endpoint from the usual `AWS_*` variables), or an `Output`.
    `hidden_states` is [T, L, H] bf16 (fp8 shards are dequantized), with L the layer
    ids in `manifest.layers`; `input_ids` is int32, `loss_mask` uint8 — torch tensors
    when the backend is torch ("auto": torch if it is installed), numpy otherwise (bf16
    as `ml_dtypes.bfloat16`). On local disk tensors are zero-copy views of the
    memory-mapped shards. On an output of a job with `regenerate:`, `ds[i]` also holds
    `regeneration`: the conversation captured and the dataset's original, with the
    sampling seeds and finish reasons (`regeneration(record, sample_index)`). On an
    output of a job that took images (`takes_images`), each sample also holds
    `modality_mask` [T] uint8: 1 on an image's vision tokens, 0 on text (their
    `loss_mask` is 0).

    `follow=True` makes `iter(ds)` and `shards()` wait for new shards (checking every
    `poll_interval` seconds) until the job has written complete.json; `timeout` bounds
    how long they wait without any new shard before raising TimeoutError.
    """

    def __init__(
        self,
        uri: str | Path | Output,
        *,
        follow: bool = False,
        backend: BackendChoice = "auto",
        poll_interval: float = 1.0,
        timeout: float | None = None,
        max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
    ) -> None:
        if backend not in ("auto", "torch", "numpy"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'numpy', got {backend!r}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.output = Output.of(uri)
        self.uri = str(self.output)
        self.follow = follow
        self.backend = backend
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.max_open_shards = max_open_shards
        self.manifest: Manifest = self.output.manifest()
        self._records: dict[int, CommitRecord] = {}
        self._index = _Index((), (), 0)
        self._init_process_state()
        self.refresh()

    # -- process-local state (not pickled)

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        # unit -> sample_index -> its regenerations row, for outputs that regenerate
        self._regenerations: OrderedDict[int, dict[int, dict[str, Any]]] = OrderedDict()
        self._resolved: Literal["torch", "numpy"] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_pid", "_lock", "_readers", "_regenerations", "_resolved"):
            state.pop(key, None)
        return state

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker): new locks, readers and connections."""
        self._init_process_state()
        self.output = pickle.loads(pickle.dumps(self.output))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    # -- commit records

    def refresh(self) -> int:
        """Pick up units committed since the last call; returns how many are new."""
        fresh = self.output.commits(skip=self._records)
        for record in fresh:
            self._records[record.unit] = record
        new = len(fresh)
        if new:
            order = tuple(self._records[u] for u in sorted(self._records))
            counts = [r.samples for r in order]
            starts = tuple([0, *itertools.accumulate(counts)][:-1])
            # One assignment, so a concurrent __getitem__ sees the old or the new index.
            self._index = _Index(order, starts, sum(counts))
        return new

    @property
    def records(self) -> list[CommitRecord]:
        """The commit records read so far, in unit order."""
        return list(self._index.order)

    @property
    def complete(self) -> bool:
        """True once the job has committed every unit (complete.json exists)."""
        return self.output.is_complete()

    def errors(self) -> list[dict[str, Any]]:
        """Every sample that has no hidden states, with the reason, by sample_index.

        Rows refused at ingestion (errors.arrow) plus samples a worker could not extract
        (the "errors" of each commit record read so far).
        """
        return [e.model_dump() for e in self.output.errors(records=self._index.order)]

    def verify(self) -> int:
        """Check every committed shard's size and checksums; returns how many were checked.

        Raises ShardCorrupt naming every shard that fails.
        """
        return self.output.verify(self._index.order)

    # -- map-style access

    def __len__(self) -> int:
        return self._index.total

    def __getitem__(self, index: SupportsIndex) -> dict[str, Any]:
        idx = self._index
        i = operator.index(index)
        if i < 0:
            i += idx.total
        if not 0 <= i < idx.total:
            raise IndexError(f"index {index} out of range for {idx.total} samples")
        k = bisect.bisect_right(idx.starts, i) - 1
        record = idx.order[k]
        sample = self._reader(record).sample(i - idx.starts[k], backend=self._backend())
        if record.regenerations is not None:
            sample["regeneration"] = self.regeneration(record, int(sample["sample_index"]))
        return sample

    def regeneration(self, record: CommitRecord, sample_index: int) -> dict[str, Any]:
        """A regenerating job's answer for one sample of a committed unit: `messages`
        (the conversation captured), `original` (the dataset's), and per regenerated
        turn its `seeds` and `finish_reasons`, `generated_tokens`, `truncated`."""
        with self._lock:
            rows = self._regenerations.get(record.unit)
        if rows is None:
            table = self.output.read_regenerations(record)
            rows = {} if table is None else {int(r["sample_index"]): r
                                             for r in table.to_pylist()}
            with self._lock:
                self._regenerations[record.unit] = rows
                while len(self._regenerations) > self.max_open_shards:
                    self._regenerations.popitem(last=False)
        row = dict(rows[sample_index])
        row["messages"] = loads_messages(row["messages"])
        row["original"] = loads_messages(row["original"])
        return row

    def __repr__(self) -> str:
        return (
            f"HiddenStatesDataset({self.uri!r}, samples={self._index.total}, "
            f"shards={len(self._index.order)}, complete={self.complete})"
        )

    # -- iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        backend = self._backend()
        for reader in self.shards():
            for j in range(len(reader)):
                yield reader.sample(j, backend=backend)

    def shards(self, records: Iterable[CommitRecord] | None = None, *,
               stop: Callable[[], bool] | None = None) -> Iterator[ShardReader]:
        """Committed shards as ShardReaders (with `.record`), in unit order.

        With follow=True: each shard once, as its commit appears (new ones in unit
        order), until complete.json exists and every committed shard has been yielded,
        or `stop()` says so while it waits for the next commit.
        With `records` (commit records from `records`, e.g. shuffled): those shards, in
        that order.
        """
        if records is None:
            records = self._follow_records(stop) if self.follow else iter(self._index.order)
        for record in records:
            yield self._reader(record)

    def _follow_records(self, stop: Callable[[], bool] | None) -> Iterator[CommitRecord]:
        seen: set[int] = set()
        last_new = time.monotonic()
        while True:
            # Look for complete.json before listing commits: the job writes it after the
            # last commit, so that listing is then sure to hold every unit.
            done = self.complete
            self.refresh()
            fresh = [r for r in self._index.order if r.unit not in seen]
            for record in fresh:
                seen.add(record.unit)
                yield record
            if fresh:
                last_new = time.monotonic()
            if done:
                self._check_all_units(seen)
                return
            if self.timeout is not None and time.monotonic() - last_new > self.timeout:
                raise TimeoutError(
                    f"{self.uri}: no new shard for {self.timeout:g}s and the job is not "
                    f"complete ({len(seen)} shards read)"
                )
            if stop is not None and stop():
                return
            time.sleep(self.poll_interval)

    def _check_all_units(self, seen: set[int]) -> None:
        missing = {u.unit for u in self.manifest.units} - seen
        if missing:
            logger.warning(
                "%s is marked complete but %d planned unit(s) have no commit record, e.g. %s",
                self.uri, len(missing), sorted(missing)[:5],
            )

    # -- Hugging Face datasets

    def to_hf_dataset(self) -> Any:
        """The committed samples as a map-style `datasets.Dataset`, without copying.

        Its Arrow columns are views of the memory-mapped shards (one chunk per shard):
        `sample_index` int64, `input_ids` list<int32>, `loss_mask` list<uint8>, and
        `hidden_states` [T][L][H] as the stored bit patterns — uint16 for bf16 (Arrow has
        no bfloat16), uint8 for fp8 e4m3 with its per-token, per-layer `scales` [T][L]
        float32 beside it; a job that took images adds `modality_mask` list<uint8> (1 on
        an image's vision tokens). Rows come in the order of `ds[i]`; the table holds the shards
        committed when this is called.

        Reading rows through `datasets`' numpy or torch formats copies them and turns
        integers into int64 (its rule); `with_format("arrow")` stays zero-copy, and
        `np.asarray(...).astype(np.uint16).view(ml_dtypes.bfloat16)` gives bf16 states
        back. For training, `to_hf_iterable()` yields the tensors themselves.
        """
        import datasets
        import numpy as np
        import pyarrow as pa

        chunks: dict[str, list[pa.Array]] = {}
        images = self.takes_images
        for reader in self.shards(list(self._index.order)):
            offsets = pa.array(np.asarray(reader.offsets, dtype=np.int32))
            hidden = reader.tensor("hidden_states")
            bits = hidden.view(np.uint16 if hidden.dtype.itemsize == 2 else np.uint8)
            _, layers, hidden_size = bits.shape
            columns = {
                "sample_index": pa.array(np.asarray(reader.sample_indices, dtype=np.int64)),
                "input_ids": pa.ListArray.from_arrays(offsets, _arrow(reader.tensor("input_ids"))),
                "loss_mask": pa.ListArray.from_arrays(offsets, _arrow(reader.tensor("loss_mask"))),
                "hidden_states": pa.ListArray.from_arrays(offsets, _fixed(_arrow(bits),
                                                                          layers, hidden_size)),
            }
            if reader.storage_dtype == "fp8":
                columns["scales"] = pa.ListArray.from_arrays(
                    offsets, _fixed(_arrow(reader.tensor("scales")), layers))
            if images:
                modality = (reader.tensor(MODALITY_MASK) if reader.has_modality
                            else np.zeros(reader.num_tokens, np.uint8))
                columns[MODALITY_MASK] = pa.ListArray.from_arrays(offsets, _arrow(modality))
            for name, array in columns.items():
                chunks.setdefault(name, []).append(array)
        if not chunks:
            raise ValueError(f"{self.uri} has no committed shard yet")
        table = pa.table({name: pa.chunked_array(arrays) for name, arrays in chunks.items()})
        info = datasets.DatasetInfo(description=(
            f"hsx hidden states of {self.uri}: layers {self.manifest.layers}, "
            f"storage {self.manifest.storage_dtype} (hidden_states holds its "
            "bit patterns)"))
        return datasets.Dataset(datasets.table.InMemoryTable(table), info=info)

    @property
    def takes_images(self) -> bool:
        """The output's job took images (`images:`): its samples carry `modality_mask`
        (1 on an image's vision tokens; docs/FORMAT.md)."""
        return bool((self.manifest.spec or {}).get("images"))

    def to_hf_iterable(self) -> Any:
        """The committed samples as a `datasets.IterableDataset` yielding what `ds[i]`
        gives: the zero-copy views of the mapped shards (torch tensors with the torch
        backend, bf16 states; fp8 dequantized), passed through untouched as long as no
        format is set on it. Shards are spread over a DataLoader's workers (each gets
        whole shards); `.shuffle(seed, buffer_size)` shuffles shards and samples.
        """
        import datasets

        return datasets.IterableDataset.from_generator(
            _hf_samples, gen_kwargs={"shards": list(self._index.order), "dataset": self})

    # -- internals

    def _backend(self) -> Literal["torch", "numpy"]:
        if self._resolved is None:
            if self.backend == "numpy":
                self._resolved = "numpy"
            elif self.backend == "torch" or "torch" in sys.modules:
                self._resolved = "torch"
            else:
                has_torch = importlib.util.find_spec("torch") is not None
                self._resolved = "torch" if has_torch else "numpy"
        return self._resolved

    def _reader(self, record: CommitRecord) -> ShardReader:
        if self._pid != os.getpid():
            # Forked (e.g. a DataLoader worker): the parent's lock may be held; start clean.
            self._after_fork()
        unit = record.unit
        with self._lock:
            reader = self._readers.get(unit)
            if reader is not None:
                self._readers.move_to_end(unit)
                return reader
        reader = self.output.open_shard(record)
        with self._lock:
            self._readers[unit] = reader
            while len(self._readers) > self.max_open_shards:
                # Dropped, not closed: a caller may still be iterating it. The mapping
                # (and its file descriptor) goes when the last reference does.
                self._readers.popitem(last=False)
        return reader


def _hf_samples(shards: list[CommitRecord], dataset: HiddenStatesDataset) -> Iterator[Any]:
    """The generator behind `to_hf_iterable` (module level: it pickles to workers)."""
    backend = dataset._backend()
    for reader in dataset.shards(shards):
        for j in range(len(reader)):
            yield reader.sample(j, backend=backend)


def _arrow(array: Any) -> Any:
    """A flat Arrow array over a numpy array's memory (no copy; it keeps the array alive)."""
    import pyarrow as pa

    flat = array.reshape(-1)
    return pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat.size,
                                 [None, pa.py_buffer(flat)])


def _fixed(values: Any, *sizes: int) -> Any:
    """`values` grouped into nested fixed-size lists, innermost size last."""
    import pyarrow as pa

    for size in reversed(sizes):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    return values
