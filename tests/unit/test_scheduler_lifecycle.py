"""The scheduler's lifecycle on a shared ledger: standby and take-over, fencing of a
coordinator that lost its lease, a runner that dies and is replaced without a restart.

Real `Scheduler` objects, a real ledger, real preparation of a tiny job (ingest, plan);
what would start Ray and engines (`ensure_ray`, and `execute`, which the job driver
`run_job` calls) is replaced, so each case chooses how the run goes. Real `hsx serve`
processes on one ledger are in tests/integration/test_service.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.spec import JobSpec
from hsx.wire import JobState, ResourcePlan
from hsx_service import runner as runner_module
from hsx_service import scheduler as scheduler_module
from hsx_service.config import Settings
from hsx_service.dispatch import DispatchResult
from hsx_service.errors import NotReady
from hsx_service.ledger import LeaseLost, Ledger, LedgerHeld
from hsx_service.scheduler import Scheduler
from hsx_workers.tiny_models import ChatDataset


class Died(BaseException):
    """What kills a thread outright: not an Exception, so nothing in the loop catches it."""


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
    # A guard against a hang: four runner attempts, each preparing the tiny job, took
    # over 60 s on a 2-core machine without AVX-512 under the rest of `make test`.
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


@pytest.fixture
def spec(tmp_path: Path, tiny_llama: Path, chat_dataset: ChatDataset) -> JobSpec:
    return JobSpec(model=str(tiny_llama), dataset=str(chat_dataset.path),
                   output=str(tmp_path / "out"), layers=[1, 2, 3, 4], max_seq_len=256,
                   unit_tokens=4096)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The runs `execute` saw; each test appends what a run does to `outcomes`."""
    monkeypatch.setattr(scheduler_module, "SUPERVISE_TICK_S", 0.05)
    monkeypatch.setattr(scheduler_module, "START_RETRY_S", 0.05)
    monkeypatch.setattr(scheduler_module, "ensure_ray", lambda *a, **k: None)
    monkeypatch.setattr(scheduler_module, "plan_for_cluster", lambda spec: ResourcePlan())
    seen: list[Any] = []
    return seen


@pytest.fixture
def schedulers() -> Iterator[list[Scheduler]]:
    made: list[Scheduler] = []
    yield made
    for scheduler in made:
        scheduler.stop()


def _scheduler(made: list[Scheduler], ledger: Path, **settings: Any) -> Scheduler:
    scheduler = Scheduler(Settings(ledger_path=ledger, **settings))
    made.append(scheduler)
    return scheduler


def _executes(monkeypatch: pytest.MonkeyPatch, runs: list[Any],
              outcomes: list[Callable[[Any], DispatchResult]]) -> None:
    """`execute` runs the next outcome (the last one again when they run out)."""
    def execute(job: Any, pool: Any, hooks: Any, max_attempts: int,
                 **_: Any) -> DispatchResult:
        runs.append(job)
        return outcomes[min(len(runs), len(outcomes)) - 1](hooks)

    monkeypatch.setattr(runner_module, "execute", execute)


def _done(hooks: Any) -> DispatchResult:
    return DispatchResult()


def test_a_second_coordinator_refuses_to_start_or_stands_by_and_takes_over(
    tmp_path: Path, spec: JobSpec, runs: list[Any], schedulers: list[Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _executes(monkeypatch, runs, [_done])
    ledger = tmp_path / "ledger.sqlite"
    holder = _scheduler(schedulers, ledger, port=8001)
    holder.start()
    wait_for(lambda: holder.ready, "the holder is ready")

    with pytest.raises(LedgerHeld, match=r"http://127\.0\.0\.1:8001"):
        _scheduler(schedulers, ledger, port=8002).start()
    standby = _scheduler(schedulers, ledger, port=8003, standby=True)
    standby.start()
    wait_for(lambda: standby._standby is not None, "the standby knows who holds the ledger")
    assert not standby.ready
    with pytest.raises(NotReady, match=r"standby: .*http://127\.0\.0\.1:8001"):
        standby.submit(spec, "on-the-standby")

    # The holder runs a job; the standby shows it as the ledger has it, changing nothing.
    job, _ = holder.submit(spec, "first")
    wait_for(lambda: holder.get(job.id).state == JobState.succeeded, "the job succeeded")
    wait_for(lambda: standby.board.get(job.id) is not None
             and standby.get(job.id).state == JobState.succeeded, "the standby shows it")
    with pytest.raises(NotReady, match="standby"):
        standby.cancel(job.id)

    # The holder stops (and gives the lease up): the standby takes over and runs jobs.
    holder.stop()
    schedulers.remove(holder)
    wait_for(lambda: standby.ready, "the standby took over")
    assert standby.ledger.lease().address == "http://127.0.0.1:8003"  # type: ignore[union-attr]
    second, created = standby.submit(spec.model_copy(update={"output": str(tmp_path / "o2")}),
                                     "second")
    assert created
    wait_for(lambda: standby.get(second.id).state == JobState.succeeded, "it ran a job")


def test_a_coordinator_whose_lease_was_taken_over_steps_down_and_is_fenced(
    tmp_path: Path, spec: JobSpec, runs: list[Any], schedulers: list[Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken_over: list[Ledger] = []
    ledger = tmp_path / "ledger.sqlite"

    def stalls_then_wakes(hooks: Any) -> DispatchResult:
        """While this run goes on, the process stalls past its lease (its heartbeat stops
        renewing) and another coordinator takes the ledger over; then it wakes up."""
        renew = holder.ledger.renew
        monkeypatch.setattr(holder.ledger, "renew", lambda ttl: None)
        other = Ledger(ledger)
        deadline = time.monotonic() + 30
        while not taken_over:
            try:
                other.acquire(ttl=3600, address="http://127.0.0.1:9999")
                taken_over.append(other)
            except LedgerHeld:  # not expired yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        monkeypatch.setattr(holder.ledger, "renew", renew)
        wait_for(lambda: hooks.cancelled(), "the run is told to stop dispatching")
        return DispatchResult(cancelled=True)

    _executes(monkeypatch, runs, [stalls_then_wakes])
    holder = _scheduler(schedulers, ledger, port=8001, lease_ttl_s=0.2)
    holder.start()
    wait_for(lambda: holder.ready, "the holder is ready")
    job, _ = holder.submit(spec, "fenced")
    wait_for(lambda: holder._standby is not None, "the holder stepped down")
    assert not holder.ready
    with pytest.raises(NotReady, match="taken over"):
        holder.submit(spec, "another")
    # Its end of the run was refused: the job stays running for the new holder to resume.
    row = taken_over[0].job(job.id)
    assert row is not None and row.state == JobState.running
    with pytest.raises(NotReady, match="standby"):
        holder.cancel(job.id)
    with pytest.raises(LeaseLost):  # and beneath, the ledger refuses its writes
        holder.ledger.request_cancel(job.id)
    wait_for(lambda: "9999" in (holder._standby or ""), "it names the new holder")
    assert len(runs) == 1  # and runs nothing more


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_job_thread_is_replaced_and_its_job_runs_again(
    tmp_path: Path, spec: JobSpec, runs: list[Any], schedulers: list[Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def dies(hooks: Any) -> DispatchResult:
        raise Died("the job thread is gone")

    _executes(monkeypatch, runs, [dies, _done])
    scheduler = _scheduler(schedulers, tmp_path / "ledger.sqlite")
    scheduler.start()
    wait_for(lambda: scheduler.ready, "ready")
    first_thread = scheduler._thread
    job, _ = scheduler.submit(spec, "survives")
    wait_for(lambda: scheduler.get(job.id).state == JobState.succeeded, "the job succeeded")
    assert len(runs) == 2 and scheduler._thread is not first_thread
    assert "runner restarted: the scheduler's job thread died" in (
        scheduler.get(job.id).last_error or "")


def test_a_run_that_loses_ray_is_queued_again_and_a_bug_fails_the_job(
    tmp_path: Path, spec: JobSpec, runs: list[Any], schedulers: list[Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def ray_lost(hooks: Any) -> DispatchResult:
        raise ConnectionError("the connection to the Ray cluster was lost")

    def bug(hooks: Any) -> DispatchResult:
        raise KeyError("oops")

    _executes(monkeypatch, runs, [ray_lost, _done, bug])
    scheduler = _scheduler(schedulers, tmp_path / "ledger.sqlite")
    scheduler.start()
    wait_for(lambda: scheduler.ready, "ready")
    job, _ = scheduler.submit(spec, "reconnects")
    wait_for(lambda: scheduler.get(job.id).state == JobState.succeeded, "the job succeeded")
    assert len(runs) == 2
    assert "Ray was lost" in (scheduler.get(job.id).last_error or "")

    other, _ = scheduler.submit(spec.model_copy(update={"output": str(tmp_path / "o2")}), "bug")
    wait_for(lambda: scheduler.get(other.id).state.finished, "the job ended")
    final = scheduler.get(other.id)
    assert final.state == JobState.failed and "KeyError" in (final.last_error or "")
    assert len(runs) == 3  # a bug is not retried


def test_a_runner_that_keeps_dying_fails_its_job(
    tmp_path: Path, spec: JobSpec, runs: list[Any], schedulers: list[Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def ray_lost(hooks: Any) -> DispatchResult:
        raise ConnectionError("Ray is gone")

    _executes(monkeypatch, runs, [ray_lost])
    scheduler = _scheduler(schedulers, tmp_path / "ledger.sqlite")
    scheduler.start()
    wait_for(lambda: scheduler.ready, "ready")
    job, _ = scheduler.submit(spec, "doomed")
    wait_for(lambda: scheduler.get(job.id).state.finished, "the job ended")
    final = scheduler.get(job.id)
    assert final.state == JobState.failed
    assert f"died {scheduler_module.MAX_RUNNER_RESTARTS + 1} times" in (final.last_error or "")
    assert len(runs) == scheduler_module.MAX_RUNNER_RESTARTS + 1


def test_stopping_a_pool_without_engines_starts_no_ray() -> None:
    # A run that lost Ray before its engines started resets an empty pool: that must not
    # start a local Ray in the coordinator (any Ray call does when none is connected).
    import ray

    from hsx_service.engine_pool import EnginePool

    if ray.is_initialized():
        pytest.skip("Ray is connected in this process already")
    try:
        EnginePool().shutdown()
        assert not ray.is_initialized()
    finally:
        ray.shutdown()
