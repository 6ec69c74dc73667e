"""The coordinator for real: `hsx serve` (uvicorn) in a subprocess, local Ray, vLLM CPU
engines, driven over HTTP with the SDK.

- submit with 2 replicas, follow the SSE stream to the end, every sample exactly once;
- idempotent submit, 409, 422 naming the field, 401 without the token, cancel, the
  paged error table (the attacks are tests/security's);
- a worker actor killed mid-job: the job completes, exactly once, the restart counted;
- a second `hsx serve` on the same ledger refuses to start, naming the holder;
- load and a coordinator killed -9 under it: 200 jobs queued at once, tiny jobs running
  back to back on the warm engine, one cancelled mid-run; a standby coordinator on the
  same ledger takes over from the killed one, the interrupted job resumes and completes
  with the same content as an uninterrupted run, and the audit finds nothing lost,
  doubled or corrupt (test_the_api_survives_fuzzing_from_its_schema fuzzes this coordinator's
  API before that).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch

from hsx.client import (
    Client,
    ConflictError,
    JobRefusedError,
    NotReadyError,
    UnauthorizedError,
)
from hsx.output.layout import COMMITS_DIR, TMP_DIR
from hsx.wire import JobState, JobStatus
from hsx_workers.tiny_models import ChatDataset

from .helpers import by_sample, kill_tree, relative_error, size_of, worker_processes

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-of-the-tests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Coordinator:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, token: str | None = TOKEN) -> Client:
        return Client(self.url, token=token, timeout=30)

    def kill(self) -> None:
        """kill -9 the coordinator and everything it started (Ray, engines)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait(timeout=30)

    def workers(self) -> list[psutil.Process]:
        return worker_processes(self.proc.pid)


def serve_command(ledger: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hsx.cli", "serve", "--port", str(port), "--ledger",
            str(ledger), *extra]


def serve_env(roots: list[Path]) -> dict[str, str]:
    env = {
        **os.environ,
        "HSX_API_TOKEN": TOKEN,
        "HSX_ALLOWED_ROOTS": ":".join(str(r) for r in roots),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # No network here: a hub id in a fuzzed request fails at once instead of retrying.
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("RAY_ADDRESS", None)
    return env


def start_coordinator(
    ledger: Path, roots: list[Path], log: Path, *, standby: bool = False,
    env: dict[str, str] | None = None,
) -> Coordinator:
    """`hsx serve` on `ledger`, once ready; a standby once it serves and says it waits.
    `env`: more environment variables of the server (HSX_RAY_ADDRESS, ...)."""
    port = _free_port()
    out = open(log, "ab")  # noqa: SIM115 - the server writes to it until it is killed
    proc = subprocess.Popen(
        serve_command(ledger, port, *(["--standby"] if standby else [])),
        stdout=out, stderr=subprocess.STDOUT, env={**serve_env(roots), **(env or {})},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    # Ray's start alone took over 300 s once, beside another worker's training on a
    # 2-core machine without AVX-512 (its local node timed out registering, twice).
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hsx serve exited: {log.read_text()[-3000:]}")
        try:
            ready = httpx.get(f"{url}/readyz", timeout=2)
            if ready.status_code == 200 or (
                    standby and "standby" in ready.json().get("message", "")):
                return Coordinator(url, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"hsx serve never became ready: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [tmp_path_factory.getbasetemp()]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ledger") / "ledger.sqlite"


def serve_for_module(tmp_path_factory: pytest.TempPathFactory, name: str,
                     *more_roots: Path) -> Iterator[Coordinator]:
    """A module's own coordinator on a fresh ledger, allowed the whole session's tmp (and
    `more_roots`)."""
    ledger = tmp_path_factory.mktemp(f"{name}-ledger") / "ledger.sqlite"
    server = start_coordinator(ledger, [tmp_path_factory.getbasetemp(), *more_roots],
                               ledger.parent / "serve.log")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def coordinator(ledger: Path, roots: list[Path]) -> Iterator[Coordinator]:
    server = start_coordinator(ledger, roots, ledger.parent / "serve.log")
    yield server
    server.kill()


def _spec(model: Path, dataset: ChatDataset, output: Path, **extra: Any) -> dict[str, Any]:
    return {
        "model": str(model), "dataset": str(dataset.path), "output": str(output),
        "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 1024, **extra,
    }


@pytest.fixture(scope="module")
def two_replica_run(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[JobStatus, list[JobStatus]]:
    output = tmp_path_factory.mktemp("svc") / "two"
    client = coordinator.client()
    job = client.submit(_spec(tiny_llama, chat_dataset, output, replicas=2), job_id="two-replicas")
    seen = list(client.events(job.id))
    return seen[-1], seen


def test_submit_and_follow_events_to_completion(
    two_replica_run: tuple[JobStatus, list[JobStatus]], chat_dataset: ChatDataset
) -> None:
    final, seen = two_replica_run
    assert final.state == JobState.succeeded, final.last_error
    assert final.samples_total == len(chat_dataset.good_indices)
    assert final.samples_done == final.samples_total
    assert final.units_done == final.units_total > 1
    assert any(s.state == JobState.running for s in seen)
    assert max(sum(w.state == "busy" for w in s.workers) for s in seen) == 2
    assert sorted(by_sample(Path(final.output))) == chat_dataset.good_indices


def test_api_contract(
    coordinator: Coordinator, two_replica_run: tuple[JobStatus, list[JobStatus]],
    tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path,
) -> None:
    client = coordinator.client()
    final, _ = two_replica_run
    spec = final.spec.model_dump() if final.spec else {}
    # Same id, same spec: the same job; same id, other spec: 409.
    again = client.submit(spec, job_id="two-replicas")
    assert again.id == "two-replicas" and again.state == JobState.succeeded
    with pytest.raises(ConflictError):
        client.submit({**spec, "layers": [1, 4]}, job_id="two-replicas")
    # Another id at the finished output: a rerun, which finds every sample committed,
    # starts no engine and says it was already complete (not a rate or a time of 0).
    rerun = client.wait(client.submit(spec, job_id="two-replicas-rerun").id)
    assert rerun.state == JobState.succeeded and rerun.already_complete, rerun.last_error
    assert rerun.samples_at_start == rerun.samples_done == final.samples_done
    # Bad specs: 422 naming the field.
    with pytest.raises(JobRefusedError) as bad:
        client.submit({**spec, "replica": 2})
    assert bad.value.field and "replica" in bad.value.field
    # What this machine can never run is refused before any engine starts: vLLM's CPU
    # build binds each TP rank to cores of its own (3 x TP 2 on CI's 2 cores).
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(JobRefusedError) as bad:
        client.submit({**spec, "replicas": max(3, cores), "tensor_parallel_size": 2})
    assert bad.value.field == "spec.replicas"
    assert f"they need {2 * max(3, cores)} cores, this machine has {cores}" in str(bad.value)
    with pytest.raises(JobRefusedError) as bad:
        client.submit(_spec(tiny_llama, chat_dataset, tmp_path / "x", layers=[1, 9]))
    assert "layers" in str(bad.value)
    # Paths outside the allowed roots, `..` included.
    escape = Path(chat_dataset.path).parent / ".." / ".." / ".." / "etc" / "passwd"
    with pytest.raises(JobRefusedError) as bad:
        client.submit({**spec, "dataset": str(escape)})
    assert bad.value.field == "spec.dataset"
    with pytest.raises(JobRefusedError) as bad:
        client.submit({**spec, "output": "/root/elsewhere"})
    assert bad.value.field == "spec.output"
    # No token, wrong token: 401.
    with pytest.raises(UnauthorizedError):
        coordinator.client(token=None).list()
    with pytest.raises(UnauthorizedError):
        coordinator.client(token="wrong").get("two-replicas")
    # The error table, paged.
    first = client.errors("two-replicas", offset=0, limit=2)
    rest = client.errors("two-replicas", offset=2, limit=100)
    assert first.total == len(chat_dataset.bad)
    indices = [e.sample_index for e in [*first.items, *rest.items]]
    assert indices == sorted(chat_dataset.bad)
    # Filtering by state.
    assert "two-replicas" in {j.id for j in client.list(state="succeeded")}


def test_cancel(coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset,
                tmp_path: Path) -> None:
    client = coordinator.client()
    job = client.submit(_spec(tiny_llama, chat_dataset, tmp_path / "cancel", unit_tokens=512))
    # Wait until it runs and has committed a unit, then cancel.
    for status in client.events(job.id):
        if status.units_done >= 1:
            break
    client.cancel(job.id)
    final = client.wait(job.id, timeout=300)
    assert final.state == JobState.cancelled
    assert final.units_done < final.units_total
    output = Path(final.output)
    assert not (output / "complete.json").exists()
    assert not list((output / TMP_DIR).glob("shards--*.part")), "a unit was left half-written"
    # What was committed before the cancel is whole.
    from hsx.dataset import HiddenStatesDataset

    ds = HiddenStatesDataset(output)
    assert ds.verify() == len(ds.records) == final.units_done


@pytest.mark.slow  # make test-slow; test_crash kills a worker under hsx extract
def test_killed_worker_actor_is_restarted_and_the_job_completes(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path
) -> None:
    client = coordinator.client()
    output = tmp_path / "killed-worker"
    job = client.submit(_spec(tiny_llama, chat_dataset, output))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        commits = list((output / COMMITS_DIR).glob("*.json"))
        partial = [p for p in (output / TMP_DIR).glob("shards--*.part") if size_of(p) > 65536]
        if commits and partial:
            break
        time.sleep(0.005)
    workers = coordinator.workers()
    assert workers
    for worker in workers:
        worker.send_signal(signal.SIGKILL)
    final = client.wait(job.id, timeout=600)
    assert final.state == JobState.succeeded, final.last_error
    assert final.restarts >= 1
    assert sorted(by_sample(output)) == chat_dataset.good_indices


# Examples per operation and mode, and for the model preflight (vLLM): `make test` runs
# the short fuzz on every change; the long one is in make test-slow.
FUZZ_RUNS = [pytest.param(3, 1, id="short"),
             pytest.param(25, 8, id="long", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("examples", "slow_examples"), FUZZ_RUNS)
def test_the_api_survives_fuzzing_from_its_schema(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path,
    examples: int, slow_examples: int,
) -> None:
    from .api_fuzz import fuzz_api

    blocker = tmp_path / "a-file"
    blocker.write_text("an output cannot be made below a file")
    real = {"model": str(tiny_llama), "dataset": str(chat_dataset.path),
            "output": str(blocker / "out")}
    before = {j.id for j in coordinator.client().list()}
    started = time.monotonic()
    report = fuzz_api(coordinator.url, TOKEN, real, examples, slow_examples)
    print(f"API fuzzing: {report.calls} requests in {time.monotonic() - started:.0f}s, "
          f"statuses {sorted(report.statuses.items())}")
    assert report.server_errors() == 0
    assert not report.failures, "\n\n".join(report.failures[:5])
    assert not report.hangs, report.hangs
    operations = {op for _, op, _ in report.statuses}
    # Every operation was called; each mode tries up to `examples` cases of each (fewer
    # where schemathesis finds nothing to vary or to violate).
    assert len(operations) == 14 and report.calls > 14 * examples
    assert {j.id for j in coordinator.client().list()} == before  # nothing was queued
    assert coordinator.client().ready()


def test_a_second_coordinator_on_a_held_ledger_refuses_to_start(
    coordinator: Coordinator, ledger: Path, roots: list[Path]
) -> None:
    second = subprocess.run(serve_command(ledger, _free_port()), env=serve_env(roots),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr
    for part in (f"pid {coordinator.proc.pid} ", coordinator.url, str(ledger), "--standby"):
        assert part in second.stderr, part
    assert coordinator.client().ready()


LOAD_JOBS = 200  # tiny jobs queued at once
RAN_JOBS = 5  # of which these run, back to back, before the big job


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory: pytest.TempPathFactory) -> ChatDataset:
    """A handful of rows (one bad) for the load's tiny jobs."""
    from hsx_workers.tiny_models import make_chat_dataset

    return make_chat_dataset(tmp_path_factory.mktemp("tiny-rows") / "rows.jsonl", n=4,
                             seed=1, bad_rows=1)


def _each(calls: list[Any], threads: int = 16) -> list[Any]:
    """Run the calls from `threads` client threads at once; their results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_a_killed_coordinator_under_load_is_taken_over_and_nothing_is_lost(
    coordinator: Coordinator, ledger: Path, roots: list[Path],
    two_replica_run: tuple[JobStatus, list[JobStatus]], tiny_llama: Path,
    chat_dataset: ChatDataset, tiny_rows: ChatDataset, tmp_path: Path,
) -> None:
    # A standby on the same ledger: it serves, runs nothing, and says who holds the ledger.
    standby = start_coordinator(ledger, roots, ledger.parent / "standby.log", standby=True)
    try:
        _load_kill_and_take_over(coordinator, standby, two_replica_run, tiny_llama,
                                 chat_dataset, tiny_rows, tmp_path, ledger)
    finally:
        standby.kill()


def _ledger_states(ledger: Path) -> dict[str, JobState]:
    """Each job's state in the ledger's file (a job's state is written at once, never
    behind: hsx_service/ledger.py)."""
    with contextlib.closing(sqlite3.connect(ledger, timeout=30)) as db:
        return {job_id: JobState(state)
                for job_id, state in db.execute("SELECT id, state FROM jobs")}


def _load_kill_and_take_over(
    holder: Coordinator, standby: Coordinator,
    two_replica_run: tuple[JobStatus, list[JobStatus]], tiny_llama: Path,
    chat_dataset: ChatDataset, tiny_rows: ChatDataset, tmp_path: Path, ledger: Path,
) -> None:
    waiting = httpx.get(f"{standby.url}/readyz", timeout=10)
    assert waiting.status_code == 503
    assert f"pid {holder.proc.pid} " in waiting.json()["message"]
    assert holder.url in waiting.json()["message"]
    with pytest.raises(NotReadyError, match="standby"):
        standby.client().submit(_spec(tiny_llama, tiny_rows, tmp_path / "nope"))

    # The load: tiny jobs on the warm engine, then the big job, then the rest of the 200
    # submitted at once from 16 client threads, with retries of the same ids among them.
    client = holder.client()
    tiny = [f"t{i:03d}" for i in range(LOAD_JOBS)]

    def submit(job_id: str, rows: ChatDataset = tiny_rows) -> Any:
        return lambda: client.submit(
            _spec(tiny_llama, rows, tmp_path / job_id, name=f"load {job_id}"),
            job_id=job_id)

    # One of the first jobs reads the whole chat dataset (many units), so that it is
    # surely caught running and cancelled there (a tiny job goes from queued to succeeded
    # between two polls), before the rest of the load: on a warm engine it ended while
    # the 200 submits below were being answered.
    cancelled_mid_run = tiny[1]
    for job_id in tiny[:2]:
        submit(job_id, chat_dataset if job_id == cancelled_mid_run else tiny_rows)()
    while (state := client.get(cancelled_mid_run).state) == JobState.queued:
        time.sleep(0.01)
    assert state == JobState.running, state
    client.cancel(cancelled_mid_run)
    for job_id in tiny[2:RAN_JOBS]:
        submit(job_id)()
    # Small units, two at a time in an engine: many left to resume when the kill lands
    # (28 of 1,024 tokens all committed between the first commit and the kill once
    # engines started in seconds; with the default 65,536 tokens in flight, all 131 of
    # 256 were in the engines at once and committed as the holder died).
    big = client.submit(_spec(tiny_llama, chat_dataset, tmp_path / "resumed", unit_tokens=256,
                              vllm={"max_inflight_tokens": 512}), job_id="resumed")
    retries = [submit(job_id) for job_id in tiny[RAN_JOBS : RAN_JOBS + 20]]
    submitted = _each([submit(job_id) for job_id in tiny[RAN_JOBS:]] + retries)
    assert {j.id for j in submitted} == set(tiny[RAN_JOBS:])  # a retry is the same job

    # The big job runs after the tiny ones; once it has committed a unit, kill -9.
    output = tmp_path / "resumed"
    deadline = time.monotonic() + 300
    while not list((output / COMMITS_DIR).glob("*.json")):
        if time.monotonic() > deadline:
            raise AssertionError("no unit committed in time")
        time.sleep(0.01)
    # The jobs' states as the ledger holds them at the kill: read from its file in a
    # moment (the holder's list under this load took seconds on CI, in which the big job
    # committed its every unit and left nothing to resume).
    before = _ledger_states(ledger)
    holder.kill()
    killed_at = time.monotonic()
    committed = len(list((output / COMMITS_DIR).glob("*.json")))

    # The standby takes over at once (the holder's pid is gone), and loses nothing.
    deadline = killed_at + 180
    while httpx.get(f"{standby.url}/readyz", timeout=10).status_code != 200:
        if time.monotonic() > deadline:
            raise AssertionError(f"the standby never took over: {standby.log.read_text()[-3000:]}")
        time.sleep(0.2)
    take_over_s = time.monotonic() - killed_at
    survivor = standby.client()
    after = {j.id: j.state for j in survivor.list()}
    assert set(after) == set(before)  # every job, none doubled
    assert {t for t in tiny if t in after} == set(tiny)
    for job_id, state in before.items():
        if state.finished:
            assert after[job_id] == state, job_id
    ran = [t for t in tiny[:RAN_JOBS] if t != cancelled_mid_run]
    assert all(before[t] == JobState.succeeded for t in ran)
    assert before[cancelled_mid_run] == JobState.cancelled
    # The rest wait (or, where an engine was free beside the big job, ran): none that
    # had not finished at the kill is finished after it.
    assert not [t for t in tiny[RAN_JOBS:] if not before[t].finished and after[t].finished]
    # Cancels land while the survivor runs the interrupted job.
    _each([lambda t=t: survivor.cancel(t) for t in tiny[RAN_JOBS:]], threads=8)

    final = survivor.wait(big.id, timeout=600)
    assert final.state == JobState.succeeded, final.last_error
    assert final.units_done == final.units_total > committed
    resumed = by_sample(output)
    reference = by_sample(Path(two_replica_run[0].output))
    assert sorted(resumed) == sorted(reference) == chat_dataset.good_indices
    for index, sample in resumed.items():
        ref = reference[index]
        assert torch.equal(sample["input_ids"], ref["input_ids"])
        assert relative_error(sample["hidden_states"], ref["hidden_states"]).max() < 1e-2
    audit_ledger(ledger, survivor, {t: tiny_rows for t in tiny}, chat_dataset)
    states = [j.state.value for j in survivor.list()]
    figures = {"jobs": len(states), "succeeded": states.count("succeeded"),
               "cancelled": states.count("cancelled"), "failed": states.count("failed"),
               "units_committed_at_kill": committed, "units_total": final.units_total,
               "take_over_s": round(take_over_s, 1)}
    print(f"\nload: {json.dumps(figures)}")


def audit_ledger(ledger: Path, client: Client, rows_of: dict[str, ChatDataset],
                 chat_dataset: ChatDataset) -> None:
    """Every job ended; the ledger agrees with every output; each output is whole.
    A succeeded job read `rows_of[job id]`, or else the chat dataset."""
    import sqlite3

    from hsx.dataset import HiddenStatesDataset
    from hsx.output import Output

    jobs = client.list()
    assert len({j.id for j in jobs}) == len(jobs)
    assert not [j.id for j in jobs if not j.state.finished]
    db = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    for job in jobs:
        output = Path(job.output)
        units = dict(db.execute("SELECT unit, state FROM units WHERE job_id = ?", (job.id,)))
        assert "running" not in units.values(), job.id
        if job.state == JobState.succeeded:
            done = Output(output).committed_units()
            assert {u for u, s in units.items() if s == "committed"} == done == set(units)
            ds = HiddenStatesDataset(output)
            assert ds.verify() == len(ds.records)  # every shard's checksum
            rows = rows_of.get(job.id, chat_dataset)
            assert sorted(by_sample(output)) == rows.good_indices, job.id  # exactly once
        elif job.state == JobState.cancelled:
            assert not (output / "complete.json").exists(), job.id
            assert not list((output / TMP_DIR).glob("*.part")), job.id
    db.close()
