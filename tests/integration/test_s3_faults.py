"""A bucket that misbehaves, and drivers that race on one bucket (real SeaweedFS).

A fault-injecting proxy (tests/faultproxy.py) sits between hsx and SeaweedFS and
answers 500/503, drops connections before and after the store acted, cuts answers in
half and delays requests, for a seeded fraction of them.

- Storage and shards through the proxy: conditional creates still have one winner, a
  multipart shard streams and verifies, a create whose answer was lost is known as ours.
- A store that ignores conditional writes, a missing bucket, bad credentials: `hsx
  extract` refuses the job before any engine starts, naming the problem.
- The extraction job through the proxy with >= 5% of requests failing: it completes,
  every good row exactly once, every shard verifies, nothing else left in the bucket.
- Two job drivers racing on one bucket output: each unit committed exactly once (the
  conditional create decides), every losing attempt's shard deleted, no orphans.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from hsx.dataset import HiddenStatesDataset
from hsx.output import ObjectExistsError, Output, ShardWriter, Storage
from hsx.output.layout import (
    COMMITS_DIR,
    COMPLETE,
    INGEST,
    MANIFEST,
    SHARDS_DIR,
    errors_part_path,
    inputs_part_path,
    part_record_path,
)
from hsx.output.object_storage import ObjectStoreStorage
from hsx.output.s3_multipart import MIN_PART_SIZE
from hsx_service.dispatch import DispatchHooks
from hsx_service.engine_pool import EnginePool
from hsx_service.runner import run_job
from hsx_workers.tiny_models import ChatDataset
from tests.faultproxy import FaultProxy, Faults
from tests.s3server import SeaweedS3
from tests.unit.test_shards import commit_side_by_side

from .helpers import by_sample

pytestmark = [pytest.mark.integration, pytest.mark.s3]

# 12% of requests fail one way or another (the issue asks for >= 5%), 5% are delayed.
FLAKY = Faults(error=0.05, drop=0.02, lost=0.03, truncate=0.02, delay=0.05, max_delay_s=0.2)


@pytest.fixture(scope="module")
def flaky(s3_server: SeaweedS3) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint, FLAKY, seed=12) as proxy:
        yield proxy


def _env(server: SeaweedS3, endpoint: str) -> dict[str, str]:
    return {**server.env, "AWS_ENDPOINT_URL": endpoint}


def _uri(server: SeaweedS3, name: str) -> str:
    return f"s3://{server.bucket}/{name}-{secrets.token_hex(4)}"


def _only_the_output_is_left(uri: str) -> None:
    """Nothing in the prefix but the output's own objects and committed shards; no
    unfinished upload."""
    out = Output(uri)
    storage = out.storage
    assert isinstance(storage, ObjectStoreStorage) and storage.multipart is not None
    assert storage.multipart.list_uploads() == []
    records = out.commits()
    parts = out.part_records()
    assert parts and parts[-1].last
    expected = {MANIFEST, INGEST, COMPLETE}
    expected |= {inputs_part_path(p.part) for p in parts}
    expected |= {part_record_path(p.part) for p in parts}
    expected |= {errors_part_path(p.part) for p in parts if p.errors}
    expected |= {f"{COMMITS_DIR}/unit-{r.unit:06d}.json" for r in records}
    expected |= {r.shard for r in records}
    assert {i.key for i in storage.list()} == expected


# --------------------------------------------------------------------------- no engines


def test_storage_through_the_faults(s3_server: SeaweedS3, flaky: FaultProxy,
                                    s3_uri: str) -> None:
    before = Counter(flaky.stats)
    options = {**s3_server.options, "endpoint": flaky.endpoint}
    storage = Storage.for_uri(s3_uri, part_size=MIN_PART_SIZE, **options)
    storage.check_writable()
    # Conditional creates: one winner per key among racing writers, whatever got lost.
    winners: Counter[str] = Counter()
    lock = threading.Lock()

    def race(i: int) -> None:
        key = f"race/key-{i % 10}"
        try:
            storage.create(key, f"writer {i}".encode())
        except ObjectExistsError:
            return
        with lock:
            winners[key] += 1

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(race, range(80)))
    # A writer whose answer was lost may see its own create as "exists" (ShardWriter
    # reads the record back for that); never may two writers both win.
    assert all(n == 1 for n in winners.values()) and len(winners) >= 1
    # Shards of several parts stream through the faults; two attempts of a unit commit once.
    rng = np.random.default_rng(0)
    samples = [(k, rng.integers(0, 1000, 600), np.ones(600), rng.standard_normal(
        (600, 4, 512)).astype(np.float32)) for k in range(8)]  # ~19 MiB: 4 parts of 5 MiB
    writers = []
    for attempt in ("first", "second"):
        w = ShardWriter(storage, 3, layers=[1, 2, 3, 4], hidden_size=512,
                        storage_dtype="bf16", attempt=attempt)
        for s in samples:
            w.add(*s)
        writers.append(w)
    winner = commit_side_by_side(writers)
    direct = Storage.for_uri(s3_uri, **s3_server.options)
    assert [i.key for i in direct.list(SHARDS_DIR)] == [winner.shard]
    assert direct.read(f"{COMMITS_DIR}/unit-000003.json") == winner.to_json()
    assert Output(direct).verify() == 1
    seen = Counter(flaky.stats) - before
    assert seen["requests"] > 50
    assert sum(seen[f] for f in ("error", "drop", "lost", "truncate")) >= 0.05 * seen["requests"]


def _job_file(make_job: Any, tmp_path: Path) -> Path:
    job = tmp_path / "job.yaml"
    spec = make_job(tmp_path / "unused").model_dump(mode="json", exclude_defaults=True)
    job.write_text(yaml.safe_dump(spec))
    return job


def test_unusable_buckets_are_refused_before_any_engine_starts(
    s3_server: SeaweedS3, make_job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hsx.cli import main

    job = _job_file(make_job, tmp_path)
    started: list[Any] = []
    monkeypatch.setattr(EnginePool, "slots", lambda *a, **k: started.append(a) or [])

    def refused(uri: str, env: dict[str, str]) -> str:
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            assert main(["extract", str(job), "--output", uri, "--no-progress"]) == 2
        assert not started  # refused before any engine was asked for
        return capsys.readouterr().err

    uri = _uri(s3_server, "refused")
    with FaultProxy(s3_server.endpoint, ignore_conditional=True) as liar:
        err = refused(uri, _env(s3_server, liar.endpoint))
        assert liar.stats["412 answered 200"] == 1
    assert "does not honour conditional writes" in err and uri in err
    err = refused(f"s3://no-such-bucket-{secrets.token_hex(3)}/job", s3_server.env)
    assert "bucket 'no-such-bucket-" in err and "does not exist" in err
    err = refused(uri, {**s3_server.env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert f"s3://{s3_server.bucket}" in err and "check the credentials" in err
    # Nothing was left behind by the probes.
    assert Storage.for_uri(uri, **s3_server.options).list() == []


# --------------------------------------------------------------------------- engines


def test_extraction_through_a_flaky_bucket(
    s3_server: SeaweedS3, flaky: FaultProxy, make_job: Any, engine_pool: Any,
    chat_dataset: ChatDataset, monkeypatch: pytest.MonkeyPatch,
) -> None:
    uri = _uri(s3_server, "flaky")
    before = Counter(flaky.stats)
    with monkeypatch.context() as patch:
        for name, value in _env(s3_server, flaky.endpoint).items():
            patch.setenv(name, value)
        summary = run_job(make_job(uri, unit_tokens=2048), pool=engine_pool)
    seen = Counter(flaky.stats) - before
    failing = sum(seen[f] for f in ("error", "drop", "lost", "truncate"))
    print(f"through the fault proxy: {dict(seen)}")  # the figure docs/RELIABILITY.md quotes
    assert seen["requests"] >= 60 and failing >= 0.05 * seen["requests"], seen
    # Read back straight from SeaweedFS, not through the proxy.
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    assert summary.samples == len(chat_dataset.good_indices)
    ds = HiddenStatesDataset(uri)
    assert ds.complete and ds.verify() == len(ds.records) == summary.shards > 3
    assert sorted(by_sample(uri)) == chat_dataset.good_indices  # type: ignore[arg-type]
    assert sorted(e["sample_index"] for e in ds.errors()) == sorted(chat_dataset.bad)
    _only_the_output_is_left(uri)


def test_two_drivers_racing_on_one_bucket_commit_each_unit_once(
    s3_server: SeaweedS3, make_job: Any, engine_pool: Any, chat_dataset: ChatDataset,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    uri = _uri(s3_server, "race")
    spec = make_job(uri, unit_tokens=2048)
    other_pool = EnginePool()  # a second driver has engines of its own
    try:
        other_pool.start(spec)  # warm, so that both drivers really run side by side
        reports: dict[str, list[Any]] = {"a": [], "b": []}
        barrier = threading.Barrier(2)

        def drive(name: str, pool: EnginePool) -> Any:
            barrier.wait()
            hooks = DispatchHooks(on_unit_done=reports[name].append)
            return run_job(spec, pool=pool, hooks=hooks)

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            futures = [ex.submit(drive, "a", engine_pool), ex.submit(drive, "b", other_pool)]
            summaries = [f.result(timeout=600) for f in futures]
    finally:
        other_pool.shutdown()
    units = {r.unit for r in Output(uri).commits()}
    wins = Counter(r.unit for rs in reports.values() for r in rs if r.won)
    assert wins == Counter(units)  # every unit won exactly once, by one driver
    losses = [r for rs in reports.values() for r in rs if not r.won]
    assert losses, "no attempt lost: the drivers did not race"
    assert all(s.samples == len(chat_dataset.good_indices) for s in summaries)
    ds = HiddenStatesDataset(uri)
    assert ds.complete and ds.verify() == len(units)
    assert sorted(by_sample(uri)) == chat_dataset.good_indices  # type: ignore[arg-type]
    _only_the_output_is_left(uri)  # every loser's shard deleted
