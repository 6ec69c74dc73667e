"""hsx.Client and the CLI's server commands against a real uvicorn serving a fake scheduler."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import hsx
from hsx.cli.jobs import job_progress
from hsx.client import (
    ApiError,
    Client,
    ConflictError,
    ConnectionFailedError,
    JobRefusedError,
    NotFoundError,
    UnauthorizedError,
    sse_events,
)
from hsx.progress import JobProgress, ProgressBar, ingestion_text
from hsx.spec import JobSpec, SpecError
from hsx.wire import JobState, JobStatus, NodeStatus, ResourcePlan, WorkerStatus
from hsx_service.config import Settings
from hsx_service.main import create_app
from tests.unit.test_api import TOKEN, FakeScheduler, job_fields, serving


@pytest.fixture(scope="module")
def fake() -> FakeScheduler:
    return FakeScheduler(run_steps=3, step_s=0.05)


@pytest.fixture(scope="module")
def url(fake: FakeScheduler) -> Iterator[str]:
    with serving(create_app(Settings(), fake)) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[Client]:
    with Client(url) as c:
        yield c


def job_file(tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / "job.yaml"
    fields = job_fields(tmp_path, **overrides)
    # Relative paths are taken from the job file's folder.
    fields["dataset"] = os.path.relpath(fields["dataset"], tmp_path)
    path.write_text(yaml.safe_dump(fields))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --- the SDK ------------------------------------------------------------------------


def test_client_is_a_lazy_public_name() -> None:
    assert hsx.Client is Client


def test_submit_a_file_follow_it_and_read_it_back(client: Client, tmp_path: Path) -> None:
    job = client.submit(job_file(tmp_path, name="from-file"), job_id="sdk-file")
    assert job.id == "sdk-file"
    assert job.spec is not None
    assert job.spec.dataset == str(tmp_path / "data" / "chats.jsonl")  # resolved locally
    updates: list[JobStatus] = []
    final = client.wait(job.id, timeout=10, on_update=updates.append)
    assert final.state == JobState.succeeded
    assert final.samples_done == 100
    assert updates[-1] == final
    assert [s.samples_done for s in updates if s.state == JobState.running][-1] == 100
    assert client.get(job.id).state == JobState.succeeded
    # Submitting the same job under the same id again is a no-op.
    assert client.submit(job_file(tmp_path, name="from-file"), job_id="sdk-file").id == job.id


def test_submit_spec_and_dict_list_cancel(client: Client, tmp_path: Path) -> None:
    spec = JobSpec(**job_fields(tmp_path, name="a-spec"))
    first = client.submit(spec)
    second = client.submit(job_fields(tmp_path, name="a-dict"), job_id="sdk-dict")
    ids = [j.id for j in client.list()]
    assert first.id in ids
    assert ids.index(first.id) < ids.index(second.id)
    cancelled = client.cancel("sdk-dict")
    assert cancelled.state in (JobState.cancelled, JobState.succeeded)
    assert "sdk-dict" in [j.id for j in client.list(cancelled.state)]
    assert "sdk-dict" in [j.id for j in client.list(cancelled.state.value)]


def test_events_end_when_the_job_ends(client: Client, tmp_path: Path) -> None:
    job = client.submit(job_fields(tmp_path), job_id="sdk-events")
    states = [s.state for s in client.events(job.id)]
    assert states[-1] == JobState.succeeded
    assert JobState.running in states


def test_errors_paged_and_iterated(client: Client, tmp_path: Path) -> None:
    job = client.submit(job_fields(tmp_path), job_id="sdk-errors")
    page = client.errors(job.id, offset=5, limit=3)
    assert (page.total, [r.sample_index for r in page.items]) == (25, [35, 42, 49])
    records = list(client.iter_errors(job.id, page_size=10))
    assert [r.sample_index for r in records] == [i * 7 for i in range(25)]


def test_server_errors_are_reraised(client: Client, tmp_path: Path) -> None:
    with pytest.raises(JobRefusedError) as refused:
        client.submit(job_fields(tmp_path, replica=3))
    assert refused.value.status == 422
    assert refused.value.field == "spec.replica"
    assert "spec.replica: unknown field" in str(refused.value)
    with pytest.raises(JobRefusedError, match=r"layers: ids \[99\]"):
        client.submit(job_fields(tmp_path, layers=[1, 99]))
    with pytest.raises(NotFoundError, match="no job 'nope'"):
        client.get("nope")
    with pytest.raises(NotFoundError):
        list(client.events("nope"))
    client.submit(job_fields(tmp_path), job_id="sdk-conflict")
    with pytest.raises(ConflictError) as conflict:
        client.submit(job_fields(tmp_path, replicas=4), job_id="sdk-conflict")
    assert isinstance(conflict.value, ApiError)
    assert conflict.value.type == "Conflict"
    with pytest.raises(SpecError):
        client.submit(tmp_path / "missing.yaml")


def test_token_from_argument_or_environment(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(create_app(Settings(api_token=TOKEN), fake)) as base:
        monkeypatch.delenv("HSX_API_TOKEN", raising=False)
        with Client(base) as anonymous, pytest.raises(UnauthorizedError) as err:
            anonymous.list()
        assert err.value.status == 401
        with Client(base, token=TOKEN) as c:
            assert isinstance(c.list(), list)
        monkeypatch.setenv("HSX_URL", base)
        monkeypatch.setenv("HSX_API_TOKEN", TOKEN)
        with Client() as c:
            assert c.base_url == base
            assert isinstance(c.list(), list)


def test_unreachable_server_names_the_url() -> None:
    base = f"http://127.0.0.1:{_free_port()}"
    with Client(base, timeout=5) as c, pytest.raises(ConnectionFailedError) as err:
        c.get("x")
    assert isinstance(err.value, ConnectionError)
    assert isinstance(err.value, ApiError)
    assert base in str(err.value)
    assert "hsx serve" in str(err.value)


def test_wait_polls_when_the_stream_breaks() -> None:
    """The event stream fails (a proxy, a restarting server); polling carries the wait."""
    calls = {"events": 0, "get": 0}

    def status(state: JobState) -> dict[str, Any]:
        return JobStatus(id="j", state=state, output="/o", created_at=0.0).model_dump(mode="json")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            calls["events"] += 1
            raise httpx.ConnectError("connection refused", request=request)
        calls["get"] += 1
        if calls["get"] == 1:
            return httpx.Response(503, json={"type": "NotReady", "message": "starting"})
        state = JobState.running if calls["get"] < 3 else JobState.succeeded
        return httpx.Response(200, json=status(state))

    seen: list[JobState] = []
    with Client("http://hsx.test", transport=httpx.MockTransport(handler)) as c:
        final = c.wait("j", timeout=10, poll_s=0.01, on_update=lambda s: seen.append(s.state))
    assert final.state == JobState.succeeded
    assert seen == [JobState.running, JobState.succeeded]
    assert calls["events"] == 3  # reopened after every poll


def test_wait_times_out(client: Client, fake: FakeScheduler, tmp_path: Path) -> None:
    fake.run_steps = 0  # this job stays queued
    try:
        job = client.submit(job_fields(tmp_path), job_id="sdk-stuck")
    finally:
        fake.run_steps = 3
    with pytest.raises(TimeoutError, match=r"sdk-stuck did not finish within 0\.3 s"):
        client.wait(job.id, timeout=0.3, poll_s=0.05)


def test_sse_parser() -> None:
    lines = [": hello", "event: status", "data: {\"a\":", "data: 1}", "", "", "data:x", "",
             "event: other", "data: tail"]
    assert list(sse_events(lines)) == [("status", '{"a":\n1}'), ("message", "x"),
                                       ("other", "tail")]


def test_job_progress_uses_the_servers_numbers() -> None:
    status = JobStatus(
        id="j", state=JobState.running, output="/o", created_at=1.0, started_at=2.0,
        samples_total=10, samples_done=4, samples_failed=1, tokens_total=1000, tokens_done=400,
        tokens_per_s=123.5, eta_s=4.9, shards=2, bytes=99, units_total=5, units_done=2,
        workers=[WorkerStatus(name="w0", state="busy", unit=3)], restarts=1,
    )
    p = job_progress(status)
    assert (p.samples_total, p.samples_done, p.samples_failed) == (10, 4, 1)
    assert (p.tokens_per_s(), p.eta_s()) == (123.5, 4.9)
    assert p.workers == {"w0": "busy"}
    assert (p.shards, p.bytes, p.restarts, p.started_at) == (2, 99, 1, 2.0)


def test_the_bar_shows_ingestion(capsys: pytest.CaptureFixture[str]) -> None:
    status = JobStatus(id="j", state=JobState.running, output="/o", created_at=1.0,
                       rows_tokenized=120_000, rows_total=1_000_000, ingesting=True,
                       units_total=40, units_done=3)
    p = job_progress(status)
    assert (p.rows_tokenized, p.rows_total, p.ingesting) == (120_000, 1_000_000, True)
    with ProgressBar("big", enabled=False) as bar:
        bar.update(p)
        bar.update(JobProgress.of_ingestion(10, 0))  # throttled: one line per 5 s
    err = capsys.readouterr().err
    assert "big: tokenizing 120,000/~1,000,000 rows, 3/40 units, 0 shards" in err
    assert ingestion_text(JobProgress.of_ingestion(10, 0)) == "tokenizing 10 rows"


# --- the CLI ------------------------------------------------------------------------


def hsx_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HSX_URL": "", "HSX_API_TOKEN": "", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hsx.cli", *args], capture_output=True,
                          text=True, timeout=60, env=full_env)


def test_cli_submit_status_ls_cancel_errors(url: str, tmp_path: Path) -> None:
    job = job_file(tmp_path, name="cli-job")
    submitted = hsx_cli("--url", url, "submit", str(job), "--id", "cli-1")
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout == "cli-1\n"

    status = hsx_cli("status", "cli-1", "--json", "--url", url)  # --url after the command
    assert status.returncode == 0, status.stderr
    assert JobStatus.model_validate_json(status.stdout).id == "cli-1"
    human = hsx_cli("--url", url, "status", "cli-1")
    assert "cli-job" in human.stdout and "samples" in human.stdout

    listed = hsx_cli("ls", env={"HSX_URL": url})
    assert listed.returncode == 0, listed.stderr
    assert "cli-1" in listed.stdout
    as_json = hsx_cli("--url", url, "ls", "--json", "--state", "running")
    assert all(j["state"] == "running" for j in json.loads(as_json.stdout))

    errors = hsx_cli("--url", url, "errors", "cli-1", "--limit", "12")
    assert errors.returncode == 0, errors.stderr
    assert "row 77: empty" in errors.stdout
    assert "row 84" not in errors.stdout
    assert "12 of 25 error records" in errors.stderr

    cancelled = hsx_cli("--url", url, "cancel", "cli-1")
    assert cancelled.returncode == 0, cancelled.stderr
    assert "job cli-1" in cancelled.stderr


def test_cli_submit_wait_and_watch_exit_codes(url: str, tmp_path: Path) -> None:
    ok = hsx_cli("--url", url, "submit", str(job_file(tmp_path, name="ok")), "--wait")
    assert ok.returncode == 0, ok.stderr
    job_id = ok.stdout.strip()
    assert f"done: job {job_id}: 100 samples" in ok.stderr
    watched = hsx_cli("--url", url, "watch", job_id)  # already finished: says so at once
    assert watched.returncode == 0, watched.stderr

    failed = hsx_cli("--url", url, "submit", str(job_file(tmp_path, name="fail-me")), "--wait")
    assert failed.returncode == 1
    assert "failed: unit 3: engine died 3 times" in failed.stderr


def test_cli_refused_unauthorized_unreachable(
    url: str, fake: FakeScheduler, tmp_path: Path
) -> None:
    refused = hsx_cli("--url", url, "submit", str(job_file(tmp_path, layers=[1, 99])))
    assert refused.returncode == 2
    assert "hsx: error:" in refused.stderr and "layers: ids [99]" in refused.stderr
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(yaml.safe_dump({**job_fields(tmp_path), "replica": 2}))
    local = hsx_cli("--url", url, "submit", str(bad_file))
    assert local.returncode == 2
    assert "replica: unknown field" in local.stderr

    assert hsx_cli("--url", url, "status", "nope").returncode == 1

    with serving(create_app(Settings(api_token=TOKEN), fake)) as secured:
        denied = hsx_cli("--url", secured, "ls")
        assert denied.returncode == 1
        assert "API token" in denied.stderr
        assert hsx_cli("--url", secured, "ls", "--token", TOKEN).returncode == 0
        assert hsx_cli("--url", secured, "ls", env={"HSX_API_TOKEN": TOKEN}).returncode == 0

    gone = f"http://127.0.0.1:{_free_port()}"
    unreachable = hsx_cli("--url", gone, "ls")
    assert unreachable.returncode == 1
    assert gone in unreachable.stderr


def test_cli_status_says_where_a_job_runs_and_what_it_waits_for(
    fake: FakeScheduler, url: str
) -> None:
    plan = ResourcePlan(gpus=1, replicas=1, engine_gpus=1, train_gpus=1, eval_gpus=1,
                        training="after", summary="1 GPU: 1 engine on 1; then the trainer")
    fake.board.post(JobStatus(
        id="waits", state=JobState.running, output="/o", created_at=time.time(), plan=plan,
        waiting_for="waiting for 1 GPU of 1: held by the trainer of job a",
        nodes=[NodeStatus(node="a" * 56, engines=["engine-0"], bytes_in_flight=3 * 2**20),
               NodeStatus(node="b" * 56, trainer_workers=[0, 1])]))
    human = hsx_cli("--url", url, "status", "waits", env={"COLUMNS": "200"})
    assert human.returncode == 0, human.stderr
    assert "1 GPU: 1 engine on 1; then the trainer" in human.stdout
    assert "waiting for 1 GPU of 1: held by the trainer of job a" in human.stdout
    # Where it runs now, per Ray node.
    assert "node aaaaaaaa  engine-0, 3.0 MiB in flight" in human.stdout
    assert "node bbbbbbbb  trainer worker 0, trainer worker 1" in human.stdout
