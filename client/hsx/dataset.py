"""`HiddenStatesDataset`: a trainer's view of an hsx output, finished or still growing.

Only committed shards are read (see `hsx.shards`): a sample becomes visible when the
commit record of its unit appears, never half-written. The dataset is a plain class
with `__len__`/`__getitem__`, so `torch.utils.data.DataLoader` takes it as a map-style
dataset without this module importing torch; it pickles without its open files, so
DataLoader workers (fork or spawn) each open shards lazily for themselves.

Indices: `ds[i]` counts committed samples in unit order. Units can commit out of order,
so while a job is still running `refresh()` may shift indices; a finished output (or a
dataset that is never refreshed) has stable ones. To consume a running job, iterate
with `follow=True`: it yields each shard's samples once, as the shard appears.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools
import json
import logging
import operator
import os
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, SupportsIndex

from hsx.layout import COMMITS_DIR, COMPLETE, ERRORS, MANIFEST
from hsx.shards import (
    ShardCorrupt,
    ShardReader,
    load_commit,
    shard_file,
    unit_of_commit_name,
    verify_shard,
)

logger = logging.getLogger(__name__)

BackendChoice = Literal["auto", "torch", "numpy"]

DEFAULT_MAX_OPEN_SHARDS = 64
"""Shards kept mapped per process. Each mapping holds a file descriptor, so an output of
thousands of shards must not keep them all open."""


class _Index(NamedTuple):
    """Commit records in unit order, each one's first global index, and the total."""

    order: tuple[dict[str, Any], ...]
    starts: tuple[int, ...]
    total: int


def resolve_output(uri: str | Path) -> Path:
    """A local directory for `uri` (a path or file:// URI); other schemes are refused."""
    if isinstance(uri, Path):
        return uri
    if "://" not in uri:
        return Path(uri).expanduser()
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme != "file":
        raise ValueError(
            f"{uri}: {parsed.scheme}:// outputs are not supported yet; use a local path "
            "or a file:// URI"
        )
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"{uri}: file:// URIs must name a local path (no host)")
    return Path(urllib.parse.unquote(parsed.path))


class HiddenStatesDataset:
    """Samples of an hsx output: {"input_ids", "loss_mask", "hidden_states", "sample_index"}.

    `hidden_states` is [T, L, H] bf16 (fp8 shards are dequantized), with L the layer
    ids in `manifest["layers"]`; `input_ids` is int32, `loss_mask` uint8 — torch tensors
    when the backend is torch ("auto": torch if it is installed), numpy otherwise (bf16
    as `ml_dtypes.bfloat16`). Tensors are zero-copy views of the memory-mapped shards.

    `follow=True` makes `iter(ds)` and `shards()` wait for new shards (checking every
    `poll_interval` seconds) until the job has written complete.json; `timeout` bounds
    how long they wait without any new shard before raising TimeoutError.
    """

    def __init__(
        self,
        uri: str | Path,
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
        self.uri = str(uri)
        self.root = resolve_output(uri)
        self.follow = follow
        self.backend = backend
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.max_open_shards = max_open_shards
        manifest_path = self.root / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no hsx output at {self.uri}: {manifest_path} does not exist"
            ) from None
        except ValueError as err:
            raise ValueError(f"{manifest_path} is not valid JSON: {err}") from None
        if not isinstance(manifest, dict):
            raise ValueError(f"{manifest_path} is not a JSON object")
        self.manifest: dict[str, Any] = manifest
        self._records: dict[int, dict[str, Any]] = {}
        self._index = _Index((), (), 0)
        self._init_process_state()
        self.refresh()

    # -- process-local state (not pickled)

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._resolved: Literal["torch", "numpy"] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_pid", "_lock", "_readers", "_resolved"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    # -- commit records

    def refresh(self) -> int:
        """Pick up units committed since the last call; returns how many are new."""
        commits = self.root / COMMITS_DIR
        new = 0
        if commits.is_dir():
            with os.scandir(commits) as entries:
                for entry in entries:
                    unit = unit_of_commit_name(entry.name)
                    if unit is None or unit in self._records:
                        continue
                    self._records[unit] = load_commit(Path(entry.path), unit)
                    new += 1
        if new:
            order = tuple(self._records[u] for u in sorted(self._records))
            counts = [int(r["samples"]) for r in order]
            starts = tuple([0, *itertools.accumulate(counts)][:-1])
            # One assignment, so a concurrent __getitem__ sees the old or the new index.
            self._index = _Index(order, starts, sum(counts))
        return new

    @property
    def records(self) -> list[dict[str, Any]]:
        """The commit records read so far, in unit order."""
        return list(self._index.order)

    @property
    def complete(self) -> bool:
        """True once the job has committed every unit (complete.json exists)."""
        return (self.root / COMPLETE).exists()

    def errors(self) -> list[dict[str, Any]]:
        """Every sample that has no hidden states, with the reason, by sample_index.

        Rows refused at ingestion (errors.arrow) plus samples a worker could not extract
        (the "errors" of each commit record read so far).
        """
        rows: list[dict[str, Any]] = []
        path = self.root / ERRORS
        if path.exists():
            import pyarrow as pa

            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_file(source).read_all()
            for idx, reason in zip(
                table.column("sample_index").to_pylist(),
                table.column("reason").to_pylist(),
                strict=True,
            ):
                rows.append({"sample_index": int(idx), "reason": str(reason)})
        for record in self._index.order:
            for e in record.get("errors", []):
                rows.append({"sample_index": int(e["sample_index"]), "reason": str(e["reason"])})
        rows.sort(key=lambda r: r["sample_index"])
        return rows

    def verify(self) -> int:
        """Check every committed shard's size and checksums; returns how many were checked.

        Raises ShardCorrupt naming every shard that fails.
        """
        problems = []
        order = self._index.order
        for record in order:
            try:
                verify_shard(self.root, record)
            except ShardCorrupt as err:
                problems.append(str(err))
        if problems:
            raise ShardCorrupt(f"{len(problems)} corrupt shard(s): " + "; ".join(problems))
        return len(order)

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
        reader = self._reader(idx.order[k])
        return reader.sample(i - idx.starts[k], backend=self._backend())

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

    def shards(self, records: Iterable[dict[str, Any]] | None = None) -> Iterator[ShardReader]:
        """Committed shards as ShardReaders (with `.record`), in unit order.

        With follow=True: each shard once, as its commit appears (new ones in unit
        order), until complete.json exists and every committed shard has been yielded.
        With `records` (commit records from `records`, e.g. shuffled): those shards, in
        that order.
        """
        if records is None:
            records = self._follow_records() if self.follow else iter(self._index.order)
        for record in records:
            yield self._reader(record)

    def _follow_records(self) -> Iterator[dict[str, Any]]:
        seen: set[int] = set()
        last_new = time.monotonic()
        while True:
            # Look for complete.json before listing commits: the job writes it after the
            # last commit, so that listing is then sure to hold every unit.
            done = self.complete
            self.refresh()
            fresh = [r for r in self._index.order if r["unit"] not in seen]
            for record in fresh:
                seen.add(record["unit"])
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
            time.sleep(self.poll_interval)

    def _check_all_units(self, seen: set[int]) -> None:
        units = self.manifest.get("units")
        if not isinstance(units, list):
            return
        planned = {int(u["unit"]) for u in units if isinstance(u, dict) and "unit" in u}
        missing = planned - seen
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
        float32 beside it. Rows come in the order of `ds[i]`; the table holds the shards
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
            for name, array in columns.items():
                chunks.setdefault(name, []).append(array)
        if not chunks:
            raise ValueError(f"{self.uri} has no committed shard yet")
        table = pa.table({name: pa.chunked_array(arrays) for name, arrays in chunks.items()})
        info = datasets.DatasetInfo(description=(
            f"hsx hidden states of {self.uri}: layers {self.manifest.get('layers')}, "
            f"storage {self.manifest.get('storage_dtype', 'bf16')} (hidden_states holds its "
            "bit patterns)"))
        return datasets.Dataset(datasets.table.InMemoryTable(table), info=info)

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

    def _reader(self, record: dict[str, Any]) -> ShardReader:
        if self._pid != os.getpid():
            # Forked (e.g. a DataLoader worker): the parent's lock may be held; start clean.
            self._init_process_state()
        unit = int(record["unit"])
        with self._lock:
            reader = self._readers.get(unit)
            if reader is not None:
                self._readers.move_to_end(unit)
                return reader
        reader = self._open(record)
        with self._lock:
            self._readers[unit] = reader
            while len(self._readers) > self.max_open_shards:
                # Dropped, not closed: a caller may still be iterating it. The mapping
                # (and its file descriptor) goes when the last reference does.
                self._readers.popitem(last=False)
        return reader

    def _open(self, record: dict[str, Any]) -> ShardReader:
        reader = ShardReader(shard_file(self.root, record), record=record)
        layers = self.manifest.get("layers")
        if layers is not None and list(layers) != reader.layers:
            raise ShardCorrupt(
                f"{reader.path}: layers {reader.layers} differ from the manifest's {layers}"
            )
        if len(reader) != int(record["samples"]):
            raise ShardCorrupt(
                f"{reader.path}: {len(reader)} samples, its commit record says {record['samples']}"
            )
        return reader


def _hf_samples(shards: list[dict[str, Any]], dataset: HiddenStatesDataset) -> Iterator[Any]:
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
