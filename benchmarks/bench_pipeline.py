"""Pipeline efficiency: hsx's capture path against vLLM-only baselines, same prompts, one run.

Variants, each in its own fresh process with its own vLLM CPU engine (engine start is
not timed; each process warms up on a few prompts before the timed repetitions):

- `hsx`   what `hsx extract` does per work unit, without Ray: the output is prepared
          with `hsx_service.prepare.prepare(JobSpec)` (ingest of pre-tokenized rows,
          manifest, plan; not timed), then `ExtractionWorker("vllm", ...).run_unit` runs
          every unit: VllmEngine steps vLLM's LLMEngine, HsxHiddenStatesConnector spools
          each request's states, ShardWriter streams them into a shard with its checksum and
          commits it (fsync, rename, commit record). Timed: first unit start to last
          commit.
- `drop`  the ceiling: `extract_hidden_states` with drop_connector.py, which copies each
          request's states out of the cache into host memory and drops them.
          `LLM.generate` over all prompts.
- `files` vLLM's per-request-file path as speculators uses it: file_connector.py (vLLM's
          ExampleHiddenStatesConnector minus pinned memory and CUDA streams) writes one
          safetensors file per request plus a `.lock` into a directory on the same file
          system as hsx's output (page cache, no fsync); after `LLM.generate` returns,
          the client does what `speculators generate-offline-data --validate-outputs`
          does per sample: wait for the lock, remove it, move the file to
          `hs_{i}.safetensors`, load it and check its token ids and length.
- `bare`  `LLM.generate(max_tokens=1)` with no capture at all (report only).

The four processes stay alive side by side (idle ones wait on a pipe) and the
repetitions are interleaved: round r runs every variant once, in an order rotated by r.
Ratios are of median tokens/s; the per-round (paired) ratios are kept too.

Run: `python -m benchmarks.bench_pipeline [--quick]` (or through run_all.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks import common
from hsx.spec import JobSpec

VARIANTS = ("hsx", "hsx-omp1", "drop", "files", "bare")
# Diagnostics, run only when named with --variants: `hsx-capture` is hsx-omp1's engine
# path (VllmEngine.capture: connector, spool file, load) without the shard writer.
DIAGNOSTIC_VARIANTS = ("hsx-capture", "hsx-nice0", "hsx-direct", "hsx-bf16", "drop-bf16",
                       "bare-bf16", "hsx-aot")
# Environment of a diagnostic variant: hsx-nice0 is hsx with its background threads
# (shard writer, committer, connector's spool writers) at normal priority; hsx-direct
# writes shards with direct I/O (HSX_DIRECT_IO=1); hsx-aot compiles through vLLM's AOT
# artifact, which its CPU build saves and cannot load (compat.compile_through_loadable_cache).
VARIANT_ENV = {"hsx-nice0": {"HSX_BACKGROUND_NICE": "0"}, "hsx-direct": {"HSX_DIRECT_IO": "1"},
               "hsx-aot": {"VLLM_USE_AOT_COMPILE": "1"}}
# The model's dtype of each variant (`vllm.dtype`): `auto` is float32 on a CPU without
# native bf16 (hsx_workers/dtypes.py); the -bf16 variants are their base variant in bf16.
VARIANT_DTYPE = {"hsx-bf16": "bfloat16", "drop-bf16": "bfloat16", "bare-bf16": "bfloat16"}
TARGETS = {"hsx/drop": 0.95, "hsx/files": 1.15}
REPORT_ONLY = ("hsx-omp1/drop", "hsx-omp1/files", "hsx/bare", "drop/bare", "files/drop",
               "hsx-capture/drop", "hsx-omp1/hsx-capture", "hsx-nice0/drop", "hsx/hsx-nice0",
               "hsx-direct/drop", "hsx-direct/hsx", "hsx/hsx-bf16", "drop/drop-bf16",
               "bare/bare-bf16", "hsx-bf16/drop-bf16", "hsx/hsx-aot")
MAX_SEQ_LEN = 1024
MIN_PROMPT, MAX_PROMPT = 64, 1024
WARMUP_PROMPTS = 8
START_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 1800.0
CONNECTORS = {
    "drop": ("benchmarks.drop_connector", "DropHiddenStatesConnector"),
    "files": ("benchmarks.file_connector", "CpuExampleHiddenStatesConnector"),
}


@dataclass(frozen=True)
class ModelShape:
    """A random-weight Llama built with hsx_workers.tiny_models.make_tiny_model."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    prompts: int
    quick_prompts: int
    reps: int

    @property
    def layers(self) -> list[int]:
        n = self.num_layers
        return sorted({1, n // 2, n - 1, n})

    @property
    def bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.hidden_size  # bf16


MODELS = {
    # The tests' tiny model: per-token I/O is large next to its compute.
    "tiny": ModelShape("tiny", 4, 256, 4, 2, 512, prompts=400, quick_prompts=48, reps=5),
    # Compute dominates, as for real models on GPUs (head_dim 64, as vLLM CPU needs).
    "large": ModelShape("large", 8, 1024, 16, 4, 2816, prompts=96, quick_prompts=12, reps=3),
}


# ------------------------------------------------------------------------- child side


class Stopwatch:
    """Wall seconds and CPU seconds (this process, its engine processes) of one region."""

    def __enter__(self) -> Stopwatch:
        self._cpu = _cpu_seconds()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        end = _cpu_seconds()
        self.cpu_s = {k: round(end[k] - self._cpu.get(k, 0.0), 2) for k in end}


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process and by its engine processes.

    "front" is this process (LLM / hsx's engine loop, spool reads, ShardWriter thread);
    "engine" its child processes (vLLM's engine core and worker, where the model runs
    and where connectors copy and write).
    """
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    engine = 0.0
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:
            continue
        engine += c.user + c.system
    return {"front": t.user + t.system, "engine": engine}


def _base(variant: str) -> str:
    """The variant a -bf16 one runs as (in bf16)."""
    return variant.removesuffix("-bf16")


def _engine_args(cfg: dict[str, Any], variant: str) -> dict[str, Any]:
    """The LLM(...) arguments of a baseline: those VllmEngine passes, minus hsx's connector."""
    from hsx_workers.dtypes import vllm_dtype

    args: dict[str, Any] = dict(
        model=cfg["model"],
        tensor_parallel_size=1,
        max_model_len=cfg["max_seq_len"] + 2,
        dtype=vllm_dtype(cfg.get("dtype", "auto"), cfg["model"]),
        trust_remote_code=False,
        enable_prefix_caching=False,
        disable_log_stats=True,
        gpu_memory_utilization=0.85,
    )
    if variant in CONNECTORS:
        module, cls = CONNECTORS[variant]
        args["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": list(cfg["layers"])}
            },
        }
        args["kv_transfer_config"] = {
            "kv_connector": cls,
            "kv_connector_module_path": module,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": cfg["spool"]},
        }
    return args


class HsxRunner:
    """ExtractionWorker.run_unit over every unit of a freshly prepared output."""

    def __init__(self, cfg: dict[str, Any], capture_only: bool = False) -> None:
        from hsx_workers.worker import ExtractionWorker

        self.cfg = cfg
        self.capture_only = capture_only
        self.work = Path(cfg["workdir"])
        warm = self._prepare(cfg["warmup_dataset"], self.work / "hsx-warmup")
        self.warm_job = warm
        self.worker = ExtractionWorker("vllm", self._engine_config(warm), name="bench")

    @staticmethod
    def _engine_config(job: Any) -> Any:
        """The EngineConfig `hsx extract` would build for this job."""
        import inspect

        from hsx_service.engine_config import engine_config_for

        # engine_config_for(job) or engine_config_for(spec, model, layers): both existed.
        config_for: Any = engine_config_for
        if len(inspect.signature(config_for).parameters) == 1:
            return config_for(job)
        return config_for(job.spec, job.model, job.layers)

    def _prepare(self, dataset: str, output: Path) -> Any:
        from hsx.spec import JobSpec
        from hsx_service.prepare import prepare

        spec = JobSpec(
            model=self.cfg["model"],
            dataset=dataset,
            output=str(output),
            layers=self.cfg["layers"],
            max_seq_len=self.cfg["max_seq_len"],
            vllm={"dtype": self.cfg.get("dtype", "auto")},
            **({"unit_tokens": self.cfg["unit_tokens"]} if self.cfg.get("unit_tokens") else {}),
        )
        return prepare(spec, stream=False)

    def _run_units(self, job: Any) -> list[Any]:
        """Every unit, handed to the worker as the job driver does: DISPATCH_DEPTH at once."""
        from concurrent.futures import ThreadPoolExecutor

        from hsx_service.engine_pool import DISPATCH_DEPTH

        with ThreadPoolExecutor(DISPATCH_DEPTH) as pool:
            futures = [pool.submit(self.worker.run_unit, str(job.output), "bf16", u)
                       for u in job.pending]
            return [f.result() for f in futures]

    def warmup(self) -> None:
        self._run_units(self.warm_job)
        shutil.rmtree(str(self.warm_job.output))

    def _capture_only(self, rep: int) -> dict[str, Any]:
        """Diagnostic: VllmEngine.capture over every prompt, results dropped (no shard)."""
        from hsx_workers.engines.base import CaptureRequest

        prompts = json.loads(Path(self.cfg["prompts"]).read_text())
        requests = [CaptureRequest(i, ids) for i, ids in enumerate(prompts)]
        tokens = samples = 0
        with Stopwatch() as clock:
            for result in self.worker.engine.capture(requests):
                if result.error is not None:
                    raise RuntimeError(f"sample {result.sample_index}: {result.error}")
                tokens += len(result.input_ids)
                samples += 1
        return {"seconds": clock.seconds, "cpu_s": clock.cpu_s, "tokens": tokens,
                "samples": samples}

    def run(self, rep: int) -> dict[str, Any]:
        from hsx.dataset import HiddenStatesDataset

        if self.capture_only:
            return self._capture_only(rep)
        output = self.work / f"hsx-out-{rep}"
        job = self._prepare(self.cfg["dataset"], output)
        with Stopwatch() as clock:
            reports = self._run_units(job)
        samples = sum(r.samples for r in reports)
        errors = sum(len(r.errors) for r in reports)
        if errors or samples != self.cfg["num_prompts"]:
            raise RuntimeError(f"hsx wrote {samples} samples with {errors} errors")
        if len(HiddenStatesDataset(output, backend="numpy")) != samples:
            raise RuntimeError("hsx output does not list every sample")
        shutil.rmtree(output)
        return {
            "seconds": clock.seconds,
            "cpu_s": clock.cpu_s,
            "tokens": sum(r.tokens for r in reports),
            "samples": samples,
            "bytes_written": sum(r.bytes for r in reports),
            "units": len(reports),
            "unit_seconds": [round(r.seconds, 3) for r in reports],
        }

    def close(self) -> None:
        self.worker.shutdown()


class GenerateRunner:
    """LLM.generate over all prompts (drop / files / bare)."""

    def __init__(self, cfg: dict[str, Any], variant: str) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.cfg = cfg
        self.variant = variant
        self.work = Path(cfg["workdir"])
        self.prompts = json.loads(Path(cfg["prompts"]).read_text())
        self.requests = [TokensPrompt(prompt_token_ids=ids) for ids in self.prompts]
        self.params = SamplingParams(max_tokens=1, detokenize=False)
        self.llm = LLM(**_engine_args(cfg, variant))

    def _generate(self, prompts: list[Any], out_dir: Path) -> int:
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"{len(outputs)} outputs for {len(prompts)} prompts")
        if self.variant == "files":
            self._client(outputs, prompts, out_dir)
        return sum(len(o.prompt_token_ids or ()) for o in outputs)

    @staticmethod
    def _client(outputs: list[Any], prompts: list[Any], out_dir: Path) -> None:
        """speculators' per-sample client work: lock, move, load, check."""
        from safetensors.torch import load_file

        out_dir.mkdir(parents=True, exist_ok=True)
        for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
            path = (out.kv_transfer_params or {})["hidden_states_path"]
            lock = path + ".lock"
            if os.path.exists(lock):
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # sleeps until the writer is done
                finally:
                    os.close(fd)
                os.remove(lock)
            target = out_dir / f"hs_{i}.safetensors"
            shutil.move(path, target)
            data = load_file(str(target))
            ids = prompt["prompt_token_ids"]
            if data["token_ids"].tolist() != ids or data["hidden_states"].shape[0] != len(ids):
                raise RuntimeError(f"{target}: token ids or length do not match the prompt")

    def warmup(self) -> None:
        out = self.work / f"{self.variant}-warmup"
        self._generate(self.requests[:WARMUP_PROMPTS], out)
        shutil.rmtree(out, ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        out = self.work / f"{self.variant}-out-{rep}"
        with Stopwatch() as clock:
            tokens = self._generate(self.requests, out)
        result: dict[str, Any] = {"seconds": clock.seconds, "cpu_s": clock.cpu_s,
                                  "tokens": tokens, "samples": len(self.requests)}
        if self.variant == "files":
            files = list(out.iterdir())
            if len(files) != len(self.requests):
                raise RuntimeError(f"{len(files)} files for {len(self.requests)} requests")
            result["bytes_written"] = sum(f.stat().st_size for f in files)
            shutil.rmtree(out)
        return result

    def close(self) -> None:
        shutdown = getattr(self.llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()


def child_main(variant: str, config: Path, fd: int) -> int:
    """One variant's process: start the engine, warm up, then run repetitions on command."""
    os.set_inheritable(fd, False)
    channel = os.fdopen(fd, "w", buffering=1)

    def send(**msg: Any) -> None:
        channel.write(json.dumps(msg) + "\n")
        channel.flush()

    cfg = json.loads(config.read_text())
    runner: HsxRunner | GenerateRunner | None = None
    try:
        start = time.perf_counter()
        if variant in ("hsx-omp1", "hsx-capture"):
            # As in a Ray actor with num_cpus=1 (Ray sets OMP_NUM_THREADS=1 there): torch
            # in this process (ShardWriter's copies) runs on one thread. vLLM's engine
            # processes are unaffected: its CPU worker binds its own OpenMP threads.
            import torch

            torch.set_num_threads(1)
        if variant.startswith("hsx"):
            runner = HsxRunner(cfg, capture_only=variant == "hsx-capture")
        else:
            runner = GenerateRunner(cfg, _base(variant))
        started = time.perf_counter() - start
        runner.warmup()
        send(event="ready", engine_start_s=started,
             warmup_s=time.perf_counter() - start - started)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            load_before = os.getloadavg()[0]
            result = runner.run(int(cmd["rep"]))
            send(event="result", loadavg_1m=[load_before, os.getloadavg()[0]], **result)
    except BaseException as err:
        send(event="error", message=f"{type(err).__name__}: {err}",
             traceback=traceback.format_exc())
        return 1
    finally:
        if runner is not None:
            runner.close()
    return 0


# ------------------------------------------------------------------------ parent side


class Child:
    """A variant's process, commanded over stdin, answering over a private pipe."""

    def __init__(self, variant: str, config: Path, log: IO[str], env: dict[str, str]) -> None:
        self.variant = variant
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--child", variant, "--config", str(config),
             "--fd", str(write_fd)],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), env=env, text=True, cwd=common.REPO,
        )
        os.close(write_fd)
        self._fd = read_fd
        self._buf = b""

    def recv(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.variant}: no answer within {timeout:.0f}s")
            ready, _, _ = select.select([self._fd], [], [], 1.0)
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.variant}: process exited ({self.proc.poll()})")
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise RuntimeError(f"{self.variant}: process exited ({self.proc.returncode})")
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        if msg.get("event") == "error":
            raise RuntimeError(f"{self.variant} failed: {msg['message']}\n{msg['traceback']}")
        return msg

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        os.close(self._fd)


def cpu_binding() -> str:
    """All cores this process may use, in VLLM_CPU_OMP_THREADS_BIND's syntax.

    `hsx extract` binds each engine's OpenMP threads this way (one engine: every core).
    Left to itself, vLLM's CPU build reserves a core for its scheduler process unless a
    KV connector is configured, so `bare` would compute on one core of two and the
    connector variants on both; binding every variant alike keeps them comparable.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def make_prompts(n: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`n` random token-id prompts with lengths uniform in [MIN_PROMPT, MAX_PROMPT]."""
    rng = random.Random(seed)
    return [
        [rng.randrange(5, vocab_size) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
        for _ in range(n)
    ]


def _write_jsonl(path: Path, prompts: list[list[int]]) -> None:
    with open(path, "w") as f:
        for ids in prompts:
            f.write(json.dumps({"input_ids": ids}) + "\n")


def bench_model(shape: ModelShape, *, quick: bool, reps: int, work: Path, log: IO[str],
                seed: int, variants: tuple[str, ...] = VARIANTS,
                prompts_n: int | None = None, unit_tokens: int | None = None,
                profile_dir: Path | None = None) -> dict[str, Any]:
    from hsx_workers.tiny_models import make_tiny_model

    model_dir = work / f"model-{shape.name}"
    make_tiny_model(
        model_dir, num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
    )
    n = prompts_n or (shape.quick_prompts if quick else shape.prompts)
    prompts = make_prompts(n, vocab_size=512, seed=seed)
    tokens = sum(len(p) for p in prompts)
    (work / f"prompts-{shape.name}.json").write_text(json.dumps(prompts))
    _write_jsonl(work / f"dataset-{shape.name}.jsonl", prompts)
    _write_jsonl(work / f"warmup-{shape.name}.jsonl", prompts[:WARMUP_PROMPTS])

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(common.REPO), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding())
    env["TOKENIZERS_PARALLELISM"] = "false"

    children: dict[str, Child] = {}
    profiles: dict[str, Any] = {}
    engine_start: dict[str, float] = {}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        # One at a time: starting engines side by side on a few cores only slows all.
        for variant in variants:
            vwork = work / f"{shape.name}-{variant}"
            vwork.mkdir()
            cfg = {
                "model": str(model_dir), "layers": shape.layers, "max_seq_len": MAX_SEQ_LEN,
                "prompts": str(work / f"prompts-{shape.name}.json"),
                "dataset": str(work / f"dataset-{shape.name}.jsonl"),
                "warmup_dataset": str(work / f"warmup-{shape.name}.jsonl"),
                "num_prompts": n, "workdir": str(vwork), "spool": str(vwork / "spool"),
                "unit_tokens": unit_tokens, "dtype": VARIANT_DTYPE.get(variant, "auto"),
            }
            cfg_path = vwork / "config.json"
            cfg_path.write_text(json.dumps(cfg))
            log.write(f"\n===== {shape.name} / {variant}: starting\n")
            log.flush()
            print(f"  [{shape.name}] starting {variant} engine ...", flush=True)
            child = Child(variant, cfg_path, log, {**env, **VARIANT_ENV.get(variant, {})})
            children[variant] = child
            ready = child.recv(START_TIMEOUT_S)
            engine_start[variant] = round(ready["engine_start_s"], 1)
        for rep in range(reps):
            for order, variant in enumerate(common.alternating(variants, rep)):
                children[variant].send(cmd="run", rep=rep)
                res = children[variant].recv(RUN_TIMEOUT_S)
                if res["tokens"] != tokens:
                    raise RuntimeError(f"{variant}: {res['tokens']} tokens, expected {tokens}")
                res.pop("event")
                res.update(rep=rep, order=order, tokens_per_s=res["tokens"] / res["seconds"])
                runs[variant].append(res)
                print(f"  [{shape.name}] rep {rep} {variant:5s} {res['tokens_per_s']:>10,.0f} tok/s"
                      f"  ({res['seconds']:.2f} s)", flush=True)
        if profile_dir is not None:
            # One more run of each variant under py-spy, outside the timed repetitions.
            from benchmarks.cpu_profile import Profiler, breakdown

            profile_dir.mkdir(parents=True, exist_ok=True)
            for variant in variants:
                child = children[variant]
                raw = profile_dir / f"{shape.name}-{variant}.txt"
                with Profiler(child.proc.pid, raw):
                    child.send(cmd="run", rep=reps)
                    res = child.recv(RUN_TIMEOUT_S)
                profiles[variant] = {
                    "tokens_per_s": res["tokens"] / res["seconds"],
                    "seconds": res["seconds"],
                    "cpu_seconds": breakdown(raw, child.proc.pid),
                }
                print(f"  [{shape.name}] profiled {variant}: {profiles[variant]}", flush=True)
    finally:
        for child in children.values():
            child.stop()

    med, ratios = summarize(runs)
    return {
        "shape": asdict(shape),
        "layers": shape.layers,
        "bytes_per_token": shape.bytes_per_token,
        "prompts": n,
        "tokens": tokens,
        "reps": reps,
        "prompt_lengths": {"min": min(map(len, prompts)), "max": max(map(len, prompts)),
                           "mean": tokens / n},
        "engine_start_s": engine_start,
        "tokens_per_s_median": med,
        "ratios": ratios,
        "runs": runs,
        **({"profiles": profiles} if profiles else {}),
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, float], dict[str, Any]]:
    """Median tokens/s per variant, and every ratio whose two variants ran.

    A ratio is of the medians; `paired` holds the per-round ratios (same round, so the
    same moment of a shared machine's load).
    """
    med = {v: common.median([r["tokens_per_s"] for r in rs]) for v, rs in runs.items()}
    ratios: dict[str, Any] = {}
    for name in (*TARGETS, *REPORT_ONLY):
        a, b = name.split("/")
        if a not in runs or b not in runs:
            continue
        ratios[name] = common.compare(runs[a], runs[b], "tokens_per_s", TARGETS.get(name))
    return med, ratios


def resummarize(path: Path) -> None:
    """Recompute the medians and ratios of a results file's pipeline section from its
    raw runs (after the set of reported ratios changed) and print the tables again."""
    data = common.load_results(path)
    section = data["benchmarks"]["pipeline"]
    for m in section["models"].values():
        m["tokens_per_s_median"], m["ratios"] = summarize(m["runs"])
    machine = section.pop("machine")
    common.save_section(path, "pipeline", section, machine)
    print_table(section)


def print_table(result: dict[str, Any]) -> None:
    for name, m in result["models"].items():
        print(f"\npipeline / {name}: {m['prompts']} prompts, {m['tokens']:,} tokens, "
              f"layers {m['layers']}, {m['bytes_per_token']} B/token, "
              f"{m['reps']} reps")
        rows = []
        for v in m["runs"]:
            tps = [r["tokens_per_s"] for r in m["runs"][v]]
            rows.append([v, m["tokens_per_s_median"][v], min(tps), max(tps)])
        print(common.table(["variant", "median tok/s", "min", "max"], rows))
        rows = [common.ratio_row(name_r, e) for name_r, e in m["ratios"].items()]
        print(common.table(common.RATIO_HEADERS, rows))


def run(*, quick: bool, out: Path, models: list[str] | None = None, reps: int | None = None,
        workdir: Path | None = None, log_path: Path | None = None, note: str | None = None,
        variants: list[str] | None = None, prompts: int | None = None,
        unit_tokens: int | None = None, profile_dir: Path | None = None) -> dict[str, Any]:
    names = models or (["tiny"] if quick else ["tiny", "large"])
    base = workdir or Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-pipeline-", dir=base))
    log_path = log_path or (out.parent / f"{out.stem}-pipeline.log.tmp")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    machine = common.machine_info()
    result: dict[str, Any] = {
        "date": common.now_iso(), "quick": quick, "note": note,
        "workdir": common.filesystem_of(work),
        "repo_fs": common.filesystem_of(common.REPO),
        "hsx_path": "hsx_service.prepare.prepare(JobSpec) (not timed), then "
                    "hsx_workers.worker.ExtractionWorker('vllm', ...).run_unit for every unit "
                    "(timed); no Ray",
        "timing": "first request to last state persisted; engine start and a warm-up on "
                  f"{WARMUP_PROMPTS} prompts excluded",
        "unit_tokens": unit_tokens or JobSpec.model_fields["unit_tokens"].default,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_binding()),
        "variants": list(variants or VARIANTS),
        "models": {},
    }
    print(f"pipeline: work dir {work}, log {log_path}", flush=True)
    try:
        with open(log_path, "w") as log:
            for i, name in enumerate(names):
                result["models"][name] = bench_model(
                    MODELS[name], quick=quick, reps=reps or MODELS[name].reps, work=work,
                    log=log, seed=i, variants=tuple(variants or VARIANTS), prompts_n=prompts,
                    unit_tokens=unit_tokens, profile_dir=profile_dir,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    common.save_section(out, "pipeline", result, machine)
    print_table(result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model only, few prompts")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS))
    p.add_argument("--reps", type=int, help="repetitions per variant (default: 5 tiny, 3 large)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS + DIAGNOSTIC_VARIANTS,
                   help=f"variants to run (default {' '.join(VARIANTS)})")
    p.add_argument("--prompts", type=int, help="number of prompts (default per model)")
    p.add_argument("--unit-tokens", type=int,
                   help="hsx work-unit size (default: the JobSpec default, 65536)")
    p.add_argument("--out", type=Path, help="results JSON (default results/<date>-cpu/cpu.json)")
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="after the timed repetitions, run each variant once more under py-spy "
                        "(raw stacks into DIR) and store where its CPU time went")
    p.add_argument("--child", choices=VARIANTS + DIAGNOSTIC_VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--resummarize", action="store_true",
                   help="recompute ratios of --out from its raw runs, print, and exit")
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child, args.config, args.fd)
    out = args.out or common.campaign_path("cpu", "cpu-quick.json" if args.quick else "cpu.json")
    if args.resummarize:
        resummarize(out)
        return 0
    run(quick=args.quick, out=out, models=args.models, reps=args.reps, workdir=args.workdir,
        note=args.note, variants=args.variants, prompts=args.prompts,
        unit_tokens=args.unit_tokens, profile_dir=args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
