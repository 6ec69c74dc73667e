"""GPU benchmark: `hsx extract` on real vLLM against vLLM's own capture ceiling and the disk.

Everything in one run on one machine (the lent H200s, vLLM 0.25.1 through the recipe in
benchmarks/gpu/README.md), so the ratios compare like with like:

- `disk`   raw sequential write + fsync of 4 GiB into the disk output's folder and into
           /dev/shm: the storage ceilings, in GB/s and in tokens/s at the job's bytes
           per token.
- `drop`   vLLM alone, in its own process: `LLM.generate(max_tokens=1)` with
           extract_hidden_states and benchmarks/drop_connector.py, which gathers each
           request's states and copies them into pinned host memory on a side stream, as
           hsx's connector does, then drops them. The capture ceiling.
- `bare`   (--bare) the same engine without capture.
- `hsx`    `hsx_service.runner.run_job` (Ray actor, vLLM engine, hsx's connector, spool,
           shard writer, commits): timed from the end of prepare (ingestion, plan) to the
           last commit; outputs in /dev/shm (tmpfs) and on the local disk; bf16 and fp8.
           The peak size of the engine's spool in /dev/shm is sampled.
- `replicas2` (2 GPUs) the same job over twice the rows with `replicas: 2`; ratio against
           replicas 1 (target >= 1.9).
- `tp2`    (2 GPUs) one engine with tensor_parallel_size 2 (placement group, vLLM's Ray
           executor); ratio against TP=1 (reported).
- `inflight` the bf16 tmpfs job with `vllm.max_inflight_tokens` at --inflight (default
           262,144) instead of 65,536: does a deeper queue in vLLM shorten the job?

Every hsx run also reports where a unit's time goes after vLLM computes it (`stages_s`,
medians over units, from the workers' UnitReport.marks): vLLM's report of the request
finished -> its states taken from the spool -> the last sample handed to the shard
writer -> written -> committed; and the same marks of the last unit from the start
(`last_unit_s`): the job's drain.

Targets (issue "The capture path at vLLM's ceiling"): hsx on tmpfs >= 0.95 of drop;
hsx on disk >= 0.95 of min(drop, disk ceiling); the same for fp8.

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service:$PWD \\
      python -m benchmarks.gpu.bench_vllm --out $OUT/vllm.json [--phases ...]
    .venv/bin/python -m benchmarks.gpu.bench_vllm --cpu --out /tmp/q.json   # CPU check

The results file is rewritten after every phase, so a run cut short keeps what it had.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
GB = 1e9

SHAPE_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
PHASES = ("disk", "drop", "bare", "hsx", "inflight", "replicas2", "tp2")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cpu = args.cpu
        self.work = Path(args.workdir)
        self.tmpfs = Path(args.tmpfs)
        self.out = Path(args.out)
        self.work.mkdir(parents=True, exist_ok=True)
        self.result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "args": vars(args), "phases": {}, "errors": {}}
        self.model = self.work / "model"
        self.layers = bench_layers(args)
        self.length = args.length
        self.max_seq_len = args.length + 64  # the jobs' max_seq_len
        self.prompts = args.prompts
        self._pool: Any = None

    # -- set-up

    def make_model(self, **shape: Any) -> int:
        """The target (a tiny Llama on the CPU, else the 8B shape with dummy weights and a
        small trained tokenizer, `shape` overriding fields of it); sets bytes_per_token
        and returns the vocabulary the prompts may use."""
        from hsx_workers.tiny_models import build_tokenizer, make_tiny_model

        if self.cpu:
            make_tiny_model(self.model, "llama")
            vocab = 512
        else:
            self.model.mkdir(parents=True, exist_ok=True)
            vocab = len(build_tokenizer(self.model, vocab_size=640))
            (self.model / "config.json").write_text(json.dumps({**SHAPE_8B, **shape}))
        hidden = 256 if self.cpu else int(SHAPE_8B["hidden_size"])
        self.bytes_per_token = {"bf16": 2 * len(self.layers) * hidden,
                                "fp8": (1 + 4 / hidden) * len(self.layers) * hidden}
        return vocab

    def setup(self) -> None:
        vocab = self.make_model()
        rng = random.Random(0)
        for name, n in (("rows", self.prompts), ("rows2", 2 * self.prompts)):
            with open(self.work / f"{name}.jsonl", "w") as f:
                for _ in range(n):
                    ids = [rng.randrange(5, vocab) for _ in range(self.length)]
                    f.write(json.dumps({"input_ids": ids}) + "\n")
        self.result["machine"] = machine()
        self.result["model"] = {"shape": "tiny llama" if self.cpu else "8B-shaped Llama",
                                "layers": self.layers, "prompts": self.prompts,
                                "prompt_tokens": self.length,
                                "bytes_per_token": self.bytes_per_token}

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=1, default=str))

    # -- phases

    def disk(self) -> dict[str, Any]:
        size = 256 * 2**20 if self.cpu else 4 * 2**30
        out = {}
        for where, folder in (("disk", self.work), ("tmpfs", self.tmpfs)):
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "raw-write.bin"
            chunk = os.urandom(64 * 2**20)
            start = time.perf_counter()
            with open(path, "wb") as f:
                for _ in range(size // len(chunk)):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            seconds = time.perf_counter() - start
            path.unlink()
            gbps = size / seconds / GB
            out[where] = {"gb_per_s": round(gbps, 3),
                          "tokens_per_s_bf16": round(gbps * GB / self.bytes_per_token["bf16"]),
                          "tokens_per_s_fp8": round(gbps * GB / self.bytes_per_token["fp8"])}
        return out

    def _vllm_alone(self, variant: str, rows: list[str] | None = None,
                    max_model_len: int | None = None) -> dict[str, Any]:
        """drop or bare in a child process (its GPU memory is back when it exits).

        `rows`: names of row files in the work folder, each timed on the one engine
        (`max_model_len` fits them all); by default rows.jsonl alone."""
        if self._pool is not None:  # an earlier hsx phase's engine holds the GPU's memory
            self._pool.shutdown()
            self._pool = None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(BENCH.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        cmd = [sys.executable, "-m", __spec__.name, "--child", variant, "--workdir", str(self.work),
               "--reps", str(self.args.reps), "--length", str(self.length),
               "--prompts", str(self.prompts), "--layers", *map(str, self.layers)
               ] + (["--cpu"] if self.cpu else [])
        if rows:
            cmd += ["--rows", *rows]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        log_path = self.work / f"{variant}.log"
        result_path = self.work / f"{variant}.json"
        result_path.unlink(missing_ok=True)
        cmd += ["--result", str(result_path)]
        with open(log_path, "w") as log_file:
            # vLLM logs to stdout: both streams go to the log, the numbers to a file. Its
            # own session: on a timeout the whole tree goes, vLLM's engine processes too.
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            try:
                proc.wait(timeout=self.args.child_timeout)
            except subprocess.TimeoutExpired:
                stacks = _stacks_of_tree(proc.pid)
                _end_session(proc.pid)
                (self.work / f"{variant}-stacks.txt").write_text(stacks)
                raise RuntimeError(f"{variant} child timed out; its log: "
                                   f"{log_path.read_text()[-3000:]}\nits stacks:\n"
                                   f"{stacks[-6000:]}") from None
            # The child leaves with os._exit, skipping vLLM's teardown, so its engine core
            # process lives on holding the GPU's memory unless its session is ended here.
            _end_session(proc.pid)
        if proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"{variant} child failed ({proc.returncode}): "
                               f"{log_path.read_text()[-3000:]}")
        return dict(json.loads(result_path.read_text()))

    def drop(self) -> dict[str, Any]:
        return self._vllm_alone("drop")

    def bare(self) -> dict[str, Any]:
        return self._vllm_alone("bare")

    def _spec(self, output: Path, dtype: str, rows: str = "rows",
              vllm_over: dict[str, Any] | None = None, **over: Any) -> Any:
        from hsx.spec import JobSpec

        vllm: dict[str, Any] = {"gpu_memory_utilization": self.args.gpu_memory_utilization,
                                **(vllm_over or {})}
        if not self.cpu:
            vllm["load_format"] = "dummy"
        return JobSpec(model=str(self.model), dataset=str(self.work / f"{rows}.jsonl"),
                       output=str(output), layers=self.layers, max_seq_len=self.max_seq_len,
                       storage_dtype=dtype, vllm=vllm, **over)

    def _job(self, spec: Any, profile: bool = False) -> dict[str, Any]:
        """run_job on the shared pool; tokens/s from the end of prepare (ingestion, plan)
        to the last commit, and for the whole job (`job_seconds`: from the call)."""
        from hsx_service.dispatch import DispatchHooks
        from hsx_service.engine_pool import EnginePool, engine_key
        from hsx_service.prepare import preflight
        from hsx_service.runner import run_job

        if self._pool is None:
            self._pool = EnginePool()
        info, layers, _ = preflight(spec)
        self._pool.keep_only(engine_key(spec, info, layers))
        self._pool.start(spec)
        shutil.rmtree(spec.output, ignore_errors=True)
        marks: dict[str, float] = {}
        peak = SpoolPeak()
        spy = _actor_profiler(self.work / f"profile-{spec.storage_dtype}.txt") if profile else None
        with peak, spy or contextlib.nullcontext():
            def prepared(_job: Any) -> None:
                marks["start"] = time.perf_counter()
                marks["start_monotonic"] = time.monotonic()

            def unit_done(report: Any) -> None:
                commits.append((time.perf_counter(), report.tokens))
                reports.append(report)

            commits: list[tuple[float, int]] = []
            reports: list[Any] = []
            called = time.perf_counter()
            summary = run_job(spec, pool=self._pool,
                              hooks=DispatchHooks(on_prepared=prepared, on_unit_done=unit_done))
            ended = time.perf_counter()
            seconds = ended - marks["start"]
        profiled = {}
        if spy is not None:
            from benchmarks.cpu_profile import breakdown

            profiled = {"profile_cpu_seconds": breakdown(spy.out, spy.pid)}
        from hsx.dataset import HiddenStatesDataset

        ds = HiddenStatesDataset(spec.output)
        if summary.errors or len(ds) != summary.samples or not ds.complete:
            raise RuntimeError(f"{spec.output}: {summary}")
        from hsx.output import Output

        Output(spec.output).verify(ds.records[:1])  # one shard: checksums of all take seconds
        shutil.rmtree(spec.output, ignore_errors=True)
        return {"tokens": summary.tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(summary.tokens / seconds),
                "job_seconds": round(ended - called, 3),
                "job_tokens_per_s": round(summary.tokens / (ended - called)),
                **_commit_times(marks["start"], commits),
                **_stages(marks["start_monotonic"], reports),
                "bytes": summary.bytes, "shards": summary.shards,
                "spool_peak_bytes": peak.peak, "restarts": summary.restarts, **profiled}

    def hsx(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for dtype in ("bf16", "fp8"):
            for rep in range(self.args.reps):
                for where, folder in (("tmpfs", self.tmpfs), ("disk", self.work)):
                    key = f"{dtype}-{where}"
                    # The last tmpfs run of each dtype again under py-spy (not timed).
                    run = self._job(self._spec(folder / f"out-{key}", dtype))
                    out.setdefault(key, []).append(run)
                    log(f"hsx {key} rep {rep}: {run['tokens_per_s']:,} tok/s "
                        f"(spool peak {run['spool_peak_bytes'] / 2**30:.2f} GiB)")
            if self.args.profile:
                run = self._job(self._spec(self.tmpfs / f"out-{dtype}-prof", dtype), profile=True)
                out[f"{dtype}-tmpfs-profiled"] = run
                log(f"hsx {dtype} tmpfs under py-spy: {run['tokens_per_s']:,} tok/s")
        return out

    def inflight(self) -> dict[str, Any]:
        tokens = self.args.inflight
        runs = []
        for rep in range(self.args.reps):
            run = self._job(self._spec(self.tmpfs / "out-inflight", "bf16",
                                       vllm_over={"max_inflight_tokens": tokens}))
            runs.append(run)
            log(f"inflight {tokens}, rep {rep}: {run['tokens_per_s']:,} tok/s "
                f"(spool peak {run['spool_peak_bytes'] / 2**30:.2f} GiB)")
        return {"bf16-tmpfs": runs, "max_inflight_tokens": tokens}

    def replicas2(self) -> dict[str, Any]:
        runs = []
        for rep in range(self.args.reps):
            run = self._job(self._spec(self.tmpfs / "out-r2", "bf16", rows="rows2", replicas=2))
            runs.append(run)
            log(f"replicas 2 rep {rep}: {run['tokens_per_s']:,} tok/s")
        return {"bf16-tmpfs": runs}

    def tp2(self) -> dict[str, Any]:
        runs = []
        for rep in range(self.args.reps):
            run = self._job(self._spec(self.tmpfs / "out-tp2", "bf16",
                                       tensor_parallel_size=2))
            runs.append(run)
            log(f"tp 2 rep {rep}: {run['tokens_per_s']:,} tok/s")
        return {"bf16-tmpfs": runs}

    def ratios(self) -> dict[str, Any]:
        p = self.result["phases"]

        def best(runs: list[dict[str, Any]]) -> float:
            return max(r["tokens_per_s"] for r in runs)

        def med(runs: list[dict[str, Any]]) -> float:
            values = sorted(r["tokens_per_s"] for r in runs)
            return values[len(values) // 2]

        out: dict[str, Any] = {}
        drop = p.get("drop")
        disk = p.get("disk", {}).get("disk")
        for dtype in ("bf16", "fp8"):
            tmp = p.get("hsx", {}).get(f"{dtype}-tmpfs")
            dsk = p.get("hsx", {}).get(f"{dtype}-disk")
            if drop and tmp:
                out[f"hsx/drop {dtype} tmpfs"] = {
                    "median": round(med(tmp) / med(drop["runs"]), 3),
                    "best": round(best(tmp) / best(drop["runs"]), 3), "target": 0.95}
            if drop and dsk and disk:
                ceiling = min(med(drop["runs"]), disk[f"tokens_per_s_{dtype}"])
                out[f"hsx/min(drop, disk) {dtype} disk"] = {
                    "median": round(med(dsk) / ceiling, 3), "ceiling_tokens_per_s": ceiling,
                    "ceiling": "drop" if ceiling == med(drop["runs"]) else "disk",
                    "target": 0.95}
        one = p.get("hsx", {}).get("bf16-tmpfs")
        if one and p.get("replicas2"):
            out["replicas 2 / replicas 1"] = {
                "median": round(med(p["replicas2"]["bf16-tmpfs"]) / med(one), 3),
                "target": 1.9}
        if one and p.get("inflight"):
            out["inflight deep / default"] = {
                "median": round(med(p["inflight"]["bf16-tmpfs"]) / med(one), 3)}
        if one and p.get("tp2"):
            out["tp 2 / tp 1"] = {"median": round(med(p["tp2"]["bf16-tmpfs"]) / med(one), 3)}
        if drop and p.get("bare"):
            out["drop/bare"] = {"median": round(med(drop["runs"]) / med(p["bare"]["runs"]), 3)}
            with_capture, without = drop.get("memory", {}), p["bare"].get("memory", {})
            if with_capture.get("cache_tokens") and without.get("cache_tokens"):
                # The capture's cache-only layer shares the KV budget: fewer tokens in flight.
                out["cache tokens, capture / bare"] = round(
                    with_capture["cache_tokens"] / without["cache_tokens"], 3)
        return out

    def run(self) -> None:
        self.setup()
        self.save()
        try:
            self.run_phases()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
        log(json.dumps(self.result["ratios"], indent=1))

    def run_phases(self) -> None:
        """Every phase of --phases in order, the ratios and the file after each."""
        for phase in self.args.phases:
            start = time.perf_counter()
            log(f"== {phase}")
            try:
                self.result["phases"][phase] = getattr(self, phase)()
            except Exception as err:
                self.result["errors"][phase] = f"{type(err).__name__}: {err}"
                log(traceback.format_exc())
            self.result.setdefault("phase_seconds", {})[phase] = round(
                time.perf_counter() - start, 1)
            self.result["ratios"] = self.ratios()
            self.save()


class SpoolPeak:
    """The largest total size of the engines' spools in /dev/shm while the block runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        root = Path("/dev/shm")
        while not self._stop.wait(0.1):
            total = 0
            for spool in root.glob("hsx-spool-*"):
                for entry in os.scandir(spool):
                    try:
                        total += entry.stat().st_size
                    except OSError:
                        continue
            self.peak = max(self.peak, total)

    def __enter__(self) -> SpoolPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _commit_times(start: float, commits: list[tuple[float, int]]) -> dict[str, Any]:
    """When each unit committed, and the rate between the first and the last commit: the
    steady rate, without the job's start (first unit) and with the last unit's tail."""
    out: dict[str, Any] = {"commit_s": [round(t - start, 3) for t, _ in commits]}
    if len(commits) > 1:
        span = commits[-1][0] - commits[0][0]
        out["steady_tokens_per_s"] = round(sum(n for _, n in commits[1:]) / span) if span else None
    return out


STAGES = ("queued", "fed", "fed_last", "computed", "spooled", "taken", "written", "committed")


def _stages(start: float, reports: list[Any]) -> dict[str, Any]:
    """Where units' time went after vLLM computed them (medians over units, seconds), and
    the last unit's marks from the start: the job's drain. Marks are the workers'
    time.monotonic(), the same clock as `start` on one host."""
    marked = [r.marks for r in reports if getattr(r, "marks", None)]
    if not marked:
        return {}
    steps = [(a, b) for a, b in itertools.pairwise(STAGES) if a != "queued"]
    stages: dict[str, float] = {}
    for a, b in steps:
        spans = sorted(m[b] - m[a] for m in marked if a in m and b in m)
        if spans:
            stages[f"{a}->{b}"] = round(spans[len(spans) // 2], 3)
    last = max(marked, key=lambda m: m.get("committed", 0.0))
    return {"stages_s": stages,
            "first_fed_s": round(min(m.get("fed", start) for m in marked) - start, 3),
            "last_unit_s": {k: round(v - start, 3) for k, v in last.items()}}


def _actor_profiler(out: Path) -> Any:
    """py-spy on the extraction actor's process tree (vLLM's engine processes included)."""
    import psutil

    from benchmarks.cpu_profile import Profiler

    for proc in psutil.process_iter(["cmdline"]):
        if "ExtractionWorker" in " ".join(proc.info["cmdline"] or []):
            return Profiler(proc.pid, out)
    raise RuntimeError("no ExtractionWorker process to profile")


def _end_session(sid: int) -> None:
    """SIGKILL every process of session `sid` and wait until they are gone."""
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid:
                members.append(p)
                p.kill()
    psutil.wait_procs(members, timeout=60)


def _stacks_of_tree(pid: int) -> str:
    """py-spy dump of a process and its descendants (vLLM's engine core is a child): where a
    hung child waits, kept for the results."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error as err:
        return f"no stacks: {err}"
    out = []
    for p in procs:
        try:
            dump = subprocess.run(["py-spy", "dump", "--pid", str(p.pid)], capture_output=True,
                                  text=True, timeout=30)
            out.append(f"--- {p.pid} {' '.join(p.cmdline())[:200]}\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.SubprocessError, psutil.Error) as err:
            out.append(f"--- {p.pid}: no dump ({err})")
    return "\n".join(out)


def child(args: argparse.Namespace) -> int:
    """drop / bare: vLLM's LLM.generate over the rows, `reps` times, timed; with --rows,
    over each named row file of the work folder in turn, on the same engine."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = Path(args.workdir)
    layers = bench_layers(args)
    max_model_len = args.max_model_len or args.length + 66
    engine: dict[str, Any] = {"model": str(work / "model"), "max_model_len": max_model_len,
                              "enable_prefix_caching": False, "disable_log_stats": True,
                              "gpu_memory_utilization": args.gpu_memory_utilization}
    if not args.cpu:
        engine["load_format"] = "dummy"
    if args.child == "drop":
        engine["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
        engine["kv_transfer_config"] = {
            "kv_connector": "DropHiddenStatesConnector",
            "kv_connector_module_path": "benchmarks.drop_connector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "drop-spool")}}
    started = time.perf_counter()
    llm = LLM(**engine)
    start_s = time.perf_counter() - started
    cache = llm.llm_engine.vllm_config.cache_config
    memory: dict[str, Any] = {"num_gpu_blocks": cache.num_gpu_blocks,
                              "block_size": cache.block_size,
                              "cache_tokens": (cache.num_gpu_blocks or 0) * cache.block_size}
    if not args.cpu:
        import torch

        free, total = torch.cuda.mem_get_info()
        memory["device_used_bytes"] = total - free  # the engine core's, in its own process
    params = SamplingParams(max_tokens=1, detokenize=False)
    by_rows: dict[str, list[dict[str, Any]]] = {}
    for name in args.rows or ["rows"]:
        prompts = [TokensPrompt(prompt_token_ids=json.loads(line)["input_ids"])
                   for line in (work / f"{name}.jsonl").read_text().splitlines()]
        llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
        runs = by_rows.setdefault(name, [])
        for _ in range(args.reps):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
            tokens = sum(len(o.prompt_token_ids or ()) for o in outs)
            runs.append({"tokens": tokens, "seconds": round(seconds, 3),
                         "tokens_per_s": round(tokens / seconds)})
    result: dict[str, Any] = {"engine_start_s": round(start_s, 1), "memory": memory}
    if args.rows:
        result["rows"] = by_rows
    else:
        result["runs"] = by_rows["rows"]
    Path(args.result).write_text(json.dumps(result))
    os._exit(0)  # skip vLLM's slow teardown; the parent only needs the numbers


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host_cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as err:
        info["torch"] = f"unavailable: {err}"
    try:
        from hsx_workers.engines.vllm.compat import vllm_version

        info["vllm"] = vllm_version()
    except Exception:
        pass
    with open("/proc/cpuinfo") as f:
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                            if ln.startswith("model name")), "?")
    return info


def bench_layers(args: argparse.Namespace) -> list[int]:
    """The ids every phase captures: --layers as a job's `layers:` reads it."""
    from hsx.methods import resolve_layers

    if not args.layers:
        return [1, 2, 3, 4] if args.cpu else [2, 16, 29, 32]
    n = 4 if args.cpu else int(SHAPE_8B["num_hidden_layers"])
    return resolve_layers([int(x) if x.isdigit() else x for x in args.layers], n)


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/hsx-bench-vllm.json")
    p.add_argument("--phases", nargs="+", default=["disk", "drop", "hsx"], choices=PHASES)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--workdir", default="/tmp/hsx-bench-vllm")
    p.add_argument("--tmpfs", default="/dev/shm/hsx-bench-vllm")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--child-timeout", type=float, default=600)
    p.add_argument("--inflight", type=int, default=262144,
                   help="max_inflight_tokens of the `inflight` phase")
    p.add_argument("--cpu", action="store_true", help="check the script on CPU (tiny model)")
    p.add_argument("--layers", nargs="+", default=None,
                   help="ids captured, or draft methods standing for theirs (`dflash`), as a "
                        "job's `layers:` (default EAGLE-3's: 2 16 29 32; 1-4 with --cpu)")
    p.add_argument("--profile", action="store_true",
                   help="one more tmpfs run per dtype under py-spy: where the actor and the "
                        "engine spend their CPU time")
    p.add_argument("--child", choices=["drop", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--rows", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.child:
        return child(args)
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
