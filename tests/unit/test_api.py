"""The REST routes against a fake scheduler, through a real uvicorn server on loopback.

`FakeScheduler` implements exactly `hsx_service.deps.SchedulerAPI` in memory; it differs
from the real scheduler in that nothing runs (a job advances only when the test calls
`advance`, or on its own in `run_steps` updates when asked), preflight is only a
stand-in (a layer id 99 is refused), and there is no ledger. `serving(app)` runs uvicorn
in a thread on a free port and yields its base URL; tests/unit/test_client.py reuses both.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hsx.spec import JobSpec
from hsx.wire import ErrorPage, ErrorRecord, JobState, JobStatus, WorkerStatus
from hsx_service.config import Settings
from hsx_service.errors import JobConflict, JobNotFound, JobRefused
from hsx_service.main import create_app
from hsx_service.routes import jobs as jobs_routes
from hsx_service.routes.ops import render_metrics

TOKEN = "s3cret-token"


class FakeScheduler:
    """An in-memory stand-in for `hsx_service.scheduler.Scheduler` (see module docstring)."""

    def __init__(
        self, *, ready: bool = True, run_steps: int = 0, step_s: float = 0.05, greet: bool = True
    ) -> None:
        self._lock = threading.Lock()
        self.greet = greet
        self._ready = ready
        self.run_steps = run_steps
        self.step_s = step_s
        self.jobs: dict[str, JobStatus] = {}
        self.specs: dict[str, JobSpec] = {}
        self.error_records: dict[str, list[ErrorRecord]] = {}
        self.subscribers: dict[str, list[queue.Queue[JobStatus | None]]] = {}
        self.calls: list[str] = []
        self.values: dict[str, float] = {"hsx_tokens_total": 1234, 'hsx_jobs{state="running"}': 1}

    # lifecycle
    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    # the job API
    def submit(self, spec: JobSpec, job_id: str | None) -> tuple[JobStatus, bool]:
        self.calls.append("submit")
        if spec.layers and 99 in spec.layers:
            raise JobRefused("layers: ids [99] are outside 0..4")
        with self._lock:
            if job_id is not None and job_id in self.jobs:
                if self.specs[job_id] == spec:
                    return self.jobs[job_id], False
                raise JobConflict(f"job {job_id!r} exists with a different spec")
            job_id = job_id or f"job-{len(self.jobs) + 1}"
            job = JobStatus(
                id=job_id, name=spec.name, state=JobState.queued, output=spec.output,
                created_at=time.time(), samples_total=100, tokens_total=10_000, spec=spec,
            )
            self.jobs[job_id], self.specs[job_id] = job, spec
            self.error_records[job_id] = [
                ErrorRecord(sample_index=i * 7, reason=f"row {i * 7}: empty") for i in range(25)
            ]
        if self.run_steps:
            threading.Thread(target=self._run, args=(job_id,), daemon=True).start()
        return job, True

    def get(self, job_id: str) -> JobStatus:
        with self._lock:
            if job_id not in self.jobs:
                raise JobNotFound(job_id)
            return self.jobs[job_id]

    def list(self, state: JobState | None) -> list[JobStatus]:
        with self._lock:
            return [j for j in self.jobs.values() if state is None or j.state == state]

    def cancel(self, job_id: str) -> JobStatus:
        job = self.get(job_id)
        if job.state.finished:
            return job
        return self.advance(job_id, state=JobState.cancelled, finished_at=time.time())

    def errors(self, job_id: str, offset: int, limit: int) -> ErrorPage:
        self.get(job_id)
        records = self.error_records[job_id]
        return ErrorPage(
            items=records[offset:offset + limit], total=len(records), offset=offset, limit=limit
        )

    def subscribe(self, job_id: str) -> queue.Queue[JobStatus | None]:
        # Like the real one: the queue starts with the current status (and the end
        # marker when the job has finished already).
        job = self.get(job_id)
        q: queue.Queue[JobStatus | None] = queue.Queue()
        if self.greet:
            q.put(job)
            if job.state.finished:
                q.put(None)
        with self._lock:
            self.subscribers.setdefault(job_id, []).append(q)
        return q

    def unsubscribe(self, job_id: str, q: queue.Queue[JobStatus | None]) -> None:
        with self._lock:
            self.subscribers.get(job_id, []).remove(q)

    def metrics(self) -> dict[str, float]:
        return dict(self.values)

    # test controls
    def advance(self, job_id: str, **changes: Any) -> JobStatus:
        """Change a job and tell its subscribers, as the real scheduler does."""
        with self._lock:
            job = self.jobs[job_id].model_copy(update=changes)
            self.jobs[job_id] = job
            queues = list(self.subscribers.get(job_id, []))
        for q in queues:
            q.put(job)
            if job.state.finished:
                q.put(None)
        return job

    def subscriber_count(self, job_id: str) -> int:
        with self._lock:
            return len(self.subscribers.get(job_id, []))

    def _run(self, job_id: str) -> None:
        time.sleep(self.step_s)
        self.advance(job_id, state=JobState.running, started_at=time.time(),
                     workers=[WorkerStatus(name="w0", state="busy", unit=0)])
        for step in range(1, self.run_steps + 1):
            time.sleep(self.step_s)
            if self.get(job_id).state.finished:  # cancelled meanwhile
                return
            self.advance(job_id, samples_done=100 * step // self.run_steps,
                         tokens_done=10_000 * step // self.run_steps, tokens_per_s=5000.0,
                         shards=step)
        name = self.specs[job_id].name or ""
        final = JobState.failed if name.startswith("fail") else JobState.succeeded
        self.advance(job_id, state=final, finished_at=time.time(),
                     last_error="unit 3: engine died 3 times" if final == JobState.failed else None)


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Run `app` under a real uvicorn in a thread on a free loopback port; yield its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited before it started serving")
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start within 15 s")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def job_fields(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    dataset = tmp_path / "data" / "chats.jsonl"
    dataset.parent.mkdir(parents=True, exist_ok=True)
    dataset.touch()
    return {"model": "tiny", "dataset": str(dataset), "output": str(tmp_path / "out"),
            **overrides}


@pytest.fixture
def fake() -> FakeScheduler:
    return FakeScheduler()


@pytest.fixture
def client(fake: FakeScheduler) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(), fake)) as c:
        yield c


def read_events(response: httpx.Response) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of an SSE response; comments come as ("comment", text)."""
    event, data = "message", []
    for line in response.iter_lines():
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event:"):
            event = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].strip())
        elif line == "" and data:
            yield event, "\n".join(data)
            event, data = "message", []


# --- submit -------------------------------------------------------------------------


def test_submit_creates_then_returns_the_same_job(
    client: TestClient, tmp_path: Path
) -> None:
    body = {"id": "my-job", "spec": job_fields(tmp_path)}
    first = client.post("/v1/jobs", json=body)
    assert first.status_code == 201, first.text
    assert first.headers["location"] == "/v1/jobs/my-job"
    job = JobStatus.model_validate(first.json())
    assert (job.id, job.state) == ("my-job", JobState.queued)
    again = client.post("/v1/jobs", json=body)
    assert again.status_code == 200
    assert again.json()["id"] == "my-job"


def test_submit_without_id_gets_one(client: TestClient, tmp_path: Path) -> None:
    response = client.post("/v1/jobs", json={"spec": job_fields(tmp_path)})
    assert response.status_code == 201
    assert response.json()["id"]


def test_same_id_other_spec_is_409(client: TestClient, tmp_path: Path) -> None:
    client.post("/v1/jobs", json={"id": "j", "spec": job_fields(tmp_path)})
    response = client.post("/v1/jobs", json={"id": "j", "spec": job_fields(tmp_path, replicas=2)})
    assert response.status_code == 409
    assert response.json()["type"] == "Conflict"
    assert "different spec" in response.json()["message"]


@pytest.mark.parametrize(
    ("spec_overrides", "body_extra", "field", "message"),
    [
        ({"replica": 2}, {}, "spec.replica", "spec.replica: unknown field"),
        ({"layers": [1, 1]}, {}, "spec.layers", "duplicate layer ids"),
        ({"layers": [1, "x"]}, {}, "spec.layers", "spec.layers.1: "),
        ({"storage_dtype": "fp4"}, {}, "spec.storage_dtype", "spec.storage_dtype"),
        ({"replicas": 0}, {}, "spec.replicas", "greater than or equal to 1"),
        ({}, {"colour": "red"}, "colour", "colour: unknown field"),
        ({}, {"id": "../etc"}, "id", "id: "),
    ],
)
def test_bad_spec_is_422_naming_the_field(
    client: TestClient, fake: FakeScheduler, tmp_path: Path,
    spec_overrides: dict[str, Any], body_extra: dict[str, Any], field: str, message: str,
) -> None:
    body = {"spec": job_fields(tmp_path, **spec_overrides), **body_extra}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["type"] == "JobRefused"
    assert error["field"] == field
    assert message in error["message"]
    assert "submit" not in fake.calls


def test_missing_field_and_bad_json(client: TestClient, tmp_path: Path) -> None:
    fields = job_fields(tmp_path)
    del fields["model"]
    error = client.post("/v1/jobs", json={"spec": fields}).json()
    assert error["field"] == "spec.model"
    assert "spec.model: Field required" in error["message"]
    response = client.post(
        "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["type"] == "JobRefused"


def test_scheduler_refusal_is_422_with_spec_field(client: TestClient, tmp_path: Path) -> None:
    response = client.post("/v1/jobs", json={"spec": job_fields(tmp_path, layers=[1, 99])})
    assert response.status_code == 422
    assert response.json() == {
        "type": "JobRefused", "message": "layers: ids [99] are outside 0..4",
        "field": "spec.layers", "detail": None,
    }


def test_trust_remote_code_needs_the_server_to_allow_it(
    fake: FakeScheduler, tmp_path: Path
) -> None:
    body = {"spec": job_fields(tmp_path, trust_remote_code=True)}
    with TestClient(create_app(Settings(), fake)) as c:
        response = c.post("/v1/jobs", json=body)
        assert response.status_code == 422
        assert response.json()["field"] == "spec.trust_remote_code"
        assert "submit" not in fake.calls
    with TestClient(create_app(Settings(allow_trust_remote_code=True), fake)) as c:
        assert c.post("/v1/jobs", json=body).status_code == 201


@pytest.mark.parametrize("field", ["dataset", "output"])
def test_paths_outside_allowed_roots_are_refused(
    fake: FakeScheduler, tmp_path: Path, field: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    fields = {"model": "tiny", "dataset": str(root / "d.jsonl"), "output": str(root / "out")}
    settings = Settings(allowed_roots=[root])
    with TestClient(create_app(settings, fake)) as c:
        assert c.post("/v1/jobs", json={"spec": fields}).status_code == 201
        for bad in (str(root / ".." / "elsewhere" / "x"), str(root / "escape" / "x"),
                    f"file://{outside}/x", str(tmp_path / "root-evil" / "x")):
            response = c.post("/v1/jobs", json={"spec": {**fields, field: bad}})
            assert response.status_code == 422, bad
            error = response.json()
            assert error["field"] == f"spec.{field}"
            assert "outside the server's allowed roots" in error["message"]
        # Other schemes are not local paths: the scheduler decides about them.
        if field == "output":
            other = c.post("/v1/jobs", json={"spec": {**fields, "output": "s3://b/x"}})
            assert other.status_code == 201
    assert fake.calls.count("submit") == (2 if field == "output" else 1)


def test_exposed_server_without_roots_keeps_jobs_in_its_directory(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    inside = job_fields(tmp_path)
    settings = Settings(api_token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(settings, fake)) as c:
        assert c.post("/v1/jobs", json={"spec": inside}, headers=headers).status_code == 201
        outside = {**inside, "output": "/var/tmp/hsx-somewhere"}
        response = c.post("/v1/jobs", json={"spec": outside}, headers=headers)
        assert response.status_code == 422
        assert response.json()["field"] == "spec.output"


# --- read, cancel, errors -----------------------------------------------------------


def test_get_list_cancel(client: TestClient, fake: FakeScheduler, tmp_path: Path) -> None:
    client.post("/v1/jobs", json={"id": "a", "spec": job_fields(tmp_path)})
    client.post("/v1/jobs", json={"id": "b", "spec": job_fields(tmp_path, name="b")})
    fake.advance("b", state=JobState.running)
    assert client.get("/v1/jobs/a").json()["state"] == "queued"
    assert [j["id"] for j in client.get("/v1/jobs").json()["jobs"]] == ["a", "b"]
    assert [j["id"] for j in client.get("/v1/jobs?state=running").json()["jobs"]] == ["b"]
    bad_state = client.get("/v1/jobs?state=sleeping")
    assert bad_state.status_code == 422
    assert bad_state.json()["type"] == "InvalidRequest"
    assert bad_state.json()["field"] == "state"
    cancelled = client.delete("/v1/jobs/b")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"


def test_unknown_job_is_404_everywhere(client: TestClient) -> None:
    for method, path in [("GET", "/v1/jobs/nope"), ("DELETE", "/v1/jobs/nope"),
                         ("GET", "/v1/jobs/nope/errors"), ("GET", "/v1/jobs/nope/events")]:
        response = client.request(method, path)
        assert response.status_code == 404, path
        assert response.json() == {"type": "NotFound", "message": "no job 'nope'",
                                   "field": None, "detail": None}
    unknown_route = client.get("/v1/nothing-here")
    assert unknown_route.status_code == 404
    assert unknown_route.json()["type"] == "NotFound"


def test_errors_are_paged(client: TestClient, tmp_path: Path) -> None:
    client.post("/v1/jobs", json={"id": "a", "spec": job_fields(tmp_path)})
    page = client.get("/v1/jobs/a/errors?offset=20&limit=10").json()
    assert page["total"] == 25
    assert [e["sample_index"] for e in page["items"]] == [140, 147, 154, 161, 168]
    default = client.get("/v1/jobs/a/errors").json()
    assert (default["offset"], default["limit"], len(default["items"])) == (0, 100, 25)
    too_many = client.get("/v1/jobs/a/errors?limit=1001")
    assert too_many.status_code == 422
    assert too_many.json()["field"] == "limit"
    assert client.get("/v1/jobs/a/errors?offset=-1").status_code == 422


# --- auth ---------------------------------------------------------------------------


def test_token_is_required_on_v1_only(fake: FakeScheduler, tmp_path: Path) -> None:
    with TestClient(create_app(Settings(api_token=TOKEN, allowed_roots=[tmp_path]), fake)) as c:
        missing = c.get("/v1/jobs")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["type"] == "Unauthorized"
        assert c.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/jobs", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        ok = c.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
        # The dashboard's EventSource cannot set headers: GETs may carry it in the query.
        assert c.get(f"/v1/jobs?access_token={TOKEN}").status_code == 200
        post = c.post(f"/v1/jobs?access_token={TOKEN}", json={"spec": job_fields(tmp_path)})
        assert post.status_code == 401
        assert c.delete(f"/v1/jobs/x?access_token={TOKEN}").status_code == 401
        assert "submit" not in fake.calls
        for open_path in ("/healthz", "/readyz", "/metrics", "/", "/docs", "/openapi.json"):
            assert c.get(open_path).status_code == 200, open_path


# --- ops ----------------------------------------------------------------------------


def test_health_ready_metrics(fake: FakeScheduler) -> None:
    fake.set_ready(False)
    with TestClient(create_app(Settings(), fake)) as c:
        assert fake.calls == ["start"]
        assert c.get("/healthz").json() == {"status": "ok"}
        not_ready = c.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json()["type"] == "NotReady"
        assert not_ready.headers["retry-after"]
        fake.set_ready(True)
        assert c.get("/readyz").json() == {"status": "ready"}
        metrics = c.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "hsx_tokens_total 1234\n" in metrics.text
        assert 'hsx_jobs{state="running"} 1\n' in metrics.text
    assert fake.calls == ["start", "stop"]


def test_metrics_text_format() -> None:
    text = render_metrics({
        "hsx_unit_seconds_sum": 12.5, "hsx_unit_seconds_count": 4,
        'hsx_tokens_total{job="a"}': 7, "hsx_new_thing": 2, "bad name!": 1,
    })
    lines = text.splitlines()
    for name in ("hsx_tokens_total", "hsx_samples_total", "hsx_samples_failed_total",
                 "hsx_bytes_total", "hsx_shards_total", "hsx_queue_depth",
                 "hsx_worker_restarts_total"):
        assert f"{name} 0" in lines, name
    assert "# TYPE hsx_unit_seconds summary" in lines
    assert "hsx_unit_seconds_sum 12.5" in lines
    assert "hsx_unit_seconds_count 4" in lines
    for state in JobState:
        assert f'hsx_jobs{{state="{state.value}"}} 0' in lines
    # A labelled sample of a known metric sits under its one TYPE line.
    assert lines.count("# TYPE hsx_tokens_total counter") == 1
    assert lines.index('hsx_tokens_total{job="a"} 7') == lines.index("hsx_tokens_total 0") + 1
    assert "# TYPE hsx_new_thing untyped" in lines
    assert "hsx_new_thing 2" in lines
    assert not any(line.startswith("bad name") for line in lines)


def test_index_and_static(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "hsx" in page.text
    assert client.get("/static/no-such-file.js").status_code == 404
    assert client.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]


# --- through a real uvicorn ---------------------------------------------------------


@pytest.mark.parametrize("greet", [True, False], ids=["greeting", "silent"])
def test_sse_through_real_uvicorn(greet: bool, tmp_path: Path) -> None:
    """In order, ending with the job; whether or not subscribe() queues the current status."""
    fake = FakeScheduler(greet=greet)
    app = create_app(Settings(api_token=TOKEN, allowed_roots=[tmp_path]), fake)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with serving(app) as url, httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        created = http.post("/v1/jobs", json={"id": "live", "spec": job_fields(tmp_path)})
        assert created.status_code == 201
        assert http.get("/v1/jobs/live", headers={"Authorization": ""}).status_code == 401

        seen: list[JobStatus] = []
        # The token in the query, as the dashboard's EventSource sends it.
        with httpx.stream("GET", f"{url}/v1/jobs/live/events?access_token={TOKEN}",
                          timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for event, data in read_events(response):
                assert event == "status"
                seen.append(JobStatus.model_validate(json.loads(data)))
                if len(seen) == 1:  # subscribed: now the job moves
                    fake.advance("live", state=JobState.running, samples_done=10)
                    fake.advance("live", state=JobState.running, samples_done=10)  # no change
                    fake.advance("live", samples_done=60, tokens_done=6000)
                    fake.advance("live", state=JobState.succeeded, samples_done=100)
        # The stream ended by itself once the job finished.
        assert [s.state for s in seen] == [JobState.queued, JobState.running,
                                           JobState.running, JobState.succeeded]
        assert [s.samples_done for s in seen] == [0, 10, 60, 100]
        assert fake.subscriber_count("live") == 0

        # A finished job: its status, then the end.
        with httpx.stream("GET", f"{url}/v1/jobs/live/events", headers=headers) as response:
            assert [e for e, _ in read_events(response)] == ["status"]


def test_sse_keepalive_and_disconnect(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_routes, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(jobs_routes, "POLL_S", 0.1)
    with serving(create_app(Settings(), fake)) as url:
        httpx.post(f"{url}/v1/jobs", json={"id": "idle", "spec": job_fields(tmp_path)})
        stop = threading.Event()

        def republish() -> None:
            # A scheduler that republishes an unchanged status must not starve keep-alives.
            while not stop.wait(0.02):
                fake.advance("idle")

        threading.Thread(target=republish, daemon=True).start()
        try:
            with httpx.stream("GET", f"{url}/v1/jobs/idle/events", timeout=10) as response:
                kinds = []
                for event, _ in read_events(response):
                    kinds.append(event)
                    if len(kinds) == 3:
                        break
        finally:
            stop.set()
        assert kinds == ["status", "comment", "comment"]
        # The client went away: the server notices and unsubscribes.
        deadline = time.monotonic() + 5
        while fake.subscriber_count("idle") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.subscriber_count("idle") == 0


def test_real_uvicorn_serves_the_error_contract(fake: FakeScheduler, tmp_path: Path) -> None:
    with serving(create_app(Settings(), fake)) as url:
        bad = httpx.post(f"{url}/v1/jobs", json={"spec": job_fields(tmp_path, replica=2)})
        assert bad.status_code == 422
        assert bad.json()["field"] == "spec.replica"
        metrics = httpx.get(f"{url}/metrics")
        assert "# TYPE hsx_unit_seconds summary" in metrics.text


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HSX_PORT", "9000")
    monkeypatch.setenv("HSX_ALLOWED_ROOTS", f"{tmp_path}{os.pathsep}/data")
    monkeypatch.setenv("HSX_API_TOKEN", "")
    monkeypatch.setenv("HSX_LEDGER_PATH", "~/x.sqlite")
    settings = Settings()
    assert settings.port == 9000
    assert settings.allowed_roots == [Path(os.path.realpath(tmp_path)), Path("/data")]
    assert settings.api_token is None
    assert settings.ledger_path == Path.home() / "x.sqlite"
    assert settings.effective_roots() == settings.allowed_roots
    monkeypatch.setenv("HSX_ALLOWED_ROOTS", '["/a", "/b"]')
    assert Settings().allowed_roots == [Path("/a"), Path("/b")]
    monkeypatch.delenv("HSX_ALLOWED_ROOTS")
    assert Settings().effective_roots() is None  # loopback, no token: the laptop case
    assert Settings(host="0.0.0.0").effective_roots() == [Path(os.path.realpath(os.getcwd()))]
    assert TOKEN not in repr(Settings(api_token=TOKEN))
    for name, field in Settings.model_fields.items():
        assert field.description, name


def test_access_log_hides_the_token(fake: FakeScheduler) -> None:
    import logging

    create_app(Settings(), fake)
    access = logging.getLogger("uvicorn.access")
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", f"/v1/jobs/a/events?access_token={TOKEN}&x=1", "1.1", 200), None,
    )
    assert all(f.filter(record) for f in access.filters)  # type: ignore[union-attr]
    assert TOKEN not in record.getMessage()
    assert "access_token=***&x=1" in record.getMessage()
