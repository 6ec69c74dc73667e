"""One GPU shared by a job's engine, its trainer and its evaluation, and by the next job,
on a Ray cluster that declares one GPU (logical: vLLM's CPU build computes, Ray
accounts the GPU exactly as on a one-GPU node). The cluster is a `ray start --head`
already running, as on GPU nodes; the coordinator joins it (HSX_RAY_ADDRESS).

- jobs that can never fit (2 engines, 2 training workers on 1 GPU) are refused at submit;
- job A (with `train:`) extracts on the GPU; its plan says the trainer trains after the
  extraction, and its training says it waits for that; then the engine yields the GPU,
  the trainer trains, and vLLM measures the draft on the GPU (draft/eval.json);
- job B, submitted behind A, waits its turn, then waits for the GPU naming who holds it
  (A's trainer or A's evaluation), in its status and in /metrics, then runs;
- nothing waits forever: every job and training ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx.client import JobRefusedError, NotFoundError
from hsx.output.layout import DRAFT_EVAL
from hsx.wire import JobState, TrainState
from hsx_workers.tiny_models import ChatDataset

from .helpers import kill_tree
from .test_service import TOKEN, Coordinator, _free_port, start_coordinator

pytestmark = pytest.mark.integration

TRAIN = {"steps": 12, "checkpoint_every": 6, "eval_prompts": 4, "eval_max_tokens": 16}
ONLINE = {"online": True, "steps": 12, "checkpoint_every": 6, "eval_prompts": 0}


@dataclass
class HeadCluster:
    address: str
    env: dict[str, str]  # what a process of this machine needs to find it by itself


@pytest.fixture(scope="module")
def one_gpu_cluster() -> Iterator[HeadCluster]:
    """`ray start --head` declaring 1 GPU, in a temporary folder of its own (so no other
    Ray client of this machine finds it), stopped with its whole process tree."""
    temp = tempfile.mkdtemp(prefix="hsxray", dir="/tmp")  # short: Ray's socket paths
    port = _free_port()
    # Without a token: Ray 2.60 turns token authentication on for a `ray start` when
    # ~/.ray/auth_token exists (an earlier local ray.init() writes one), and a client
    # must then be told (RAY_AUTH_MODE=token) to send it.
    env = {**os.environ, "RAY_TMPDIR": temp, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", f"--port={port}", "--num-gpus=1", "--num-cpus=8",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"127.0.0.1:{port}"
    # Up once it has recorded itself where a process of this machine looks for it (a
    # driver started before that would start a private Ray instead of joining).
    recorded = Path(temp) / "ray" / "ray_current_cluster"
    deadline = time.monotonic() + 180
    while not recorded.exists() and head.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert recorded.exists(), f"ray start --head did not come up (exit {head.poll()})"
    try:
        yield HeadCluster(address, env)
    finally:
        kill_tree(head.pid)
        head.wait(timeout=60)


@pytest.fixture(scope="module")
def coordinator(one_gpu_cluster: HeadCluster,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    ledger = tmp_path_factory.mktemp("gpu-share-ledger") / "ledger.sqlite"
    # The same authentication mode as the cluster's: a ray.init() earlier in this
    # session set RAY_AUTH_MODE=token in this process, which the server would inherit.
    server = start_coordinator(ledger, [tmp_path_factory.getbasetemp()],
                               ledger.parent / "serve.log",
                               env={"HSX_RAY_ADDRESS": one_gpu_cluster.address,
                                    "RAY_AUTH_MODE": "disabled"})
    yield server
    server.kill()


def _spec(model: Path, dataset: ChatDataset, output: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "dataset": str(dataset.path), "output": str(output),
            "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 4096, **extra}


def test_hsx_extract_joins_the_cluster_a_ray_start_left_here_and_trains_online_on_it(
    one_gpu_cluster: HeadCluster, tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path
) -> None:
    """With a `ray start --head` cluster on the machine and no address anywhere, `hsx
    extract` joins it (and says so) instead of dying on the sizing ray.init() refuses
    there. Its job trains online: with no GPU to spare, the plan it prints gives the
    trainer 0.3 of the engine's GPU and vLLM 0.65 of its memory; the draft trains on
    what the engine captures, and no shard is stored."""
    import yaml

    job = tmp_path / "job.yaml"
    out = tmp_path / "out"
    job.write_text(yaml.safe_dump(_spec(tiny_llama, chat_dataset, out, train=ONLINE)))
    env = {k: v for k, v in one_gpu_cluster.env.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "hsx.cli", "extract", str(job),
                           "--no-progress"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "joined the Ray cluster already running on this machine (CPUs: 8, GPUs: 1)" in text
    assert ("plan: 1 GPU: 1 engine on 1; the online trainer shares a GPU with them: it "
            "takes 0.3 of it (and of its memory), vLLM 0.65 of each GPU's memory") in text
    assert f"trained {ONLINE['steps']} steps" in text, text[-3000:]
    complete = json.loads((out / "complete.json").read_text())
    assert complete["shards"] == 0 and complete["online"]["trainer"] == "done", complete


def test_what_one_gpu_can_never_run_is_refused_at_submit(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset, tmp_path: Path
) -> None:
    client = coordinator.client()
    with pytest.raises(JobRefusedError) as refused:
        client.submit(_spec(tiny_llama, chat_dataset, tmp_path / "a", replicas=2))
    assert refused.value.field == "spec.replicas"
    assert "need 2 GPUs, but the Ray cluster has 1" in str(refused.value)
    with pytest.raises(JobRefusedError) as refused:
        client.submit(_spec(tiny_llama, chat_dataset, tmp_path / "b", train={"workers": 2}))
    assert refused.value.field == "spec.train.workers"
    assert "2 training workers need a GPU each, but the Ray cluster has 1" in str(refused.value)
    assert client.list() == []  # nothing was queued


def test_one_gpu_extracts_trains_measures_then_serves_the_next_job(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    client = coordinator.client()
    base = tmp_path_factory.mktemp("gpu-share")
    a = client.submit(_spec(tiny_llama, chat_dataset, base / "a", train=TRAIN), job_id="a")
    b = client.submit(_spec(tiny_llama, chat_dataset, base / "b"), job_id="b")
    seen_a: set[str] = set()
    seen_b: dict[str, float] = {}  # what B waited for -> when first seen
    train_waits: set[str] = set()
    metrics_while_b_waits = ""
    plan = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        job_a, job_b = client.get(a.id), client.get(b.id)
        plan = job_a.plan or plan
        if job_a.waiting_for:
            seen_a.add(job_a.waiting_for)
        if job_b.waiting_for and job_b.waiting_for not in seen_b:
            seen_b[job_b.waiting_for] = time.time()
            if "held by" in job_b.waiting_for and not metrics_while_b_waits:
                metrics_while_b_waits = httpx.get(
                    f"{coordinator.url}/metrics",
                    headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).text
        try:
            training = client.train_status(a.id)
            if training.waiting_for:
                train_waits.add(training.waiting_for)
        except NotFoundError:
            training = None
        if job_b.state.finished and training is not None and training.state.finished:
            break
        time.sleep(0.2)
    job_a, job_b = client.get(a.id), client.get(b.id)
    training = client.train_status(a.id)
    assert job_a.state == JobState.succeeded, job_a.last_error
    assert job_b.state == JobState.succeeded, job_b.last_error
    assert training.state == TrainState.done, training.error

    # A's plan: one engine, then the trainer on the same GPU, then the evaluation.
    assert plan is not None and (plan.gpus, plan.replicas, plan.training) == (1, 1, "after")
    assert plan.eval_gpus == 1 and "engines yield their GPUs" in plan.summary
    assert any(w.startswith(f"waiting for the extraction of job {a.id} to end")
               for w in train_waits), train_waits
    # The trainer started only once the extraction had ended.
    assert training.first_step_at is not None and job_a.finished_at is not None
    assert training.first_step_at >= job_a.finished_at
    # vLLM measured the draft (on the one GPU, as the job's engine ran).
    evaluation = json.loads((base / "a" / DRAFT_EVAL).read_text())
    assert evaluation.get("error") is None and evaluation["drafts"] > 0, evaluation

    # B waited its turn, then for the GPU, naming who held it; it ran after A's evaluation.
    assert any(w.startswith("its turn") for w in seen_b), seen_b
    holders = [w for w in seen_b if w.startswith("waiting for 1 GPU of 1: held by")]
    assert holders, seen_b
    assert any(f"the trainer of job {a.id}" in w or f"the evaluation of job {a.id}" in w
               for w in holders), holders
    assert job_b.started_at is not None and job_b.finished_at is not None
    assert job_b.finished_at >= evaluation["time"]
    assert f'hsx_job_waiting{{job="{b.id}"}} 1.0' in metrics_while_b_waits
    assert f'hsx_gpus_waited{{job="{b.id}",role="engine-0"}} 1.0' in metrics_while_b_waits
    assert not seen_a, seen_a  # A itself never waited: its engine came first


def test_one_gpu_online_job_gives_its_trainer_a_part_of_the_engines_gpu(
    coordinator: Coordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An online job on the one GPU: the engine and the trainer hold it together (0.7 and
    0.3 in the coordinator's books and in Ray's), the trainer never waits for the
    extraction to end, and the job stores no shard."""
    client = coordinator.client()
    base = tmp_path_factory.mktemp("gpu-share-online")
    job = client.submit(_spec(tiny_llama, chat_dataset, base / "o", train=ONLINE),
                        job_id="online")
    both_held = ""
    deadline = time.monotonic() + 600
    status = training = None
    while time.monotonic() < deadline:
        status = client.get(job.id)
        try:
            training = client.train_status(job.id)
        except NotFoundError:
            training = None
        if not both_held and training is not None and training.state == TrainState.running:
            scrape = httpx.get(f"{coordinator.url}/metrics",
                               headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).text
            if f'hsx_gpus_held{{job="{job.id}",role="engine-0"}} 0.7' in scrape:
                both_held = scrape
        if status.state.finished and training is not None and training.state.finished:
            break
        time.sleep(0.2)
    assert status is not None and training is not None
    assert status.state == JobState.succeeded, status.last_error
    assert training.state == TrainState.done, training.error
    assert training.step == ONLINE["steps"]
    plan = status.plan
    assert plan is not None and (plan.training, plan.train_share, plan.engine_memory) == \
        ("shared", 0.3, 0.65), plan
    assert "the online trainer shares a GPU with them" in plan.summary
    assert both_held, "the engine and the trainer never held the GPU at the same time"
    assert f'hsx_gpus_held{{job="{job.id}",role="trainer"}} 0.3' in both_held
    complete = json.loads((base / "o" / "complete.json").read_text())
    assert complete["shards"] == 0 and complete["online"]["trainer"] == "done", complete
