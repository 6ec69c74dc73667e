"""The driver's side of an online job: which unit the engines capture next, for which
epoch, and when they wait for the trainer (the stream's layout and protocol:
hsx.online).

`OnlineFeed` is asked by the dispatcher (dispatch.py) each round for units to hand out.
It keeps, per epoch, the job's units captured for the trainer's current run (committed in
the stream, taken by the trainer, or in flight) and hands out the rest, epoch after
epoch, while the stream has room: the bytes the trainer has not taken plus the units in
flight (at their estimated size) stay under `buffer_bytes`; at least one unit is always
let through, so a unit larger than the buffer still moves, and so is a unit the trainer
needs before anything the buffer holds (after a restart its epoch's units are captured
again while the buffer may hold the next epoch's). When the
trainer starts a run (its `resume.json` changes: a first start, a restart after a crash,
a coordinator restart), the books are made again from what it resumed: its checkpoint's
units of its epoch, and whatever the stream still holds or the engines are capturing. The
feed ends when the trainer says it ended (done, stopped or failed).
"""

from __future__ import annotations

from collections.abc import Iterable

from hsx.online import DEFAULT_BUFFER_BYTES, Resume, Stream, split_unit, stream_unit
from hsx.plan import WorkUnit

# Without `buffer_bytes` the buffer holds this many of the job's largest units, when that
# is more than DEFAULT_BUFFER_BYTES: one the trainer reads, one committed behind it, one
# the engine captures, so neither side waits on a unit boundary.
BUFFER_UNITS = 3

# What ends the feed. A `stopped` trainer (its coordinator shutting down) is resumed
# later: the feed goes on with its next run.
TRAINER_ENDED = ("done", "failed")


class OnlineFeed:
    """See the module docstring. Not thread-safe: the dispatcher's loop alone calls it."""

    def __init__(self, stream: Stream, buffer_bytes: int | None, bytes_per_token: int
                 ) -> None:
        self.stream = stream
        self.asked_bytes = buffer_bytes  # the spec's train.buffer_bytes
        self.bytes_per_token = bytes_per_token  # of a captured token, all layers
        self.units: list[WorkUnit] = []  # the job's plan so far, in order
        self._by_unit: dict[int, WorkUnit] = {}
        self.whole = False  # the plan is whole (the ingestion ended)
        self.run: str | None = None  # the trainer's run the books are for
        self.epoch = 0  # the trainer's epoch when its run began
        self.captured: dict[int, set[int]] = {}  # epoch -> job units handed out for it
        self.inflight: dict[int, int] = {}  # stream unit -> its estimated bytes
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
        """A stream unit came back (committed, or failed: the dispatcher retries it)."""
        self.inflight.pop(stream_id, None)

    def committed(self, stream_id: int) -> None:
        self.answered(stream_id)
        self.captures += 1

    def rows_of(self, stream_id: int) -> WorkUnit:
        return self._by_unit[split_unit(stream_id)[1]]

    # -- what the dispatcher asks

    def finished(self) -> bool:
        """The trainer's run ended: nothing more to capture."""
        if self.ended is None:
            trainer = self.stream.trainer() or {}
            if trainer.get("state") in TRAINER_ENDED:
                self.ended = trainer["state"]
                self.error = trainer.get("error")
        return self.ended is not None

    def take(self, room: int) -> list[WorkUnit]:
        """Up to `room` stream units to hand out now (the dispatcher's free depth)."""
        self._follow_trainer()
        if self.finished() or room <= 0:
            return []
        taken: list[WorkUnit] = []
        self.waiting_for = None
        # The stream is listed once a call; what this call hands out is added as it goes.
        stored, present = self.stream.buffered()[1], self.stream.committed()
        while len(taken) < room:
            unit = self._next()
            if unit is None:
                break
            cost = unit[1].tokens * self.bytes_per_token
            held = stored + sum(self.inflight.values())
            if held and held + cost > self.buffer_bytes and self._before(unit[0], present):
                self.waiting_for = (
                    f"the trainer: {_mb(held)} of captured states wait to be trained on "
                    f"(online buffer {_mb(self.buffer_bytes)})")
                break
            epoch, job_unit = unit
            self.captured.setdefault(epoch, set()).add(job_unit.unit)
            sid = stream_unit(epoch, job_unit.unit)
            self.inflight[sid] = cost
            taken.append(WorkUnit(sid, job_unit.row_start, job_unit.row_end, job_unit.tokens))
        return taken

    def _before(self, epoch: int, present: set[int]) -> bool:
        """Whether the stream (`present`) holds, or the engines capture, a unit the
        trainer takes before this epoch's: else the buffer may be full of later epochs'
        units while the trainer waits for this one (a unit captured again after its
        restart), and this unit goes through whatever the buffer holds."""
        return any(split_unit(sid)[0] <= epoch for sid in (*present, *self.inflight))

    def _next(self) -> tuple[int, WorkUnit] | None:
        """The next (epoch, unit) not captured for the trainer's run, None if none yet."""
        epoch = self.epoch
        while True:
            done = self.captured.get(epoch, set())
            for u in self.units:
                if u.unit not in done:
                    return epoch, u
            if not (self.whole and self.units):
                return None  # the ingestion plans more
            epoch += 1

    def _follow_trainer(self) -> None:
        """A new run of the trainer: make the books again from where it resumed."""
        resume = self.stream.resume()
        if resume is None or resume.run == self.run:
            return
        self.rebuild(resume, self.stream.committed())

    def rebuild(self, resume: Resume, present: set[int]) -> None:
        self.run, self.epoch = resume.run, resume.epoch
        self.ended = None
        held: dict[int, set[int]] = {}
        for sid in [*present, *self.inflight]:
            epoch, unit = split_unit(sid)
            held.setdefault(epoch, set()).add(unit)
        self.captured = {e: units for e, units in held.items() if e >= resume.epoch}
        self.captured.setdefault(resume.epoch, set()).update(resume.units_done)


def _mb(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"
