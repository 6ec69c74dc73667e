"""The self-check's cost: the same job with `checks: on` against `checks: off`, one run.

One process, one vLLM CPU engine (`ExtractionWorker("vllm", ...)`, as `hsx extract`
builds it, without Ray), the same prepared rows for both variants; the repetitions
alternate (`common.alternating`), each on a fresh output (prepare is not timed). Timed:
the first unit handed to the worker to the last commit, as in bench_pipeline.py.
Reported:

- `on/off`: the ratio of median tokens/s (target ≥ 0.97 on CPU: ≤ 3% cost), and
  `on/off steady` the same from each run's first commit to its last (a job pays once, at
  its start, for its head check's first samples; a short run weighs that far more than
  a job of hours);
- `check_share`: the wall seconds the checking thread spent on samples
  (`StatesCheck._check_one`) over the `on` runs' seconds, and `check_cpu_share` the CPU
  seconds it used there: the check's own cost, off the capture thread, which the shared
  machine's noise blurs less than the end-to-end ratio (on a loaded host the wall time
  also counts waits for the GIL and for a core).

- `head_s`: the seconds the head check's thread spent comparing id N with the engine's
  own next token (headcheck.py), and the rows it compared and found agreeing.

The model is the tests' tiny Llama by default (H 256: next to its compute, per-token
I/O and the check's pass over the states weigh the most of any model: the worst case);
`--model large` is bench_pipeline's 8-layer H 1024 model; `--model 8b` (a GPU) the 8B
Llama shape of benchmarks/gpu (32 layers, H 4096, 128,256 tokens), written as a real
checkpoint of random weights (the head check reads the head vLLM runs: no
`load_format: dummy`), its prompts 512-2,048 tokens.

`--faults` then runs each of HSX_FAULT_STATES's faults on a small job on the same
engine and records the message each fails with (or that it did not).

`--head-product` instead times the head check alone, without an engine: the verdicts
of a job's first 8 samples (32 rows each) on an 8B-shaped head (128,256 x 4,096, bf16),
torch on one thread as in the worker, through `headcheck.check_samples` (the product in
the head's dtype over the host's cores, the top logits again in float32) against the
float32 product of the whole head it replaced (numpy's BLAS on a float32 copy of the
head), alternating; `float32/bf16` is the speedup (the first commit of a job waits for
this product on each engine).

Run: `python -m benchmarks.bench_selfcheck [--quick] [--model tiny|large|8b] [--faults]`
or `--head-product`; results into benchmarks/results/<date>-selfcheck/selfcheck.json
with the command.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

MODELS = {"tiny": (4, 256, 4, 2, 512), "large": (8, 1024, 16, 4, 2816),  # L, H, heads, kv, I
          "8b": (32, 4096, 32, 8, 14336)}
VARIANTS = ("on", "off")
FAULTS = ("zeros", "nan:{sample}", "copy_layer", "scale:1e4:{sample}", "postnorm", "swap")


class CheckClock:
    """Wall seconds spent in StatesCheck._check_one and the CPU seconds its thread used there
    (wrapped while it lives). On a loaded host the wall time also counts the waits for
    the GIL and for a core; the CPU time is what the check itself costs."""

    def __init__(self) -> None:
        from hsx_workers import selfcheck

        self.seconds = 0.0
        self.cpu_s = 0.0
        self._cls = selfcheck.StatesCheck
        self._check = self._cls._check_one
        clock = self

        def timed_check(this: Any, *args: Any, **kwargs: Any) -> None:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                clock._check(this, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.cpu_s += time.thread_time() - cpu

        self._cls._check_one = timed_check  # type: ignore[method-assign]

    def close(self) -> None:
        self._cls._check_one = self._check  # type: ignore[method-assign]


class HeadClock:
    """Seconds the head check's thread spent in `check_samples` (wrapped while it lives)."""

    def __init__(self) -> None:
        from hsx_workers import selfcheck

        self.seconds = 0.0
        self._module = selfcheck
        self._check = selfcheck.check_samples
        clock = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return clock._check(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start

        selfcheck.check_samples = timed  # type: ignore[assignment]

    def close(self) -> None:
        self._module.check_samples = self._check  # type: ignore[assignment]


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (64, 512)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def write_random_llama(folder: Path, shape: tuple[int, int, int, int, int],
                       vocab: int) -> None:
    """A Llama checkpoint of random weights (std 0.02, norms 1, bf16), made on the GPU
    when there is one and saved as safetensors with an index, beside the tiny
    tokenizer: a model vLLM loads as it would a real one."""
    import torch
    from safetensors.torch import save_file

    from hsx_workers.tiny_models import make_tiny_model

    layers, hidden, heads, kv, inter = shape
    make_tiny_model(folder, num_layers=1, weights=False)  # tokenizer, configs
    config = json.loads((folder / "config.json").read_text())
    head_dim = hidden // heads
    config.update(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                  head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)

    def rand(*size: int) -> Any:
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(
            torch.bfloat16).cpu()

    def ones() -> Any:
        return torch.ones(hidden, dtype=torch.bfloat16)

    index: dict[str, str] = {}
    files = [("model-embed.safetensors", {"model.embed_tokens.weight": rand(vocab, hidden)}),
             ("model-head.safetensors", {"lm_head.weight": rand(vocab, hidden),
                                         "model.norm.weight": ones()})]
    for i in range(layers):
        pre = f"model.layers.{i}."
        files.append((f"model-layer{i:03d}.safetensors", {
            pre + "input_layernorm.weight": ones(), pre + "post_attention_layernorm.weight": ones(),
            pre + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            pre + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            pre + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            pre + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            pre + "mlp.gate_proj.weight": rand(inter, hidden),
            pre + "mlp.up_proj.weight": rand(inter, hidden),
            pre + "mlp.down_proj.weight": rand(hidden, inter)}))
    for name, tensors in files:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))
    for stale in folder.glob("model.safetensors"):
        stale.unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}))


def run(model: str, prompts_n: int, reps: int, work: Path, faults: bool = False
        ) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from hsx.spec import JobSpec
    from hsx_service.engine_config import engine_config_for
    from hsx_service.engine_pool import DISPATCH_DEPTH
    from hsx_service.prepare import prepare
    from hsx_workers.tiny_models import make_tiny_model
    from hsx_workers.worker import ExtractionWorker

    layers_n, hidden, heads, kv, inter = MODELS[model]
    model_dir = work / "model"
    started = time.perf_counter()
    if model == "8b":
        write_random_llama(model_dir, MODELS[model], vocab=128256)
    else:
        make_tiny_model(model_dir, num_layers=layers_n, hidden_size=hidden, num_heads=heads,
                        num_kv_heads=kv, intermediate_size=inter)
    model_s = time.perf_counter() - started
    layers = sorted({2, layers_n // 2, layers_n - 3, layers_n})  # EAGLE-3's, and N
    lengths = (512, 2048) if model == "8b" else (64, 512)
    dataset = work / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"input_ids": p}) + "\n"
                               for p in _prompts(prompts_n, seed=0, lengths=lengths)))
    small = work / "small.jsonl"
    small.write_text("".join(json.dumps({"input_ids": p}) + "\n"
                             for p in _prompts(24, seed=1, lengths=(64, 512))))

    def job(output: Path, checks: str, data: Path = dataset) -> Any:
        spec = JobSpec(model=str(model_dir), dataset=str(data), output=str(output),
                       layers=layers, max_seq_len=lengths[1], unit_tokens=16384,
                       checks=checks)
        return prepare(spec, stream=False)

    def units(worker: Any, prepared: Any, fault: str | None = None) -> list[Any]:
        with ThreadPoolExecutor(DISPATCH_DEPTH) as pool:
            futures = [pool.submit(worker.run_unit, str(prepared.output), "bf16", u,
                                   checks=prepared.spec.checks, fault=fault)
                       for u in prepared.pending]
            return [f.result() for f in futures]

    warm = job(work / "warm", "on")
    worker = ExtractionWorker("vllm", engine_config_for(warm.spec, warm.model, warm.layers),
                              name="bench")
    units(worker, warm)  # compiles, warms the engine
    shutil.rmtree(work / "warm")
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    clock, head_clock = CheckClock(), HeadClock()
    tripped: dict[str, str] = {}
    try:
        for rep in range(reps):
            for variant in common.alternating(VARIANTS, rep):
                prepared = job(work / f"{variant}-{rep}", variant)
                before, before_cpu, before_head = clock.seconds, clock.cpu_s, head_clock.seconds
                start = time.perf_counter()
                reports = units(worker, prepared)
                seconds = time.perf_counter() - start
                tokens = sum(r.tokens for r in reports)
                # The steady state: from the first unit's commit to the last (a job's
                # start pays once for its head check's first samples).
                commits = sorted((r.marks["committed"], r.tokens) for r in reports)
                steady_s = commits[-1][0] - commits[0][0]
                steady_tokens = sum(t for _, t in commits[1:])
                checked = sum(r.checks.get("samples", 0) for r in reports)
                if variant == "on" and checked != sum(r.samples for r in reports):
                    raise RuntimeError(f"checked {checked} samples of "
                                       f"{sum(r.samples for r in reports)}")
                results[variant].append({"seconds": seconds, "tokens": tokens,
                                         "tokens_per_s": tokens / seconds,
                                         "steady_tokens_per_s": steady_tokens / steady_s,
                                         "check_s": clock.seconds - before,
                                         "check_cpu_s": clock.cpu_s - before_cpu,
                                         "head_s": head_clock.seconds - before_head,
                                         "head_rows": sum(r.checks.get("head_rows", 0)
                                                          for r in reports),
                                         "head_agreed": sum(r.checks.get("head_agreed", 0)
                                                            for r in reports),
                                         "samples": sum(r.samples for r in reports)})
                shutil.rmtree(work / f"{variant}-{rep}")
        for fault in FAULTS if faults else ():
            name = fault.format(sample=5)
            prepared = job(work / f"fault-{len(tripped)}", "on", small)
            try:
                units(worker, prepared, fault=name)
                tripped[name] = "NOT TRIPPED: the job completed"
            except Exception as err:  # the worker's StatesCheckFailed, or what went wrong
                tripped[name] = f"{type(err).__name__}: {err}"
    finally:
        clock.close()
        head_clock.close()
        worker.shutdown()
    on = results["on"]
    return {
        "model": {"name": model, "num_layers": layers_n, "hidden_size": hidden,
                  "layers": layers, "made_in_s": model_s},
        "faults": tripped,
        "head_s": sum(r["head_s"] for r in on),
        "head_rows": sum(r["head_rows"] for r in on),
        "head_agreed": sum(r["head_agreed"] for r in on),
        "prompts": prompts_n, "reps": reps,
        "runs": results,
        "ratios": {"on/off": common.compare(on, results["off"], "tokens_per_s",
                                            target=0.97),
                   "on/off steady": common.compare(on, results["off"], "steady_tokens_per_s",
                                                   target=0.97)},
        "check_share": sum(r["check_s"] for r in on) / sum(r["seconds"] for r in on),
        "check_ms_per_sample": 1e3 * sum(r["check_s"] for r in on) / sum(
            r["samples"] for r in on),
        "check_cpu_share": sum(r["check_cpu_s"] for r in on) / sum(r["seconds"] for r in on),
        "check_cpu_ms_per_sample": 1e3 * sum(r["check_cpu_s"] for r in on) / sum(
            r["samples"] for r in on),
    }


def head_product(reps: int) -> dict[str, Any]:
    """The head check of 8 samples x 32 rows on an 8B-shaped bf16 head: this tree's
    check_samples against a float32 product of the whole head (numpy's BLAS), the same
    rows, torch on one thread (as the worker keeps it)."""
    import torch

    from hsx.finalnorm import FinalNorm
    from hsx_workers.headcheck import (
        HEAD_FIRST,
        HEAD_FIRST_ROWS,
        FinalHead,
        HeadSample,
        check_samples,
    )

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 128256, 4096
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16()
    head = FinalHead(FinalNorm(torch.ones(hidden).bfloat16(), 1e-5, False), weight)
    samples = [HeadSample(torch.randn(1024, hidden, generator=gen).bfloat16(),
                          torch.randint(0, vocab, (1024,), generator=gen).tolist(), 32,
                          rows=HEAD_FIRST_ROWS) for _ in range(HEAD_FIRST)]
    rows = torch.cat([s.last[torch.linspace(0, 1023, HEAD_FIRST_ROWS).round().long()]
                      for s in samples])
    made = time.perf_counter()
    head32 = weight.float().numpy()
    copy_s = time.perf_counter() - made

    def float32_product() -> None:  # the product before: a float32 copy through numpy
        normed = head.norm(rows).bfloat16().float().numpy()
        (normed @ head32.T).argmax(-1)

    runs: dict[str, list[dict[str, float]]] = {"bf16": [], "float32": []}
    ways = {"bf16": lambda: check_samples(head, samples), "float32": float32_product}
    for name in ways:  # warm: the threads, the pages
        ways[name]()
    for rep in range(reps):
        for name in common.alternating(list(ways), rep):
            start = time.perf_counter()
            ways[name]()
            seconds = time.perf_counter() - start
            runs[name].append({"seconds": seconds, "rate": 1 / seconds})
    return {
        "rows": len(rows), "head": [vocab, hidden], "float32_copy_s": copy_s,
        "runs": runs,
        "ratios": {"float32/bf16": common.compare(runs["bf16"], runs["float32"], "rate")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--quick", action="store_true", help="fewer prompts and repetitions")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temp dir)")
    p.add_argument("--faults", action="store_true", help="then each fault, on a small job")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--head-product", action="store_true",
                   help="time the head check's product alone (no engine)")
    args = p.parse_args(argv)
    out = args.out or common.campaign_path("selfcheck", "selfcheck.json")
    if args.head_product:
        result = head_product(args.reps or 5)
        result["command"] = " ".join(["python", "-m", "benchmarks.bench_selfcheck",
                                      *sys.argv[1:]])
        common.save_section(out, "head-product", result, common.machine_info())
        print(common.table(common.RATIO_HEADERS, [common.ratio_row(name, entry)
                                                  for name, entry in result["ratios"].items()]))
        print({k: [round(r["seconds"], 3) for r in v] for k, v in result["runs"].items()},
              f"float32 copy {result['float32_copy_s']:.2f} s; results in {out}")
        return 0
    prompts_n, reps = (96, 2) if args.quick else (240, 3)
    prompts_n = args.prompts or prompts_n
    reps = args.reps or reps
    with tempfile.TemporaryDirectory(prefix="hsx-bench-selfcheck-", dir=args.workdir) as tmp:
        payload = run(args.model, prompts_n, reps, Path(tmp), faults=args.faults)
    payload["command"] = " ".join(["python", "-m", "benchmarks.bench_selfcheck", *sys.argv[1:]])
    common.save_section(out, f"selfcheck-{args.model}", payload, common.machine_info())
    print(common.table(common.RATIO_HEADERS, [common.ratio_row(name, entry)
                                              for name, entry in payload["ratios"].items()]))
    print(f"time inside the check: {payload['check_share']:.2%} of the `on` runs' wall "
          f"time ({payload['check_ms_per_sample']:.2f} ms a sample); its thread's CPU there: "
          f"{payload['check_cpu_share']:.2%} ({payload['check_cpu_ms_per_sample']:.3f} ms a "
          f"sample); head check: {payload['head_s']:.1f} s on its thread, "
          f"{payload['head_agreed']} of {payload['head_rows']} rows agreed; results in {out}")
    for fault, words in payload["faults"].items():
        print(f"fault {fault}: {words[:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
