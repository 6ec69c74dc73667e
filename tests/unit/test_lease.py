"""The ledger's lease: one coordinator per ledger, take-over of a gone holder, fencing.

Real SQLite files, real processes (a holder that is killed -9); no scheduler here
(tests/unit/test_scheduler_lifecycle.py drives schedulers on a shared ledger).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsx.spec import JobSpec
from hsx.wire import JobState
from hsx_service.ledger import LeaseLost, Ledger, LedgerHeld
from hsx_service.processes import process_alive, process_start


def _spec(tmp_path: Path, name: str) -> JobSpec:
    return JobSpec(model="/m", dataset="/d.jsonl", output=str(tmp_path / name), name=name)


def test_a_held_ledger_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    first, second = Ledger(path), Ledger(path)
    held = first.acquire(ttl=60, address="http://127.0.0.1:8642")
    assert held.epoch == 1 and held.pid == os.getpid() and first.holds_lease
    with pytest.raises(LedgerHeld) as refused:
        second.acquire(ttl=60, address="http://127.0.0.1:9999")
    message = str(refused.value)
    for part in (f"pid {os.getpid()}", socket.gethostname(), "http://127.0.0.1:8642",
                 "since", str(path), "--standby"):
        assert part in message, part
    assert not second.holds_lease
    # The refused ledger cannot write either: it asked for the lease, so it is fenced.
    with pytest.raises(LeaseLost, match="does not hold"):
        second.insert_job("j", _spec(tmp_path, "j"), "/o")
    # The holder writes, renews, and may take its own lease again.
    assert first.insert_job("j", _spec(tmp_path, "j"), "/o") is not None
    first.renew(ttl=60)
    assert first.acquire(ttl=60).epoch == 2


def test_release_lets_a_successor_start_at_once(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    first = Ledger(path)
    first.acquire(ttl=3600)
    first.close()  # a clean stop gives the lease up
    assert Ledger(path).lease() is None
    successor = Ledger(path)
    assert successor.acquire(ttl=3600).epoch == 1


_HOLDER = """
import sys, time
from hsx_service.ledger import Ledger
Ledger(sys.argv[1]).acquire(ttl=3600, address="http://127.0.0.1:1")
print("holding", flush=True)
time.sleep(600)
"""


def test_a_holder_killed_on_this_host_is_taken_over_without_waiting(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(LedgerHeld, match=f"pid {holder.pid} "):
            Ledger(path).acquire(ttl=3600)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
    lease = Ledger(path).lease()
    assert lease is not None and lease.pid == holder.pid and lease.gone()
    # Its lease had an hour to run; the process is gone, so it is taken over now.
    successor = Ledger(path)
    taken = successor.acquire(ttl=3600)
    assert taken.epoch == 2 and taken.pid == os.getpid()


def test_a_reused_pid_is_not_mistaken_for_the_holder(tmp_path: Path) -> None:
    started = process_start(os.getpid())
    assert started is not None and process_alive(os.getpid(), started)
    assert not process_alive(os.getpid(), started + "0")  # another process with our pid
    assert not process_alive(2**22 + 12345, None)  # above any pid_max: no such process


def test_an_expired_holder_is_taken_over_and_fenced(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    stalled, successor = Ledger(path, write_interval=3600), Ledger(path)
    stalled.acquire(ttl=0.05)
    assert stalled.insert_job("a", _spec(tmp_path, "a"), "/a") is not None
    stalled.add_restart("a")  # queued bookkeeping, not yet written
    time.sleep(0.1)  # it stalls: no renewal, so its lease expires
    assert successor.acquire(ttl=60).epoch == 2

    # Every state-changing write of the stalled holder now fails, inside its transaction.
    with pytest.raises(LeaseLost, match="taken over"):
        stalled.set_state("a", JobState.running)
    assert not stalled.holds_lease
    for write in (lambda: stalled.renew(ttl=60), lambda: stalled.request_cancel("a"),
                  lambda: stalled.insert_job("b", _spec(tmp_path, "b"), "/b"),
                  lambda: stalled.plan("a", [(0, 0, 1, 10)])):
        with pytest.raises(LeaseLost):
            write()
    # Its queued bookkeeping is dropped, and later bookkeeping is not even queued.
    stalled.add_restart("a")
    job = stalled.job("a")  # reads still work
    assert job is not None and job.state == JobState.queued and job.restarts == 0
    assert stalled.jobs(JobState.running) == []

    # The successor writes as usual; the stalled one cannot take the lease back.
    successor.set_state("a", JobState.running)
    assert successor.job("a").state == JobState.running  # type: ignore[union-attr]
    with pytest.raises(LedgerHeld):
        stalled.acquire(ttl=60)
    stalled.close()  # releases nothing: the lease is not its own
    lease = successor.lease()
    assert lease is not None and lease.epoch == 2
