"""The online job's stream between Ray nodes, and the online job on a local cluster.

On a local Ray cluster (`ray.cluster_utils.Cluster`: a head with no CPU, where the driver
and the stream's actor run, and worker nodes of one CPU each):

`--part stream` (the hand-off alone): units of `--unit-mib` MiB of an 8B target's states
(4 layers x 4096 in bf16, 32 KiB a token, in samples of 512 tokens), made once in a
producer actor (the engine's side: the states lie in its memory, as in a spool) and
read by a consumer actor (the trainer's side), which copies each sample's states into a
batch buffer, as the trainer's collate does. Up to `--in-flight` units are on their way
at once (the online buffer); the figure is the whole run: bytes and units handed over ÷
the seconds from the first unit asked to the last one taken.

- `ray-cross`  what an online job does (hsx_workers.stream): the producer builds each
               unit's shard in memory (`ShardWriter` into `MemoryStorage`) and returns
               it to the driver's call, so Ray copies it into its node's object store; the
               driver puts the reference into the job's `StreamActor`; the consumer, on
               another node, waits for it there, pulls it into its node's store, reads it
               in place (`ShardReader` over the buffer) and takes it.
- `ray-same`   the same with the consumer on the producer's node.
- `folder`     the one-node folder the stream was before (what `hsx.online.Stream` did):
               the producer writes the shard with `ShardWriter` into a folder in /dev/shm
               and commits it; the consumer, on the same node, maps the shard, reads and
               copies it, and deletes it.

Variants alternate, each repetition in an order rotated by one.

`--part job` (the whole online job): `hsx extract` of the learnable target's online job
(3,000 samples, `--steps` steps, no evaluation) on a cluster of a head and three nodes,
with 1 and then 2 trainer workers (`place: apart`: the engine on one node, each worker on
another); the training's tokens/s (the median step after the 10th, all workers) and its
share of time waiting for data, and the whole command's seconds.

`--part ab --baseline DIR` (the stream against the folder it replaced, in a whole job):
the same online job (1 worker, no placement fields, which DIR's hsx does not know) by
`hsx extract` on one node, a local Ray, alternately with this tree's code and DIR's (an
earlier hsx: `git archive REV client workers service | tar -x -C DIR`), `--reps` times
each; the training's tokens/s and the whole command's seconds, and this tree ÷ DIR's.

Results: benchmarks/results/<date>-online-stream/online_stream.json.

Run: `.venv/bin/python -m benchmarks.bench_online_stream [--part stream|job|both|ab]
[--unit-mib 64] [--units 16] [--reps 3] [--steps 60] [--baseline DIR]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import campaign_path, machine_info, save_section

LAYERS = [2, 16, 29, 32]
HIDDEN = 4096
TOKENS = 512  # per sample (16 MiB of states)
ROOT = Path(__file__).resolve().parents[1]


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

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def _write(self, storage: Any, unit: int) -> Any:
        from hsx.output import ShardWriter

        writer = ShardWriter(storage, unit, layers=LAYERS, hidden_size=HIDDEN,
                             storage_dtype="bf16")
        first = unit * len(self.samples)
        for i, (ids, mask, hs) in enumerate(self.samples):
            writer.add(first + i, ids, mask, hs, take=True)  # a spool's arrays: no copy
        return writer.commit().record

    def to_memory(self, unit: int) -> tuple[int, np.ndarray]:
        """What an engine's `run_unit` returns for an online unit: the report, the shard."""
        from hsx.output.memory_storage import MemoryStorage

        per = TOKENS * (len(LAYERS) * HIDDEN * 2 + 5) + 48
        memory = MemoryStorage(expect_bytes=per * len(self.samples) + 4096)
        record = self._write(memory, unit)
        payload = memory.take(record.shard)
        return int(payload.nbytes), payload

    def to_folder(self, root: str, unit: int) -> int:
        from hsx.output.local_storage import LocalStorage

        return int(self._write(LocalStorage(Path(root)), unit).bytes)


class Consumer:
    """The trainer's side: each sample's states copied into a batch buffer."""

    def __init__(self) -> None:
        import torch

        self.dst = torch.empty(TOKENS * len(LAYERS) * HIDDEN, dtype=torch.bfloat16)

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def _read(self, reader: Any) -> None:
        for i in range(len(reader)):
            hs = reader.sample(i, backend="torch")["hidden_states"].reshape(-1)
            self.dst[: hs.numel()].copy_(hs)

    def from_stream(self, location: str, units: int) -> float:
        """Take `units` units from the job's stream, as a training worker does."""
        from hsx_workers.stream import TrainerStream

        stream = TrainerStream(location, 0, 1)
        start, left = time.perf_counter(), units
        while left:
            for sid, ref in stream.wait(0, lambda: False):
                reader = stream.fetch(sid, ref, lambda: False)
                if reader is None:
                    raise RuntimeError(f"unit {sid} was lost")
                self._read(reader)
                del reader
                stream.take(sid)
                left -= 1
        return time.perf_counter() - start

    def from_folder(self, root: str, unit: int) -> None:
        from hsx.output import Output
        from hsx.output.layout import commit_path

        out = Output(root)
        reader = out.open_shard(out.read_commit(unit))
        self._read(reader)
        reader.close()
        for key in (reader.record.shard if reader.record else "", commit_path(unit)):
            if key:
                (Path(root) / key).unlink(missing_ok=True)


def hand_off(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tests.unit.outputs import make_manifest

    from hsx.online import Captured
    from hsx.output.layout import MANIFEST
    from hsx_workers.stream import DriverStream

    store = {"object_store_memory": max(4 * args.unit_mib, 256) * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **store})
    nodes = [cluster.add_node(num_cpus=1, **store) for _ in range(2)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        def on(node: Any, cls: Any) -> Any:
            return ray.remote(cls).options(num_cpus=0, max_concurrency=4,
                                           scheduling_strategy=NodeAffinitySchedulingStrategy(
                                               node.node_id, soft=False))

        producer = on(nodes[0], Producer).remote(args.unit_mib * 2**20)
        consumers = {"same": on(nodes[0], Consumer).remote(),
                     "cross": on(nodes[1], Consumer).remote()}
        ray.get([producer.node.remote(), *(c.node.remote() for c in consumers.values())])
        folder = tempfile.mkdtemp(prefix="hsx-stream-bench-", dir="/dev/shm")
        per_unit = ray.get(producer.to_memory.remote(0))[0]  # warm; its size
        manifest = make_manifest(layers=LAYERS, hidden_size=HIDDEN, num_layers=32,
                                 units=[(u, u + 1) for u in range(args.units)])
        (Path(folder) / MANIFEST).write_text(manifest.to_json().decode())

        def ray_run(where: str) -> dict[str, float]:
            location = f"bench-{where}-{time.monotonic_ns()}"
            stream = DriverStream(location)
            stream.books()  # its actor started (once a job), not timed
            taking = consumers[where].from_stream.remote(location, args.units)
            start = time.perf_counter()
            pending: list[tuple[int, Any, Any]] = []
            nbytes = 0
            for unit in range(args.units):
                while len(pending) >= args.in_flight or (
                        len(stream.books().units) >= args.in_flight):
                    if pending:
                        sid, report, payload = pending.pop(0)
                        nbytes += ray.get(report)
                        stream.put(Captured(sid, 0, 0, ""), payload)
                    else:
                        time.sleep(0.005)
                report, payload = producer.to_memory.options(num_returns=2).remote(unit)
                pending.append((unit, report, payload))
            for sid, report, payload in pending:
                nbytes += ray.get(report)
                stream.put(Captured(sid, 0, 0, ""), payload)
            ray.get(taking)
            seconds = time.perf_counter() - start
            stream.close()
            return {"seconds": seconds, "bytes": nbytes}

        def folder_run() -> dict[str, float]:
            start = time.perf_counter()
            pending: list[tuple[int, Any]] = []
            nbytes = 0
            reading: list[Any] = []
            for unit in range(args.units):
                pending.append((unit, producer.to_folder.remote(folder, unit)))
                if len(pending) >= args.in_flight:
                    done, ref = pending.pop(0)
                    nbytes += ray.get(ref)
                    reading.append(consumers["same"].from_folder.remote(folder, done))
            for done, ref in pending:
                nbytes += ray.get(ref)
                reading.append(consumers["same"].from_folder.remote(folder, done))
            ray.get(reading)
            return {"seconds": time.perf_counter() - start, "bytes": nbytes}

        variants = {"ray-cross": lambda: ray_run("cross"), "ray-same": lambda: ray_run("same"),
                    "folder": folder_run}
        names = list(variants)
        for warm in variants.values():  # imports, first reads, each path once: untimed
            warm()
        runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                runs[name].append(variants[name]())
                print(name, runs[name][-1], flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    result: dict[str, Any] = {"unit_bytes": per_unit, "units": args.units,
                              "in_flight": args.in_flight, "reps": args.reps, "runs": runs}
    for name, rows in runs.items():
        seconds = statistics.median(r["seconds"] for r in rows)
        result[name] = {"seconds_median": round(seconds, 3),
                        "gb_per_s": round(rows[0]["bytes"] / seconds / 1e9, 3),
                        "units_per_s": round(args.units / seconds, 2),
                        "gb_per_s_best": round(max(r["bytes"] / r["seconds"] for r in rows)
                                               / 1e9, 3)}
    for name in ("ray-cross", "ray-same"):
        result[f"{name} / folder"] = round(result[name]["gb_per_s"]
                                           / result["folder"]["gb_per_s"], 3)
    return result


def _learnable(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The work folder, the learnable target and its 3,000 chats (made once)."""
    from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    language = TaskLanguage(seed=0)
    target = make_learnable_model(work / "target", language=language, steps=500)
    rows = work / "tasks.jsonl"
    if not rows.exists():
        write_language_dataset(rows, 3000, language=language)
    return work, target, rows


def online_jobs(args: argparse.Namespace) -> dict[str, Any]:
    """The learnable target's online job on a local cluster, with 1 and 2 workers."""
    work, target, rows = _learnable(args)
    runs: dict[str, Any] = {}
    for workers in (1, 2):
        runs[f"{workers} worker{'s' * (workers > 1)}"] = _job(work, target, rows, workers,
                                                              args.steps)
        print(workers, runs[f"{workers} worker{'s' * (workers > 1)}"], flush=True)
    one, two = runs["1 worker"], runs["2 workers"]
    return {"steps": args.steps, "runs": runs,
            "2 workers / 1, training tokens/s": round(
                two["train_tokens_per_s_median"] / one["train_tokens_per_s_median"], 3)}


def online_ab(args: argparse.Namespace) -> dict[str, Any]:
    """The one-node online job on this tree and on `args.baseline`'s, alternately."""
    work, target, rows = _learnable(args)
    trees = {"new": ROOT, "baseline": Path(args.baseline).resolve()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for rep in range(args.reps):
        for name in (list(trees) if rep % 2 == 0 else list(trees)[::-1]):
            runs[name].append(_job(work, target, rows, 1, args.steps, tree=trees[name]))
            print(name, runs[name][-1], flush=True)

    def median(name: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[name]))

    return {"steps": args.steps, "baseline": str(args.baseline), "runs": runs,
            "new / baseline, training tokens/s": round(
                median("new", "train_tokens_per_s_median")
                / median("baseline", "train_tokens_per_s_median"), 3),
            "new / baseline, whole job seconds": round(
                median("new", "seconds") / median("baseline", "seconds"), 3)}


def _job(work: Path, target: Path, rows: Path, workers: int, steps: int,
         tree: Path | None = None) -> dict[str, Any]:
    """The online job by `hsx extract`: on a local cluster of a head and `workers` + 1
    nodes, the trainer apart; or (`tree`: this hsx's code or another's, first on the
    path) on one node, a local Ray, with no placement fields."""
    import yaml

    name = f"online-{workers}" if tree is None else \
        f"online-one-node-{'new' if tree == ROOT else 'baseline'}"
    output = work / name
    shutil.rmtree(output, ignore_errors=True)
    train: dict[str, Any] = {"online": True, "steps": steps, "batch_tokens": 1024 // workers,
                             "eval_prompts": 0, "seed": 0,
                             "buffer_bytes": 2 * 8192 * 4 * 256 * 2}
    if tree is None:
        train.update(workers=workers, place="apart")
    job = {"model": str(target), "dataset": str(rows), "output": str(output),
           "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 8192, "train": train}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    tmp = tempfile.mkdtemp(prefix="hsxray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, VLLM_CPU_CI_ENV="1", VLLM_CPU_KVCACHE_SPACE="1")
    if tree is not None:  # another hsx first on the path; its own local Ray
        packages = ":".join(str(tree / p) for p in ("client", "workers", "service"))
        env["PYTHONPATH"] = f"{packages}:{env.get('PYTHONPATH', '')}"
        return _extract(path, env, output, tmp)
    state = work / f"cluster-{workers}.json"
    cluster = subprocess.Popen([sys.executable, "-m", "tests.cluster", str(state)], cwd=ROOT,
                               env=env, stdin=subprocess.PIPE, text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert cluster.stdin is not None
        for name in ("engine", "trainer-1", "trainer-2")[: workers + 1]:
            cluster.stdin.write(f"add {name}\n")
        cluster.stdin.flush()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                known = json.loads(state.read_text())
                if len(known.get("nodes", {})) == workers + 1:
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.5)
        return _extract(path, {**env, "RAY_ADDRESS": known["address"]}, output, tmp)
    finally:
        if cluster.stdin is not None:
            cluster.stdin.write("quit\n")
            cluster.stdin.flush()
        cluster.wait(timeout=300)


def _extract(path: Path, env: dict[str, str], output: Path, tmp: str) -> dict[str, Any]:
    """`hsx extract` of the job file; its training's figures from draft/metrics.jsonl."""
    try:
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "hsx.cli", "extract", str(path),
                               "--no-progress"], env=env, capture_output=True, text=True,
                              timeout=7200, check=False)
        seconds = time.monotonic() - t0
        if done.returncode != 0:
            raise RuntimeError(f"{path.name}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = [json.loads(x) for x in (output / "draft" / "metrics.jsonl").read_text()
               .splitlines() if x.strip()]
    steady = [m["tokens_per_s"] for m in metrics[10:]] or [m["tokens_per_s"] for m in metrics]
    return {"seconds": round(seconds, 1), "steps": metrics[-1]["step"],
            "train_tokens_per_s_median": round(statistics.median(steady), 1),
            "wait_fraction": round(metrics[-1]["wait_fraction"], 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["stream", "job", "both", "ab"], default="both")
    p.add_argument("--baseline", default=None, help="--part ab: an earlier hsx's tree")
    p.add_argument("--unit-mib", type=int, default=64)
    p.add_argument("--units", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--workdir", default="/tmp/hsx-bench-online-stream")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out) if args.out else campaign_path("online-stream", "online_stream.json")
    if args.part in ("stream", "both"):
        result = hand_off(args)
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        save_section(out, "stream", result, machine_info())
    if args.part in ("job", "both"):
        result = online_jobs(args)
        print(json.dumps(result, indent=1))
        save_section(out, "online_job", result, machine_info())
    if args.part == "ab":
        if not args.baseline:
            p.error("--part ab needs --baseline DIR")
        result = online_ab(args)
        print(json.dumps(result, indent=1))
        save_section(out, "one_node_ab", result, machine_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
