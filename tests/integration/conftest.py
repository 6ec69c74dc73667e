"""Integration fixtures: `ray_local`, `engine_pool` and `make_job` live in tests/conftest.py,
shared with tests/chaos/ so that one session starts one Ray and one pool of warm engines.

`learnable` (the learnable target and its language's dataset) serves test_train.py,
test_train_job.py and test_online.py, which `make test` may run on different
pytest-xdist workers: the first to ask builds it (~2.5 minutes on one core) under a lock
in the run's shared temporary directory, the others find it there.

`learnable_server` (the coordinator of the learnable target's jobs) and `offline_run`
(its offline job with `train:`) serve test_train_job.py and test_online.py, which one
worker runs (tests/conftest.py's ONE_WORKER): the offline job is checked by the one and
is the comparator of the other's online job, made once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import pytest

from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

from .helpers import LEARNABLE_SAMPLES, Learnable
from .learnable_jobs import OfflineRun, Server, run_offline_job


@pytest.fixture(scope="session")
def learnable(tmp_path_factory: pytest.TempPathFactory) -> Learnable:
    """The learnable target and LEARNABLE_SAMPLES samples of its language, built once a run."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, the same for every worker
    root = base / "learnable"
    root.mkdir(exist_ok=True)
    language = TaskLanguage(seed=0)
    with (base / "learnable.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        # 500 steps: greedy accuracy 0.997 on the determined tokens (900: 0.9995), at
        # ~0.27 s a step on one core.
        target = make_learnable_model(root / "target", language=language, steps=500)
        dataset = root / "tasks.jsonl"
        if not dataset.exists():
            partial = write_language_dataset(root / "tasks.jsonl.partial", LEARNABLE_SAMPLES,
                                             language=language)
            partial.rename(dataset)
    return Learnable(target, language, dataset)


@pytest.fixture(scope="session")
def learnable_server(tmp_path_factory: pytest.TempPathFactory,
                     learnable: Learnable) -> Iterator[Server]:
    """The coordinator of the learnable target's jobs (test_online.py restarts it)."""
    ledger = tmp_path_factory.mktemp("learnable-ledger") / "ledger.sqlite"
    # Under pytest-xdist the learnable target and its rows lie outside this worker's tmp.
    server = Server(ledger, [tmp_path_factory.getbasetemp(), learnable.target.parent])
    server.start()
    _SERVERS.append(server)
    yield server
    server.stop()


_SERVERS: list[Server] = []  # the learnable_server of this session, once made


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the learnable target's coordinator (its Ray and engines) when the next test
    does not use it, instead of keeping it until the session ends: the worker's other
    modules need the memory and the cores."""
    if nextitem is None or "learnable_server" not in nextitem.fixturenames:
        for server in _SERVERS:
            server.stop()


@pytest.fixture(scope="session")
def offline_run(learnable_server: Server, learnable: Learnable,
                tmp_path_factory: pytest.TempPathFactory) -> OfflineRun:
    """The offline job with `train:`, its trainer killed once (learnable_jobs.py)."""
    output = tmp_path_factory.mktemp("offline-out") / "tasks"
    return run_offline_job(learnable_server, learnable, output)
