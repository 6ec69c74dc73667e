"""The REST routes against a fake scheduler, through a real uvicorn server on loopback.

`FakeScheduler` implements exactly `hsx_service.deps.SchedulerAPI` in memory, posting its
statuses on a real `StatusBoard`; it differs from the real scheduler in that nothing runs
(a job advances only when the test calls `advance`, or on its own in `run_steps` updates
when asked), preflight is only a stand-in (a layer id 99 is refused), and there is no
ledger. `serving(app)` runs uvicorn in a thread on a free port and yields its base URL;
tests/unit/test_client.py reuses both.
"""

from __future__ import annotations

import json
import os
import re
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hsx.spec import JobSpec
from hsx.wire import (
    ErrorPage,
    ErrorRecord,
    JobState,
    JobStatus,
    Throughput,
    ThroughputPoint,
    WorkerStatus,
)
from hsx_service.board import StatusBoard
from hsx_service.config import Settings
from hsx_service.errors import JobConflict, JobNotFound, JobRefused, NotReady
from hsx_service.main import create_app
from hsx_service.routes import jobs as jobs_routes

TOKEN = "s3cret-token-of-the-tests"


class FakeScheduler:
    """An in-memory stand-in for `hsx_service.scheduler.Scheduler` (see module docstring)."""

    def __init__(
        self, *, ready: bool = True, run_steps: int = 0, step_s: float = 0.05
    ) -> None:
        self._lock = threading.Lock()
        self._ready = ready
        self.run_steps = run_steps
        self.step_s = step_s
        self.board = StatusBoard()
        self.specs: dict[str, JobSpec] = {}
        self.error_records: dict[str, list[ErrorRecord]] = {}
        self.calls: list[str] = []

    # lifecycle
    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    def not_ready(self) -> NotReady:
        return NotReady("the coordinator is still starting")

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    # the job API
    def submit(self, spec: JobSpec, job_id: str | None,
               owner: str | None = None) -> tuple[JobStatus, bool]:
        self.calls.append("submit")
        if spec.layers and 99 in spec.layers:
            raise JobRefused("layers: ids [99] are outside 0..4")
        with self._lock:
            if job_id is not None and job_id in self.specs:
                if self.specs[job_id] == spec:
                    return self.get(job_id), False
                raise JobConflict(f"job {job_id!r} exists with a different spec")
            job_id = job_id or f"job-{len(self.specs) + 1}"
            job = JobStatus(
                id=job_id, name=spec.name, owner=owner, state=JobState.queued,
                output=spec.output, created_at=time.time(), samples_total=100,
                tokens_total=10_000, spec=spec,
            )
            self.specs[job_id] = spec
            self.board.post(job)
            self.error_records[job_id] = [
                ErrorRecord(sample_index=i * 7, reason=f"row {i * 7}: empty") for i in range(25)
            ]
        if self.run_steps:
            threading.Thread(target=self._run, args=(job_id,), daemon=True).start()
        return job, True

    def get(self, job_id: str) -> JobStatus:
        post = self.board.get(job_id)
        if post is None:
            raise JobNotFound(job_id)
        return post.status

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

    def throughput(self, job_id: str) -> Throughput:
        job = self.get(job_id)
        points = [ThroughputPoint(at=job.created_at + i, tokens_per_s=5000.0 + i,
                                  tokens_done=5000 * i) for i in range(1, 4)]
        return Throughput(job_id=job_id, tokens_per_s_avg=5001.0, points=points)

    def collect_metrics(self) -> list[Metric]:
        jobs = [p.status for p in self.board.list()]
        tokens = CounterMetricFamily("hsx_job_tokens", "Tokens.", labels=["job"])
        by_state = GaugeMetricFamily("hsx_jobs", "Jobs by state.", labels=["state"])
        for job in jobs:
            tokens.add_metric([job.id], job.tokens_done)
        for state in JobState:
            by_state.add_metric([state.value], sum(j.state == state for j in jobs))
        return [tokens, by_state]

    # test controls
    def advance(self, job_id: str, **changes: Any) -> JobStatus:
        """Change a job and post it on the board, as the real scheduler does."""
        with self._lock:
            job = self.get(job_id).model_copy(update={**changes, "updated_at": time.time()})
            self.board.post(job)
        return job


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
        time.sleep(self.step_s)  # followers see the last step (a slow one would skip it)
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


def local_client(app: Any, **options: Any) -> TestClient:
    """A test client that calls as a local browser does: Host `localhost` (the loopback
    server answers no other name: main.HostCheck)."""
    return TestClient(app, base_url="http://localhost", **options)


def job_fields(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    dataset = tmp_path / "data" / "chats.jsonl"
    dataset.parent.mkdir(parents=True, exist_ok=True)
    dataset.touch()
    return {"model": str(tmp_path / "tiny"), "dataset": str(dataset),
            "output": str(tmp_path / "out"), **overrides}


@pytest.fixture
def fake() -> FakeScheduler:
    return FakeScheduler()


@pytest.fixture
def client(fake: FakeScheduler) -> Iterator[TestClient]:
    with local_client(create_app(Settings(), fake)) as c:
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
        ({"layers": [1, "x"]}, {}, "spec.layers",
         "layers.1: 'x' is neither a layer id nor a draft method"),
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
    with local_client(create_app(Settings(), fake)) as c:
        response = c.post("/v1/jobs", json=body)
        assert response.status_code == 422
        assert response.json()["field"] == "spec.trust_remote_code"
        assert "submit" not in fake.calls
    with local_client(create_app(Settings(allow_trust_remote_code=True), fake)) as c:
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
    fields = {"model": str(root / "tiny"), "dataset": str(root / "d.jsonl"),
              "output": str(root / "out")}
    settings = Settings(allowed_roots=[root, "s3://bkt/team"])
    with local_client(create_app(settings, fake)) as c:
        assert c.post("/v1/jobs", json={"spec": fields}).status_code == 201
        for bad in (str(root / ".." / "elsewhere" / "x"), str(root / "escape" / "x"),
                    f"file://{outside}/x", str(tmp_path / "root-evil" / "x"),
                    "s3://bkt/x", "s3://bkt/team-evil/x"):
            response = c.post("/v1/jobs", json={"spec": {**fields, field: bad}})
            assert response.status_code == 422, bad
            error = response.json()
            assert error["field"] == f"spec.{field}"
            assert "outside the server's allowed roots" in error["message"]
        # A bucket prefix among the roots: what lies under it is allowed.
        if field == "output":
            other = c.post("/v1/jobs", json={"spec": {**fields, "output": "s3://bkt/team/x"}})
            assert other.status_code == 201
    assert fake.calls.count("submit") == (2 if field == "output" else 1)


def test_exposed_server_without_roots_keeps_jobs_in_its_directory(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    inside = job_fields(tmp_path)
    settings = Settings(api_token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with local_client(create_app(settings, fake)) as c:
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
    with local_client(create_app(Settings(api_token=TOKEN, allowed_roots=[tmp_path]), fake)) as c:
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
        for open_path in ("/healthz", "/readyz", "/", "/docs", "/openapi.json"):
            assert c.get(open_path).status_code == 200, open_path
        # Metrics cover every user's jobs: an admin's token (the one token is one).
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_the_token_is_compared_in_constant_time(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every comparison of a presented token goes through hmac.compare_digest (its time
    does not depend on where the first difference is), header or query alike."""
    from hsx_service import users

    compared: list[tuple[bytes, bytes]] = []
    real = users.hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append((given, expected))
        return real(given, expected)

    monkeypatch.setattr(users.hmac, "compare_digest", spy)
    with local_client(create_app(Settings(api_token=TOKEN, allowed_roots=[tmp_path]), fake)) as c:
        for given in ("s3cret-tokeX", TOKEN[:-1], "\u00e9" * 4):
            header = f"Bearer {given}".encode()
            assert c.get("/v1/jobs", headers={"Authorization": header}).status_code == 401
        assert c.get(f"/v1/jobs?access_token={TOKEN}x").status_code == 401
        assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert len(compared) == 5
    assert all(expected == TOKEN.encode() for _, expected in compared)


def test_oversized_bodies_are_refused_before_parsing(fake: FakeScheduler, tmp_path: Path) -> None:
    with local_client(create_app(Settings(max_body_bytes=4096), fake)) as c:
        big = c.post("/v1/jobs", json={"spec": {**job_fields(tmp_path), "name": "x" * 5000}})
        assert big.status_code == 413 and big.json()["type"] == "PayloadTooLarge"
        assert "4096" in big.json()["message"]
        small = c.post("/v1/jobs", json={"spec": job_fields(tmp_path)})
        assert small.status_code == 201
        not_json = c.post("/v1/jobs", content=b"\xff\xfe not json",
                          headers={"Content-Type": "application/json"})
        assert not_json.status_code in (400, 422)
        assert not_json.json()["type"] in ("InvalidRequest", "JobRefused")
    assert fake.calls.count("submit") == 1


# --- ops ----------------------------------------------------------------------------


def test_health_ready_metrics(fake: FakeScheduler, tmp_path: Path) -> None:
    fake.set_ready(False)
    with local_client(create_app(Settings(), fake)) as c:
        assert fake.calls == ["start"]
        assert c.get("/healthz").json() == {"status": "ok"}
        not_ready = c.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json()["type"] == "NotReady"
        assert not_ready.headers["retry-after"]
        fake.set_ready(True)
        assert c.get("/readyz").json() == {"status": "ready"}
        c.post("/v1/jobs", json={"id": "a", "spec": job_fields(tmp_path)})
        fake.advance("a", state=JobState.running, tokens_done=1234)
        metrics = c.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "# TYPE hsx_job_tokens_total counter\n" in metrics.text
        assert 'hsx_job_tokens_total{job="a"} 1234.0\n' in metrics.text
        assert 'hsx_jobs{state="running"} 1.0\n' in metrics.text
        # A scraper that asks for OpenMetrics gets it.
        om = c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
    assert fake.calls == ["start", "submit", "stop"]


def test_each_app_has_its_own_registry(tmp_path: Path) -> None:
    """Two apps in one process: each /metrics shows its own scheduler's jobs, and
    nothing is registered in prometheus_client's global registry."""
    from prometheus_client import REGISTRY

    first, second = FakeScheduler(), FakeScheduler()
    with local_client(create_app(Settings(), first)) as a, \
            local_client(create_app(Settings(), second)) as b:
        a.post("/v1/jobs", json={"id": "only-in-a", "spec": job_fields(tmp_path)})
        assert 'job="only-in-a"' in a.get("/metrics").text
        assert 'job="only-in-a"' not in b.get("/metrics").text
    assert not [name for name in REGISTRY._names_to_collectors if name.startswith("hsx_")]


def test_index_and_static(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "hsx" in page.text
    assert client.get("/static/no-such-file.js").status_code == 404
    assert client.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]


def test_dashboard_modules_are_served_as_javascript(client: TestClient) -> None:
    """Every ES module the page loads, from its entry point through each import, is
    there; a browser runs a module only if it comes with a JavaScript content type."""
    entry = re.findall(r'<script type="module" src="static/([\w-]+\.js)"', client.get("/").text)
    assert entry == ["main.js"]
    seen: set[str] = set()
    todo = list(entry)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        module = client.get(f"/static/{name}")
        assert module.status_code == 200, name
        assert module.headers["content-type"].split(";")[0] in (
            "text/javascript", "application/javascript"), name
        todo += re.findall(r'from "\./([\w-]+\.js)"', module.text)
    assert {"main.js", "api.js", "job.js", "training.js"} <= seen


# --- through a real uvicorn ---------------------------------------------------------


def test_sse_through_real_uvicorn(tmp_path: Path) -> None:
    """In order, ending with the job; an unchanged status is not an event."""
    fake = FakeScheduler()
    app = create_app(Settings(api_token=TOKEN, allowed_roots=[tmp_path]), fake)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with serving(app) as url, httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        created = http.post("/v1/jobs", json={"id": "live", "spec": job_fields(tmp_path)})
        assert created.status_code == 201
        assert http.get("/v1/jobs/live", headers={"Authorization": ""}).status_code == 401

        seen: list[JobStatus] = []
        # After each event the job moves once (a follower that falls behind would get
        # the newest status only); the second step changes nothing but the time.
        steps: list[dict[str, Any]] = [
            {"state": JobState.running, "samples_done": 10},
            {},
            {"samples_done": 60, "tokens_done": 6000},
            {"state": JobState.succeeded, "samples_done": 100},
        ]
        # The token in the query, as the dashboard's EventSource sends it.
        with httpx.stream("GET", f"{url}/v1/jobs/live/events?access_token={TOKEN}",
                          timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for event, data in read_events(response):
                assert event == "status"
                seen.append(JobStatus.model_validate(json.loads(data)))
                fake.advance("live", **steps.pop(0)) if steps else None
                if steps and not steps[0]:
                    fake.advance("live", **steps.pop(0))  # no news: no event for it
        # The stream ended by itself once the job finished.
        assert [s.state for s in seen] == [JobState.queued, JobState.running,
                                           JobState.running, JobState.succeeded]
        assert [s.samples_done for s in seen] == [0, 10, 60, 100]
        assert fake.board.following("live") == 0

        # A finished job: its status, then the end.
        with httpx.stream("GET", f"{url}/v1/jobs/live/events", headers=headers) as response:
            assert [e for e, _ in read_events(response)] == ["status"]


def test_sse_keepalive_and_disconnect(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_routes, "KEEPALIVE_S", 0.2)
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
        # The client went away: the server notices and its stream stops waiting.
        deadline = time.monotonic() + 5
        while fake.board.following("idle") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.board.following("idle") == 0


def test_real_uvicorn_serves_the_error_contract(fake: FakeScheduler, tmp_path: Path) -> None:
    with serving(create_app(Settings(), fake)) as url:
        bad = httpx.post(f"{url}/v1/jobs", json={"spec": job_fields(tmp_path, replica=2)})
        assert bad.status_code == 422
        assert bad.json()["field"] == "spec.replica"
        metrics = httpx.get(f"{url}/metrics")
        assert "# TYPE hsx_jobs gauge" in metrics.text


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
    monkeypatch.setenv("HSX_ALLOWED_ROOTS", f"s3://team/hs/,{tmp_path}:S3://bkt")
    assert Settings().allowed_roots == ["s3://team/hs", Path(os.path.realpath(tmp_path)),
                                        "s3://bkt"]
    monkeypatch.setenv("HSX_ALLOWED_ROOTS", "s3://team/../x")
    with pytest.raises(ValueError, match=r"no empty, '\.' or '\.\.' segments"):
        Settings()
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
    page = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", f"/?token={TOKEN}", "1.1", 200), None,
    )
    assert all(f.filter(page) for f in access.filters)  # type: ignore[union-attr]
    assert TOKEN not in page.getMessage() and "/?token=***" in page.getMessage()


def test_checks_past_their_limits_are_429_with_retry_after(
    fake: FakeScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submit's checks hold a request thread (and a child process) for seconds: at
    most HSX_MAX_USER_CHECKS of one user's and HSX_MAX_CHECKS in all run at once; the
    next is a 429 with Retry-After before it does any work, and the client waits it out
    and gets through."""
    from hsx.client import Client, TooBusyError

    release = threading.Event()
    checking = threading.Semaphore(0)
    real_submit = fake.submit

    def slow_submit(*args: Any, **kwargs: Any) -> Any:
        checking.release()
        release.wait(30)
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(fake, "submit", slow_submit)
    app = create_app(Settings(api_token=TOKEN, allowed_roots=[tmp_path], max_checks=2,
                              max_user_checks=1), fake)
    with serving(app) as url:
        client = Client(url, token=TOKEN, busy_wait=0)
        first = threading.Thread(target=client.submit, args=(job_fields(tmp_path),))
        first.start()
        assert checking.acquire(timeout=10)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=10) as http:
            busy = http.post("/v1/jobs", json={"spec": job_fields(tmp_path)})
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "5"
            assert "HSX_MAX_USER_CHECKS" in busy.json()["message"]
            assert http.get("/healthz").status_code == 200  # the API answers meanwhile
        with pytest.raises(TooBusyError) as raised:
            client.submit(job_fields(tmp_path))
        assert raised.value.retry_after == 5.0
        # A patient client waits its turn.
        patient = Client(url, token=TOKEN, busy_wait=30)
        later = threading.Timer(1.0, release.set)
        later.start()
        assert patient.submit(job_fields(tmp_path)).state == JobState.queued
        first.join(10)
        assert fake.calls.count("submit") == 2  # the refused ones did no work
