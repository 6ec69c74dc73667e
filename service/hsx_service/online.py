"""The driver's side of an online job: which unit the engines capture next, for which
training worker and epoch, and when they wait for the trainer (the stream's protocol:
hsx.online; its Ray side: hsx_workers.stream).

`OnlineFeed` is asked by the dispatcher (dispatch.py) each round for units to hand out.
It reads the stream's books once a round and keeps, per training worker and epoch, the
job's units captured for that worker's current run (in the stream, read by it, or in
flight) and hands out the rest, epoch after epoch, while the stream has room: the
captured bytes no worker has taken plus the units in flight (at their estimated size)
stay under `buffer_bytes`, counted over the whole cluster. The worker with the least
waiting for it is served first. A worker that has nothing of its current epoch (or an
earlier one) in the stream or in flight always gets its next unit, whatever the buffer
holds: the workers step together (DDP), so one starved of data would hold every other
one, and after a restart its epoch's units are captured again while the buffer may hold
the next epoch's. When a worker starts a run (its `Resume` in the books changes: a first
start, a restart after a crash, a coordinator restart), its books are made again from
what it resumed: its checkpoint's units of its epoch, and whatever the stream still
holds or the engines are capturing for it. A unit whose bytes were lost is captured
again. A worker that waits with nothing ready names the units of its epoch it still
wants: any of them the books count as captured but that is neither in the stream nor in
flight is captured again, and the worker's books move to that epoch. The feed ends when
the trainer says it ended (done or failed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hsx.online import (
    DEFAULT_BUFFER_BYTES,
    Books,
    Captured,
    Resume,
    rank_of,
    split_unit,
    stream_unit,
)
from hsx.plan import WorkUnit

logger = logging.getLogger(__name__)

# Without `buffer_bytes` the buffer holds this many of the job's largest units, when that
# is more than DEFAULT_BUFFER_BYTES: one the trainer reads, one committed behind it, one
# the engine captures, so neither side waits on a unit boundary.
BUFFER_UNITS = 3

# What ends the feed. A `stopped` trainer (its coordinator shutting down) is resumed
# later: the feed goes on with its next run.
TRAINER_ENDED = ("done", "failed")


class StreamPort(Protocol):
    """What the feed asks of the stream (hsx_workers.stream.DriverStream on Ray)."""

    def books(self) -> Books: ...

    def put(self, unit: Captured, payload: Any) -> bool: ...

    def close(self) -> None: ...


@dataclass
class WorkerBooks:
    """One training worker's books: its run, its epoch when the run began, and per epoch
    the job's units captured for it."""

    run: str | None = None
    epoch: int = 0
    captured: dict[int, set[int]] = field(default_factory=dict)


class OnlineFeed:
    """See the module docstring. Not thread-safe: the dispatcher's loop alone calls it."""

    def __init__(self, stream: StreamPort, buffer_bytes: int | None, bytes_per_token: int,
                 workers: int = 1) -> None:
        self.stream = stream
        self.asked_bytes = buffer_bytes  # the spec's train.buffer_bytes
        self.bytes_per_token = bytes_per_token  # of a captured token, all layers
        self.world = workers  # the training's workers: unit u is worker u % world's
        self.units: list[WorkUnit] = []  # the job's plan so far, in order
        self._by_unit: dict[int, WorkUnit] = {}
        self.whole = False  # the plan is whole (the ingestion ended)
        self.workers = [WorkerBooks() for _ in range(workers)]
        self.inflight: dict[int, int] = {}  # stream unit -> its estimated bytes
        self.present: dict[int, Captured] = {}  # in the stream, as last read
        self.books = Books()  # the stream's, as last read
        self.waiting_for: str | None = None  # why nothing is handed out now
        self.ended: str | None = None  # the trainer's final state
        self.error: str | None = None  # why it failed
        self.captures = 0  # stream units committed, all epochs

    @property
    def buffer_bytes(self) -> int:
        """The spec's, else 1 GiB or BUFFER_UNITS of the largest unit planned so far."""
        if self.asked_bytes:
            return self.asked_bytes
        largest = max((u.tokens for u in self.units), default=0) * self.bytes_per_token
        return max(DEFAULT_BUFFER_BYTES, BUFFER_UNITS * largest)

    # -- what the dispatcher tells

    def planned(self, units: Iterable[WorkUnit], whole: bool) -> None:
        for u in units:
            if u.unit not in self._by_unit:
                self._by_unit[u.unit] = u
                self.units.append(u)
        self.whole = self.whole or whole

    def answered(self, stream_id: int) -> None:
        """A stream unit failed for good (given up, or dispatch stopped): it is not being
        captured. (One the dispatcher retries still is.)"""
        self.inflight.pop(stream_id, None)

    def committed(self, stream_id: int, nbytes: int, node: str, payload: Any) -> None:
        """A stream unit was captured: its bytes (`payload`, a reference into Ray's object
        store) go to the stream for the worker whose unit it is."""
        self.inflight.pop(stream_id, None)
        unit = Captured(stream_id, rank_of(split_unit(stream_id)[1], self.world), nbytes,
                        node)
        if self.stream.put(unit, payload):
            self.present[stream_id] = unit
        self.captures += 1

    def rows_of(self, stream_id: int) -> WorkUnit:
        return self._by_unit[split_unit(stream_id)[1]]

    # -- what the dispatcher asks

    def finished(self) -> bool:
        """The trainer's run ended: nothing more to capture (as of the last round)."""
        return self.ended is not None

    def take(self, room: int) -> list[WorkUnit]:
        """Up to `room` stream units to hand out now (the dispatcher's free depth)."""
        self.read_books()
        if self.finished() or room <= 0:
            return []
        taken: list[WorkUnit] = []
        self.waiting_for = None
        while len(taken) < room:
            chosen = self._choose()
            if chosen is None:
                break
            rank, epoch, job_unit = chosen
            sid = stream_unit(epoch, job_unit.unit)
            self.workers[rank].captured.setdefault(epoch, set()).add(job_unit.unit)
            self.inflight[sid] = job_unit.tokens * self.bytes_per_token
            taken.append(WorkUnit(sid, job_unit.row_start, job_unit.row_end, job_unit.tokens))
        return taken

    def where(self) -> tuple[dict[int, str], dict[str, int]]:
        """Where the training's workers run (rank -> Ray node), and the captured bytes
        not yet trained on by Ray node (the engine's that holds them, or the worker's
        reading them), as of the last round."""
        runs = {rank: run.node for rank, run in self.books.runs.items()}
        held: dict[str, int] = {}
        for unit in self.present.values():
            reader = runs.get(unit.rank) if unit.sid in self.books.reading else None
            where = reader or unit.node
            held[where] = held.get(where, 0) + unit.nbytes
        return runs, held

    def held(self) -> int:
        """Bytes captured and not taken, with those being captured (estimated)."""
        return sum(u.nbytes for u in self.present.values()) + sum(self.inflight.values())

    def read_books(self) -> None:
        """The stream's books: the trainer's state, new runs, lost units."""
        books = self.books = self.stream.books()
        self.present = dict(books.units)
        for rank, resume in books.runs.items():
            if rank < self.world and resume.run != self.workers[rank].run:
                self.rebuild(resume)
        trainer = books.trainer or {}
        if self.ended is None and trainer.get("state") in TRAINER_ENDED:
            self.ended = trainer["state"]
            self.error = trainer.get("error")
        for sid in books.lost:
            epoch, unit = split_unit(sid)
            logger.warning("unit %d of epoch %d: its captured states were lost with their "
                           "node before the trainer read them; capturing it again",
                           unit, epoch)
            self.workers[rank_of(unit, self.world)].captured.get(epoch, set()).discard(unit)
        for rank, (epoch, wanted) in books.wants.items():
            if rank < self.world:
                self.wanted(rank, epoch, wanted)

    def wanted(self, rank: int, epoch: int, units: list[int]) -> None:
        """Worker `rank` waits in `epoch` for `units`: those the books count as captured
        but that are neither in the stream nor being captured are captured again, and
        epochs before it are not. (The rest are due anyway: a worker with nothing coming
        for its epoch is starved, and served first.)"""
        books = self.workers[rank]
        if epoch > books.epoch:
            books.epoch = epoch
            books.captured = {e: u for e, u in books.captured.items() if e >= epoch}
        coming = {split_unit(sid) for sid in (*self.present, *self.inflight)}
        counted = books.captured.get(epoch, set())
        missing = [u for u in units if u in counted and (epoch, u) not in coming]
        if missing:  # once counted no longer, they are not missing again
            logger.warning("trainer worker %d waits for units %s of epoch %d, counted as "
                           "captured but neither in the stream nor being captured; "
                           "capturing them again", rank, missing, epoch)
        counted.difference_update(missing)

    def _choose(self) -> tuple[int, int, WorkUnit] | None:
        """The next (worker, epoch, unit) to capture: the worker with the fewest bytes
        waiting for it first; None (and `waiting_for` says why) when the buffer is full
        and no worker is starved, or nothing is left to plan yet."""
        waiting: dict[int, int] = dict.fromkeys(range(self.world), 0)
        for sid, cost in [*((u.sid, u.nbytes) for u in self.present.values()),
                          *self.inflight.items()]:
            waiting[rank_of(split_unit(sid)[1], self.world)] += cost
        held = self.held()
        for rank in sorted(waiting, key=lambda r: (waiting[r], r)):
            nxt = self._next(rank)
            if nxt is None:
                continue
            epoch, unit = nxt
            cost = unit.tokens * self.bytes_per_token
            if held and held + cost > self.buffer_bytes and not self._starved(rank, epoch):
                self.waiting_for = (
                    f"the trainer: {_mb(held)} of captured states wait to be trained on "
                    f"(online buffer {_mb(self.buffer_bytes)})")
                continue
            return rank, epoch, unit
        return None

    def _starved(self, rank: int, epoch: int) -> bool:
        """Whether worker `rank` has nothing of `epoch` or before in the stream or being
        captured: then it waits for this unit, and with it every worker."""
        return not any(
            rank_of(unit, self.world) == rank and e <= epoch
            for e, unit in map(split_unit, (*self.present, *self.inflight)))

    def _next(self, rank: int) -> tuple[int, WorkUnit] | None:
        """The next (epoch, unit) of worker `rank` not captured for its run, None if none
        yet."""
        books = self.workers[rank]
        mine = [u for u in self.units if rank_of(u.unit, self.world) == rank]
        if not mine:
            return None
        epoch = books.epoch
        while True:
            done = books.captured.get(epoch, set())
            for u in mine:
                if u.unit not in done:
                    return epoch, u
            if not self.whole:
                return None  # the ingestion plans more
            epoch += 1

    def rebuild(self, resume: Resume) -> None:
        """Worker `resume.rank` began a run: what its checkpoint holds, and what the
        stream holds or the engines capture for it, count as captured; the rest of its
        epoch and after is captured again."""
        books = WorkerBooks(resume.run, resume.epoch)
        self.workers[resume.rank] = books
        self.ended = None
        for sid in [*self.present, *self.inflight]:
            epoch, unit = split_unit(sid)
            if rank_of(unit, self.world) == resume.rank and epoch >= resume.epoch:
                books.captured.setdefault(epoch, set()).add(unit)
        books.captured.setdefault(resume.epoch, set()).update(resume.units_done)


def _mb(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"
