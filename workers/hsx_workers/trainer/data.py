"""What one worker of a training reads: its units' samples as packed steps, epoch after
epoch, read ahead on a thread; and its share of the held-out samples.

Worker r of N reads the units u with u % N == r. The first epoch follows the extraction
(`spec.follow`): a shard is trained on as soon as its commit lands; later epochs shuffle
units. Held-out samples (`held_out`: by sample index, the same on every run) are
skipped. Each sample becomes speculators' sample dict (the layers its method's draft
reads), shifted as the method says (`DraftMethod.preprocess`: EAGLE-3's speculators'
`shift_batch`; a block drafter reads states and tokens as they are), and packed, whole
samples only, by its `CollateFn` into sequences of `pack_tokens`; a step is packs worth
`batch_tokens`.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hsx.dataset import HiddenStatesDataset
from hsx.online import rank_of, split_unit
from hsx.output import CommitRecord, Manifest, Output, ShardReader
from hsx.spec import TrainSpec
from hsx_workers.trainer.draft_model import layer_picks
from hsx_workers.trainer.group import WorkerGroup
from hsx_workers.trainer.plan import Plan, held_out

READER_JOIN_S = 30.0  # how long a finished training waits for its data thread to stop

logger = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One optimizer step of one worker: packed sequences and the units it finishes."""

    packs: list[dict[str, Any]]
    tokens: int
    units: list[int]
    samples: list[tuple[int, int]] = field(default_factory=list)  # (unit, sample_index)


@dataclass(frozen=True)
class EpochEnd:
    """This worker's data of `epoch` ended (the prefetch goes on with the next epoch)."""

    epoch: int


def to_speculators_sample(sample: dict[str, Any], dtype: torch.dtype,
                          picks: Sequence[int] | None = None) -> dict[str, Any]:
    """An hsx sample ([T, L, H] states) as speculators' dict, before `shift_batch`: the
    layers at `picks` (default: all but the last) the draft reads, the last (id N) its
    target."""
    hidden = sample["hidden_states"]
    seq_len = hidden.shape[0]
    aux = hidden[:, :-1] if picks is None else hidden[:, list(picks)]
    return {
        "hidden_states": aux.flatten(1).to(dtype),
        "input_ids": sample["input_ids"].to(torch.long),
        "verifier_last_hidden_states": hidden[:, -1].to(dtype),
        "loss_mask": sample["loss_mask"].to(torch.bool),
        "lengths": torch.tensor([seq_len], dtype=torch.long),
        "position_ids": torch.arange(seq_len, dtype=torch.long),
    }


def unit_of(reader: ShardReader) -> int:
    if reader.record is None:
        raise ValueError(f"{reader.name}: opened without its commit record")
    return reader.record.unit


def _trainer_stream(output: Output, group: WorkerGroup) -> Any:
    """This worker's side of the job's stream (on Ray: hsx_workers.stream)."""
    from hsx_workers.stream import TrainerStream

    return TrainerStream(output.location, group.rank, group.world)


def _seeded(*parts: int) -> random.Random:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + int(p)) % (1 << 61)
    return random.Random(value)


class TrainingData:
    """The samples one worker of a training reads (see the module docstring).

    Who calls what: `DraftTrainer.prepare` names the held-out samples (`hold_out`); its
    loop reads `prefetch` and bills each step the time it waited for it (`take_wait`);
    its validation reads `held_out_samples` and packs them with `collate`.
    """

    def __init__(self, output: Output, spec: TrainSpec, group: WorkerGroup, *,
                 stop: threading.Event, poll_interval: float) -> None:
        self.output = output
        # An online job's units come from its stream (hsx.online, on Ray:
        # hsx_workers.stream), each taken once read; the held-out samples are kept here
        # as they pass, for validation.
        self.stream = _trainer_stream(output, group) if spec.online else None
        self._held: dict[int, dict[str, Any]] = {}
        self.spec = spec
        self.group = group
        self.stop = stop
        self.poll_interval = poll_interval
        self.val_indices: list[int] = []
        self._val_set: frozenset[int] = frozenset()
        self._val_rows: dict[int, int] = {}  # held-out sample index -> row of inputs.arrow
        self._unbilled_wait = 0.0  # waits since the last step, billed to the next one
        self._waiting_since: float | None = None  # the loop waits for its next step now

    def hold_out(self, sample_indices: Sequence[int]) -> list[int]:
        """Set aside the samples validation scores (`held_out`: `sample_indices` are
        inputs.arrow's, in its row order) and return them, sorted."""
        self.val_indices = held_out(sample_indices, self.spec.val_fraction,
                                    self.spec.val_max_samples, self.spec.seed)
        self._val_set = frozenset(self.val_indices)
        row_of = {idx: row for row, idx in enumerate(sample_indices)}
        self._val_rows = {i: row_of[i] for i in self.val_indices}
        return self.val_indices

    def waiting_for(self, after_s: float = 2.0) -> str | None:
        """What the training waits for, once its loop has waited `after_s` for data."""
        since = self._waiting_since
        if since is None or time.monotonic() - since < after_s:
            return None
        waited = time.monotonic() - since
        if self.stream is not None:
            return (f"the engines: no captured unit in the online stream for {waited:.0f} s "
                    "(the trainer takes them faster than they are captured)")
        return f"the extraction: no new committed shard for {waited:.0f} s"

    def take_wait(self) -> float:
        """Seconds the reader of `prefetch` waited for it since the last call."""
        waited, self._unbilled_wait = self._unbilled_wait, 0.0
        return waited

    def _own(self, unit: int) -> bool:
        return rank_of(unit, self.group.world) == self.group.rank

    def _units(self, ds: HiddenStatesDataset, epoch: int, done: set[int],
               halted: Callable[[], bool]) -> Iterator[tuple[int, ShardReader]]:
        """(unit, its shard) of this worker's units of `epoch` not in `done`, each once."""
        if self.stream is not None:
            yield from self._stream_units(ds, epoch, done, halted)
            return
        if epoch == 0 and not ds.complete:
            shards = ds.shards(stop=halted)  # follow=True: as commits land
        else:
            ds.refresh()
            records = [r for r in ds.records if r.unit not in done and self._own(r.unit)]
            _seeded(self.spec.seed, epoch, 1).shuffle(records)
            shards = ds.shards(records)
        for reader in shards:
            if halted():
                return
            unit = unit_of(reader)
            if unit not in done and self._own(unit):
                yield unit, reader

    def _stream_units(self, ds: HiddenStatesDataset, epoch: int, done: set[int],
                      halted: Callable[[], bool]) -> Iterator[tuple[int, ShardReader]]:
        """This worker's units of `epoch` (an online job), as the engines capture them
        into the stream. Each is taken once yielded (its samples are read by then, see
        `batches`); a unit this run does not need (an earlier epoch's, one the checkpoint
        holds, one read already) is taken unread; one whose bytes were lost is reported
        (`fetch`) and waited for again. When the stream is gone (its driver ended), the
        training stops: a new driver's trainer resumes from the checkpoint."""
        from hsx_workers.stream import StreamLost

        stream = self.stream
        if stream is None:
            raise RuntimeError("not an online training")
        wanted = {u.unit for u in ds.manifest.units if self._own(u.unit)} - done
        try:
            while wanted and not halted():
                for sid, ref in stream.wait(epoch, halted, wanted):
                    if halted():
                        return
                    e, unit = split_unit(sid)
                    if e < epoch or unit not in wanted:
                        stream.take(sid, read=False)
                        continue
                    reader = stream.fetch(sid, ref, halted)
                    if reader is None:  # lost (captured again) or halted
                        continue
                    wanted.discard(unit)
                    yield unit, reader
                    stream.take(sid)
        except StreamLost as err:
            logger.warning("%s; the training stops at its next step", err)
            self.stop.set()

    def _wait_for_complete(self, halted: Callable[[], bool]) -> None:
        while not self.output.is_complete() and not halted():
            time.sleep(self.poll_interval)

    def collate(self, dtype: torch.dtype, manifest: Manifest, plan: Plan, *, pad: bool
                ) -> Callable[..., Any]:
        """What turns samples into one pack (speculators' CollateFn, after the method's
        `preprocess`: EAGLE-3's shift), padded to `plan.pack_tokens` when `pad` (on GPU)."""
        from speculators.train.data import CollateFn

        aux = len(layer_picks(manifest, self.spec.method))
        shift = self.spec.draft.preprocess()

        def collate(samples: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
            # Padded to pack_tokens on GPU (one shape for the compiled model); exactly
            # as long as its samples on CPU, where padding is compute thrown away.
            length = plan.pack_tokens if pad else max(1, tokens)
            fn = CollateFn(length, manifest.hidden_size, num_target_layers=aux, dtype=dtype,
                           preprocess=shift)
            return fn(samples)

        return collate

    def trained(self, raw: dict[str, Any], dtype: torch.dtype, manifest: Manifest,
                pack_tokens: int) -> tuple[dict[str, Any], int]:
        """A read sample as the draft trains on it, and its tokens in a pack (shifted
        states, EAGLE-3's, are `shift` shorter; at most `pack_tokens`)."""
        sample = to_speculators_sample(raw, dtype, layer_picks(manifest, self.spec.method))
        return sample, min(int(sample["lengths"][0]) - self.spec.draft.shift, pack_tokens)

    def batches(self, epoch: int, dtype: torch.dtype, plan: Plan, *, pad: bool,
                done: Sequence[int] = (), partial: Mapping[int, Sequence[int]] | None = None,
                halted: Callable[[], bool] | None = None) -> Iterator[StepBatch]:
        """This worker's steps of one epoch, in order; each names the units it finishes
        and the samples it trains. `done`: units of this epoch trained before a resume,
        left out; `partial`: samples of units begun before it (unit -> sample indices),
        left out; `halted()`: stop reading (default: the training's stop); `pad`: see
        `collate`."""
        halted = halted or self.stop.is_set
        if not self.spec.follow:
            self._wait_for_complete(halted)
        ds = HiddenStatesDataset(self.output, follow=True, backend="torch",
                                 poll_interval=self.poll_interval)
        collate = self.collate(dtype, ds.manifest, plan, pad=pad)
        packs: list[dict[str, Any]] = []
        pack: list[dict[str, Any]] = []
        pack_tokens = step_tokens = 0
        finished: list[int] = []
        trained: list[tuple[int, int]] = []
        partial = partial or {}
        for unit, reader in self._units(ds, epoch, set(done), halted):
            skip = set(partial.get(unit, ()))
            indices = [int(i) for i in reader.sample_indices]
            if self.stream is not None:
                self._keep_held_out(reader, indices)
            order = [j for j in range(len(reader))
                     if indices[j] not in self._val_set and indices[j] not in skip]
            _seeded(self.spec.seed, epoch, unit, 2).shuffle(order)
            for j in order:
                sample, length = self.trained(reader.sample(j, backend="torch"), dtype,
                                              ds.manifest, plan.pack_tokens)
                if length <= 0:
                    continue
                if (pack or packs) and step_tokens + pack_tokens + length > plan.batch_tokens:
                    if pack:
                        packs.append(collate(pack, pack_tokens))
                    yield StepBatch(packs, step_tokens + pack_tokens, finished, trained)
                    packs, pack, pack_tokens, step_tokens, finished = [], [], 0, 0, []
                    trained = []
                elif pack and pack_tokens + length > plan.pack_tokens:
                    # Whole samples only: what does not fit starts the next pack.
                    packs.append(collate(pack, pack_tokens))
                    step_tokens += pack_tokens
                    pack, pack_tokens = [], 0
                pack.append(sample)
                pack_tokens += length
                trained.append((unit, indices[j]))
            finished.append(unit)
        if pack:
            packs.append(collate(pack, pack_tokens))
        if packs or finished:
            yield StepBatch(packs, step_tokens + pack_tokens, finished, trained)

    def _keep_held_out(self, reader: ShardReader, indices: list[int]) -> None:
        """Online: the held-out samples of a unit read from the stream, kept (copied: the
        stream's file goes) for validation."""
        for j, idx in enumerate(indices):
            if idx in self._val_set and idx not in self._held:
                sample = reader.sample(j, backend="torch")
                self._held[idx] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in sample.items()}

    def prefetch(self, epoch: int, dtype: torch.dtype, plan: Plan, *, pad: bool,
                 done: Sequence[int] = (), partial: Mapping[int, Sequence[int]] | None = None
                 ) -> Iterator[StepBatch | EpochEnd]:
        """This worker's steps from `epoch` on (the units of it in `done`, and the
        samples in `partial`, left out), an EpochEnd after each epoch's last. One thread
        reads ahead across epoch ends, so a new epoch's first step does not wait for its
        first unit to be read (with small data and several workers, epochs end every few
        steps). It ends when
        the training stops or the consumer stops reading."""
        q: queue.Queue[Any] = queue.Queue(maxsize=4)
        end = object()
        abandoned = threading.Event()  # the consumer stopped reading

        def halted() -> bool:
            return self.stop.is_set() or abandoned.is_set()

        def put(item: Any, give_up: Callable[[], bool]) -> bool:
            while not give_up():
                try:
                    q.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                skip, begun, current = list(done), partial, epoch
                while not halted():
                    for batch in self.batches(current, dtype, plan, pad=pad, done=skip,
                                              partial=begun, halted=halted):
                        if not put(batch, halted):
                            break
                    # An epoch cut short by the stop has not ended.
                    if halted() or not put(EpochEnd(current), halted):
                        break
                    skip, begun, current = [], None, current + 1
                put(end, abandoned.is_set)  # a stopped training still reads to the end
            except BaseException as err:
                put(err, abandoned.is_set)

        thread = threading.Thread(target=produce, name="hsx-train-data", daemon=True)
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                self._waiting_since = time.monotonic()
                try:
                    item = q.get()
                finally:
                    self._waiting_since = None
                self._unbilled_wait += time.perf_counter() - t0
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            abandoned.set()
            # A reader thread still inside torch or pyarrow when the interpreter exits
            # aborts the process ("terminate called without an active exception", after
            # the training succeeded): it is let reach its next check of `abandoned`.
            thread.join(timeout=READER_JOIN_S)

    def held_out_samples(self, ds: HiddenStatesDataset) -> Iterator[dict[str, Any]]:
        """This worker's share of the held-out samples committed so far (online: those
        of its own units read from the stream so far; each unit is one worker's)."""
        import bisect

        if self.stream is not None:
            for idx in sorted(self._held):
                yield self._held[idx]
            return
        wanted = {i for n, i in enumerate(self.val_indices)
                  if n % self.group.world == self.group.rank}
        if not wanted:
            return
        mine = sorted(self._val_rows[i] for i in wanted)

        def holds(record: CommitRecord) -> bool:  # a unit holds rows [a, b) of inputs
            a, b = rows.get(record.unit, (0, 1 << 62))
            k = bisect.bisect_left(mine, a)
            return k < len(mine) and mine[k] < b

        rows = {u.unit: u.rows for u in ds.manifest.units}
        ds.refresh()
        for reader in ds.shards([r for r in ds.records if holds(r)]):
            for j, idx in enumerate(reader.sample_indices.tolist()):
                if int(idx) in wanted:
                    yield reader.sample(j, backend="torch")
