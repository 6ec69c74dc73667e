"""The status board, and the scheduler's bookkeeping around it (no Ray, no engines).

The board: posts, versions, one wake per post for any number of followers, a slow
follower skipping to the newest status. The scheduler: a real `Scheduler` on a real
ledger runs a real prepared job (tiny model, real ingestion) whose dispatch is a
stand-in for `runner.execute` calling the same hooks; what a job page and /metrics
show during and after the run, and after a coordinator restart, is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.progress import JobProgress
from hsx.spec import JobSpec, TrainSpec
from hsx.wire import JobList, JobState, JobStatus, ResourcePlan, Throughput, TrainState
from hsx_service import runner as runner_module
from hsx_service import scheduler as scheduler_module
from hsx_service import statuses as statuses_module
from hsx_service.board import StatusBoard
from hsx_service.config import Settings
from hsx_service.dispatch import DispatchResult
from hsx_service.main import create_app
from hsx_service.metrics import METRICS, exposed_names
from hsx_service.placement import ENGINE, TRAINER, Holder
from hsx_service.scheduler import Scheduler, thin_curve
from hsx_workers.tiny_models import ChatDataset
from hsx_workers.worker import UnitReport
from tests.unit.test_api import local_client
from tests.unit.test_deploy import board_metric_names


def _status(job_id: str, **fields: Any) -> JobStatus:
    return JobStatus.model_validate(
        {"id": job_id, "state": JobState.queued, "output": "/o", "created_at": 1.0, **fields})


# --------------------------------------------------------------------------- the board


def test_posts_versions_and_encodings() -> None:
    board = StatusBoard()
    first = board.post(_status("a", updated_at=1.0))
    assert first.version == 1
    assert JobStatus.model_validate_json(first.json) == first.status
    assert first.event.startswith(b"event: status\ndata: {") and first.event.endswith(b"\n\n")
    # The same content at a later time: a GET sees the new time, followers no news.
    again = board.post(_status("a", updated_at=2.0))
    assert again.version == 1
    assert board.get("a") is again
    moved = board.post(_status("a", state=JobState.running, updated_at=3.0))
    assert moved.version == 2
    board.post(_status("b"))
    assert [p.status.id for p in board.list()] == ["a", "b"]
    assert [p.status.id for p in board.list(JobState.queued)] == ["b"]
    listed = JobList.model_validate_json(board.list_json())
    assert [j.id for j in listed.jobs] == ["a", "b"]
    assert JobList.model_validate_json(board.list_json(JobState.failed)).jobs == []
    assert board.get("nope") is None


def test_one_post_wakes_every_follower() -> None:
    board = StatusBoard()
    board.post(_status("a"))

    async def follow_all() -> list[int | None]:
        followers = [asyncio.create_task(board.next("a", 1, timeout=10)) for _ in range(200)]
        while board.following("a") < 200:
            await asyncio.sleep(0.001)
        # Posted from another thread, as the scheduler does.
        poster = threading.Thread(
            target=board.post, args=(_status("a", state=JobState.running),))
        poster.start()
        posts = await asyncio.gather(*followers)
        poster.join()
        return [p.version if p else None for p in posts]

    assert asyncio.run(follow_all()) == [2] * 200
    assert board.following("a") == 0


def test_a_slow_follower_gets_the_newest_status_and_an_idle_one_times_out() -> None:
    board = StatusBoard()
    board.post(_status("a"))
    for samples in (1, 2, 3):
        board.post(_status("a", state=JobState.running, samples_done=samples))

    async def read() -> tuple[Any, Any]:
        newest = await board.next("a", 1, timeout=1)
        idle = await board.next("a", newest.version if newest else 0, timeout=0.05)
        return newest, idle

    newest, idle = asyncio.run(read())
    assert newest is not None and newest.version == 4
    assert newest.status.samples_done == 3
    assert idle is None
    assert board.following("a") == 0


def test_thin_curve_keeps_the_ends_and_the_mean() -> None:
    points = [(float(i), float(i % 2) * 100, i * 10) for i in range(1000)]
    thinned = thin_curve(points, 100)
    assert len(thinned) == 100
    assert thinned[-1][0] == 999.0 and thinned[-1][2] == 9990
    assert all(p[1] == 50.0 for p in thinned)
    assert thin_curve(points[:5], 100) == points[:5]


# --------------------------------------------------------------------------- the scheduler


def _report(unit: int, tokens: int, worker: str, **extra: Any) -> UnitReport:
    return UnitReport(unit=unit, won=True, samples=2, tokens=tokens, bytes=tokens * 8,
                      seconds=0.7, worker=worker, **extra)


def _scrape(scheduler: Scheduler) -> str:
    """/metrics of an app around `scheduler` (its lifespan, which would start Ray, not run)."""
    client = local_client(create_app(Settings(), scheduler))
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.fixture
def prepared(tmp_path: Path, tiny_llama: Path, chat_dataset: ChatDataset) -> JobSpec:
    return JobSpec(name="bookkeeping", model=str(tiny_llama), dataset=str(chat_dataset.path),
                   output=str(tmp_path / "out"), layers=[1, 2, 3, 4], max_seq_len=256,
                   unit_tokens=2048)


def test_a_job_page_remembers_and_metrics_follow_the_run(
    tmp_path: Path, prepared: JobSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(statuses_module, "CURVE_INTERVAL_S", 0.05)
    monkeypatch.setattr(scheduler_module, "plan_for_cluster", lambda spec: ResourcePlan())
    ledger_path = tmp_path / "ledger.sqlite"
    scheduler = Scheduler(Settings(ledger_path=ledger_path))
    scheduler._ready = True  # Ray is never started here: start() is not called
    seen: dict[str, Any] = {}

    def dispatch(job: Any, pool: Any, hooks: Any, max_attempts: int,
                 **_: Any) -> DispatchResult:
        """What runner.execute reports for a run where two engines commit every unit."""
        progress = job.output.totals().progress()
        progress.rate_since = time.time()
        for i, unit in enumerate(job.pending):
            worker = f"engine-{i % 2}"
            progress.workers = {"engine-0": "busy", "engine-1": "busy"}
            progress.worker_units = {worker: unit.unit}
            progress.tokens_done += unit.tokens
            progress.rate_tokens += unit.tokens
            progress.samples_done += unit.samples
            progress.units_done += 1
            progress.shards += 1
            progress.bytes += unit.tokens * 8
            time.sleep(0.06)
            hooks.on_progress(JobProgress(**progress.__dict__))
            hooks.on_unit_done(_report(unit.unit, unit.tokens, worker))
            if i == 0:
                hooks.on_restart("engine-1")
                hooks.on_unit_error(unit, 1, "engine died", False)
                seen["running"] = scheduler.get(seen_id[0])
                seen["metrics"] = _scrape(scheduler)
        return DispatchResult()

    monkeypatch.setattr(runner_module, "execute", dispatch)
    job, created = scheduler.submit(prepared, "remember-me")
    assert created and job.state == JobState.queued
    seen_id = [job.id]
    row = scheduler.ledger.next_queued()
    assert row is not None
    scheduler._run(row)

    final = scheduler.get(job.id)
    assert final.state == JobState.succeeded, final.last_error
    running = seen["running"]
    assert running.state == JobState.running and running.restarts == 1
    assert running.last_error == "unit 0 attempt 1: engine died"
    assert final.tokens_done == final.tokens_total > 0
    assert final.tokens_per_s_avg > 0 and final.tokens_per_s == 0
    assert {w.name for w in final.worker_totals} == {"engine-0", "engine-1"}
    assert sum(w.tokens for w in final.worker_totals) == final.tokens_total
    assert sum(w.units for w in final.worker_totals) == final.units_total
    curve = scheduler.throughput(job.id)
    assert len(curve.points) >= 2
    assert curve.points[-1].tokens_done == final.tokens_done
    assert all(p.tokens_per_s >= 0 for p in curve.points)
    assert curve.tokens_per_s_avg == final.tokens_per_s_avg

    # During the run: every job metric a dashboard needs, the stuck-job signal included.
    names = _sample_names(seen["metrics"])
    for name in ("hsx_job_seconds_since_last_commit", "hsx_job_engines",
                 "hsx_job_tokens_per_second", "hsx_unit_seconds_bucket", "hsx_queue_depth",
                 "hsx_job_restarts_total", "hsx_job_unit_failures_total"):
        assert name in names, name
    assert f'hsx_job_engines{{job="{job.id}",state="busy"}} 2.0' in seen["metrics"]
    assert f'hsx_job_restarts_total{{job="{job.id}"}} 1.0' in seen["metrics"]

    # Every name the Grafana board queries is in this real coordinator's /metrics: the
    # job's while it ran, the training's once the job has one.
    scheduler.ledger.put_training(job.id, TrainSpec())
    draft = Path(prepared.output) / "draft"
    draft.mkdir()
    (draft / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    # And the GPU books, while a trainer holds the cluster's one GPU and an engine waits.
    scheduler.arbiter.total = lambda: 1
    assert scheduler.arbiter.acquire(Holder(job.id, "trainer", 1, (0.0, TRAINER)))
    stop = threading.Event()
    waiter = threading.Thread(target=scheduler.arbiter.acquire, daemon=True, args=(
        Holder("next", "engine-0", 1, (1.0, ENGINE)),), kwargs={"cancelled": stop.is_set})
    waiter.start()
    while not scheduler.arbiter.waiters():
        time.sleep(0.01)
    text = _scrape(scheduler)
    stop.set()
    waiter.join(5)
    after = _sample_names(text)
    assert {"hsx_train_loss", "hsx_train_step", "hsx_train_state"} <= after
    assert f'hsx_gpus_held{{job="{job.id}",role="trainer"}} 1.0' in text
    assert 'hsx_gpus_waited{job="next",role="engine-0"} 1.0' in text
    missing = board_metric_names() - names - after
    assert not missing, f"the Grafana board queries what /metrics lacks: {missing}"

    # A coordinator started again on the same ledger (and the output gone: nothing is
    # read back from it) shows the same finished job.
    scheduler.ledger.close()
    shutil.rmtree(prepared.output)
    again = Scheduler(Settings(ledger_path=ledger_path))
    restored = again.get(job.id)
    for name in ("tokens_done", "tokens_total", "samples_done", "bytes", "shards",
                 "units_done", "tokens_per_s_avg", "worker_totals", "restarts"):
        assert getattr(restored, name) == getattr(final, name), name
    assert again.throughput(job.id) == curve
    again.ledger.close()


def test_ingestion_shows_beside_extraction_and_a_cancel_stops_it(
    tmp_path: Path, prepared: JobSpec, chat_dataset: ChatDataset,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a job's dataset is tokenized its status says so (rows tokenized of the
    rows expected); after, the rows stay, beside the units; a cancel during ingestion
    ends the job cancelled, with no inputs table left behind."""
    monkeypatch.setattr(scheduler_module, "plan_for_cluster", lambda spec: ResourcePlan())
    monkeypatch.setattr(runner_module, "execute", lambda *a, **k: DispatchResult())
    monkeypatch.setattr(statuses_module, "PUBLISH_INTERVAL_S", 0.0)
    scheduler = Scheduler(Settings(ledger_path=tmp_path / "ledger.sqlite"))
    scheduler._ready = True
    seen: list[JobStatus] = []
    cancel_at_first = [False]
    ingesting = scheduler.statuses.ingesting

    def observe(job_id: str, rows: int, rows_total: int) -> None:
        ingesting(job_id, rows, rows_total)
        seen.append(scheduler.get(job_id))
        if cancel_at_first[0]:
            scheduler.cancel(job_id)

    monkeypatch.setattr(scheduler.statuses, "ingesting", observe)
    for name, cancel in (("watched", False), ("cancelled", True)):
        seen.clear()
        cancel_at_first[0] = cancel
        spec = prepared.model_copy(update={"output": str(tmp_path / name)})
        job, _ = scheduler.submit(spec, name)
        row = scheduler.ledger.next_queued()
        assert row is not None
        scheduler._run(row)
        final = scheduler.get(job.id)
        if cancel:
            assert final.state == JobState.cancelled, final.last_error
            assert len(seen) == 1
            # Nothing published: no part of the inputs, no manifest.
            assert not any((tmp_path / name / folder).exists()
                           for folder in ("inputs", "inputs.arrow", "manifest.json"))
            continue
        assert final.state == JobState.succeeded, final.last_error
        assert seen and all(s.ingesting and s.state == JobState.running for s in seen)
        assert seen[-1].rows_tokenized == seen[-1].rows_total == chat_dataset.num_rows
        assert not final.ingesting and final.units_total > 0
        assert final.rows_tokenized == final.rows_total == chat_dataset.num_rows
    scheduler.ledger.close()


def test_a_rerun_of_a_finished_job_says_it_was_already_complete(
    tmp_path: Path, prepared: JobSpec, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job at an output an earlier run completed ends at once, succeeded, with nothing
    extracted: its status says `already_complete` (every sample found committed) for the
    CLI and the dashboard to say so, instead of a rate and an elapsed time of 0; the
    first run does not, and a coordinator started again on the ledger says the same."""
    import numpy as np

    from hsx.cli.jobs import _cmd_status, _report_final

    monkeypatch.setattr(scheduler_module, "plan_for_cluster", lambda spec: ResourcePlan())
    ledger_path = tmp_path / "ledger.sqlite"
    scheduler = Scheduler(Settings(ledger_path=ledger_path))
    scheduler._ready = True

    def commit_every_unit(job: Any, pool: Any, hooks: Any, max_attempts: int,
                          **_: Any) -> DispatchResult:
        """What runner.execute leaves in the output: a committed shard per unit."""
        for unit in job.pending:
            table = job.output.input_rows(unit.row_start, unit.row_end)
            with job.output.shard_writer(unit.unit, layers=job.layers,
                                         hidden_size=job.manifest.hidden_size,
                                         storage_dtype=job.manifest.storage_dtype) as w:
                for index, ids, mask in zip(table.column("sample_index").to_pylist(),
                                            table.column("input_ids").to_pylist(),
                                            table.column("loss_mask").to_pylist(),
                                            strict=True):
                    w.add(index, ids, mask, np.zeros(
                        (len(ids), len(job.layers), job.manifest.hidden_size), np.float32))
                w.commit()
        hooks.on_progress(job.totals().progress())
        return DispatchResult()

    def no_engine(*_: Any, **__: Any) -> DispatchResult:
        raise AssertionError("a rerun of a finished job dispatched units")

    def run(job_id: str) -> JobStatus:
        scheduler.submit(prepared, job_id)
        row = scheduler.ledger.next_queued()
        assert row is not None and row.id == job_id
        scheduler._run(row)
        return scheduler.get(job_id)

    monkeypatch.setattr(runner_module, "execute", commit_every_unit)
    first = run("first")
    assert first.state == JobState.succeeded, first.last_error
    assert first.samples_done == first.samples_total > 0
    assert first.samples_at_start == 0 and not first.already_complete

    monkeypatch.setattr(runner_module, "execute", no_engine)
    rerun = run("rerun")
    assert rerun.state == JobState.succeeded, rerun.last_error
    assert rerun.already_complete and rerun.tokens_per_s_avg == 0
    assert rerun.samples_at_start == rerun.samples_done == first.samples_done
    said = JobStatus.model_validate_json(rerun.model_dump_json())  # as the client reads it
    assert said.already_complete and "already_complete" in rerun.model_dump(mode="json")

    # The CLI: `hsx submit --wait` and `hsx status` say it, with the count.
    assert _report_final(said) == 0
    message = f"already complete: {first.samples_done:,} samples committed by an earlier run"
    assert message in " ".join(capsys.readouterr().err.split())
    monkeypatch.setattr("hsx.cli.jobs.client_for", lambda args: _OneJob(said))
    assert _cmd_status(argparse.Namespace(job="rerun", json=False)) == 0
    assert message in " ".join(capsys.readouterr().out.split())

    scheduler.ledger.close()
    again = Scheduler(Settings(ledger_path=ledger_path))
    assert again.get("rerun").already_complete and not again.get("first").already_complete
    again.ledger.close()


class _OneJob:
    """A client whose server knows one job."""

    def __init__(self, status: JobStatus) -> None:
        self.status = status

    def __enter__(self) -> _OneJob:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def get(self, job_id: str) -> JobStatus:
        return self.status


def test_metrics_name_every_family_and_only_recent_jobs(tmp_path: Path) -> None:
    """/metrics of a real scheduler: the train families from a training in the ledger,
    a job that ended long ago no longer exported."""
    scheduler = Scheduler(Settings(ledger_path=tmp_path / "ledger.sqlite"))
    output = tmp_path / "out"
    (output / "draft").mkdir(parents=True)
    (output / "draft" / "metrics.jsonl").write_text(
        json.dumps({"step": 5, "epoch": 0, "loss": 2.5, "acc": [0.1], "time": 1.0}) + "\n")
    spec = JobSpec(model="/m", dataset="/d.jsonl", output=str(output))
    for job_id in ("old", "training"):
        scheduler.ledger.insert_job(job_id, spec, str(output))
        scheduler.ledger.set_state(job_id, JobState.succeeded)
        scheduler.statuses.changed(job_id, scheduler.ledger.job(job_id))
    scheduler.ledger.put_training("training", TrainSpec())
    scheduler.ledger.set_training("training", TrainState.running)
    stale = scheduler.get("old").model_copy(update={"finished_at": time.time() - 7200})
    scheduler.board.post(stale)

    text = _scrape(scheduler)
    assert 'hsx_train_loss{job="training"} 2.5' in text
    assert 'hsx_train_step{job="training"} 5.0' in text
    assert 'hsx_train_state{job="training",state="running"} 1.0' in text
    assert 'job="old"' not in text
    assert 'hsx_jobs{state="succeeded"} 2.0' in text
    assert "hsx_ready 0.0" in text
    # Every family declared in METRICS is exposed (the histogram once observed).
    names = _sample_names(text)
    missing = exposed_names() - names - {"hsx_unit_seconds_bucket", "hsx_unit_seconds_sum",
                                         "hsx_unit_seconds_count",
                                         "hsx_job_seconds_since_last_commit",
                                         "hsx_job_engines",
                                         # the GPU books: while something holds or waits
                                         "hsx_gpus_held", "hsx_gpus_waited"}
    assert not missing, missing
    assert names <= exposed_names(), names - exposed_names()  # nothing undeclared
    assert {kind for kind, _ in METRICS.values()} == {"gauge", "counter", "histogram"}
    scheduler.ledger.close()


def test_throughput_route(tmp_path: Path) -> None:
    from tests.unit.test_api import FakeScheduler, job_fields

    fake = FakeScheduler()
    with local_client(create_app(Settings(), fake)) as client:
        client.post("/v1/jobs", json={"id": "a", "spec": job_fields(tmp_path)})
        curve = Throughput.model_validate(client.get("/v1/jobs/a/throughput").json())
        assert [p.tokens_per_s for p in curve.points] == [5001.0, 5002.0, 5003.0]
        assert client.get("/v1/jobs/nope/throughput").status_code == 404
