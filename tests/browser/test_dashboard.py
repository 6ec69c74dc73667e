"""The dashboard in headless chromium against the fake coordinator (tests/browser/conftest.py).

The page is exercised end to end: the job list, the live job page fed by SSE, the error
table's paging, cancel, the API token, and a job's draft training (polled, with its loss
curve). Screenshots land in artifacts/.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import pytest

from .conftest import FakeCoordinator, FakeJob, FakeTraining, open_dashboard, save_screenshot

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.browser


def wait(browser: WebDriver, condition: object, timeout: float = 15, what: str = "") -> object:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(condition, what)


def text(browser: WebDriver, selector: str) -> str:
    from selenium.webdriver.common.by import By

    return str(browser.find_element(By.CSS_SELECTOR, selector).text)


def progress(browser: WebDriver) -> float:
    from selenium.webdriver.common.by import By

    bar = browser.find_element(By.CSS_SELECTOR, "#progress-bar")
    return float(bar.get_attribute("aria-valuenow") or 0)


def chart_points(browser: WebDriver) -> int:
    from selenium.webdriver.common.by import By

    canvas = browser.find_element(By.CSS_SELECTOR, "#rate-chart")
    return int(canvas.get_attribute("data-points") or 0)


def loss_chart(browser: WebDriver) -> tuple[int, float | None]:
    """Points drawn on the loss chart and the last loss, read in one go."""
    points, last = browser.execute_script(
        "const c = document.querySelector('#loss-chart');"
        "return [c.dataset.points, c.dataset.lastLoss];"
    )
    return int(points or 0), float(last) if last else None


def shown(browser: WebDriver, selector: str) -> bool:
    script = "return document.querySelector(arguments[0]).hidden;"
    return not browser.execute_script(script, selector)


def count(browser: WebDriver, selector: str) -> int:
    from selenium.webdriver.common.by import By

    return len(browser.find_elements(By.CSS_SELECTOR, selector))


def list_rows(browser: WebDriver) -> dict[str, dict[str, str]]:
    """The job list's rows, read in one go (the page rebuilds them on every refresh)."""
    rows: dict[str, dict[str, str]] = browser.execute_script(
        """
        const rows = {};
        for (const tr of document.querySelectorAll("#job-list [data-job-id]")) {
          rows[tr.dataset.jobId] = {
            state: tr.querySelector(".badge").textContent,
            samples: tr.querySelector("td.num").textContent,
            text: tr.innerText,
          };
        }
        return rows;
        """
    )
    return rows


def test_job_list_shows_jobs(browser: WebDriver, fake_api: FakeCoordinator) -> None:
    from selenium.webdriver.common.by import By

    now = time.time()
    fake_api.add_job(
        FakeJob(id="list-done", name="sharegpt-llama8b", duration_s=30, created_at=now - 3600)
    )
    fake_api.add_job(FakeJob(id="list-running", name="ultrachat-qwen", duration_s=600))
    fake_api.add_job(FakeJob(id="list-queued", name="tulu-mix", duration_s=60, queued_s=600))

    open_dashboard(browser, fake_api.base_url)
    wait(browser, lambda d: count(d, "#job-list [data-job-id]") >= 3, what="job rows")

    rows = list_rows(browser)
    assert rows["list-done"]["state"] == "succeeded"
    assert "100%" in rows["list-done"]["text"]
    assert "1,200 / 1,200" in rows["list-done"]["text"]
    # An ended job: its average throughput and the size of its output.
    assert re.search(r"\d+(\.\d)?k avg", rows["list-done"]["text"]), rows["list-done"]["text"]
    assert "GiB" in rows["list-done"]["text"]
    assert "avg" not in rows["list-queued"]["text"]
    assert rows["list-running"]["state"] == "running"
    assert "ultrachat-qwen" in rows["list-running"]["text"]
    assert rows["list-queued"]["state"] == "queued"

    # The list refreshes by itself: the running job's samples move.
    before = rows["list-running"]["samples"]
    wait(
        browser,
        lambda d: list_rows(d)["list-running"]["samples"] != before,
        what="list refresh",
    )
    save_screenshot(browser, "dashboard-list.png")

    # The state filter asks the server for one state only.
    browser.find_element(By.CSS_SELECTOR, "#state-filter option[value='queued']").click()
    wait(browser, lambda d: count(d, '#job-list [data-job-id="list-running"]') == 0)
    assert count(browser, '#job-list [data-job-id="list-queued"]') == 1
    browser.find_element(By.CSS_SELECTOR, "#state-filter option[value='']").click()


def test_job_page_follows_a_running_job(browser: WebDriver, fake_api: FakeCoordinator) -> None:
    from selenium.webdriver.common.by import By

    job = fake_api.add_job(
        FakeJob(id="live-1", name="sharegpt-eagle3", duration_s=18, queued_s=1.0, fail_every=13)
    )
    open_dashboard(browser, fake_api.base_url)
    wait(browser, lambda d: count(d, '[data-job-id="live-1"]') == 1, what="job row")
    browser.find_element(By.CSS_SELECTOR, '[data-job-id="live-1"] td:nth-child(2)').click()
    wait(browser, lambda d: d.current_url.endswith("#/jobs/live-1"), what="hash route")
    wait(browser, lambda d: text(d, "#job-title") == "sharegpt-eagle3", what="job title")

    wait(browser, lambda d: text(d, "#state") == "running", what="running state")
    first = progress(browser)
    wait(browser, lambda d: progress(d) > first + 5, what="progress advancing")
    assert "samples" in text(browser, "#progress-text")
    assert text(browser, "#eta").startswith("ETA")
    assert text(browser, "#conn") == "live"

    wait(browser, lambda d: count(d, "#workers li.worker") == job.replicas, what="workers")
    # Read in one go: the page redraws the workers on every update.
    workers = browser.execute_script(
        "return [...document.querySelectorAll('#workers li.worker')]"
        ".map((w) => [w.dataset.worker, w.dataset.state]);"
    )
    assert {name for name, _ in workers} == {f"engine-{i}" for i in range(job.replicas)}
    assert {state for _, state in workers} <= {"starting", "idle", "busy", "dead"}
    wait(browser, lambda d: count(d, "#errors-table tbody tr") > 0, what="error rows")
    wait(browser, lambda d: chart_points(d) >= 4, what="the throughput curve")
    wait(browser, lambda d: text(d, "#stat-restarts") == "1", what="a restart")
    assert "ActorDiedError" in text(browser, "#last-error")
    assert not browser.find_element(By.CSS_SELECTOR, "#cancel-btn").get_attribute("hidden")
    wait(browser, lambda d: progress(d) >= 60, what="progress past 60%")
    save_screenshot(browser, "dashboard.png")
    save_screenshot(browser, "dashboard-full.png", full_page=True)

    # The stream ends with the job; the page shows the final status.
    wait(browser, lambda d: text(d, "#state") == "succeeded", timeout=30, what="final state")
    assert progress(browser) == 100
    assert text(browser, "#progress-text").startswith("1,200 / 1,200 samples")
    assert text(browser, "#stat-checks") == "1,200 checked"  # every sample's states
    assert browser.find_element(By.CSS_SELECTOR, "#cancel-btn").get_attribute("hidden")
    # The workers now show what each committed over the job.
    assert_worker_totals(browser, job)
    assert text(browser, "#stat-rate-label") == "Tokens/s (average)"
    assert text(browser, "#stat-rate") != NO_VALUE
    assert text(browser, "#stat-shards") == "24"
    assert text(browser, "#stat-bytes").endswith("GiB")

    # The error table pages: 92 records, 50 a page.
    total = len(job.failed_samples(time.time()))
    wait(browser, lambda d: f"of {total} shown" in text(d, "#errors-summary"), what="all errors")
    assert count(browser, "#errors-table tbody tr") == 50
    browser.find_element(By.CSS_SELECTOR, "#errors-more").click()
    wait(browser, lambda d: count(d, "#errors-table tbody tr") == total, what="load more")
    assert not browser.find_element(By.CSS_SELECTOR, "#errors-more").is_displayed()
    first_row = browser.find_element(By.CSS_SELECTOR, "#errors-table tbody tr")
    assert first_row.get_attribute("data-sample") == "12"
    save_screenshot(browser, "dashboard-final.png", full_page=True)

    # The whole run's curve: a point a second of its 18 s.
    wait(browser, lambda d: chart_points(d) >= 16, what="the final curve")
    assert text(browser, "#rate-chart-span") == "whole run"


def assert_worker_totals(browser: WebDriver, job: FakeJob) -> None:
    workers = browser.execute_script(
        "return [...document.querySelectorAll('#workers li.worker')].map((w) =>"
        " [w.dataset.worker, w.dataset.state, Number(w.querySelector('.worker-totals')"
        ".dataset.units), w.querySelector('.worker-totals').textContent]);"
    )
    assert [w[0] for w in workers] == [f"engine-{i}" for i in range(job.replicas)]
    assert {w[1] for w in workers} == {"ended"}
    assert sum(w[2] for w in workers) == job.units_total
    assert all(re.search(r"\d+ units · [\d.]+[kMG]? tok · [\d.]+ [KMG]iB", w[3]) for w in workers)


def test_a_job_across_nodes_shows_what_each_node_runs(
        browser: WebDriver, fake_api: FakeCoordinator) -> None:
    """An online job on three Ray nodes: per node its engines, the trainer's workers and
    the captured bytes in flight there (JobStatus.nodes)."""
    nodes = [{"node": "a" * 56, "engines": ["engine-0"], "trainer_workers": [],
              "bytes_in_flight": 16_893_268},
             {"node": "b" * 56, "engines": [], "trainer_workers": [0], "bytes_in_flight": 0},
             {"node": "c" * 56, "engines": [], "trainer_workers": [1],
              "bytes_in_flight": 16_893_268}]
    fake_api.add_job(FakeJob(id="nodes-1", name="online-apart", duration_s=30, replicas=1,
                             nodes=nodes))
    open_dashboard(browser, fake_api.base_url, job_id="nodes-1")
    wait(browser, lambda d: count(d, "#nodes li.node") == 3, what="the nodes")
    shown = browser.execute_script(
        "return [...document.querySelectorAll('#nodes li.node')].map((n) =>"
        " [n.dataset.node, n.querySelector('.worker-totals').textContent,"
        "  n.querySelector('.worker-unit').textContent]);")
    assert [row[0][0] for row in shown] == ["a", "b", "c"]
    assert [row[1] for row in shown] == ["engine-0", "trainer 0", "trainer 1"]
    assert re.fullmatch(r"16(\.\d)? MiB in flight", shown[0][2]) and shown[1][2] == ""


def test_a_job_that_ended_before_the_page_opened(
    browser: WebDriver, fake_api: FakeCoordinator
) -> None:
    """The page shows the stored curve, the average rate and each worker's totals."""
    now = time.time()
    job = fake_api.add_job(
        FakeJob(id="ended-earlier", name="overnight", duration_s=40, created_at=now - 7200)
    )
    open_dashboard(browser, fake_api.base_url, job_id="ended-earlier")
    wait(browser, lambda d: text(d, "#state") == "succeeded", what="the final state")
    wait(browser, lambda d: chart_points(d) == 40, what="the stored curve")
    assert not shown(browser, "#rate-chart-empty")
    assert text(browser, "#rate-chart-span") == "whole run"
    expected = job.throughput(now)["tokens_per_s_avg"]
    assert text(browser, "#stat-rate") == f"{round(expected):,}"
    assert text(browser, "#stat-rate-label") == "Tokens/s (average)"
    assert_worker_totals(browser, job)
    assert text(browser, "#conn") == ""  # nothing live to follow
    save_screenshot(browser, "dashboard-ended.png", full_page=True)


def test_cancel_a_running_job(browser: WebDriver, fake_api: FakeCoordinator) -> None:
    from selenium.webdriver.common.by import By

    fake_api.add_job(FakeJob(id="to-cancel", name="long-run", duration_s=600))
    open_dashboard(browser, fake_api.base_url, job_id="to-cancel")
    wait(browser, lambda d: text(d, "#state") == "running", what="running state")

    button = browser.find_element(By.CSS_SELECTOR, "#cancel-btn")
    button.click()
    assert "again" in button.text  # the first click only arms it
    button.click()
    wait(browser, lambda d: text(d, "#state") == "cancelled", what="cancelled")
    assert not button.is_displayed()
    assert fake_api.jobs["to-cancel"].cancelled_at is not None


def test_api_token(browser: WebDriver, fake_api: FakeCoordinator) -> None:
    fake_api.add_job(FakeJob(id="with-token", name="secured", duration_s=600))
    fake_api.token = "s3cret/+token"
    try:
        browser.get(fake_api.base_url + "/")
        browser.execute_script("localStorage.clear()")
        open_dashboard(browser, fake_api.base_url)
        wait(browser, lambda d: "token" in text(d, "#banner"), what="401 banner")
        assert count(browser, "#job-list [data-job-id]") == 0

        open_dashboard(browser, fake_api.base_url, token=fake_api.token)
        wait(browser, lambda d: count(d, '[data-job-id="with-token"]') == 1, what="job row")
        assert "token" not in browser.current_url  # dropped from the address bar

        # Later loads use the stored token, for fetch and for the SSE stream alike.
        open_dashboard(browser, fake_api.base_url, job_id="with-token")
        wait(browser, lambda d: text(d, "#state") == "running", what="running state")
        wait(browser, lambda d: text(d, "#conn") == "live", what="SSE with access_token")
        wait(browser, lambda d: chart_points(d) >= 1, what="the curve with the token")
    finally:
        fake_api.token = None
        browser.execute_script("localStorage.clear()")


NO_VALUE = "\u2013"  # the page's en dash for "nothing to show"
# Polls the page makes of GET .../train (training.js: TRAIN_POLL_MS, TRAIN_ABSENT_POLL_MS).
TRAIN_POLL_S = 2.0
TRAIN_ABSENT_POLL_S = 10.0


def test_job_page_follows_a_draft_training(browser: WebDriver, fake_api: FakeCoordinator) -> None:
    training = FakeTraining(duration_s=12, steps=240, starting_s=1.0, evaluating_s=3.0,
                            warning="the data is small for this schedule")
    fake_api.add_job(
        FakeJob(id="train-1", name="sharegpt-eagle3", duration_s=600, training=training)
    )
    open_dashboard(browser, fake_api.base_url, job_id="train-1")
    wait(browser, lambda d: shown(d, "#training"), what="training section")
    wait(browser, lambda d: text(d, "#train-state") == "running", what="training running")

    wait(browser, lambda d: loss_chart(d)[0] >= 10, what="loss points")
    first, _ = loss_chart(browser)
    wait(browser, lambda d: loss_chart(d)[0] > first, what="the loss curve growing")
    # The chart draws the history as served: one point a step, the last one's loss.
    state = browser.execute_script(
        "const c = document.querySelector('#loss-chart');"
        "return [c.dataset.points, c.dataset.lastLoss,"
        " document.querySelector('#train-step').textContent];"
    )
    step_text, total = state[2].split(" / ")
    points, last_loss, step = int(state[0]), float(state[1]), int(step_text.replace(",", ""))
    assert total == "240"  # the plan's steps
    assert points == step
    assert last_loss == pytest.approx(training.point(points)["loss"])
    assert re.fullmatch(r"\d\.\d\d / \d\.\d\d / \d\.\d\d", text(browser, "#train-acc"))
    assert text(browser, "#train-epoch") == "1 / 1"
    assert text(browser, "#train-wait") == "12.0%"
    assert text(browser, "#train-rate") != NO_VALUE
    assert text(browser, "#train-draft") == "/data/hsx/train-1/draft"
    assert not shown(browser, "#train-error-box")
    assert "240 steps of 8,192 tokens on cuda" in text(browser, "#train-plan")
    assert text(browser, "#train-warning") == "Warning: the data is small for this schedule"
    wait(browser, lambda d: loss_chart(d)[0] >= 100, what="a checkpoint's worth of steps")
    assert text(browser, "#train-checkpoint") == "step 100"
    # Each checkpoint is validated; draft/ holds the best one so far.
    first_val = f"{training.expected(100):.2f}"
    wait(browser, lambda d: text(d, "#train-val") == f"{first_val} at step 100",
         what="the first validation")
    assert text(browser, "#train-best") == f"step 100 ({first_val})"
    assert text(browser, "#train-eval") == NO_VALUE
    browser.execute_script("document.querySelector('#training').scrollIntoView()")
    save_screenshot(browser, "job-training.png")
    save_screenshot(browser, "job-training-full.png", full_page=True)

    wait(browser, lambda d: text(d, "#train-state") == "evaluating", timeout=40,
         what="the draft being measured")
    assert text(browser, "#train-eval") == "measuring…"
    wait(browser, lambda d: text(d, "#train-state") == "done", timeout=40, what="training done")
    assert loss_chart(browser)[0] == training.steps
    assert text(browser, "#train-step") == f"{training.steps} / {training.steps}"
    assert text(browser, "#train-rate") == NO_VALUE
    assert text(browser, "#train-best") == f"step 200 ({training.expected(200):.2f})"
    assert text(browser, "#train-eval") == "3.21 at k=3"
    assert text(browser, "#train-eval-pos") == "0.85 / 0.70 / 0.66"
    # A finished training is not asked about again.
    assert_no_more_train_requests(fake_api, "train-1")


def assert_no_more_train_requests(fake_api: FakeCoordinator, job_id: str) -> None:
    """Over a few polling periods, the page asks nothing more about the training."""
    asked = fake_api.train_requests[job_id]
    time.sleep(2.5 * TRAIN_POLL_S)
    assert fake_api.train_requests[job_id] == asked


def test_training_polls_stop_when_the_page_closes(
    browser: WebDriver, fake_api: FakeCoordinator
) -> None:
    now = time.time()
    fake_api.add_job(
        FakeJob(
            id="train-long",
            name="after-extraction",
            duration_s=30,
            created_at=now - 3600,
            training=FakeTraining(duration_s=600),
        )
    )
    open_dashboard(browser, fake_api.base_url, job_id="train-long")
    wait(browser, lambda d: text(d, "#train-state") == "running", what="training running")
    wait(browser, lambda d: fake_api.train_requests["train-long"] >= 2, what="polling")

    browser.execute_script("window.location.hash = '#/'")
    wait(browser, lambda d: shown(d, "#view-list"), what="the job list")
    time.sleep(0.5)  # a request already under way may still land
    assert_no_more_train_requests(fake_api, "train-long")


def test_job_without_training_has_no_training_section(
    browser: WebDriver, fake_api: FakeCoordinator
) -> None:
    job = fake_api.add_job(FakeJob(id="no-train", name="plain", duration_s=600))
    open_dashboard(browser, fake_api.base_url, job_id="no-train")
    wait(browser, lambda d: text(d, "#state") == "running", what="running state")
    wait(browser, lambda d: fake_api.train_requests["no-train"] >= 1, what="the training asked")
    time.sleep(0.5)
    assert not shown(browser, "#training")
    assert loss_chart(browser) == (0, None)

    # A training started later (hsx train) shows up without a reload.
    job.training = FakeTraining(duration_s=600)
    wait(
        browser,
        lambda d: shown(d, "#training"),
        timeout=TRAIN_ABSENT_POLL_S + 10,
        what="the training section",
    )
    wait(browser, lambda d: text(d, "#train-state") == "running", what="training running")


def test_failed_training_shows_its_error(browser: WebDriver, fake_api: FakeCoordinator) -> None:
    now = time.time()
    error = (
        "trainer died 3 times; last: torch.OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 2.00 GiB"
    )
    training = FakeTraining(
        duration_s=5, steps=40, final_state="failed", error=error, created_at=now - 60
    )
    fake_api.add_job(
        FakeJob(
            id="train-failed", name="oom", duration_s=30, created_at=now - 3600, training=training
        )
    )
    open_dashboard(browser, fake_api.base_url, job_id="train-failed")
    wait(browser, lambda d: text(d, "#train-state") == "failed", what="failed training")
    assert shown(browser, "#train-error-box")
    assert text(browser, "#train-error") == error
    assert loss_chart(browser)[0] == training.steps
    browser.execute_script("document.querySelector('#training').scrollIntoView()")
    save_screenshot(browser, "job-training-failed.png")


def test_a_waiting_job_and_training_say_what_they_wait_for(
    browser: WebDriver, fake_api: FakeCoordinator
) -> None:
    """A job whose engine waits for the GPU another job's trainer holds, and a training
    that waits for its extraction to end: the list, the page and the training card say so."""
    held = "waiting for 1 GPU of 1: held by the trainer of job sharegpt-a"
    plan = {"gpus": 1, "replicas": 1, "tensor_parallel_size": 1, "engine_gpus": 1,
            "train_gpus": 1, "eval_gpus": 1, "training": "after",
            "summary": "1 GPU: 1 engine on 1; when the extraction ends the engines yield their "
                       "GPUs and the trainer on 1 GPU trains; then vLLM measures the draft on "
                       "1 GPU"}
    after = "waiting for the extraction of job waits-b to end: its engines hold the GPUs"
    fake_api.add_job(FakeJob(
        id="waits-b", name="ultrachat-b", duration_s=600, waiting_for=held, plan=plan,
        training=FakeTraining(duration_s=600, starting_s=600, waiting_for=after)))
    open_dashboard(browser, fake_api.base_url)
    wait(browser, lambda d: "waiting" in text(d, "tr[data-job-id='waits-b']"),
         what="the list marks the waiting job")

    open_dashboard(browser, fake_api.base_url, job_id="waits-b")
    wait(browser, lambda d: shown(d, "#waiting"), what="the waiting banner")
    assert text(browser, "#waiting") == "Waiting for 1 GPU of 1: held by the trainer of job " \
        "sharegpt-a"
    assert text(browser, "#job-plan") == f"Plan: {plan['summary']}"
    wait(browser, lambda d: shown(d, "#train-waiting"), what="the training's wait")
    assert text(browser, "#train-waiting").startswith(
        "Waiting for the extraction of job waits-b to end")
    path = save_screenshot(browser, "job-waiting.png", full_page=True)
    assert path.stat().st_size > 0
