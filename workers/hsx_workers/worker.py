"""ExtractionWorker: one engine, fed work units, each unit committed as one shard.

The class is plain Python; the job driver wraps it with `ray.remote` (one actor per
engine, resources for its tensor-parallel ranks). A unit's life:

1. `run_unit` reads its rows (sample_index, input_ids, loss_mask) from the output's
   inputs table and queues it;
2. one capture loop per worker streams the queued units' requests through the engine
   back to back, so the engine never drains between units: while the tail of one unit
   computes, the next unit's requests are already in flight. Results come back in
   request order, and each goes straight into its unit's `ShardWriter` (nothing of a
   unit is held in memory as a whole);
3. when a unit's last result is in, a committer thread commits it: the shard becomes
   visible only through its commit record, created create-if-absent — if another
   attempt of the same unit won, this one's data is dropped and the unit reports
   `won=False`. `run_unit` returns that report.

The driver keeps up to two units queued on each worker (runner.py) for that overlap.
Per-sample failures are recorded in the commit record's errors and the unit goes on.
`EngineDead` fails every unit the worker holds: the driver restarts the actor and
retries them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.plan import WorkUnit
from hsx.shards import DEFAULT_CHECKSUM, ShardWriter, background_priority
from hsx_workers.engines.base import (
    WAIT,
    CaptureRequest,
    CaptureResult,
    EngineConfig,
    EngineDead,
    _Wait,
    create_engine,
)

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 5.0
"""A capture loop with nothing queued or in flight for this long ends (a new unit
starts another), so an idle engine does not poll."""


@dataclass
class UnitReport:
    unit: int
    won: bool
    samples: int
    tokens: int
    bytes: int
    errors: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    worker: str = ""


@dataclass
class _UnitRun:
    """One unit on its way through this worker."""

    output: Path
    storage_dtype: str
    checksum: str
    unit: WorkUnit
    rows: list[tuple[int, list[int], list[int]]]
    future: Future[UnitReport] = field(default_factory=Future)
    started: float = field(default_factory=time.monotonic)
    writer: ShardWriter | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    fed: int = 0  # requests handed to the engine
    done: int = 0  # results taken
    tokens_done: int = 0
    failure: BaseException | None = None


class ExtractionWorker:
    """Owns one capture engine and turns work units into committed shards."""

    def __init__(self, engine: str, engine_config: EngineConfig, name: str = "worker"):
        self.name = name
        self.config = engine_config
        self._lock = threading.Lock()
        # The inputs table of the output last worked on (memory-mapped); an engine
        # serves any job whose engine config matches, one output at a time.
        self._inputs: tuple[Path, Any] | None = None
        self._queued: deque[_UnitRun] = deque()  # waiting for the capture loop
        self._routing: deque[_UnitRun] = deque()  # fed to the engine, results pending
        self._loop: threading.Thread | None = None  # the capture loop taking units
        self._last_loop: threading.Thread | None = None  # a new one waits for it to end
        self._stopping = False
        self._dead: BaseException | None = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsx-commit",
                                             initializer=background_priority)
        self.engine = create_engine(engine, engine_config)

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> bool:
        return True

    def progress(self) -> dict[int, tuple[int, int]]:
        """unit -> (samples, tokens) taken so far, for the units in flight (polled)."""
        with self._lock:
            runs = list(self._routing)
        return {run.unit.unit: (run.done, run.tokens_done) for run in runs}

    def _rows(self, output: Path, unit: WorkUnit) -> list[tuple[int, list[int], list[int]]]:
        with self._lock:
            if self._inputs is None or self._inputs[0] != output:
                from hsx.ingest import read_inputs

                self._inputs = (output, read_inputs(output))
            inputs = self._inputs[1]
        table = inputs.slice(unit.row_start, unit.samples)
        return list(
            zip(
                table.column("sample_index").to_pylist(),
                table.column("input_ids").to_pylist(),
                table.column("loss_mask").to_pylist(),
                strict=True,
            )
        )

    def run_unit(self, output: str, storage_dtype: str, unit: WorkUnit,
                 checksum: str = DEFAULT_CHECKSUM) -> UnitReport:
        """Extract one unit into its shard and commit it; blocks until it is committed.

        Units queued by concurrent calls run back to back through one engine, in the
        order the calls arrived.
        """
        run = _UnitRun(Path(output), storage_dtype, checksum, unit,
                       self._rows(Path(output), unit))
        with self._lock:
            if self._dead is not None:
                raise EngineDead(f"{self.name}: the engine is gone: {self._dead}")
            self._queued.append(run)
            if self._loop is None:
                self._loop = threading.Thread(
                    target=self._capture_loop, args=(self._last_loop,),
                    name=f"hsx-capture-{self.name}", daemon=True)
                self._last_loop = self._loop
                self._loop.start()
        return run.future.result()

    # -- the capture loop (one thread at a time)

    def _capture_loop(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        try:
            for result in self.engine.capture(self._feed()):
                self._take(result)
        except BaseException as err:
            logger.error("%s: capture failed: %s", self.name, err)
            with self._lock:
                self._dead = err
                runs = list(self._routing) + list(self._queued)
                self._routing.clear()
                self._queued.clear()
                self._loop = None
            for run in runs:
                if run.writer is not None:
                    run.writer.abort()
                run.future.set_exception(err)

    def _feed(self) -> Iterator[CaptureRequest | _Wait]:
        """The requests of the queued units, back to back; WAIT while none is queued."""
        run: _UnitRun | None = None
        idle_since = time.monotonic()
        while True:
            if run is None or run.fed == len(run.rows):
                run = self._next_run()
                if run is None:
                    with self._lock:
                        idle = not self._queued and not self._routing
                        if idle and (self._stopping
                                     or time.monotonic() - idle_since > IDLE_EXIT_S):
                            self._loop = None
                            return
                    yield WAIT
                    continue
            idle_since = time.monotonic()
            index, ids, _mask = run.rows[run.fed]
            run.fed += 1
            yield CaptureRequest(index, ids)

    def _next_run(self) -> _UnitRun | None:
        """The next queued unit with its writer open, now awaiting results; None if none."""
        while True:
            with self._lock:
                if not self._queued:
                    return None
                run = self._queued.popleft()
            try:
                if not run.rows:
                    raise ValueError(f"unit {run.unit.unit} has no rows")
                run.writer = ShardWriter(
                    run.output, run.unit.unit, layers=self.config.layers,
                    hidden_size=self.config.hidden_size,
                    storage_dtype=run.storage_dtype,  # type: ignore[arg-type]
                    checksum=run.checksum,  # type: ignore[arg-type]
                )
            except BaseException as err:  # the output cannot take this unit
                run.future.set_exception(err)
                continue
            with self._lock:
                self._routing.append(run)
            return run

    def _take(self, result: CaptureResult) -> None:
        """One result into its unit's shard (results come in request order)."""
        run = self._routing[0]
        if result.sample_index != run.rows[run.done][0]:
            raise RuntimeError(f"internal: result for sample {result.sample_index} where "
                               f"sample {run.rows[run.done][0]} of unit {run.unit.unit} was due")
        if run.failure is None and run.writer is not None:
            try:
                if result.error is not None or result.hidden_states is None:
                    run.errors.append({"sample_index": result.sample_index,
                                       "reason": result.error or "no hidden states"})
                else:
                    run.writer.add(result.sample_index, result.input_ids,
                                   run.rows[run.done][2], result.hidden_states,
                                   take=result.owned, scales=result.scales)
            except BaseException as err:
                run.failure = err
                run.writer.abort()
        run.done += 1
        run.tokens_done += len(result.input_ids)
        if run.done == len(run.rows):
            with self._lock:
                self._routing.popleft()
            self._committer.submit(self._commit, run)

    def _commit(self, run: _UnitRun) -> None:
        writer = run.writer
        try:
            if run.failure is not None:
                raise run.failure
            if writer is None:
                raise RuntimeError(f"unit {run.unit.unit} has no writer")
            outcome = writer.commit(errors=run.errors)
        except BaseException as err:
            if writer is not None:
                writer.abort()
            run.future.set_exception(err)
            return
        record = outcome.record
        run.future.set_result(UnitReport(
            unit=run.unit.unit,
            won=outcome.won,
            samples=int(record["samples"]),
            tokens=int(record["tokens"]),
            bytes=int(record["bytes"]),
            errors=list(record.get("errors", [])),
            seconds=time.monotonic() - run.started,
            worker=self.name,
        ))

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            loop = self._loop
        if loop is not None:
            loop.join(timeout=60)
        self._committer.shutdown(wait=True)
        self.engine.close()
