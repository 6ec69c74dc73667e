"""The coordinator for real: `hsx serve` (uvicorn) in a subprocess, local Ray, vLLM CPU
engines, driven over HTTP with the SDK.

- submit with 2 replicas, follow the SSE stream to the end, every sample exactly once;
- idempotent submit, 409, 422 naming the field, 401 without the token, path escapes,
  cancel, the paged error table;
- a worker actor killed mid-job: the job completes, exactly once, the restart counted;
- the coordinator killed -9 mid-job and started again: the job resumes and completes
  with the same content as an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import socket
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
    UnauthorizedError,
)
from hsx.layout import COMMITS_DIR, TMP_DIR
from hsx.wire import JobState, JobStatus
from hsx_workers.tiny_models import ChatDataset

from .helpers import by_sample, kill_tree, relative_error, worker_processes

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token"


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


def start_coordinator(ledger: Path, roots: list[Path], log: Path) -> Coordinator:
    port = _free_port()
    env = {
        **os.environ,
        "HSX_API_TOKEN": TOKEN,
        "HSX_ALLOWED_ROOTS": ":".join(str(r) for r in roots),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    env.pop("RAY_ADDRESS", None)
    out = open(log, "ab")  # noqa: SIM115 - the server writes to it until it is killed
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "serve", "--port", str(port), "--ledger", str(ledger)],
        stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hsx serve exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
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
    # Bad specs: 422 naming the field.
    with pytest.raises(JobRefusedError) as bad:
        client.submit({**spec, "replica": 2})
    assert bad.value.field and "replica" in bad.value.field
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
    assert not list((output / TMP_DIR).glob("*.partial")), "a unit was left half-written"
    # What was committed before the cancel is whole.
    from hsx.dataset import HiddenStatesDataset

    ds = HiddenStatesDataset(output)
    assert ds.verify() == len(ds.records) == final.units_done


def test_killed_worker_actor_is_restarted_and_the_job_completes(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path
) -> None:
    client = coordinator.client()
    output = tmp_path / "killed-worker"
    job = client.submit(_spec(tiny_llama, chat_dataset, output))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        commits = list((output / COMMITS_DIR).glob("*.json"))
        partial = [p for p in (output / TMP_DIR).glob("*.partial") if p.stat().st_size > 65536]
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


def test_killed_coordinator_resumes_the_job(
    coordinator: Coordinator, ledger: Path, roots: list[Path],
    two_replica_run: tuple[JobStatus, list[JobStatus]],
    tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path,
) -> None:
    output = tmp_path / "resumed"
    job = coordinator.client().submit(_spec(tiny_llama, chat_dataset, output))
    deadline = time.monotonic() + 300
    while not list((output / COMMITS_DIR).glob("*.json")):
        if time.monotonic() > deadline:
            raise AssertionError("no unit committed in time")
        time.sleep(0.01)
    coordinator.kill()
    committed = len(list((output / COMMITS_DIR).glob("*.json")))

    restarted = start_coordinator(ledger, roots, ledger.parent / "serve-2.log")
    try:
        final = restarted.client().wait(job.id, timeout=600)
    finally:
        restarted.kill()
    assert final.state == JobState.succeeded, final.last_error
    assert final.units_done == final.units_total > committed
    resumed = by_sample(output)
    reference = by_sample(Path(two_replica_run[0].output))
    assert sorted(resumed) == sorted(reference) == chat_dataset.good_indices
    for index, sample in resumed.items():
        ref = reference[index]
        assert torch.equal(sample["input_ids"], ref["input_ids"])
        assert relative_error(sample["hidden_states"], ref["hidden_states"]).max() < 1e-2
