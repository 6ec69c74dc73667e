"""The dashboard against the real coordinator while a real extraction job runs.

`hsx serve` with a token, local Ray and a vLLM CPU engine; the page is opened on the
job as a user would (`/?token=...#/jobs/<id>`) and must follow it live to the end.
"""

from __future__ import annotations

import json
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


@pytest.mark.slow  # make test-slow
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


# Markup that would run if the page ever put server text into HTML: each sets a flag.
HOSTILE_NAME = '<img src=x onerror="window.__pwned=1">'
HOSTILE_ROLE = "<img src=x onerror=window.__pwned=2>"
HOSTILE_FIELD = "<svg onload=window.__pwned=3>"
# A folder name cannot hold "/", so no closing tag here.
HOSTILE_DIR = '<b onclick="window.__pwned=4">dir'
HOSTILE_FILE = "<iframe onload=window.__pwned=5>.parquet"
HOSTILE_ID = "<img src=x onerror=window.__pwned=6>"


def _content(browser: WebDriver, selector: str) -> str:
    """All text of an element, shown or not (a closed <details> hides its text)."""
    return str(browser.execute_script(
        "return document.querySelector(arguments[0]).textContent;", selector))


def _nothing_ran(browser: WebDriver) -> None:
    ran = browser.execute_script(
        "return [window.__pwned, document.querySelectorAll("
        "'[onerror],[onload],[onclick],script:not([src]),iframe,svg').length];")
    assert ran == [None, 0], ran


def test_hostile_names_reasons_and_file_names_are_shown_as_text(
    browser: WebDriver, live_coordinator: Coordinator, tiny_llama: Path, tmp_path: Path
) -> None:
    """A job name, a dataset's rows (their error reasons), a folder and a file name, and a
    job id in the link, all carrying markup: the page shows each as text and runs none.

    Neither job needs an engine: every row of the first is refused at ingestion (so it
    fails naming the commonest reasons), the second's Parquet file is truncated (it
    fails naming the file)."""
    folder = tmp_path / HOSTILE_DIR
    folder.mkdir()
    rows = folder / "rows.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": HOSTILE_ROLE, "content": "hi"}]}) + "\n"
        + json.dumps({HOSTILE_FIELD: "x"}) + "\n")
    broken = folder / HOSTILE_FILE
    broken.write_bytes(b"PAR1 cut short")
    client = live_coordinator.client()
    spec = {"model": str(tiny_llama), "layers": [1, 2, 3, 4], "max_seq_len": 256}
    refused_rows = client.submit({**spec, "name": HOSTILE_NAME, "dataset": str(rows),
                                  "output": str(folder / "out-rows")})
    unreadable = client.submit({**spec, "name": "unreadable", "dataset": str(broken),
                                "output": str(folder / "out-broken")})
    all_bad = client.wait(refused_rows.id, timeout=300)
    said = all_bad.last_error or ""
    assert all_bad.state == JobState.failed and "the commonest reasons" in said, said
    failed = client.wait(unreadable.id, timeout=300)
    assert failed.state == JobState.failed and HOSTILE_FILE in (failed.last_error or "")

    open_dashboard(browser, live_coordinator.url, token=TOKEN)
    wait(browser, lambda d: HOSTILE_NAME in _content(d, "#job-rows"), what="the job list")
    _nothing_ran(browser)

    open_dashboard(browser, live_coordinator.url, job_id=refused_rows.id)
    wait(browser, lambda d: count(d, "#errors-table tbody tr") == 2, what="the error table")
    assert text(browser, "#job-title") == HOSTILE_NAME
    reasons = _content(browser, "#errors-table tbody")
    assert HOSTILE_ROLE in reasons and HOSTILE_FIELD in reasons
    assert HOSTILE_DIR in _content(browser, "#details")  # the output's path
    _nothing_ran(browser)

    open_dashboard(browser, live_coordinator.url, job_id=unreadable.id)
    wait(browser, lambda d: HOSTILE_FILE in _content(d, "#last-error"), what="the last error")
    _nothing_ran(browser)

    # Ids come from links too: one carrying markup, one with a malformed escape.
    open_dashboard(browser, live_coordinator.url, job_id=HOSTILE_ID)
    wait(browser, lambda d: text(d, "#progress-text") == "No such job.", what="a 404")
    assert text(browser, "#job-title") == HOSTILE_ID
    browser.get(f"{live_coordinator.url}/#/jobs/%E0%A4%A")
    wait(browser, lambda d: text(d, "#progress-text") == "No such job.", what="a 404")
    assert text(browser, "#job-title") == "%E0%A4%A"
    _nothing_ran(browser)
