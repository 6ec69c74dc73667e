"""Draft training on 2 GPUs ÷ 1 GPU: training tokens/s of hsx's Ray Train run (DDP).

One run of this script makes its own hsx output and measures both, one after the other:

- the target: an 8B-shaped Llama config (hidden 4096, 32 layers, 32 heads, 8 kv heads,
  intermediate 14336, vocabulary 128256) whose checkpoint holds only what a draft reads
  from its target (embeddings, lm_head, final norm; random, small), so nothing of 16 GB
  is written;
- the output: random bf16 states of layers [2, 16, 29, 32] (32 KiB a token) for
  samples of 128..2048 tokens, written with hsx's ShardWriter into units of ~16k
  tokens, with its manifest and inputs table;
- the training: `train_distributed` (hsx's Ray Train TorchTrainer: one worker per GPU,
  NCCL, DDP; each worker reads its own units) with `workers` 1, then 2, the GPU
  defaults (packs of 8192 tokens, flex attention) and a 32000-token draft vocabulary,
  `--steps` steps each, no validation.

Tokens/s of a run = tokens trained on by all workers in steps `--warmup`+1 .. last ÷
the wall time between the ends of step `--warmup` and of the last step (from
draft/metrics.jsonl): compilation and the first steps are left out, the collectives
and everything else between steps are in. ratio = tokens/s with 2 workers ÷ with 1;
target >= 1.8.

GPU machine (torch + CUDA, Ray 2.60 and speculators 0.9 carried in /tmp/site; no vLLM):

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service \\
        python -m benchmarks.gpu.bench_train_scaling --out $OUT/train_scaling.json

CPU check of the script (tiny shape, gloo, ~2 min on 2 cores):

    .venv/bin/python -m benchmarks.gpu.bench_train_scaling --shape tiny --device cpu \\
        --steps 6 --warmup 2 --out /tmp/train_scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TARGET = 1.8
# Keep NVLink multicast off (the lent machines' rule), in this process and in Ray's.
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}

SHAPES: dict[str, dict[str, int]] = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 32, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 2048},
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def check_imports() -> dict[str, str]:
    """Versions of what the run needs; a clear error naming what is missing."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    missing = []
    for name in ("torch", "ray", "speculators", "transformers", "safetensors", "pyarrow",
                 "pandas", "fsspec", "requests", "pydantic", "hsx", "hsx_workers"):
        try:
            module = __import__(name)
        except ImportError as err:
            missing.append(f"{name} ({err})")
            continue
        try:
            versions[name] = version(name)
        except PackageNotFoundError:  # hsx from PYTHONPATH, not installed
            versions[name] = str(getattr(module, "__version__", "source"))
    try:
        import ray.train.torch  # noqa: F401
        from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    except ImportError as err:
        missing.append(str(err))
    if missing:
        raise SystemExit("missing: " + "; ".join(missing) + " (PYTHONPATH must hold "
                         "/tmp/site with Ray and speculators, and client, workers, service)")
    return versions


def write_target(path: Path, shape: dict[str, int], device: str) -> Path:
    """config.json of the shape and a checkpoint of embeddings, lm_head and final norm."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    heads = shape["num_attention_heads"]
    config = LlamaConfig(**shape, head_dim=shape["hidden_size"] // heads,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=3)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(path))
    gen = torch.Generator(device=device).manual_seed(0)
    vocab, hidden = shape["vocab_size"], shape["hidden_size"]

    def rand(*size: int) -> Any:
        t = torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
        return t.cpu()

    save_file({"model.embed_tokens.weight": rand(vocab, hidden),
               "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)},
              str(path / "model.safetensors"))
    return path


def measure(root: Path, workers: int, steps: int, warmup: int, use_gpu: bool,
            draft_vocab: int, loss_implementation: str) -> dict[str, Any]:
    from hsx.draft import read_metrics
    from hsx.spec import TrainSpec
    from hsx_workers.trainer import train_distributed

    shutil.rmtree(root / "draft", ignore_errors=True)
    spec = TrainSpec(workers=workers, steps=steps, checkpoint_every=10**9, val_fraction=0.0,
                     draft_vocab_size=draft_vocab, device="cuda" if use_gpu else "cpu",
                     follow=False, keep_checkpoints=1,
                     loss_implementation=loss_implementation)
    t0 = time.perf_counter()
    train_distributed(root, spec, use_gpu=use_gpu)
    wall = time.perf_counter() - t0
    rows = read_metrics(root)
    if len(rows) != steps or warmup >= steps:
        raise RuntimeError(f"{len(rows)} step records for {steps} steps (warmup {warmup})")
    steady = rows[warmup:]
    seconds = rows[-1]["time"] - rows[warmup - 1]["time"] if warmup else sum(
        r["step_s"] for r in rows)
    tokens = sum(int(r["step_tokens"]) for r in steady)
    state = json.loads((root / "draft" / "train.json").read_text())
    return {
        "workers": workers, "steps": steps, "warmup_steps": warmup,
        "tokens_per_step": tokens / len(steady), "steady_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "median_step_s": sorted(r["step_s"] for r in steady)[len(steady) // 2],
        "first_step_s": rows[0]["step_s"], "run_wall_s": wall,
        "plan": state.get("plan"),
        "step_s": [round(r["step_s"], 4) for r in rows],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--workers", default="1,2", help="worker counts, the first is the base")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens in the output (default 64k: 4 units of ~16k)")
    parser.add_argument("--draft-vocab", type=int, default=None)
    parser.add_argument("--loss-implementation", default="eager",
                        choices=["auto", "fused", "eager"],
                        help="speculators' loss kernels (eager: as the earlier GPU runs)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the output")
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default: $OUT/train_scaling.json when $OUT is set)")
    args = parser.parse_args()
    out = args.out or (Path(os.environ["OUT"]) / "train_scaling.json"
                       if os.environ.get("OUT") else None)
    for key, value in NCCL_SAFE.items():
        os.environ.setdefault(key, value)
    started = time.time()
    versions = check_imports()

    import ray
    import torch

    from benchmarks.bench_train_input import write_output

    use_gpu = args.device == "cuda"
    counts = [int(w) for w in args.workers.split(",")]
    if use_gpu and torch.cuda.device_count() < max(counts):
        raise SystemExit(f"{max(counts)} GPUs needed, torch sees {torch.cuda.device_count()}")
    shape = SHAPES[args.shape]
    tokens = args.tokens or 65536
    draft_vocab = args.draft_vocab or min(32000, shape["vocab_size"] // 2)
    work = Path(tempfile.mkdtemp(prefix="hsx-train-scaling-", dir=args.work))
    result: dict[str, Any] = {
        "benchmark": "train_scaling", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"shape": args.shape, **shape, "device": args.device, "workers": counts,
                   "steps": args.steps, "warmup": args.warmup, "tokens": tokens,
                   "draft_vocab": draft_vocab, "layers": [2, 16, 29, 32],
                   "loss_implementation": args.loss_implementation},
        "machine": {"host": platform.node(), "python": platform.python_version(),
                    "gpus": [torch.cuda.get_device_name(i)
                             for i in range(torch.cuda.device_count())] if use_gpu else [],
                    "versions": versions},
        "runs": [],
    }
    try:
        t0 = time.perf_counter()
        target = write_target(work / "target", shape, "cuda" if use_gpu else "cpu")
        samples = write_output(work / "out", target, shape["hidden_size"], tokens,
                               unit_tokens=max(1, tokens // 4), vocab=shape["vocab_size"])
        result["config"]["samples"] = samples
        result["setup_s"] = time.perf_counter() - t0
        log(f"output: {samples} samples, {tokens:,}+ tokens, H={shape['hidden_size']}, "
            f"written in {result['setup_s']:.1f}s")
        ray.init(num_cpus=max(8, (os.cpu_count() or 1)),
                 runtime_env={"env_vars": {k: os.environ[k] for k in NCCL_SAFE}},
                 include_dashboard=False)
        for workers in counts:
            run = measure(work / "out", workers, args.steps, args.warmup, use_gpu, draft_vocab,
                          args.loss_implementation)
            result["runs"].append(run)
            log(f"{workers} worker(s): {run['tokens_per_s']:,.0f} tokens/s "
                f"({run['tokens_per_step']:,.0f} tokens a step, median step "
                f"{run['median_step_s'] * 1e3:.0f} ms, first step {run['first_step_s']:.1f}s, "
                f"run {run['run_wall_s']:.0f}s)")
        base = result["runs"][0]["tokens_per_s"]
        result["ratios"] = {
            f"{r['workers']}/{counts[0]}": {
                "value": r["tokens_per_s"] / base,
                "target": f">= {TARGET}" if r["workers"] == 2 * counts[0] else "report",
                "verdict": ("PASS" if r["tokens_per_s"] / base >= TARGET else "MISS")
                if r["workers"] == 2 * counts[0] else "report",
            } for r in result["runs"][1:]
        }
    except BaseException as err:
        result["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        result["wall_s"] = time.time() - started
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
            log(f"results in {out}")
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    for name, ratio in result.get("ratios", {}).items():
        log(f"ratio {name} workers: {ratio['value']:.3f} (target {ratio['target']}: "
            f"{ratio['verdict']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
