"""The stream of an online job: captured states handed from the engines to the trainer's
workers without ever becoming the output's shards (the protocol; its Ray side is
hsx_workers.stream, the driver's books hsx_service.online).

An online job (`train: {online: true}`) writes its output's tables (inputs, errors,
manifest, complete.json) and its draft, but no shard. Its engines capture each unit
again for every epoch the trainer needs. Each captured unit is a shard built in the
engine's memory and handed to Ray's object store; the job's **stream** (one per job, a
Ray actor holding a `StreamHub`) keeps the reference until the trainer's worker whose
unit it is has read it, and Ray frees the bytes once nobody holds them. The stream is
bounded (`buffer_bytes`, counted over the cluster): the driver hands out no unit while
the captured bytes the trainer has not taken, with those being captured, reach it, and
says so.

Units of the stream are numbered `epoch * EPOCH_STRIDE + unit` (`stream_unit`), so the
same unit captured for two epochs is two stream units, and the driver's bookkeeping
(attempts, retries) works on them as on any unit. A training of N workers splits each
epoch's units between them: worker `rank_of(unit, N)` trains unit `unit`, once per epoch
of its own (each worker keeps its own epoch, as offline).

Exactly once per epoch: the trainer's checkpoint keeps, per worker, the units (and the
samples of units begun) it trained in its current epoch. Each run of a worker starts by
telling the stream where it resumed (`Resume`: a run id, the checkpoint's epoch and
units); the driver then captures again, for that worker, what the checkpoint had not
consumed and what the stream no longer holds. A worker drops unread what it does not
need: a unit of an epoch before its own, or one its checkpoint already holds. A unit
whose bytes Ray lost (the engine's node died before the trainer read it) is reported
`lost` by the worker and captured again.

The books are the driver's inference; the worker's own word settles them. A worker that
finds nothing ready says which units of its epoch it still wants (`Books.wants`), and
the driver captures again any of them that its books count as captured but that is
neither in the stream nor being captured: a unit can leave the stream unseen by them (a
worker of a run that has ended, still reading as its node is taken down, takes it). And
only a worker's current run takes units: a late `take` of a run that has ended is
ignored, so it cannot remove a unit that the run after it needs. The books are the
driver's read alone (they hand each lost unit once); a status asks only who waits
(`waiting`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

EPOCH_STRIDE = 1_000_000_000  # stream unit = epoch * EPOCH_STRIDE + the job's unit
DEFAULT_BUFFER_BYTES = 1 << 30


def stream_unit(epoch: int, unit: int) -> int:
    return epoch * EPOCH_STRIDE + unit


def split_unit(stream: int) -> tuple[int, int]:
    """(epoch, the job's unit) of a stream unit."""
    return divmod(stream, EPOCH_STRIDE)


def rank_of(unit: int, world: int) -> int:
    """The training worker (of `world`) that trains the job's `unit`: each epoch's
    units are split between the workers, as offline."""
    return unit % world


@dataclass
class Resume:
    """One run of one training worker: where it started (its checkpoint's epoch and the
    units of that epoch it had trained) and on which Ray node it runs."""

    run: str
    rank: int = 0
    world: int = 1
    epoch: int = 0
    units_done: list[int] = field(default_factory=list)
    node: str = ""

    @classmethod
    def new(cls, rank: int, world: int, epoch: int, units_done: list[int],
            node: str = "") -> Resume:
        return cls(uuid.uuid4().hex[:12], rank, world, epoch, sorted(units_done), node)


@dataclass(frozen=True)
class Captured:
    """A unit in the stream: its stream number, the worker it is for, its bytes and the
    Ray node whose object store holds them (the engine's)."""

    sid: int
    rank: int
    nbytes: int
    node: str = ""


@dataclass
class Books:
    """The stream as the driver reads it, once a round (`StreamHub.books`)."""

    units: dict[int, Captured] = field(default_factory=dict)  # captured, not taken
    runs: dict[int, Resume] = field(default_factory=dict)  # each worker's current run
    trainer: dict[str, Any] | None = None  # the trainer's state: running, done, ...
    lost: list[int] = field(default_factory=list)  # since the last call: capture again
    reading: dict[int, Captured] = field(default_factory=dict)  # handed to a worker
    taken_units: int = 0  # read by the trainer, all time
    taken_bytes: int = 0
    since: float = 0.0  # when the stream started counting
    waits: dict[int, float] = field(default_factory=dict)  # worker -> waiting for units since
    # A waiting worker -> (its epoch, the units of it it still wants), as it said last.
    wants: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


class StreamHub:
    """One job's stream: the units captured and not yet taken, each worker's run, the
    trainer's state. Plain Python, so the driver's logic is tested without Ray; the Ray
    actor `hsx_workers.stream.StreamActor` holds one with each unit's payload (a
    reference to its bytes in Ray's object store).

    Who calls what: the driver `put`s each captured unit and reads `books()`; a training
    worker says where it resumed (`start_run`), takes what is `ready` for it, reports
    each unit read (`take`) or whose bytes are gone (`lose`); the main worker and the
    training's driver set the trainer's state (`set_trainer`). A worker that asked for
    units while none was ready for it `waits` until it gets one, and `wants` the units
    it named.
    """

    def __init__(self) -> None:
        self.units: dict[int, Captured] = {}
        self.payloads: dict[int, Any] = {}
        self.reading: dict[int, Captured] = {}  # handed to a worker, not yet taken
        self.runs: dict[int, Resume] = {}
        self.trainer: dict[str, Any] | None = None
        self.lost: list[int] = []
        self.taken_units = 0
        self.taken_bytes = 0
        self.since = time.time()
        self.waits: dict[int, float] = {}  # worker -> since when it waits with nothing ready
        self.wants: dict[int, tuple[int, list[int]]] = {}  # see Books.wants

    def put(self, unit: Captured, payload: Any) -> bool:
        """A captured unit; False (and dropped) if the stream holds it already."""
        if unit.sid in self.units or unit.sid in self.reading:
            return False
        self.units[unit.sid] = unit
        self.payloads[unit.sid] = payload
        return True

    def ready(self, rank: int, epoch: int, wanted: list[int] | None = None,
              run: str | None = None) -> list[tuple[int, Any]]:
        """(stream unit, payload) of the units for worker `rank` of epochs up to
        `epoch`, in order; each stays in the stream until it is taken. `wanted`: the
        units of `epoch` the worker still needs, its word for the driver when none is
        ready (ignored from a run that is not the worker's current one)."""
        out = []
        for sid in sorted(self.units):
            unit = self.units[sid]
            if unit.rank == rank and split_unit(sid)[0] <= epoch:
                self.reading[sid] = unit
                out.append((sid, self.payloads[sid]))
        if out:
            self.waits.pop(rank, None)
            self.wants.pop(rank, None)
        else:
            self.waits.setdefault(rank, time.time())
            if wanted is not None and self._current(rank, run):
                self.wants[rank] = (epoch, sorted(wanted))
        return out

    def _current(self, rank: int, run: str | None) -> bool:
        """Whether `run` is worker `rank`'s current run (None: a caller that names none)."""
        current = self.runs.get(rank)
        return run is None or current is None or current.run == run

    def take(self, sid: int, read: bool = True, run: str | None = None) -> None:
        """The worker is done with a unit (`read`: it trained on it; else dropped
        unread): the stream lets it go. Ignored from a `run` that has ended: the unit is
        its worker's next run's now."""
        held = self.units.get(sid)
        if held is not None and not self._current(held.rank, run):
            return
        unit = self.units.pop(sid, None)
        self.payloads.pop(sid, None)
        self.reading.pop(sid, None)
        if unit is not None and read:
            self.taken_units += 1
            self.taken_bytes += unit.nbytes

    def lose(self, sid: int) -> None:
        """The unit's bytes are gone (the node that held them died): capture it again."""
        if sid in self.units:
            self.take(sid, read=False)
            self.lost.append(sid)

    def waiting(self) -> dict[int, float]:
        """The workers waiting with nothing ready: rank -> since when (a status's read)."""
        return dict(self.waits)

    def start_run(self, resume: Resume) -> None:
        """A worker's run begins from a checkpoint at (`resume.epoch`, `units_done`)."""
        self.runs[resume.rank] = resume
        self.wants.pop(resume.rank, None)
        if resume.rank == 0:
            self.trainer = {"state": "running", "run": resume.run}

    def set_trainer(self, state: str, **extra: Any) -> None:
        """The trainer's state for the driver: `running`, `done`, `stopped`, `failed`."""
        self.trainer = {"state": state, **extra}

    def books(self) -> Books:
        """The driver's read, once a round. It is the only reader: each lost unit is in
        one read alone (then captured again), so another reader would take it from the
        driver (`waiting` is the read for everyone else)."""
        lost, self.lost = self.lost, []
        return Books(dict(self.units), dict(self.runs),
                     None if self.trainer is None else dict(self.trainer), lost,
                     dict(self.reading), self.taken_units, self.taken_bytes, self.since,
                     dict(self.waits), dict(self.wants))
