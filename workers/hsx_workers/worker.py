"""ExtractionWorker: one engine, fed work units, each unit committed as one shard.

The class is plain Python; the job driver wraps it with `ray.remote` (one actor per
engine, resources for its tensor-parallel ranks). A unit's life:

1. read its rows (sample_index, input_ids, loss_mask) from the output's inputs table;
2. stream them through the engine; every captured sample goes straight into a
   `ShardWriter` (nothing of the unit is held in memory as a whole);
3. commit: the shard becomes visible only through its commit record, created
   create-if-absent — if another attempt of the same unit won, this one's data is
   dropped and the unit reports `won=False`.

Per-sample failures are recorded in the commit record's errors and the unit goes on.
`EngineDead` propagates: the driver restarts the actor and retries the unit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.plan import WorkUnit
from hsx.shards import ShardWriter
from hsx_workers.engines.base import CaptureRequest, EngineConfig, create_engine

logger = logging.getLogger(__name__)


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


class ExtractionWorker:
    """Owns one capture engine and turns work units into committed shards."""

    def __init__(self, engine: str, engine_config: EngineConfig, name: str = "worker"):
        self.name = name
        self.config = engine_config
        self._lock = threading.Lock()
        self._progress = {"unit": -1, "samples": 0, "tokens": 0}
        # The inputs table of the output last worked on (memory-mapped); an engine
        # serves any job whose engine config matches, one output at a time.
        self._inputs: tuple[Path, Any] | None = None
        self.engine = create_engine(engine, engine_config)

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> bool:
        return True

    def progress(self) -> dict[str, int]:
        """Samples and tokens done in the unit now running (polled while it runs)."""
        with self._lock:
            return dict(self._progress)

    def _rows(self, output: Path, unit: WorkUnit) -> list[tuple[int, list[int], list[int]]]:
        if self._inputs is None or self._inputs[0] != output:
            from hsx.ingest import read_inputs

            self._inputs = (output, read_inputs(output))
        table = self._inputs[1].slice(unit.row_start, unit.samples)
        return list(
            zip(
                table.column("sample_index").to_pylist(),
                table.column("input_ids").to_pylist(),
                table.column("loss_mask").to_pylist(),
                strict=True,
            )
        )

    def run_unit(self, output: str, storage_dtype: str, unit: WorkUnit) -> UnitReport:
        started = time.monotonic()
        root = Path(output)
        rows = self._rows(root, unit)
        masks = {idx: mask for idx, _, mask in rows}
        with self._lock:
            self._progress = {"unit": unit.unit, "samples": 0, "tokens": 0}
        errors: list[dict[str, Any]] = []
        writer = ShardWriter(
            root,
            unit.unit,
            layers=self.config.layers,
            hidden_size=self.config.hidden_size,
            storage_dtype=storage_dtype,  # type: ignore[arg-type]
        )
        try:
            requests = (CaptureRequest(idx, ids) for idx, ids, _ in rows)
            for result in self.engine.capture(requests):
                if result.error is not None or result.hidden_states is None:
                    errors.append({"sample_index": result.sample_index,
                                   "reason": result.error or "no hidden states"})
                else:
                    writer.add(
                        result.sample_index,
                        result.input_ids,
                        masks[result.sample_index],
                        result.hidden_states,
                        take=result.owned,
                    )
                with self._lock:
                    self._progress["samples"] += 1
                    self._progress["tokens"] += len(result.input_ids)
            outcome = writer.commit(errors=errors)
        except BaseException:
            writer.abort()
            raise
        record = outcome.record
        return UnitReport(
            unit=unit.unit,
            won=outcome.won,
            samples=int(record["samples"]),
            tokens=int(record["tokens"]),
            bytes=int(record["bytes"]),
            errors=list(record.get("errors", [])),
            seconds=time.monotonic() - started,
            worker=self.name,
        )

    def shutdown(self) -> None:
        self.engine.close()
