"""ExtractionWorker with a stand-in engine: units run back to back, failures stay contained.

The stand-in keeps a window of requests in flight, like vLLM's scheduler, and records
what it had admitted when it gave each result back; that is how these tests see whether
the engine drained between two units.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx.output import Output
from hsx.plan import WorkUnit
from hsx.spec import VllmOptions
from hsx_workers.engines.base import (
    WAIT,
    CaptureRequest,
    CaptureResult,
    EngineConfig,
    EngineDead,
    RequestStream,
)
from hsx_workers.engines.vllm.settings import VllmSettings
from hsx_workers.worker import ExtractionWorker

from .outputs import write_inputs_table

LAYERS = [1, 2]
HIDDEN = 8


class WindowEngine:
    """Up to `window` requests in flight; the oldest comes back when the window is full,
    when the stream says WAIT, or at its end. `fail_on` raises EngineDead for a sample."""

    def __init__(self, window: int = 3, fail_on: int | None = None) -> None:
        self.window = window
        self.fail_on = fail_on
        self.admitted: list[int] = []
        self.admitted_at_emit: dict[int, int] = {}  # sample -> len(admitted) when emitted
        self.waits = 0
        self.go = threading.Event()  # the first capture starts once set
        self.go.set()

    def _result(self, req: CaptureRequest) -> CaptureResult:
        if req.sample_index == self.fail_on:
            raise EngineDead(f"engine died on sample {req.sample_index}")
        self.admitted_at_emit[req.sample_index] = len(self.admitted)
        # Distinct, nonzero layers of one scale: states the self-check passes.
        layer = np.arange(1, len(LAYERS) + 1, dtype=np.float32)[None, :, None]
        states = np.full((len(req.input_ids), len(LAYERS), HIDDEN), req.sample_index + 1,
                         np.float32) * layer
        return CaptureResult(req.sample_index, req.input_ids, hidden_states=states)

    def capture(self, requests: RequestStream) -> Iterator[CaptureResult]:
        self.go.wait(timeout=10)
        inflight: deque[CaptureRequest] = deque()
        for req in requests:
            if req is WAIT:
                self.waits += 1
                if inflight:
                    yield self._result(inflight.popleft())
                else:
                    time.sleep(0.001)
                continue
            assert isinstance(req, CaptureRequest)
            self.admitted.append(req.sample_index)
            inflight.append(req)
            if len(inflight) > self.window:
                yield self._result(inflight.popleft())
        while inflight:
            yield self._result(inflight.popleft())

    def close(self) -> None:
        pass


def _output(tmp_path: Path, n: int = 12) -> Path:
    rng = np.random.default_rng(0)
    samples = [{"input_ids": rng.integers(1, 100, 5), "loss_mask": np.ones(5, np.uint8)}
               for _ in range(n)]
    write_inputs_table(tmp_path, list(range(n)), samples)
    return tmp_path


def _worker(monkeypatch: pytest.MonkeyPatch, engine: WindowEngine) -> ExtractionWorker:
    monkeypatch.setattr("hsx_workers.worker.create_engine", lambda name, config: engine)
    config = EngineConfig(model="m", layers=LAYERS, num_layers=2, hidden_size=HIDDEN,
                          max_seq_len=64, settings=VllmSettings(options=VllmOptions()))
    return ExtractionWorker("vllm", config, name="w0")


def _units(n: int, per_unit: int) -> list[WorkUnit]:
    return [WorkUnit(u, u * per_unit, (u + 1) * per_unit, per_unit * 5)
            for u in range(n // per_unit)]


def _run_side_by_side(worker: ExtractionWorker, engine: WindowEngine, out: Path,
                      units: list[WorkUnit]) -> list[Any]:
    """What the driver does: the units handed over together, each call waiting."""
    engine.go.clear()
    with ThreadPoolExecutor(len(units)) as pool:
        futures = []
        for unit in units:
            futures.append(pool.submit(worker.run_unit, str(out), "bf16", unit))
            time.sleep(0.05)  # keep the hand-over order
        engine.go.set()
        return [f.result() for f in futures]


def test_units_run_back_to_back_without_draining(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = _output(tmp_path)
    engine = WindowEngine(window=3)
    worker = _worker(monkeypatch, engine)
    reports = _run_side_by_side(worker, engine, out, _units(12, 4))
    assert [r.unit for r in reports] == [0, 1, 2]
    assert all(r.won and r.samples == 4 for r in reports)
    # When unit 0's last sample (3) came back, unit 1's samples were already admitted:
    # the engine kept a full window instead of draining at the unit's end.
    assert engine.admitted_at_emit[3] == 7
    assert engine.admitted == list(range(12))
    records = Output(out).commits()
    assert [r.samples for r in records] == [4, 4, 4]
    for record in records:
        Output(out).verify([record])
    worker.shutdown()


def test_unit_failure_does_not_touch_its_neighbours(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = _output(tmp_path)
    worker = _worker(monkeypatch, WindowEngine())
    real_add = worker._take.__func__  # type: ignore[attr-defined]

    def bad_sample_5(self: ExtractionWorker, result: CaptureResult) -> None:
        if result.sample_index == 5:
            result.hidden_states = np.zeros((1, 1, 1), np.float32)  # wrong shape
        real_add(self, result)

    monkeypatch.setattr(ExtractionWorker, "_take", bad_sample_5)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(worker.run_unit, str(out), "bf16", u) for u in _units(12, 4)]
        time.sleep(0.01)
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result().samples)
            except ValueError as err:
                outcomes.append(str(err))
    assert outcomes[0] == 4 and outcomes[2] == 4
    assert "sample 5" in str(outcomes[1])
    assert sorted(r.unit for r in Output(out).commits()) == [0, 2]
    assert not list((out / ".tmp").iterdir())  # the failed unit's file is gone
    worker.shutdown()


def test_engine_death_fails_every_unit_held(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = _output(tmp_path)
    worker = _worker(monkeypatch, WindowEngine(window=2, fail_on=6))
    errors: list[str] = []
    lock = threading.Lock()

    def run(unit: WorkUnit) -> None:
        try:
            worker.run_unit(str(out), "bf16", unit)
        except EngineDead as err:
            with lock:
                errors.append(f"{unit.unit}: {err}")

    threads = [threading.Thread(target=run, args=(u,)) for u in _units(12, 4)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=30)
    # Unit 0 (samples 0-3) committed before sample 6 killed the engine; the others failed.
    assert [r.unit for r in Output(out).commits()] == [0]
    assert len(errors) == 2 and all("died on sample 6" in e for e in errors)
    with pytest.raises(EngineDead, match="engine is gone"):
        worker.run_unit(str(out), "bf16", _units(12, 4)[1])
    assert not list((out / ".tmp").iterdir())


def test_a_trip_on_another_worker_stops_every_unit_of_the_job_held_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx_workers.selfcheck import StatesCheckFailed

    out = _output(tmp_path)
    engine = WindowEngine(window=2)
    worker = _worker(monkeypatch, engine)
    engine.go.clear()  # no result comes back before the stop
    reason = "unit 7: self-check failed: sample 30 (dataset row 30), layer 2: ..."
    with ThreadPoolExecutor(3) as pool:
        futures = []
        for unit in _units(12, 4):
            futures.append(pool.submit(worker.run_unit, str(out), "bf16", unit))
            time.sleep(0.05)
        assert worker.stop_job(str(out), reason) == 3  # computing, or queued behind
        engine.go.set()
        for f in futures:
            with pytest.raises(StatesCheckFailed, match="unit 7: self-check failed"):
                f.result(timeout=30)
    assert Output(out).commits() == []
    assert not list((out / ".tmp").iterdir())  # no half-written shard left
    worker.stop_job(str(out), reason)  # nothing held: nothing to stop
    worker.shutdown()


def test_an_online_unit_returns_its_shard_and_stores_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An online job's unit (hsx.online): the rows of the job's unit, committed in the
    worker's memory as its stream unit, its shard returned whole (what Ray puts into the
    node's object store for the trainer); the output gets no shard and no record."""
    from hsx.online import stream_unit
    from hsx.output.shards.reader import BufferSource, ShardReader

    engine = WindowEngine()
    worker = _worker(monkeypatch, engine)
    out = _output(tmp_path)
    job_unit = _units(12, 4)[1]
    sid = stream_unit(2, job_unit.unit)
    try:
        report, payload = worker.run_unit(str(out), "bf16", WorkUnit(sid, 4, 8, 20),
                                          rows_of=job_unit)
    finally:
        worker.shutdown()
    assert report.unit == sid and report.won and report.samples == 4
    reader = ShardReader(BufferSource("unit", payload))
    assert reader.unit == sid and [int(i) for i in reader.sample_indices] == [4, 5, 6, 7]
    assert float(reader.sample(0)["hidden_states"].astype(np.float32)[0, 1, 0]) == 10.0
    assert Output(out).committed_units() == set() and not (out / "shards").exists()
