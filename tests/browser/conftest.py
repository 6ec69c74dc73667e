"""Browser fixtures: a headless Debian chromium driven by selenium, and a fake coordinator.

`browser` (session-scoped) and `open_dashboard` are meant for any dashboard test, the ones
against the real coordinator included. `fake_api` is a small FastAPI app on a loopback
port that serves the real static files and fakes the `/v1` job API of client/hsx/wire.py
with jobs (their throughput curves and draft trainings included) that progress in time,
so the page runs end to end without Ray or vLLM.

The tests skip cleanly when chromium, chromedriver or selenium are missing
(scripts/setup-env.sh installs Debian's chromium and chromium-driver when run as root).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote

import pytest

if TYPE_CHECKING:
    from fastapi import FastAPI
    from selenium.webdriver.remote.webdriver import WebDriver

REPO = Path(__file__).resolve().parents[2]
STATIC_DIR = REPO / "service" / "hsx_service" / "static"
ARTIFACTS = REPO / "artifacts"
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_NAMES = ("chromium", "chromium-browser")
WINDOW = (1280, 800)
CHROME_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)
# Every SSE update of the fake server; the real coordinator decides its own pace.
FAKE_EVENT_INTERVAL_S = 0.2


# ---------------------------------------------------------------------------- browser


def _chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="package")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """One headless chromium for the browser tests, with a fresh profile directory.

    It quits when they end: a page left open keeps repainting (a running job's progress
    bar is animated) and would take CPU from every test after it.
    """
    chromium = _chromium()
    if chromium is None or not CHROMEDRIVER.exists():
        pytest.skip("chromium and /usr/bin/chromedriver are needed (apt install chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def open_dashboard(
    browser: WebDriver, base_url: str, token: str | None = None, job_id: str | None = None
) -> None:
    """Load the dashboard (the job page of `job_id` if given) and wait until it has started.

    `token` goes in as `?token=`, as a user would pass it; the page keeps it in
    localStorage, so later loads without it still authenticate.
    """
    from selenium.webdriver.support.ui import WebDriverWait

    url = base_url.rstrip("/") + "/"
    if token is not None:
        url += f"?token={quote(token)}"
    if job_id is not None:
        url += f"#/jobs/{quote(job_id, safe='')}"
    browser.get(url)
    view = "#view-job" if job_id is not None else "#view-list"
    WebDriverWait(browser, 10).until(
        lambda d: d.execute_script(
            "const v = document.querySelector(arguments[0]); return v && !v.hidden;", view
        )
    )


def save_screenshot(browser: WebDriver, name: str, full_page: bool = False) -> Path:
    """Save what the browser shows under artifacts/ (kept by CI as a test artefact).

    `full_page` captures the whole page, below the fold included (Chrome DevTools).
    """
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    if not full_page:
        browser.save_screenshot(str(path))
        return path
    metrics = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})  # type: ignore[attr-defined]
    size = metrics["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = browser.execute_cdp_cmd(  # type: ignore[attr-defined]
        "Page.captureScreenshot", {"captureBeyondViewport": True, "clip": clip}
    )
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


# ---------------------------------------------------------------------------- fake API


@dataclass
class FakeTraining:
    """A draft training whose steps are a function of time: `steps` steps over `duration_s`.

    `starting_s` first (the actor starting), then running, then `evaluating_s` evaluating
    (vLLM measuring the draft); it ends `final_state` (with `error` when that is
    "failed"), as GET /v1/jobs/{id}/train reports it (TrainStatus). Each checkpoint is
    validated (`expected(step)`); a done training has vLLM's measurement (`EVAL`).
    """

    duration_s: float
    steps: int = 300
    starting_s: float = 0.0
    evaluating_s: float = 0.0
    ttt_steps: int = 3
    checkpoint_every: int = 100
    final_state: str = "done"
    error: str | None = None
    warning: str | None = None
    waiting_for: str | None = None  # what it says it waits for while starting
    created_at: float = field(default_factory=time.time)

    EVAL = {"k": 3, "prompts": 32, "prompt_source": "held-out samples", "draft_step": 200,
            "generated_tokens": 4096, "drafts": 1276, "draft_tokens": 3828,
            "accepted_tokens": 2820, "accepted_per_position": [1085, 893, 842],
            "acceptance_per_position": [0.85, 0.70, 0.66], "mean_acceptance_length": 3.21,
            "seconds": 12.5}

    @property
    def started_at(self) -> float:
        return self.created_at + self.starting_s

    def state(self, now: float) -> str:
        if now < self.started_at:
            return "starting"
        if now < self.started_at + self.duration_s:
            return "running"
        if self.final_state == "done" and now < self.started_at + self.duration_s + \
                self.evaluating_s:
            return "evaluating"
        return self.final_state

    @staticmethod
    def expected(step: int) -> float:
        """The held-out expected acceptance length at a checkpoint (a dip at step 300)."""
        return 1.0 + 2.2 * (1 - math.exp(-step / 90)) - (0.3 if step == 300 else 0.0)

    def step(self, now: float) -> int:
        fraction = min(1.0, max(0.0, (now - self.started_at) / self.duration_s))
        return int(fraction * self.steps)

    def point(self, step: int) -> dict[str, Any]:
        loss = 1.1 + 7.5 * math.exp(-step / 60) + 0.15 * math.sin(step * 0.7)
        acc = [0.95 * (1 - math.exp(-step / 80)) * 0.9**k for k in range(self.ttt_steps)]
        time_ = self.started_at + step / self.steps * self.duration_s
        return {"step": step, "epoch": 0, "loss": loss, "acc": acc, "time": time_}

    def status(self, job_id: str, output: str, now: float) -> dict[str, Any]:
        """The TrainStatus, checked against the wire schema so the fake cannot drift."""
        from hsx.spec import TrainSpec
        from hsx.wire import TrainStatus

        state = self.state(now)
        step = self.step(now)
        history = [self.point(i) for i in range(1, step + 1)]
        last = history[-1] if history else None
        checkpoint = step // self.checkpoint_every * self.checkpoint_every
        if state in ("done", "failed"):
            checkpoint = step
        spec = TrainSpec(ttt_steps=self.ttt_steps, checkpoint_every=self.checkpoint_every)
        validation = [
            {"step": s, "loss": self.point(s)["loss"] + 0.2, "acc": self.point(s)["acc"],
             "cond_acc": self.point(s)["acc"], "expected_acceptance_length": self.expected(s),
             "tokens": 51_200, "time": self.point(s)["time"]}
            for s in range(self.checkpoint_every, checkpoint + 1, self.checkpoint_every)]
        best = max(validation, key=lambda v: v["expected_acceptance_length"], default=None)
        plan = {"device": "cuda", "workers": 1, "steps": self.steps, "batch_tokens": 8192,
                "pack_tokens": 8192, "lr": 1e-4, "lr_schedule": "cosine",
                "warmup_steps": self.steps // 20, "checkpoint_every": self.checkpoint_every,
                "train_samples": 3800, "train_tokens": self.steps * 8192,
                "val_samples": 200, "passes": 1.0, "warning": self.warning}
        body = {
            "job_id": job_id,
            "state": state,
            "draft": f"{output}/draft",
            "step": step,
            "epoch": 1 if state == "done" else 0,
            "loss": last["loss"] if last else None,
            "acc": last["acc"] if last else [],
            "tokens_per_s": 18_500 + 1_500 * math.sin(now * 1.7) if state == "running" else 0.0,
            "wait_fraction": 0.12,
            "checkpoint_step": checkpoint or None,
            "restarts": 0,
            "resumed_from": None,
            "first_step_at": self.started_at if step else None,
            "error": self.error if state == "failed" else None,
            "waiting_for": self.waiting_for if state == "starting" else None,
            "spec": spec.model_dump(mode="json"),
            "history": history,
            "plan": plan,
            "warning": self.warning,
            "validation": validation,
            "best_step": best["step"] if best else None,
            "best_expected_acceptance_length": best["expected_acceptance_length"]
            if best else None,
            "eval": self.EVAL if state == "done" else None,
            "updated_at": now,
        }
        return TrainStatus.model_validate(body).model_dump(mode="json")


@dataclass
class FakeJob:
    """A job whose progress is a function of time: queued, then running for `duration_s`."""

    id: str
    name: str
    duration_s: float
    queued_s: float = 0.0
    samples_total: int = 1200
    units_total: int = 24
    replicas: int = 3
    fail_every: int = 37
    final_state: str = "succeeded"
    created_at: float = field(default_factory=time.time)
    cancelled_at: float | None = None
    training: FakeTraining | None = None
    waiting_for: str | None = None  # what it says it waits for while running
    plan: dict[str, Any] | None = None  # its ResourcePlan
    nodes: list[dict[str, Any]] | None = None  # while running: its NodeStatus rows

    @property
    def started_at(self) -> float:
        return self.created_at + self.queued_s

    def _fraction(self, now: float) -> float:
        end = now if self.cancelled_at is None else min(now, self.cancelled_at)
        return min(1.0, max(0.0, (end - self.started_at) / self.duration_s))

    @staticmethod
    def rate(t: float) -> float:
        """Tokens/s at time t (what the curve and the live status show)."""
        return 52_000 + 9_000 * math.sin(t * 2.1) + 4_000 * math.sin(t * 5.3)

    def throughput(self, now: float) -> dict[str, Any]:
        """GET .../throughput: a point a second from the start to now (or the end)."""
        end = min(now, self.started_at + self.duration_s)
        if self.cancelled_at is not None:
            end = min(end, self.cancelled_at)
        points = []
        t = self.started_at + 1.0
        while t <= end:
            points.append({"at": t, "tokens_per_s": self.rate(t),
                           "tokens_done": int((t - self.started_at) / self.duration_s
                                              * self.samples_total * 480)})
            t += 1.0
        avg = sum(p["tokens_per_s"] for p in points) / len(points) if points else 0.0
        return {"job_id": self.id, "tokens_per_s_avg": avg, "points": points}

    def state(self, now: float) -> str:
        if self.cancelled_at is not None:
            return "cancelled"
        if now < self.started_at:
            return "queued"
        return "running" if now < self.started_at + self.duration_s else self.final_state

    def failed_samples(self, now: float) -> list[int]:
        done = int(self._fraction(now) * self.samples_total)
        return [i for i in range(done) if i % self.fail_every == self.fail_every - 1]

    def status(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        state = self.state(now)
        fraction = self._fraction(now)
        tokens_total = self.samples_total * 480
        samples_done = int(fraction * self.samples_total)
        units_done = int(fraction * self.units_total)
        running = state == "running"
        rate = self.rate(now)
        tokens_done = int(fraction * tokens_total)
        worker_totals = [
            {"name": f"engine-{i}", "units": units_done // self.replicas
             + (1 if i < units_done % self.replicas else 0),
             "samples": samples_done // self.replicas, "tokens": tokens_done // self.replicas,
             "bytes": tokens_done // self.replicas * 4 * 4096 * 2, "seconds": 1.5 * units_done}
            for i in range(self.replicas)
        ] if units_done else []
        # One worker "dies" a third of the way through and comes back.
        died = fraction >= 1 / 3
        workers = []
        for i in range(self.replicas):
            if not running:
                break
            if i == 1 and 1 / 3 <= fraction < 0.4:
                workers.append({"name": f"engine-{i}", "state": "dead", "unit": None})
            elif (int(now * 2) + i) % 4 == 0:
                workers.append({"name": f"engine-{i}", "state": "idle", "unit": None})
            else:
                unit = min(self.units_total - 1, units_done + i)
                workers.append({"name": f"engine-{i}", "state": "busy", "unit": unit})
        finished_at = None
        if state in ("succeeded", "failed"):
            finished_at = self.started_at + self.duration_s
        elif state == "cancelled":
            finished_at = self.cancelled_at
        left = (1 - fraction) * self.duration_s
        return {
            "id": self.id,
            "name": self.name,
            "state": state,
            "output": f"file:///data/hsx/{self.id}",
            "created_at": self.created_at,
            "started_at": self.started_at if state != "queued" else None,
            "finished_at": finished_at,
            "samples_total": self.samples_total,
            "samples_done": samples_done,
            "samples_failed": len(self.failed_samples(now)),
            "samples_checked": samples_done,
            "check_problems": 0,
            "tokens_total": tokens_total,
            "tokens_done": tokens_done,
            "bytes": int(fraction * tokens_total) * 4 * 4096 * 2,
            "shards": units_done,
            "units_total": self.units_total,
            "units_done": units_done,
            "units_failed": 0,
            "tokens_per_s": rate if running else 0.0,
            "tokens_per_s_avg": self.throughput(now)["tokens_per_s_avg"],
            "worker_totals": worker_totals,
            "eta_s": left if running else None,
            "workers": workers,
            "waiting_for": self.waiting_for if running else None,
            "plan": self.plan,
            "nodes": (self.nodes or []) if running else [],
            "restarts": 1 if died else 0,
            "last_error": (
                "engine-1 died: ray.exceptions.ActorDiedError: The actor died unexpectedly "
                "before finishing this task (unit 8 requeued)"
                if died
                else None
            ),
            "spec": {
                "version": 1,
                "name": self.name,
                "model": "/models/Llama-3.1-8B-Instruct",
                "dataset": "/data/sharegpt-1200.jsonl",
                "output": f"/data/hsx/{self.id}",
                "layers": [2, 16, 29, 32],
                "engine": "vllm",
                "max_seq_len": 4096,
                "replicas": self.replicas,
                "tensor_parallel_size": 2,
                "storage_dtype": "bfloat16",
            },
        }


REASONS = (
    "empty conversation",
    "too long: 9312 tokens > max_seq_len 4096",
    "chat template failed: roles must alternate user/assistant/user/assistant/...",
    "unparsable row: expected a 'messages' list",
)


class FakeCoordinator:
    """The `/v1` job API over FakeJobs, with the real static files at / and /static."""

    def __init__(self) -> None:
        self.jobs: dict[str, FakeJob] = {}
        self.train_requests: Counter[str] = Counter()  # job id -> GET .../train calls
        self.token: str | None = None
        self.base_url = ""
        self.closing = False

    def add_job(self, job: FakeJob) -> FakeJob:
        self.jobs[job.id] = job
        return job

    def app(self) -> FastAPI:
        from fastapi import APIRouter, FastAPI
        from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
        from fastapi.staticfiles import StaticFiles

        def error(status: int, type_: str, message: str) -> JSONResponse:
            return JSONResponse({"type": type_, "message": message}, status_code=status)

        app = FastAPI()
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
        api = APIRouter(prefix="/v1")

        @app.get("/")
        async def index() -> FileResponse:
            return FileResponse(STATIC_DIR / "index.html")

        def find(job_id: str) -> FakeJob | None:
            return self.jobs.get(job_id)

        @api.get("/jobs")
        async def list_jobs(state: str | None = None) -> Any:
            now = time.time()
            jobs = [j.status(now) for j in self.jobs.values()]
            return {"jobs": [j for j in jobs if state is None or j["state"] == state]}

        @api.get("/jobs/{job_id}")
        async def get_job(job_id: str) -> Any:
            job = find(job_id)
            if job is None:
                return error(404, "NotFound", f"no job {job_id!r}")
            return job.status()

        @api.delete("/jobs/{job_id}")
        async def cancel_job(job_id: str) -> Any:
            job = find(job_id)
            if job is None:
                return error(404, "NotFound", f"no job {job_id!r}")
            if job.state(time.time()) in ("queued", "running"):
                job.cancelled_at = time.time()
            return job.status()

        @api.get("/jobs/{job_id}/errors")
        async def job_errors(job_id: str, offset: int = 0, limit: int = 100) -> Any:
            job = find(job_id)
            if job is None:
                return error(404, "NotFound", f"no job {job_id!r}")
            failed = job.failed_samples(time.time())
            items = [
                {"sample_index": i, "reason": REASONS[(i // job.fail_every) % len(REASONS)]}
                for i in failed[offset : offset + limit]
            ]
            return {"items": items, "total": len(failed), "offset": offset, "limit": limit}

        @api.get("/jobs/{job_id}/throughput")
        async def job_throughput(job_id: str) -> Any:
            job = find(job_id)
            if job is None:
                return error(404, "NotFound", f"no job {job_id!r}")
            return job.throughput(time.time())

        @api.get("/jobs/{job_id}/train")
        async def training_status(job_id: str) -> Any:
            self.train_requests[job_id] += 1
            job = find(job_id)
            if job is None:
                return error(404, "NotFound", f"no job {job_id!r}")
            if job.training is None:
                message = f"job {job_id} has no training; POST /v1/jobs/{job_id}/train starts one"
                return error(404, "NotFound", message)
            return job.training.status(job_id, f"/data/hsx/{job_id}", time.time())

        @api.get("/jobs/{job_id}/events")
        async def job_events(job_id: str) -> Any:
            job = find(job_id)
            if job is None:
                return error(404, "NotFound", f"no job {job_id!r}")

            async def stream() -> AsyncIterator[str]:
                while True:
                    status = job.status()
                    yield f"event: status\ndata: {json.dumps(status)}\n\n"
                    if self.closing or status["state"] in ("succeeded", "failed", "cancelled"):
                        return
                    await asyncio.sleep(FAKE_EVENT_INTERVAL_S)

            return StreamingResponse(
                stream(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        app.include_router(api)
        return app

    def asgi(self) -> Any:
        """The app behind a token check, as the real coordinator does it when it has one.

        A plain ASGI wrapper: the SSE stream must not go through a buffering middleware.
        """
        from fastapi.responses import JSONResponse

        app = self.app()

        async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if self.token and scope["type"] == "http" and scope["path"].startswith("/v1"):
                headers = dict(scope["headers"])
                bearer = headers.get(b"authorization", b"").decode()
                query = parse_qs(scope.get("query_string", b"").decode())
                # Bearer header for fetch; ?access_token= for EventSource (no headers there).
                if bearer != f"Bearer {self.token}" and query.get("access_token") != [self.token]:
                    body = {"type": "Unauthorized", "message": "missing or wrong API token"}
                    await JSONResponse(body, status_code=401)(scope, receive, send)
                    return
            await app(scope, receive, send)

        return guarded


@pytest.fixture(scope="session")
def fake_api() -> Iterator[FakeCoordinator]:
    """A fake coordinator on a loopback port, served by uvicorn in a thread."""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    coordinator = FakeCoordinator()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        coordinator.asgi(), log_level="warning", timeout_graceful_shutdown=1, lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake coordinator did not start")
        time.sleep(0.02)
    coordinator.base_url = f"http://127.0.0.1:{port}"
    try:
        yield coordinator
    finally:
        coordinator.closing = True
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
