"""The dispatcher's steps on plain objects (service/hsx_service/dispatch.py; no Ray).

Fake workers whose `run_unit.remote` and `ready.remote` return a fresh object standing
for Ray's object ref, a fake output that says which units were committed: units go out
up to DISPATCH_DEPTH a worker, a unit retried alone gets a worker to itself, a failed
worker's units count an attempt and go back to the head of the queue (or are given up
after `max_attempts`), a committed unit counts into the progress, a full disk stops
dispatch, and a worker that never started fails the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from hsx.output import CommitRecord
from hsx.plan import WorkUnit
from hsx.progress import JobProgress
from hsx_service.dispatch import Dispatch, DispatchHooks
from hsx_service.engine_pool import DISPATCH_DEPTH, EngineSlot
from hsx_service.errors import JobFailed
from hsx_workers.worker import UnitReport


class _Method:
    """An actor method: `remote(...)` records the call and returns a new ref."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any, **kwargs: Any) -> object:
        self.calls.append(args)
        return object()


class _Actor:
    def __init__(self) -> None:
        self.run_unit = _Method()
        self.ready = _Method()
        self.progress = _Method()
        self.stop_job = _Method()


@dataclass
class _Output:
    committed: dict[int, CommitRecord] = field(default_factory=dict)

    def totals(self) -> Any:
        return SimpleNamespace(progress=lambda: JobProgress(samples_total=40, tokens_total=400))

    def read_commit(self, unit: int) -> CommitRecord:
        if unit not in self.committed:
            raise FileNotFoundError(unit)
        return self.committed[unit]


@dataclass
class _Heard:
    """What the hooks heard."""

    errors: list[tuple[int, int, str, bool]] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    progress: list[JobProgress] = field(default_factory=list)

    def hooks(self) -> DispatchHooks:
        return DispatchHooks(
            on_unit_error=lambda unit, attempt, msg, gave_up: self.errors.append(
                (unit.unit, attempt, msg, gave_up)),
            on_unit_done=self.done.append,
            on_restart=self.restarts.append,
            on_progress=self.progress.append)


def _units(n: int) -> list[WorkUnit]:
    return [WorkUnit(unit=i, row_start=4 * i, row_end=4 * i + 4, tokens=40) for i in range(n)]


def _dispatch(units: int, heard: _Heard | None = None, *, workers: int = 1,
              max_attempts: int = 3, output: _Output | None = None,
              ingestion: Any = None, hooks: DispatchHooks | None = None) -> Dispatch:
    out = output or _Output()
    job: Any = SimpleNamespace(spec=SimpleNamespace(storage_dtype="bfloat16", checksum="xxh3",
                                                    checks="on", regenerate=None),
                               output=out, pending=_units(units), units=_units(units),
                               totals=out.totals, ingestion=ingestion, committed=set(),
                               manifest=None)
    slots = [EngineSlot(name=f"engine-{i}", actor=_Actor(), state="idle")
             for i in range(workers)]
    pool: Any = SimpleNamespace(restarts=0)
    return Dispatch(job, pool, hooks or (heard or _Heard()).hooks(), slots, max_attempts)


def _busy(units: int, heard: _Heard | None = None, **options: Any
          ) -> tuple[Dispatch, EngineSlot]:
    """A dispatch whose first worker got its units."""
    run = _dispatch(units, heard, **options)
    run.dispatch(run.slots[0])
    return run, run.slots[0]


def _held(slot: EngineSlot) -> list[int]:
    return [u.unit for u in slot.inflight.values()]


def _report(unit: int, worker: str = "engine-0") -> UnitReport:
    return UnitReport(unit=unit, won=True, samples=4, tokens=40, bytes=320, worker=worker,
                      errors=[{"sample_index": 1, "reason": "too long"}], generated=2,
                      generated_tokens=9)


def test_a_worker_gets_units_up_to_the_dispatch_depth() -> None:
    run = _dispatch(5)
    slot = run.slots[0]
    assert run.dispatch(slot)
    assert _held(slot) == list(range(DISPATCH_DEPTH)) and slot.state == "busy"
    assert [u.unit for u in run.queue] == list(range(DISPATCH_DEPTH, 5))
    output, dtype, unit, checksum = slot.actor.run_unit.calls[0]
    assert (output, dtype, unit.unit, checksum) == (run.job.output, "bfloat16", 0, "xxh3")
    assert not run.dispatch(slot)  # full: nothing more goes out
    assert len(slot.actor.run_unit.calls) == DISPATCH_DEPTH


def test_a_unit_retried_alone_gets_a_worker_to_itself() -> None:
    run = _dispatch(4, workers=2)
    first, second = run.slots
    run.alone.add(0)
    run.dispatch(first)
    assert _held(first) == [0]  # nothing goes beside it
    run.dispatch(second)
    assert _held(second) == [1, 2]
    # Nor does it go beside a unit a worker already holds: it waits for an empty one.
    run.unit_done(first, next(iter(first.inflight)), _report(0))
    run.unit_done(second, next(iter(second.inflight)), _report(1))
    run.queue.appendleft(_units(6)[5])
    run.alone.add(5)
    assert not run.dispatch(second) and _held(second) == [2]
    run.dispatch(first)
    assert _held(first) == [5]


def test_a_failed_worker_requeues_its_units_counts_attempts_and_restarts() -> None:
    heard = _Heard()
    run, slot = _busy(5, heard)
    run.live[0] = (1, 10, 0, 0)
    run.fail_slot(slot, RuntimeError("EngineDead: the engine died"), kill=False)
    assert [u.unit for u in run.queue] == [0, 1, 2, 3, 4]  # back at the head, in order
    assert run.attempts == {0: 1, 1: 1} and run.alone == {0, 1}
    assert heard.errors == [(0, 1, "EngineDead: the engine died", False),
                            (1, 1, "EngineDead: the engine died", False)]
    assert run.live == {} and not slot.inflight
    # Restarted: asked whether it is ready again, counted everywhere.
    assert slot.state == "starting" and slot.ever_ready and slot.ready_failures == 0
    assert len(slot.actor.ready.calls) == 1 and slot.ready_ref is not None
    assert run.pool.restarts == run.result.restarts == run.progress.restarts == 1
    assert heard.restarts == ["engine-0"]


def test_a_unit_is_given_up_after_max_attempts() -> None:
    heard = _Heard()
    run = _dispatch(2, heard, max_attempts=2)
    slot = run.slots[0]
    for attempt in (1, 2):
        slot.state = "idle"
        run.alone.clear()  # both go out together again, so both fail together
        run.dispatch(slot)
        run.fail_slot(slot, RuntimeError("boom"), kill=False)
        assert run.attempts == {0: attempt, 1: attempt}
    assert not run.queue and run.alone == set()
    assert run.result.failed_units == {0: "boom", 1: "boom"}
    assert run.progress.units_failed == 2
    assert [e[3] for e in heard.errors] == [False, False, True, True]


def test_units_that_all_fail_alike_before_any_commit_stop_the_job() -> None:
    """An engine that fails every unit the same way (seen on one H200: a package its
    kernel needs was missing) stops the job after SAME_FAILURE_UNITS units, not after
    restarting engines max_attempts times for each of its units."""
    heard = _Heard()
    run = _dispatch(50, heard, max_attempts=2)
    slot = run.slots[0]
    error = RuntimeError("vLLM engine failed: ModuleNotFoundError: No module named 'x'")
    for _ in range(2):
        slot.state = "idle"
        run.alone.clear()
        run.dispatch(slot)
        run.fail_slot(slot, error, kill=False)
    assert run.result.failed_units == {0: str(error), 1: str(error)}
    assert not run.queue and not run.working()  # units 2..49 are not tried
    fatal = run.result.fatal or ""
    assert fatal.startswith("2 of 50 units failed 2 times and were given up (units [0, 1])")
    assert "No module named 'x'" in fatal and "none committed" in fatal
    assert len(heard.restarts) == 2


def test_units_failing_after_a_commit_or_in_different_ways_do_not_stop_the_job() -> None:
    def fail_next_alone(run: Dispatch, message: str) -> None:
        slot = run.slots[0]
        slot.state = "idle"
        run.alone.add(run.queue[0].unit)  # out on its own
        run.dispatch(slot)
        run.fail_slot(slot, RuntimeError(message), kill=False)

    # One unit committed: the engines can run the job; those given up are the units'.
    run = _dispatch(6, max_attempts=1)
    run.dispatch(run.slots[0])
    slot = run.slots[0]
    run.unit_done(slot, next(iter(slot.inflight)), _report(0))
    run.fail_slot(slot, RuntimeError("boom"), kill=False)  # unit 1
    fail_next_alone(run, "boom")
    assert sorted(run.result.failed_units) == [1, 2] and run.result.fatal is None
    assert [u.unit for u in run.queue] == [3, 4, 5]
    # Nothing committed, but each failed its own way: the units, not the engines.
    run = _dispatch(6, max_attempts=1)
    fail_next_alone(run, "row 3 does not fit the KV cache")
    fail_next_alone(run, "boom")
    assert sorted(run.result.failed_units) == [0, 1] and run.result.fatal is None
    assert [u.unit for u in run.queue] == [2, 3, 4, 5]


def test_a_unit_committed_before_its_worker_died_is_done_not_failed() -> None:
    record = CommitRecord(unit=0, shard="shards/unit-000000.bin", attempt="a", samples=4,
                          tokens=40, bytes=320)
    heard = _Heard()
    run, slot = _busy(2, heard, output=_Output(committed={0: record}))
    run.fail_slot(slot, RuntimeError("node lost"), kill=False)
    assert [u.unit for u in run.queue] == [1] and run.attempts == {1: 1}
    assert run.progress.units_done == 1 and run.progress.tokens_done == 40
    assert [(r.unit, r.worker) for r in heard.done] == [(0, "engine-0")]


def test_a_worker_that_held_nothing_fails_the_job() -> None:
    run = _dispatch(1)
    with pytest.raises(JobFailed, match="engine-0: gone"):
        run.fail_slot(run.slots[0], RuntimeError("gone"), kill=False)


def test_a_committed_unit_counts_into_the_progress() -> None:
    heard = _Heard()
    run, slot = _busy(3, heard)
    first = next(iter(slot.inflight))
    run.alone.add(0)
    run.live[0] = (2, 20, 1, 4)
    run.unit_done(slot, first, _report(0))
    progress = run.progress
    assert (progress.units_done, progress.shards, progress.samples_done,
            progress.samples_failed, progress.tokens_done, progress.bytes,
            progress.rate_tokens, progress.samples_generated,
            progress.tokens_generated) == (1, 1, 5, 1, 40, 320, 40, 2, 9)
    assert run.alone == set() and run.live == {} and slot.units_run == 1
    assert slot.state == "busy"  # it still holds unit 1
    run.unit_done(slot, next(iter(slot.inflight)), _report(1))
    assert slot.state == "idle" and [r.unit for r in heard.done] == [0, 1]


def test_an_engine_ray_restarted_on_another_node_is_placed_there_by_its_next_report(
) -> None:
    # Its node died while it held no unit: no call failed, and only its next report
    # says where it runs now (the status, `place: apart`, an online unit's bytes).
    placed: list[dict[str, str]] = []
    run, slot = _busy(2, hooks=DispatchHooks(on_engines=placed.append))
    slot.node = "node-a"
    refs = list(slot.inflight)
    run.unit_done(slot, refs[0], _report(0))  # one naming no node (read from a commit)
    assert slot.node == "node-a" and placed == []
    report = _report(1)
    report.node = "node-b"
    run.unit_done(slot, refs[1], report)
    assert slot.node == "node-b" and placed == [{"engine-0": "node-b"}]


def test_what_is_shown_includes_the_units_still_running() -> None:
    heard = _Heard()
    run, _ = _busy(3, heard)
    run.live = {0: (2, 20, 1, 5), 1: (1, 7, 0, 0)}
    run.emit(False)
    run.emit(True)
    plain, live = heard.progress
    assert plain.tokens_done == 0 and plain.workers == {"engine-0": "busy"}
    assert plain.worker_units == {"engine-0": 0}
    assert (live.samples_done, live.tokens_done, live.rate_tokens, live.samples_generated,
            live.tokens_generated) == (3, 27, 27, 1, 5)
    assert run.progress.tokens_done == 0  # the live counts are shown, not kept


def test_a_full_disk_stops_dispatch_and_names_enospc() -> None:
    heard = _Heard()
    run, slot = _busy(4, heard)
    ref = next(iter(slot.inflight))
    run.stop_for_full_disk(slot, ref, OSError(28, "No space left on device"))
    assert not run.queue and _held(slot) == [1] and slot.state == "busy"
    assert run.result.fatal is not None and "ENOSPC" in run.result.fatal
    assert heard.errors == [(0, 1, "[Errno 28] No space left on device", True)]
    assert run.working()  # the unit out is still waited for, and no other goes out
    run.unit_done(slot, next(iter(slot.inflight)), _report(1))
    assert not run.working()


def test_a_tripped_check_fails_the_job_and_stops_the_other_workers_units() -> None:
    heard = _Heard()
    run = _dispatch(6, heard, workers=2)
    first, second = run.slots
    run.dispatch(first)
    run.dispatch(second)
    tripped = "unit 0: self-check failed: sample 2 (dataset row 2), layer 4: all zeros"
    run.stop_for_check(first, next(iter(first.inflight)), RuntimeError(tripped))
    assert run.result.fatal == tripped and not run.queue
    assert second.actor.stop_job.calls == [(run.job.output, tripped)]
    assert first.actor.stop_job.calls == []  # its worker stopped its own units
    # The other worker's units then fail with the same words; nobody is told twice.
    run.stop_for_check(second, next(iter(second.inflight)), RuntimeError(tripped))
    assert len(second.actor.stop_job.calls) == 1 and len(first.actor.stop_job.calls) == 0
    assert [e[0] for e in heard.errors] == [0, DISPATCH_DEPTH]


def test_engines_that_start_together_begin_together() -> None:
    run = _dispatch(2, workers=2)
    run.slots[1].state = "starting"
    assert not run.all_started()
    run.slots[1].ever_ready = True  # a restart of an engine that served holds nobody back
    assert run.all_started()


def test_an_engine_that_never_started_fails_the_job_one_that_served_is_asked_again() -> None:
    run = _dispatch(2, workers=2)
    new, restarting = run.slots
    new.state = "starting"
    with pytest.raises(JobFailed, match="engine-0 could not start: no memory"):
        run.not_ready(new, RuntimeError("no memory"))
    restarting.state, restarting.ever_ready = "starting", True
    restarting.ready_ref = object()
    new.state = "idle"
    run.not_ready(restarting, RuntimeError("node lost"))
    assert restarting.ready_ref is None and restarting.ready_failures == 1
    assert restarting.check_at > 0  # asked again after a pause, the others go on


def test_a_cancel_stops_dispatch_once() -> None:
    cancelled = [False]
    run = _dispatch(3)
    run.hooks.cancelled = lambda: cancelled[0]
    assert not run.cancel_asked()
    cancelled[0] = True
    assert run.cancel_asked() and run.result.cancelled and not run.queue
    assert not run.cancel_asked()  # already stopped


# --------------------------------------------------------------------------- the loop


@dataclass(eq=False)  # hashed by identity, as refs are
class _Ref:
    """A Ray object ref that is already computed: its value, or the error `ray.get` raises."""

    value: Any = None
    error: BaseException | None = None


class _Worker:
    """An actor that commits every unit at once, except that its process dies on the
    units named in `dies_on`, the first time it gets them."""

    def __init__(self, dies_on: set[int]) -> None:
        self.dies_on = dies_on
        self.ran: list[int] = []
        self.run_unit = SimpleNamespace(remote=self._run_unit)
        self.ready = SimpleNamespace(remote=lambda: _Ref(True))
        self.progress = SimpleNamespace(remote=lambda: _Ref({}))

    def _run_unit(self, output: Any, dtype: str, unit: WorkUnit, checksum: str,
                  **checks: Any) -> _Ref:
        self.ran.append(unit.unit)
        if unit.unit in self.dies_on:
            from ray.exceptions import RayActorError

            self.dies_on.discard(unit.unit)
            return _Ref(error=RayActorError())
        return _Ref(_report(unit.unit))


def test_the_loop_runs_every_unit_retrying_a_dead_workers_units_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`run` over workers whose refs are computed already: `ray.wait` answers the first,
    `ray.get` its value. Nothing here starts Ray."""
    import ray

    def get(ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs[:1], refs[1:]))
    monkeypatch.setattr(ray, "get", get)
    heard = _Heard()
    run = _dispatch(6, heard, workers=2)
    workers = [_Worker(dies_on={0}), _Worker(dies_on=set())]
    for slot, worker in zip(run.slots, workers, strict=True):
        slot.actor, slot.state, slot.ready_ref = worker, "starting", worker.ready.remote()

    result = run.run()
    assert result.restarts == 1 and not result.failed_units and not result.cancelled
    assert sorted(r.unit for r in heard.done) == list(range(6))
    assert run.progress.units_done == 6 and run.attempts == {0: 1, 1: 1}
    assert heard.restarts == ["engine-0"] and [e[:2] for e in heard.errors] == [(0, 1), (1, 1)]
    assert sorted(workers[0].ran + workers[1].ran) == [0, 0, 1, 1, 2, 3, 4, 5]
    assert heard.progress[-1].workers == {"engine-0": "idle", "engine-1": "idle"}


@dataclass
class _Feed:
    """An ingestion as the dispatcher sees it: units planned part by part."""

    manifest: Any
    planned: list[WorkUnit] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None
    progress: Any = None
    dispatching: bool = False

    def take(self) -> list[WorkUnit]:
        new, self.planned = self.planned, []
        return new


def test_units_planned_while_the_dataset_is_tokenized_are_dispatched_as_they_come() -> None:
    planned: list[tuple[list[int], bool]] = []
    heard = _Heard()
    hooks = heard.hooks()
    hooks.on_planned = lambda _job, units, done: planned.append(([u.unit for u in units], done))
    feed = _Feed(manifest=SimpleNamespace(num_samples=8, num_errors=1, tokens_total=80))
    run = _dispatch(0, ingestion=feed)
    run.hooks = hooks
    run.job.committed = {1}  # an earlier run committed unit 1 before it was killed
    assert feed.dispatching and run.progress.ingesting
    assert run.working() and not run.queue  # nothing yet, but units may come

    feed.planned = _units(3)[:2]
    feed.progress = SimpleNamespace(rows=9, rows_expected=20)
    run.take_planned()
    assert [u.unit for u in run.queue] == [0]  # unit 1 is committed already
    assert run.progress.units_total == 2 and run.progress.rows_tokenized == 9
    assert run.progress.rows_total == 20 and run.progress.ingesting
    run.dispatch(run.slots[0])
    assert not run.queue and run.working()

    feed.planned, feed.done = [_units(3)[2]], True
    run.take_planned()
    assert [u.unit for u in run.queue] == [2] and not run.feeding()
    assert not run.progress.ingesting and run.progress.rows_total == 9
    assert planned == [([0, 1], False), ([2], True)]
    assert heard.progress[-1].units_total == 3


def test_an_ingestion_that_fails_stops_dispatch_and_lets_the_units_out_end() -> None:
    feed = _Feed(manifest=SimpleNamespace(num_samples=0, num_errors=0, tokens_total=0))
    run = _dispatch(0, ingestion=feed)
    feed.planned = _units(3)
    run.take_planned()
    run.dispatch(run.slots[0])  # two units out, one queued
    feed.done, feed.error = True, ValueError("dataset: a file went away")
    run.take_planned()
    assert not run.queue and not run.feeding()
    assert run.working()  # the units out end first
    run.slots[0].inflight.clear()
    assert not run.working()


def test_an_ingestion_that_ends_with_every_unit_done_ends_the_loop() -> None:
    """The last units commit before the ingestion says it ended, and its end brings no
    new unit (a rerun whose units were committed, a resumed ingestion's last part):
    the loop ends there, not on "no engine is running" with idle engines."""
    feed = _Feed(manifest=SimpleNamespace(num_samples=8, num_errors=0, tokens_total=80))
    run = _dispatch(0, ingestion=feed)
    assert run.working()  # units may still come
    feed.done = True  # between the loop's check and its take: nothing came
    result = run.run()
    assert result.fatal is None and not result.failed_units and not run.queue
    assert run.slots[0].state == "idle"
