"""The ledger: queue order, idempotent inserts, unit states across a reconcile."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from hsx.spec import JobSpec
from hsx.wire import JobState
from hsx_service.ledger import Ledger


def _spec(tmp_path: Path, name: str) -> JobSpec:
    return JobSpec(model="/m", dataset="/d.jsonl", output=str(tmp_path / name), name=name)


def test_jobs_queue_in_submission_order(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite")
    for name in ("a", "b", "c"):
        assert ledger.insert_job(name, _spec(tmp_path, name), name) is not None
    assert ledger.insert_job("b", _spec(tmp_path, "b"), "b") is None  # id taken
    assert [j.id for j in ledger.jobs()] == ["a", "b", "c"]
    first = ledger.next_queued()
    assert first is not None and first.id == "a"
    ledger.set_state("a", JobState.running)
    second = ledger.next_queued()
    assert second is not None and second.id == "b"
    ledger.set_state("a", JobState.succeeded)
    row = ledger.job("a")
    assert row is not None and row.started_at and row.finished_at
    assert row.spec == _spec(tmp_path, "a")


def test_units_survive_a_reopen_and_reconcile(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    ledger = Ledger(path)
    ledger.insert_job("j", _spec(tmp_path, "j"), "j")
    ledger.plan("j", [(0, 0, 10, 100), (1, 10, 20, 100), (2, 20, 30, 100)])
    ledger.plan("j", [(0, 0, 10, 100)])  # planning twice changes nothing
    report = SimpleNamespace(unit=0, won=True, samples=10, errors=[], tokens=100, bytes=800,
                             seconds=1.5, worker="engine-0")
    ledger.unit_committed("j", report)
    ledger.unit_failed("j", 1, 1, "engine died", gave_up=False)
    ledger.unit_failed("j", 2, 3, "boom", gave_up=True)
    ledger.close()  # applies the writes queued behind
    reopened = Ledger(path)
    assert reopened.failed_units("j") == [(2, 20, 30, "boom")]
    reopened.reconcile_units("j", {0, 2})  # the output says unit 2 did commit after all
    assert reopened.failed_units("j") == []
    assert reopened.unit_seconds() == (1.5, 1)


def test_threads_each_get_a_connection(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite")
    errors: list[BaseException] = []

    def insert(i: int) -> None:
        try:
            ledger.insert_job(f"job-{i}", _spec(tmp_path, f"o{i}"), f"o{i}")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=insert, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(ledger.jobs()) == 8


def test_bookkeeping_is_written_behind_and_read_back(tmp_path: Path) -> None:
    """Queued writes are invisible to other connections until the writer applies them,
    always visible to this ledger's own reads, and applied by close()."""
    path = tmp_path / "l.sqlite"
    ledger = Ledger(path, write_interval=3600)  # the writer thread never gets to it
    ledger.insert_job("j", _spec(tmp_path, "j"), "j")
    ledger.add_restart("j")
    ledger.set_error("j", "engine died")
    ledger.add_throughput("j", 10.0, 500.0, 5000)
    ledger.put_totals("j", {"tokens_done": 5000, "run_tokens": 5000, "run_seconds": 10.0})
    report = SimpleNamespace(unit=0, won=True, samples=3, errors=[], tokens=70, bytes=560,
                             seconds=0.5, worker="engine-1")
    ledger.unit_committed("j", report)
    ledger.unit_committed("j", SimpleNamespace(**{**report.__dict__, "unit": 1, "won": False}))
    assert Ledger(path).throughput("j") == []  # not applied yet
    row = ledger.job("j")  # a read applies what is queued first
    assert row is not None and (row.restarts, row.last_error) == (1, "engine died")
    assert ledger.throughput("j") == [(10.0, 500.0, 5000)]
    assert ledger.totals()["j"]["run_seconds"] == 10.0
    # A duplicate commit (another attempt won) does not count for the worker.
    assert ledger.worker_totals("j") == {"j": [{"name": "engine-1", "units": 1, "samples": 3,
                                                "tokens": 70, "bytes": 560, "seconds": 0.5}]}
    ledger.add_throughput("j", 12.0, 400.0, 5800)
    ledger.close()
    assert Ledger(path).throughput("j")[-1] == (12.0, 400.0, 5800)


def test_the_writer_thread_applies_queued_writes(tmp_path: Path) -> None:
    import time

    path = tmp_path / "l.sqlite"
    ledger = Ledger(path, write_interval=0.05)
    ledger.insert_job("j", _spec(tmp_path, "j"), "j")
    ledger.add_throughput("j", 1.0, 2.0, 3)
    other = Ledger(path)
    deadline = time.monotonic() + 10
    while not other.throughput("j") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert other.throughput("j") == [(1.0, 2.0, 3)]
    ledger.close()
