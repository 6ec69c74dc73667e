"""An online job's stream on Ray (the protocol: hsx.online).

- `StreamActor`: the job's stream, a Ray actor named after the job's output (one per
  job, `open_stream`), holding a `StreamHub`: the units captured and not yet taken, each
  with the reference to its bytes in Ray's object store, each training worker's run, the
  trainer's state. It is created by the process that drives the job (the coordinator,
  `hsx extract`) on its own node and dies with it; so does every reference it holds, and
  the protocol captures again what a new driver's trainer needs.
- `TrainerStream`: a training worker's side: where its run resumed, the units ready for
  it (waited for in the actor, not polled), each read through `fetch` (its bytes pulled
  from the engine's node into this node's object store, read in place), then taken.

Who owns the bytes: the driver. A captured unit is the second return value of the
engine's `run_unit` call (worker.py), so it belongs to the process that made the call,
lives in the engine node's object store until a training worker pulls it, survives the
engine's process (not its node), and is freed once the stream and the worker let it go.
Why Ray's object store and not a shared folder: docs/ARCHITECTURE.md, "The trainer".
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

from hsx.online import Books, Captured, Resume, StreamHub
from hsx.output.shards.reader import BufferSource, ShardReader

NAMESPACE = "hsx"
WAIT_S = 1.0  # a worker's wait for units is answered at least this often
LOOKUP_S = 0.5  # a worker looks for the job's stream this often until it exists
UNAVAILABLE_S = 120.0  # the driver asks a stream Ray calls unavailable again this long


class StreamLost(RuntimeError):
    """The job's stream is gone (its driver died): the trainer's run ends, and a new
    driver's trainer resumes from the checkpoint."""


def stream_name(location: str) -> str:
    """The stream actor's name for the output at `location` (`Output.location`)."""
    return "hsx-stream-" + hashlib.sha256(location.encode()).hexdigest()[:16]


class StreamActor:
    """The job's stream (see the module docstring); every method but `wait` answers at
    once, so it runs threaded (a waiting worker holds one slot)."""

    def __init__(self) -> None:
        self.hub = StreamHub()
        self.cond = threading.Condition()

    def put(self, unit: Captured, payload: list[Any]) -> bool:
        """A captured unit and its bytes' reference (in a list, so Ray hands the
        reference itself and does not fetch the bytes here)."""
        with self.cond:
            added = self.hub.put(unit, payload[0])
            self.cond.notify_all()
        return added

    def wait(self, rank: int, epoch: int, timeout: float = WAIT_S,
             wanted: list[int] | None = None, run: str | None = None
             ) -> list[tuple[int, list[Any]]]:
        """The units ready for worker `rank` up to `epoch`, once there is one (or after
        `timeout`: an empty list); `wanted`, `run`: `StreamHub.ready`'s."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                ready = self.hub.ready(rank, epoch, wanted, run)
                left = deadline - time.monotonic()
                if ready or left <= 0:
                    return [(sid, [payload]) for sid, payload in ready]
                self.cond.wait(left)

    def take(self, sid: int, read: bool = True, run: str | None = None) -> None:
        with self.cond:
            self.hub.take(sid, read, run)

    def lose(self, sid: int) -> None:
        with self.cond:
            self.hub.lose(sid)

    def start_run(self, resume: Resume) -> None:
        with self.cond:
            self.hub.start_run(resume)
            self.cond.notify_all()

    def set_trainer(self, state: str, extra: dict[str, Any] | None = None) -> None:
        with self.cond:
            self.hub.set_trainer(state, **(extra or {}))
            self.cond.notify_all()

    def books(self) -> Books:
        """The driver's alone (`StreamHub.books`)."""
        with self.cond:
            return self.hub.books()

    def waiting(self) -> dict[int, float]:
        with self.cond:
            return self.hub.waiting()


def open_stream(location: str) -> Any:
    """The job's stream actor, created on this process's node if it does not exist yet
    (the driver of the job, and its training's driver, both ask; the first makes it)."""
    import ray

    from hsx_workers.nodes import on_this_node

    actor: Any = ray.remote(StreamActor)
    return actor.options(
        name=stream_name(location), namespace=NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=64, max_restarts=0,
        scheduling_strategy=on_this_node()).remote()


def stream_waits(location: str) -> dict[int, float] | None:
    """The job's workers waiting for units (rank -> since), None when the job has no
    stream (it does not make one)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        actor = ray.get_actor(stream_name(location), namespace=NAMESPACE)
        waits: dict[int, float] = ray.get(actor.waiting.remote(), timeout=10)
    except (ValueError, RayActorError, GetTimeoutError):
        return None
    return waits


def close_stream(location: str) -> None:
    """The job is over: its stream goes, and with it every reference it held."""
    import ray

    with contextlib.suppress(ValueError):  # none
        ray.kill(ray.get_actor(stream_name(location), namespace=NAMESPACE))


class DriverStream:
    """The driver's handle on the stream (hsx_service.online.OnlineFeed calls it)."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.actor = open_stream(location)

    def _call(self, method: str, *args: Any) -> Any:
        """The stream's `method`, asked again while Ray says the actor is only
        unavailable (its node's heartbeats late on a loaded machine, say: the call could
        not reach it). A unit put twice while the stream holds it is kept once; one put
        again after a worker took it would be trained twice, which needs the first put
        to have reached the actor that the second found unreachable. An actor that
        died raises at once."""
        import ray
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + UNAVAILABLE_S
        while True:
            try:
                return ray.get(getattr(self.actor, method).remote(*args))
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(LOOKUP_S)

    def books(self) -> Books:
        books: Books = self._call("books")
        return books

    def put(self, unit: Captured, payload: Any) -> bool:
        added: bool = self._call("put", unit, [payload])
        return added

    def set_trainer(self, state: str, **extra: Any) -> None:
        self._call("set_trainer", state, extra)

    def close(self) -> None:
        close_stream(self.location)


class TrainerStream:
    """A training worker's side of the job's stream (the trainer's data.py calls it)."""

    def __init__(self, location: str, rank: int, world: int) -> None:
        self.location = location
        self.rank, self.world = rank, world
        self.run: str | None = None  # this worker's run, once started
        self._actor: Any = None

    def _stream(self, halted: Callable[[], bool] | None = None) -> Any:
        """The stream actor, once the job's driver has made it."""
        import ray

        while self._actor is None:
            try:
                self._actor = ray.get_actor(stream_name(self.location), namespace=NAMESPACE)
            except ValueError:
                if halted is not None and halted():
                    raise StreamLost(f"no stream for {self.location}") from None
                time.sleep(LOOKUP_S)
        return self._actor

    def _call(self, method: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(getattr(self._stream(), method).remote(*args))
        except RayActorError as err:
            self._actor = None
            raise StreamLost(f"the stream of {self.location} is gone: {err}") from err

    def start_run(self, epoch: int, units_done: list[int]) -> Resume:
        """This worker's run begins from a checkpoint at (`epoch`, `units_done`)."""
        import ray

        resume = Resume.new(self.rank, self.world, epoch, units_done,
                            ray.get_runtime_context().get_node_id())
        self._call("start_run", resume)
        self.run = resume.run
        return resume

    def wait(self, epoch: int, halted: Callable[[], bool], wanted: set[int]
             ) -> list[tuple[int, Any]]:
        """(stream unit, reference) of the units ready for this worker up to `epoch`;
        empty after WAIT_S without one, the driver told the units of `epoch` it still
        wants."""
        self._stream(halted)
        ready = self._call("wait", self.rank, epoch, WAIT_S, sorted(wanted), self.run)
        return [(sid, payload[0]) for sid, payload in ready]

    def fetch(self, sid: int, ref: Any, halted: Callable[[], bool]) -> ShardReader | None:
        """The unit's shard, read in place from this node's object store; None when its
        bytes are lost (reported: the driver captures it again) or the training halts."""
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError

        while not halted():
            try:
                payload = ray.get(ref, timeout=WAIT_S)
            except GetTimeoutError:  # a large unit on its way, or its node dying
                continue
            except ObjectLostError:  # owner or node gone, its reconstruction failed
                self._call("lose", sid)
                return None
            return ShardReader(BufferSource(f"stream unit {sid}", payload))
        return None

    def take(self, sid: int, read: bool = True) -> None:
        self._call("take", sid, read, self.run)

    def set_trainer(self, state: str, **extra: Any) -> None:
        self._call("set_trainer", state, extra)
