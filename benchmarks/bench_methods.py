"""Draft methods compared on one capture: every method of hsx.methods (EAGLE-3, DFlash,
DSpark, P-EAGLE) on the learnable target.

One extraction with `layers:` naming every method (the union of their ids) of the
learnable target's 3,000 samples; then, for each method, `hsx train OUTPUT --method M`
with no other option (each in a draft folder of its own), `hsx eval-draft` (vLLM loads
the draft with its method and answers the held-out prompts greedily), and vLLM without a
draft on the same prompts. Reported per method: the best held-out validation (expected
acceptance length), vLLM's mean acceptance length and per-position acceptance,
generation tokens/s with the draft over the target alone (the speedup: both timed on
their engine's first call, as eval-draft times it; on CPU vLLM's drafting costs more than
on a GPU), training seconds, and the bytes the capture stores
per token for that method's layers. Where this vLLM cannot serve a method's draft (DSpark
on vLLM's CPU build), its row holds the training's figures and the reason in place of
vLLM's.

Run: `python -m benchmarks.bench_methods [--methods eagle3,dflash,peagle] [--work DIR]
[--side-by-side]` (`--side-by-side`: the trainings at once on the one device, as the GPU
campaign runs them; their seconds are then each one's share)
(~25 minutes on 2 cores for EAGLE-3 and DFlash). vLLM generates as `hsx eval-draft` does:
greedily, each held-out prompt until the end of its turn or its answer's length. Results:
benchmarks/results/<date>-methods/methods.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from hsx.methods import method_names

SAMPLES = 3000  # the learnable language's samples, as the integration tests use
CPU_ENV = {  # vLLM's CPU CI switches, as tests/conftest.py sets them
    "VLLM_CPU_CI_ENV": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _hsx(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hsx.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **CPU_ENV}, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"hsx {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds, done


def capture(work: Path) -> tuple[Path, float]:
    """The learnable target and one extraction for both methods."""
    from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

    language = TaskLanguage(seed=0)
    target = make_learnable_model(work / "target", language=language, steps=500)
    dataset = work / "tasks.jsonl"
    if not dataset.exists():
        write_language_dataset(dataset, SAMPLES, language=language)
    output = work / "out"
    job = work / "job.json"
    job.write_text(json.dumps({
        "model": str(target), "dataset": str(dataset), "output": str(output),
        "layers": list(method_names()), "max_seq_len": 256, "unit_tokens": 8192,
        "ray_address": "local",
    }))
    seconds, _ = _hsx("extract", str(job))
    return output, seconds


def target_alone(output: Path, work: Path) -> dict[str, Any]:
    """vLLM without a draft on the held-out prompts of a default training (in a process
    of its own, as eval-draft runs), timed twice: the engine's first call, as eval-draft
    times the drafted engine (`seconds`, the speedup's baseline), and a second one
    (`seconds_again`: what the first call's one-time costs add)."""
    code = f"""
import json, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from hsx.output import Output
from hsx.spec import TrainSpec
from hsx_workers.acceptance import held_out_prompts
out = Output({str(output)!r})
spec = TrainSpec()
prompts, _ = held_out_prompts(out, spec, spec.eval_prompts, max_tokens=spec.eval_max_tokens)
from hsx_workers.dtypes import vllm_dtype
model = out.manifest().model
llm = LLM(model=model, enforce_eager=True, dtype=vllm_dtype("auto", model),
          max_model_len=max(len(p.token_ids) + p.max_tokens for p in prompts) + 9)
timed = []
for _ in range(2):
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts],
                       [SamplingParams(max_tokens=p.max_tokens, temperature=0.0)
                        for p in prompts], use_tqdm=False)
    timed.append(time.perf_counter() - t0)
print(json.dumps({{"seconds": timed[0], "seconds_again": timed[1],
                  "generated_tokens": sum(len(o.outputs[0].token_ids) for o in res)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **CPU_ENV}, check=True, cwd=work)
    return json.loads([x for x in done.stdout.splitlines() if x.startswith("{")][-1])


def train_side_by_side(output: Path, methods: list[str], work: Path) -> dict[str, float]:
    """`hsx train --method M` for every method at once, each in a process of its own on
    the one device (a lent GPU's time); the seconds each took while sharing it."""
    started = {}
    for method in methods:
        draft_dir = work / f"draft-{method}"
        shutil.rmtree(draft_dir, ignore_errors=True)
        log = (work / f"train-{method}.log").open("w")
        started[method] = (time.perf_counter(), subprocess.Popen(
            [sys.executable, "-m", "hsx.cli", "train", str(output), "--method", method,
             "--draft-dir", str(draft_dir)], stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **CPU_ENV}))
    seconds = {}
    for method, (t0, proc) in started.items():
        if proc.wait() != 0:
            raise RuntimeError(f"hsx train --method {method}: see {work}/train-{method}.log")
        seconds[method] = time.perf_counter() - t0
    return seconds


def run_method(output: Path, method: str, work: Path, alone: dict[str, Any],
               trained_s: float | None = None) -> dict[str, Any]:
    """Train (unless `trained_s`: trained already, in that many seconds) and measure."""
    from hsx.methods import draft_aux_layers
    from hsx.output import Output

    draft_dir = work / f"draft-{method}"
    if trained_s is None:
        shutil.rmtree(draft_dir, ignore_errors=True)  # trained from nothing, not resumed
        trained_s, _ = _hsx("train", str(output), "--method", method,
                            "--draft-dir", str(draft_dir))
    train_s = trained_s
    rows = [json.loads(x) for x in
            (draft_dir / "draft" / "validation.jsonl").read_text().splitlines()]
    best = max(rows, key=lambda r: r["expected_acceptance_length"])
    manifest = Output(output).manifest()
    layers = len(draft_aux_layers(manifest.layers, manifest.num_layers, method)) + 1
    trained = {
        "method": method, "train_seconds": round(train_s, 1),
        "validation_expected_acceptance_length": round(best["expected_acceptance_length"], 3),
        "validation_step": best["step"],
        "stored_bytes_per_token_bf16": layers * manifest.hidden_size * 2,
    }
    try:
        _, done = _hsx("eval-draft", str(output), "--draft-dir", str(draft_dir), "--json")
    except RuntimeError as err:
        if "cannot serve" not in str(err):
            raise
        why = next(x for x in str(err).splitlines() if "cannot serve" in x)
        return {**trained, "k": None, "vllm_mean_acceptance_length": None,
                "speedup": None, "vllm_unavailable": why.strip().removeprefix("hsx: error: ")}
    acc = json.loads([x for x in done.stdout.splitlines() if x.startswith('{"k"')][-1])
    with_draft = acc["generated_tokens"] / acc["seconds"]
    without = alone["generated_tokens"] / alone["seconds"]
    return {
        **trained, "k": acc["k"],
        "vllm_mean_acceptance_length": round(acc["mean_acceptance_length"], 3),
        "vllm_interval_95": [round(x, 3) for x in acc["confidence_interval"] or []] or None,
        "vllm_prompts": acc["prompts"], "vllm_stopped_at_eos": acc["stopped_at_eos"],
        "vllm_acceptance_per_position": [round(a, 3) for a in acc["acceptance_per_position"]],
        "tokens_per_s_with_draft": round(with_draft, 1),
        "tokens_per_s_target_alone": round(without, 1),
        "speedup": round(with_draft / without, 3),
        "speedup_vs_target_again": round(
            with_draft / (alone["generated_tokens"] / alone["seconds_again"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(method_names()))
    parser.add_argument("--work", type=Path, default=None, help="working folder (kept)")
    parser.add_argument("--out", type=Path, default=common.campaign_path("methods", "methods.json"))
    parser.add_argument("--side-by-side", action="store_true",
                        help="train every method at once on the one device, then measure "
                             "each (training seconds are then under sharing)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="hsx-methods-"))
    work.mkdir(parents=True, exist_ok=True)
    output, extract_s = capture(work)
    alone = target_alone(output, work)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.bench_methods " + " ".join(sys.argv[1:]),
        "date": common.now_iso(), "machine": common.machine_info(),
        "capture": {"layers": list(method_names()), "samples": SAMPLES,
                    "extract_seconds": round(extract_s, 1)},
        "target_alone": alone, "methods": [],
        "trained_side_by_side": args.side_by_side,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = result["methods"]
    methods = args.methods.split(",")
    trained = train_side_by_side(output, methods, work) if args.side_by_side else {}
    for method in methods:
        rows.append(run_method(output, method, work, alone, trained.get(method)))
        # written after each method: a run cut short (a lent GPU's time) keeps its rows
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(common.table(
        ["method", "k", "val EAL", "vLLM accept", "speedup", "train s", "B/token"],
        [[r["method"], *("-" if v is None else v for v in (
            r["k"], r["validation_expected_acceptance_length"], r["vllm_mean_acceptance_length"],
            r["speedup"], r["train_seconds"], r["stored_bytes_per_token_bf16"]))]
         for r in rows]))


if __name__ == "__main__":
    main()
