"""The online job's hand-off, measured both ways: the stream (shards in a memory folder,
what hsx uses) against Ray's object store, from an engine-side actor to the trainer.

Each unit is S samples of T tokens x 4 layers x 4096 hidden in bf16 (32 KiB a token, an
8B target's four layers), made once in a Ray actor (the engine's side: the states lie in
its memory, as they do in a spool) and handed to this process (the trainer's side), which
copies each sample's states into a batch buffer, as the trainer's collate does:

- `stream`   the actor writes the unit with `ShardWriter` into an `hsx.online.Stream`
             folder under /dev/shm and commits it (what an online job's worker does);
             here the commit record is read, the shard opened (`Output.open_shard`),
             each sample read (`ShardReader.sample`, torch) and copied; the unit is
             taken (`Stream.take`: deleted).
- `objects`  the actor returns the samples (numpy arrays): Ray serializes them into its
             object store; here `ray.get` maps them (zero-copy numpy), each is copied
             into the buffer, and the reference dropped.

Per unit, in turn (not overlapped): the actor's seconds (write + commit, or the return
into the object store), this side's seconds (open + read + copy, or get + copy), and
the whole round. Repetitions alternate the two; GB/s = the unit's state bytes / the
median round. Results: benchmarks/results/<date>-handoff/handoff.json.

Run: `.venv/bin/python -m benchmarks.bench_handoff [--unit-mib 256] [--units 8] [--reps 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import campaign_path, machine_info, save_section

RESULTS = campaign_path("handoff", "handoff.json")
LAYERS = [2, 16, 29, 32]
HIDDEN = 4096
TOKENS = 512  # per sample (16 MiB of states)


class Producer:
    """The engine's side: one unit's samples in memory, handed out either way."""

    def __init__(self, unit_bytes: int) -> None:
        import ml_dtypes

        rng = np.random.default_rng(0)
        per_sample = TOKENS * len(LAYERS) * HIDDEN * 2
        self.samples = []
        for _ in range(max(1, unit_bytes // per_sample)):
            hs = rng.standard_normal((TOKENS, len(LAYERS), HIDDEN), dtype=np.float32)
            self.samples.append((rng.integers(0, 128000, TOKENS, dtype=np.int32),
                                 np.ones(TOKENS, np.uint8), hs.astype(ml_dtypes.bfloat16)))

    def count(self) -> int:
        return len(self.samples)

    def to_stream(self, root: str, unit: int) -> float:
        from hsx.output import ShardWriter

        start = time.perf_counter()
        writer = ShardWriter(Path(root), unit, layers=LAYERS, hidden_size=HIDDEN,
                             storage_dtype="bf16")
        first = unit * len(self.samples)
        for i, (ids, mask, hs) in enumerate(self.samples):
            writer.add(first + i, ids, mask, hs, take=True)  # a spool's arrays: no copy
        if not writer.commit().won:
            raise RuntimeError(f"unit {unit} was committed already")
        return time.perf_counter() - start

    def to_objects(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return self.samples


def consume_stream(stream: Any, unit: int, dst: Any) -> None:
    source = stream.output()
    reader = source.open_shard(source.read_commit(unit))
    try:
        for i in range(len(reader)):
            hs = reader.sample(i, backend="torch")["hidden_states"].reshape(-1)
            dst[: hs.numel()].copy_(hs)
    finally:
        reader.close()
    stream.take(unit)


def consume_objects(samples: list[Any], dst: Any) -> None:
    import torch

    for _ids, _mask, hs in samples:
        flat = torch.from_numpy(hs.reshape(-1).view(np.int16)).view(torch.bfloat16)
        dst[: flat.numel()].copy_(flat)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--unit-mib", type=int, default=256)
    p.add_argument("--units", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    import ray
    import torch
    from tests.unit.outputs import make_manifest

    from hsx.online import Stream

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=max(2 * args.unit_mib * 2**20, 512 * 2**20))
    producer: Any = ray.remote(Producer).options(num_cpus=1).remote(args.unit_mib * 2**20)
    per_unit = ray.get(producer.count.remote())
    unit_bytes = per_unit * TOKENS * len(LAYERS) * HIDDEN * 2
    folder = tempfile.mkdtemp(prefix="hsx-handoff-", dir="/dev/shm")
    stream = Stream("bench-handoff", root=Path(folder))
    manifest = make_manifest(layers=LAYERS, hidden_size=HIDDEN, num_layers=32,
                             units=[(u * per_unit, (u + 1) * per_unit)
                                    for u in range(args.units)])
    stream.open(manifest.to_json().decode())
    dst = torch.empty(TOKENS * len(LAYERS) * HIDDEN, dtype=torch.bfloat16)
    runs: dict[str, list[dict[str, float]]] = {"stream": [], "objects": []}

    def stream_unit(unit: int) -> dict[str, float]:
        start = time.perf_counter()
        produce = ray.get(producer.to_stream.remote(str(stream.path), unit))
        got = time.perf_counter()
        consume_stream(stream, unit, dst)
        end = time.perf_counter()
        return {"produce_s": produce, "consume_s": end - got, "round_s": end - start}

    def objects_unit(_unit: int) -> dict[str, float]:
        start = time.perf_counter()
        ref = producer.to_objects.remote()
        ray.wait([ref])
        got = time.perf_counter()
        samples = ray.get(ref)
        consume_objects(samples, dst)
        del samples, ref
        end = time.perf_counter()
        return {"produce_s": got - start, "consume_s": end - got, "round_s": end - start}

    ways = {"stream": stream_unit, "objects": objects_unit}
    for way in ways.values():  # warm both paths once, untimed
        way(0)
    for rep in range(args.reps):
        order = ("stream", "objects") if rep % 2 == 0 else ("objects", "stream")
        for name in order:
            for unit in range(args.units):
                runs[name].append(ways[name](unit))
    ray.shutdown()
    os.system(f"rm -rf {folder}")

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    result: dict[str, Any] = {"unit_bytes": unit_bytes, "samples_per_unit": per_unit,
                              "units": args.units, "reps": args.reps}
    for name in runs:
        result[name] = {key: round(median(name, key), 4)
                        for key in ("produce_s", "consume_s", "round_s")}
        result[name]["gb_per_s"] = round(unit_bytes / median(name, "round_s") / 1e9, 3)
    result["stream_over_objects"] = round(result["stream"]["gb_per_s"]
                                          / result["objects"]["gb_per_s"], 3)
    print(result)
    save_section(RESULTS, "handoff", result, machine_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
