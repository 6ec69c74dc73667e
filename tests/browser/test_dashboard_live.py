"""The dashboard against the real coordinator while a real extraction job runs.

`hsx serve` with a token, local Ray and a vLLM CPU engine; the page is opened on the
job as a user would (`/?token=...#/jobs/<id>`) and must follow it live to the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from hsx.wire import JobState
from hsx_workers.tiny_models import ChatDataset
from tests.integration.test_service import TOKEN, Coordinator, start_coordinator
from tests.unit.test_deploy import board_metric_names

from .conftest import open_dashboard, save_screenshot
from .test_dashboard import chart_points, count, progress, text, wait

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = [pytest.mark.browser, pytest.mark.integration]


@pytest.fixture(scope="module")
def live_coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    ledger = tmp_path_factory.mktemp("live-ledger") / "ledger.sqlite"
    server = start_coordinator(ledger, [tmp_path_factory.getbasetemp()], ledger.parent / "log")
    yield server
    server.kill()


def test_dashboard_follows_a_real_job(
    browser: WebDriver, live_coordinator: Coordinator, tiny_llama: Path,
    chat_dataset: ChatDataset, tmp_path: Path,
) -> None:
    client = live_coordinator.client()
    job = client.submit({
        "name": "live-dashboard", "model": str(tiny_llama), "dataset": str(chat_dataset.path),
        "output": str(tmp_path / "out"), "layers": [1, 2, 3, 4], "max_seq_len": 256,
        "unit_tokens": 512,
    })
    open_dashboard(browser, live_coordinator.url, token=TOKEN, job_id=job.id)
    wait(browser, lambda d: text(d, "#state") in ("queued", "running", "succeeded"),
         what="the job's state")
    # While it runs: a moving progress bar, points on the chart, a busy engine.
    wait(browser, lambda d: text(d, "#state") == "running" and count(d, "#workers li.worker"),
         timeout=300, what="a running job with its engine")
    wait(browser, lambda d: 0 < progress(d) < 100, timeout=300, what="progress mid-job")
    # The Grafana board's queries against this real coordinator's /metrics, mid-job
    # (the draft-training ones need a training: tests/unit/test_board.py has them).
    scraped = {line.split("{")[0].split(" ")[0]
               for line in httpx.get(f"{live_coordinator.url}/metrics").text.splitlines()
               if line and not line.startswith("#")}
    wanted = {n for n in board_metric_names() if not n.startswith("hsx_train_")}
    assert wanted <= scraped, f"/metrics lacks what the board queries: {wanted - scraped}"
    first = progress(browser)
    wait(browser, lambda d: progress(d) > first or text(d, "#state") == "succeeded",
         timeout=120, what="progress moving")
    if text(browser, "#state") == "running":
        wait(browser, lambda d: chart_points(d) >= 2 or text(d, "#state") == "succeeded",
             timeout=60, what="tokens/s points")
        save_screenshot(browser, "dashboard-live.png")
    # To the end: the final state, 100 %, the bad rows in the error table.
    wait(browser, lambda d: text(d, "#state") == "succeeded", timeout=600, what="success")
    assert progress(browser) == 100
    wait(browser, lambda d: count(d, "#errors-table tbody tr") == len(chat_dataset.bad),
         timeout=30, what="the error table")
    save_screenshot(browser, "dashboard-live-final.png", full_page=True)
    assert client.get(job.id).state == JobState.succeeded
