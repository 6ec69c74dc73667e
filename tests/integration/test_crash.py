"""Crash safety through the real CLI: `hsx extract` in a subprocess, processes killed -9.

- A worker killed in the middle of a shard: nothing partial becomes visible, Ray
  restarts the worker, the unit is retried, the job completes, the restart is counted.
- The whole driver killed mid-job: a rerun resumes and completes; every checksum
  verifies; the content equals an uninterrupted run's; no sample is missing or doubled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hsx.dataset import HiddenStatesDataset
from hsx.output.layout import COMMITS_DIR, SHARDS_DIR, TMP_DIR
from hsx_workers.tiny_models import ChatDataset

from .helpers import by_sample, kill_tree, relative_error, size_of, worker_processes

pytestmark = pytest.mark.integration

HSX = [sys.executable, "-m", "hsx.cli"]


def _job_file(tmp: Path, tiny_llama: Path, dataset: ChatDataset, output: Path) -> Path:
    job = tmp / f"{output.name}.yaml"
    job.write_text(yaml.safe_dump({
        "model": str(tiny_llama),
        "dataset": str(dataset.path),
        "output": str(output),
        "layers": [1, 2, 3, 4],
        "max_seq_len": 256,
        "unit_tokens": 1024,  # many small units, so a kill lands mid-job
        # Another test's Ray may run on this machine (pytest-xdist); never join it.
        "ray_address": "local",
    }))
    return job


def _start(job: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("RAY_ADDRESS", None)
    # The product's default topology (tests/conftest.py runs engine cores in-process):
    # the killed worker's engine-core process goes with it.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return subprocess.Popen(
        [*HSX, "extract", str(job), "--no-progress", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )


def _wait_for_partial_shard(output: Path, proc: subprocess.Popen[str], min_commits: int) -> None:
    """Until a unit is mid-write (its staging file holds data) after `min_commits` commits."""
    deadline = time.monotonic() + 300
    verified = -1
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hsx extract ended early: {proc.communicate()}")
        commits = list((output / COMMITS_DIR).glob("*.json"))
        partial = [p for p in (output / TMP_DIR).glob("shards--*.part") if size_of(p) > 65536]
        if len(commits) >= min_commits and partial:
            return
        if len(commits) != verified:
            # Shards become visible with their commit records: check each new set once
            # (re-reading every shard every 5 ms would take the CPU the job runs on).
            _assert_only_complete_shards_visible(output)
            verified = len(commits)
        time.sleep(0.005)
    raise AssertionError("no unit was ever seen mid-write")


def _assert_only_complete_shards_visible(output: Path) -> None:
    if not (output / "manifest.json").exists():
        return
    ds = HiddenStatesDataset(output)
    ds.verify()  # every shard a reader can see is whole and matches its checksum


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    kill_tree(proc.pid)
    proc.wait(timeout=30)


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise
    assert proc.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def killed_worker_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, chat_dataset: ChatDataset
) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("crash")
    output = tmp / "killed-worker"
    proc = _start(_job_file(tmp, tiny_llama, chat_dataset, output))
    try:
        _wait_for_partial_shard(output, proc, min_commits=2)
        workers = worker_processes(proc.pid)
        assert len(workers) == 1, f"one ExtractionWorker under hsx extract, found {workers}"
        for worker in workers:
            worker.send_signal(signal.SIGKILL)
        _assert_only_complete_shards_visible(output)
    except BaseException:
        _kill_tree(proc)
        raise
    return output, _finish(proc)


def test_killed_worker_leaves_nothing_partial_and_the_job_completes(
    killed_worker_run: tuple[Path, dict[str, Any]], chat_dataset: ChatDataset
) -> None:
    output, summary = killed_worker_run
    # One worker killed once is one restart, however long Ray takes to bring it back.
    assert summary["restarts"] == 1
    ds = HiddenStatesDataset(output)
    assert ds.complete
    assert ds.verify() == len(ds.records)
    assert sorted(by_sample(output)) == chat_dataset.good_indices
    # The killed attempt's leftovers never became shards.
    named = {Path(r.shard).name for r in ds.records}
    assert {p.name for p in (output / SHARDS_DIR).iterdir()} == named


@pytest.mark.slow  # make test-slow
def test_killed_driver_then_rerun_completes_with_identical_content(
    tmp_path: Path,
    tiny_llama: Path,
    chat_dataset: ChatDataset,
    killed_worker_run: tuple[Path, dict[str, Any]],
) -> None:
    output = tmp_path / "killed-driver"
    job = _job_file(tmp_path, tiny_llama, chat_dataset, output)
    proc = _start(job)
    _wait_for_partial_shard(output, proc, min_commits=1)
    _kill_tree(proc)
    committed_before = len(list((output / COMMITS_DIR).glob("*.json")))
    assert not (output / "complete.json").exists()
    _assert_only_complete_shards_visible(output)

    summary = _finish(_start(job))
    assert not summary["nothing_to_do"]
    ds = HiddenStatesDataset(output)
    assert ds.complete and len(ds.records) > committed_before
    assert ds.verify() == len(ds.records)

    resumed = by_sample(output)
    reference = by_sample(killed_worker_run[0])
    assert sorted(resumed) == sorted(reference) == chat_dataset.good_indices
    for index, sample in resumed.items():
        ref = reference[index]
        assert torch.equal(sample["input_ids"], ref["input_ids"])
        assert torch.equal(sample["loss_mask"], ref["loss_mask"])
        assert relative_error(sample["hidden_states"], ref["hidden_states"]).max() < 1e-2

    # And once complete, running it again changes nothing.
    again = _finish(_start(job))
    assert again["nothing_to_do"]
