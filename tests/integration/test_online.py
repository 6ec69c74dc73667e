"""An online job across nodes through the coordinator: `train: {online: true, workers: 2,
place: apart}` on the learnable target, on a local Ray cluster of a head and three
worker nodes (tests/cluster.py, a process of its own). The engine runs on one node and
the two trainer workers (Ray Train, DDP) on the other two; the engines capture the data
again for every epoch and hand each unit to the worker whose unit it is through Ray's
object store, and no shard is ever stored. Meanwhile a trainer worker's node and the
engine's node are killed together (every process of each, after the first checkpoint:
mid-epoch), then the coordinator itself (kill -9 and a new one on the same ledger);
each lost node is replaced by a new one, as a cluster's autoscaler would. The draft the
job ends with has trained on every sample exactly once per epoch along its line of checkpoints
(draft/visits.jsonl: every worker's steps), and vLLM accepts it as often as the draft of
an offline job with the same data, steps, tokens per step and seed (`offline_run`,
whose own checks are test_train_job.py's; the two modules share the coordinator of the
learnable target: tests/integration/learnable_jobs.py).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hsx.draft import read_visits
from hsx.output import Output
from hsx.wire import JobState, JobStatus, TrainState, TrainStatus

from .helpers import Learnable
from .learnable_jobs import JOB, STEPS, TRAIN, OfflineRun, Server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
# Each worker's step is half the offline job's 1,024 tokens: the same tokens a step.
ONLINE = {**TRAIN, "online": True, "workers": WORKERS, "batch_tokens": 512,
          "place": "apart",
          # About one of its ~8k-token units' states (4 layers x 256 x bf16).
          "buffer_bytes": 8192 * 4 * 256 * 2}


class LocalCluster:
    """tests/cluster.py in its own process: a head and worker nodes, killed on demand."""

    def __init__(self, work: Path) -> None:
        # Short: Ray's socket paths live under it.
        self.tmp = tempfile.mkdtemp(prefix="hsxray", dir="/tmp")
        self.state = work / "cluster.json"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster", str(self.state)], cwd=ROOT,
            env={**env, "RAY_TMPDIR": self.tmp}, stdin=subprocess.PIPE, text=True,
            stdout=(work / "cluster.log").open("a"), stderr=subprocess.STDOUT)
        self.names: dict[str, str] = {}
        self._read(lambda s: bool(s.get("address")))

    def _read(self, until: Any) -> dict[str, Any]:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the cluster exited ({self.proc.returncode})")
            try:
                state = json.loads(self.state.read_text())
            except (FileNotFoundError, ValueError):
                state = {}
            if until(state):
                self.names = dict(state.get("nodes", {}))
                return state
            time.sleep(0.2)
        raise AssertionError("the cluster did not answer")

    @property
    def address(self) -> str:
        return str(json.loads(self.state.read_text())["address"])

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def add(self, name: str) -> str:
        self._send(f"add {name}")
        state = self._read(lambda s: name in s.get("nodes", {}).values())
        return next(nid for nid, n in state["nodes"].items() if n == name)

    def kill(self, node: str) -> int:
        self._send(f"kill {node}")
        return int(self._read(lambda s: node in s.get("killed", {}))["killed"][node])

    def close(self) -> None:
        if self.proc.poll() is None:
            self._send("quit")
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass
class OnlineRun:
    output: Path
    job: JobStatus
    training: TrainStatus
    cluster: dict[str, str]  # node id -> name, every node the cluster had
    killed: list[str] = field(default_factory=list)
    waits: set[str] = field(default_factory=set)  # what the job said it waits for
    train_waits: set[str] = field(default_factory=set)  # and its training
    # Each status seen with engines and trainer workers placed: node -> (engines, ranks)
    placements: list[dict[str, tuple[list[str], list[int]]]] = field(default_factory=list)
    in_flight: int = 0  # the most captured bytes a status showed in flight on one node
    plan: Any = None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        for name in ("node-1", "node-2", "node-3"):
            made.add(name)
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def online(cluster: LocalCluster, learnable: Learnable,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnlineRun]:
    base = tmp_path_factory.mktemp("online")
    output = base / "out" / "tasks"
    server = Server(base / "ledger.sqlite", [tmp_path_factory.getbasetemp(),
                                             learnable.target.parent],
                    env={"HSX_RAY_ADDRESS": cluster.address, "RAY_TMPDIR": cluster.tmp})
    server.start()
    try:
        yield _run(server, cluster, learnable, output)
    finally:
        server.stop()


def _run(server: Server, cluster: LocalCluster, learnable: Learnable,
         output: Path) -> OnlineRun:
    client = server.coordinator().client()
    job = client.submit({
        "model": str(learnable.target), "dataset": str(learnable.dataset),
        "output": str(output), **JOB, "train": ONLINE,
    }, job_id="online")
    run = OnlineRun(output, job, None, {})  # type: ignore[arg-type]
    # After the first checkpoint the trainer worker's node and the engine's node die at
    # once (each recovery runs while the other does); after the next, the coordinator.
    faults = [("trainer", "engine"), ("coordinator",)]
    done_at = 0  # the checkpoint after which the last fault was made
    replaced = 0
    deadline = time.monotonic() + 3000
    while time.monotonic() < deadline:
        try:
            status = server.coordinator().client().get(job.id)
            training = server.train_status(job.id)
        except Exception:  # the coordinator is restarting (or, just restarted and taking
            time.sleep(0.5)  # its job back on a loaded machine, slow to answer)
            continue
        if status.state in (JobState.failed, JobState.cancelled):  # the asserts say why
            break
        run.plan = status.plan or run.plan
        if status.waiting_for:
            run.waits.add(status.waiting_for)
        where = {n.node: (list(n.engines), list(n.trainer_workers)) for n in status.nodes}
        if any(e for e, _ in where.values()) and any(t for _, t in where.values()):
            run.placements.append(where)
        run.in_flight = max([run.in_flight, *(n.bytes_in_flight for n in status.nodes)])
        if training is None:
            time.sleep(0.5)
            continue
        if training.waiting_for:
            run.train_waits.add(training.waiting_for)
        step = training.checkpoint_step or 0
        if faults and step > done_at:
            kinds = faults[0]
            if kinds == ("coordinator",):
                server.restart()
            else:
                victims = [next((node for node, (engines, ranks) in where.items()
                                 if (ranks if kind == "trainer" else engines)), None)
                           for kind in kinds]
                if None in victims:  # not placed (again) yet
                    time.sleep(0.3)
                    continue
                for victim in victims:
                    cluster.kill(victim)
                for _ in victims:
                    replaced += 1
                    cluster.add(f"node-{3 + replaced}")
            faults.pop(0)
            done_at = step
            run.killed.extend(f"{kind} after checkpoint {step}" for kind in kinds)
        if training.state.finished:
            break
        time.sleep(0.3)
    client = server.coordinator().client()
    run.job = client.wait(job.id, timeout=2400)
    run.training = client.wait_train(job.id, timeout=2400)
    run.cluster = dict(cluster.names)
    return run


def test_the_online_job_trains_across_nodes_and_stores_no_shard(online: OnlineRun) -> None:
    assert online.job.state == JobState.succeeded, online.job.last_error
    assert online.training.state == TrainState.done, online.training.error
    assert online.training.step == STEPS
    out = Output(online.output)
    assert out.committed_units() == set() and not (online.output / "shards").exists()
    complete = json.loads((online.output / "complete.json").read_text())
    assert complete["shards"] == 0 and complete["online"]["trainer"] == "done"
    assert complete["online"]["captures"] >= 1
    assert out.manifest().num_samples > 0


def test_the_engine_and_each_trainer_worker_run_on_nodes_of_their_own(
        online: OnlineRun) -> None:
    plan = online.plan
    assert plan is not None and plan.train_place == "apart"
    planned = {n.node: (n.engines, n.trainer_workers) for n in plan.nodes}
    assert sorted(len(e) + len(t) for e, t in planned.values()) == [1, 1, 1], planned
    assert online.placements, "no status showed the engine and the trainer placed"
    for where in online.placements:  # as they ran: never an engine beside a worker
        assert all(not (engines and ranks) for engines, ranks in where.values()), where
        assert all(len(ranks) <= 1 for _, ranks in where.values()), where
    # Captured states waited on a node for a worker to read them, and the status said so.
    assert online.in_flight > 0


def test_every_sample_once_per_epoch_through_a_lost_trainer_node_engine_node_and_coordinator(
        online: OnlineRun) -> None:
    assert [k.split()[0] for k in online.killed] == ["trainer", "engine", "coordinator"]
    assert online.training.restarts >= 1 and online.training.resumed_from is not None
    visits = read_visits(online.output)
    # Every worker's every step, once, along the line of checkpoints.
    assert sorted((v["step"], v["rank"]) for v in visits) == [
        (step, rank) for step in range(1, STEPS + 1) for rank in range(WORKERS)]
    counts: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    last: dict[int, int] = {}  # each worker's last epoch
    for v in visits:
        counts[v["epoch"]].update(v["samples"])
        last[v["rank"]] = max(last.get(v["rank"], 0), v["epoch"])
    plan = online.training.plan
    assert plan is not None and plan.workers == WORKERS
    every = set(Output(online.output).inputs().column("sample_index").to_pylist())
    held = every - set().union(*(set(c) for c in counts.values()))
    assert len(held) == plan.val_samples  # the held-out samples, never trained on
    assert min(last.values()) >= 1, last
    for epoch, c in counts.items():
        assert max(c.values()) == 1, (epoch, c.most_common(3))
        if epoch < min(last.values()):  # every worker ended it: every sample, once
            assert set(c) == every - held, epoch


def test_who_waits_on_whom_shows_in_the_status(online: OnlineRun) -> None:
    # The engines filled the buffer and waited for the trainer's workers.
    assert any("the trainer" in w and "online buffer" in w for w in online.waits), \
        online.waits
    # CPU engines capture slower than the draft trains: the trainer waits for them.
    assert any("the engines" in w for w in online.train_waits), online.train_waits


def test_online_and_offline_drafts_are_accepted_alike(online: OnlineRun,
                                                      offline_run: OfflineRun) -> None:
    measured: dict[str, Any] = {}
    for name, training in (("online", online.training), ("offline", offline_run.training)):
        assert training.eval is not None and training.eval.error is None, training.eval
        measured[name] = training.eval.mean_acceptance_length
    # 120 steps are short of the 500 of the default plan: both drafts land near 2.7.
    assert measured["online"] >= 2.5, measured
    assert abs(measured["online"] - measured["offline"]) <= 0.05 * measured["offline"], \
        measured
