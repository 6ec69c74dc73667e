"""VllmEngine.capture against a stand-in for vLLM's LLMEngine: results leave the spool as
soon as they are published, while vLLM's blocking step() computes the next batch; the
in-flight budget holds; an engine failure or a consumer that stops ends the driver; an
engine core in the engine's own process is stepped until its files come.

The stand-in's step() returns a batch only when the test releases it, and the test
publishes each finished request's spool file itself (the connector's part), so every
order of events is chosen here, not left to timing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from hsx.spec import VllmOptions  # noqa: E402
from hsx_workers.engines.base import (  # noqa: E402
    WAIT,
    CaptureRequest,
    CaptureResult,
    EngineConfig,
    EngineDead,
)
from hsx_workers.engines.vllm.engine import VllmEngine  # noqa: E402
from hsx_workers.engines.vllm.settings import VllmSettings  # noqa: E402
from hsx_workers.engines.vllm.spool import SPOOL_SUFFIX, publish_spool_file  # noqa: E402

LAYERS, HIDDEN, TOKENS = 2, 4, 3
WAIT_S = 30.0  # how long a test waits for something that must happen


@pytest.fixture(autouse=True)
def _engine_core_in_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's topology: vLLM's engine core computes while the driver waits for
    files (tests/conftest.py runs engine cores in-process; one test here does too)."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)


class StepRefused(RuntimeError):
    pass


class FakeLLMEngine:
    """add_request records; step() blocks until released, then finishes the oldest
    `batch` requests (or raises what it was released with). A step with no request
    left returns at once, as vLLM's does."""

    def __init__(self, spool: Path, batch: int) -> None:
        self.spool = spool
        self.batch = batch
        self.added: list[tuple[str, list[int]]] = []
        self.unfinished: list[str] = []
        self.releases: queue.Queue[BaseException | None] = queue.Queue()
        self.in_step = threading.Event()
        self.steps = 0

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        self.added.append((request_id, list(prompt["prompt_token_ids"])))
        self.unfinished.append(request_id)

    def step(self) -> list[Any]:
        self.steps += 1
        if not self.unfinished:
            return []
        self.in_step.set()
        err = self.releases.get(timeout=WAIT_S)
        self.in_step.clear()
        if err is not None:
            raise err
        done, self.unfinished = self.unfinished[: self.batch], self.unfinished[self.batch :]
        return [SimpleNamespace(finished=True, request_id=rid, outputs=[],
                                kv_transfer_params={"hidden_states_path": self.path(rid)})
                for rid in done]

    def path(self, request_id: str) -> str:
        return str(self.spool / f"{request_id}{SPOOL_SUFFIX}")

    def publish(self, request_id: str) -> None:
        ids = dict(self.added)[request_id]
        states = torch.full((len(ids), LAYERS, HIDDEN), float(ids[0]), dtype=torch.bfloat16)
        publish_spool_file(self.path(request_id), lambda: {
            "hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.int64)})


def _engine(tmp_path: Path, batch: int, budget_requests: int) -> tuple[VllmEngine,
                                                                        FakeLLMEngine]:
    fake = FakeLLMEngine(tmp_path, batch)
    engine = object.__new__(VllmEngine)
    engine.config = EngineConfig(model="m", layers=[1, 2], num_layers=2, hidden_size=HIDDEN,
                                 max_seq_len=16, settings=VllmSettings(options=VllmOptions()))
    engine.max_inflight_tokens = budget_requests * TOKENS
    engine.spool = tmp_path
    engine.hooks = False
    engine.llm = SimpleNamespace(llm_engine=fake)
    engine._next_id = 0
    return engine, fake


def _requests(n: int) -> list[CaptureRequest]:
    return [CaptureRequest(i, [10 * i + 1 + k for k in range(TOKENS)]) for i in range(n)]


class Consumer:
    """Iterates a capture on a thread of its own, keeping what it got."""

    def __init__(self, results: Iterator[CaptureResult]) -> None:
        self.got: queue.Queue[CaptureResult | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(results,), daemon=True)
        self.thread.start()

    def _run(self, results: Iterator[CaptureResult]) -> None:
        try:
            for result in results:
                self.got.put(result)
        except BaseException as err:
            self.got.put(err)

    def take(self) -> CaptureResult | BaseException:
        return self.got.get(timeout=WAIT_S)


def _wait_until(condition: Any) -> None:
    deadline = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("condition never held")


def test_published_states_leave_while_vllm_computes_the_next_batch(tmp_path: Path) -> None:
    engine, fake = _engine(tmp_path, batch=2, budget_requests=8)
    consumer = Consumer(engine.capture(_requests(4)))
    _wait_until(lambda: fake.in_step.is_set() and len(fake.added) == 4)
    fake.releases.put(None)  # the first batch (samples 0 and 1) finishes
    _wait_until(lambda: fake.in_step.is_set() and len(fake.unfinished) == 2)
    # vLLM is inside the second batch's step; the connector publishes the first's.
    fake.publish(fake.added[0][0])
    fake.publish(fake.added[1][0])
    first, second = consumer.take(), consumer.take()
    assert fake.in_step.is_set()  # still computing, and both results are out
    for result, sample in ((first, 0), (second, 1)):
        assert isinstance(result, CaptureResult) and result.error is None
        assert result.sample_index == sample
        assert result.hidden_states.shape == (TOKENS, LAYERS, HIDDEN)
        assert float(result.hidden_states[0, 0, 0]) == 10 * sample + 1
        assert 0 < result.computed_at <= result.spooled_at
    fake.releases.put(None)
    _wait_until(lambda: not fake.unfinished)
    for rid, _ in reversed(fake.added[2:]):  # published out of order, yielded in order
        fake.publish(rid)
    assert [consumer.take().sample_index for _ in range(2)] == [2, 3]  # type: ignore[union-attr]
    consumer.thread.join(WAIT_S)
    assert not consumer.thread.is_alive() and consumer.got.empty()
    assert not list(tmp_path.iterdir())  # every spool file was taken


def test_requests_wait_for_the_budget_that_spool_files_hold(tmp_path: Path) -> None:
    engine, fake = _engine(tmp_path, batch=2, budget_requests=2)
    consumer = Consumer(engine.capture(_requests(3)))
    _wait_until(lambda: fake.in_step.is_set())
    assert len(fake.added) == 2  # the budget: two requests' tokens
    fake.releases.put(None)
    _wait_until(lambda: not fake.unfinished)
    assert len(fake.added) == 2  # finished, but their states still take spool space
    fake.publish(fake.added[0][0])
    assert consumer.take().sample_index == 0  # type: ignore[union-attr]
    _wait_until(lambda: len(fake.added) == 3)  # its space went to the third request
    fake.publish(fake.added[1][0])
    fake.releases.put(None)
    _wait_until(lambda: not fake.unfinished)
    fake.publish(fake.added[2][0])
    assert [consumer.take().sample_index for _ in range(2)] == [1, 2]  # type: ignore[union-attr]


def test_a_refused_prompt_keeps_its_place(tmp_path: Path) -> None:
    engine, fake = _engine(tmp_path, batch=2, budget_requests=8)
    add = fake.add_request

    def refuse_sample_1(request_id: str, prompt: dict[str, Any], params: Any) -> None:
        if request_id.startswith("s1-"):
            raise ValueError("prompt too long")
        add(request_id, prompt, params)

    fake.add_request = refuse_sample_1  # type: ignore[method-assign]
    consumer = Consumer(engine.capture(_requests(3)))
    _wait_until(lambda: fake.in_step.is_set())
    fake.releases.put(None)
    _wait_until(lambda: not fake.unfinished)
    for rid, _ in fake.added:
        fake.publish(rid)
    got = [consumer.take() for _ in range(3)]
    assert [r.sample_index for r in got] == [0, 1, 2]  # type: ignore[union-attr]
    assert "vLLM refused the prompt: prompt too long" in (got[1].error or "")  # type: ignore[union-attr]


def test_an_engine_failure_ends_the_capture_as_engine_dead(tmp_path: Path) -> None:
    engine, fake = _engine(tmp_path, batch=2, budget_requests=8)
    consumer = Consumer(engine.capture(_requests(2)))
    _wait_until(lambda: fake.in_step.is_set())
    fake.releases.put(StepRefused("engine core died"))
    err = consumer.take()
    assert isinstance(err, EngineDead) and "engine core died" in str(err)


def test_a_consumer_that_stops_stops_the_driver(tmp_path: Path) -> None:
    engine, fake = _engine(tmp_path, batch=1, budget_requests=8)

    def endless() -> Iterator[Any]:
        i = 0
        while True:
            yield CaptureRequest(i, [1, 2, 3]) if i < 2 else WAIT
            i += 1

    results = engine.capture(endless())
    got: list[CaptureResult] = []
    reader = threading.Thread(target=lambda: got.append(next(results)), daemon=True)
    reader.start()
    _wait_until(lambda: fake.in_step.is_set())
    fake.releases.put(None)
    _wait_until(lambda: fake.in_step.is_set() and len(fake.unfinished) == 1)
    fake.publish(fake.added[0][0])
    reader.join(WAIT_S)
    assert got and got[0].sample_index == 0
    fake.releases.put(None)  # the driver's step in progress ends with its batch
    results.close()
    assert not [t for t in threading.enumerate() if t.name == "hsx-vllm-driver"]


def test_an_engine_core_in_this_process_is_stepped_until_its_files_come(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With VLLM_ENABLE_V1_MULTIPROCESSING=0 the connector's copies and writes move only
    # when the engine is stepped: with every request finished and none of their files
    # written yet, the driver steps again instead of waiting for files.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine, fake = _engine(tmp_path, batch=2, budget_requests=8)
    consumer = Consumer(engine.capture(_requests(2)))
    _wait_until(lambda: fake.in_step.is_set() and len(fake.added) == 2)
    fake.releases.put(None)  # both finish; their files are not written yet
    _wait_until(lambda: fake.steps >= 3)  # stepped on while it waits for them
    for rid, _ in fake.added:  # a step writes them
        fake.publish(rid)
    assert [consumer.take().sample_index for _ in range(2)] == [0, 1]  # type: ignore[union-attr]
    # Nothing arriving and nothing left to send: the driver stops stepping and ends.
    consumer.thread.join(WAIT_S)
    assert not consumer.thread.is_alive() and consumer.got.empty()
