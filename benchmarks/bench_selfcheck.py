"""The self-check's cost: the same job with `checks: on` against `checks: off`, one run.

One process, one vLLM CPU engine (`ExtractionWorker("vllm", ...)`, as `hsx extract`
builds it, without Ray), the same prepared rows for both variants; the repetitions
alternate (`common.alternating`), each on a fresh output (prepare is not timed). Timed:
the first unit handed to the worker to the last commit, as in bench_pipeline.py.
Reported:

- `on/off`: the ratio of median tokens/s (target ≥ 0.97 on CPU: ≤ 3% cost);
- `check_share`: the wall seconds spent inside `StatesCheck.check` over the `on` runs'
  seconds, and `check_cpu_share` the CPU seconds its thread used there: the check's own
  cost, which the shared machine's noise blurs less than the end-to-end ratio (on a
  loaded host the wall time also counts waits for the GIL and for a core).

The model is the tests' tiny Llama by default (H 256: next to its compute, per-token
I/O and the check's pass over the states weigh the most of any model: the worst case);
`--model large` is bench_pipeline's 8-layer H 1024 model.

Run: `python -m benchmarks.bench_selfcheck [--quick] [--model tiny|large]`; results into
benchmarks/results/<date>-selfcheck/selfcheck.json with the command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

MODELS = {"tiny": (4, 256, 4, 2, 512), "large": (8, 1024, 16, 4, 2816)}  # L, H, heads, kv, I
VARIANTS = ("on", "off")


class CheckClock:
    """Wall seconds spent in StatesCheck.check and the CPU seconds its thread used there
    (wrapped while it lives). On a loaded host the wall time also counts the waits for
    the GIL and for a core; the CPU time is what the check itself costs."""

    def __init__(self) -> None:
        from hsx_workers import selfcheck

        self.seconds = 0.0
        self.cpu_s = 0.0
        self._cls = selfcheck.StatesCheck
        self._check = self._cls.check
        clock = self

        def timed_check(this: Any, *args: Any, **kwargs: Any) -> None:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                clock._check(this, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.cpu_s += time.thread_time() - cpu

        self._cls.check = timed_check  # type: ignore[method-assign]

    def close(self) -> None:
        self._cls.check = self._check  # type: ignore[method-assign]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def run(model: str, prompts_n: int, reps: int, work: Path) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from hsx.spec import JobSpec
    from hsx_service.engine_config import engine_config_for
    from hsx_service.engine_pool import DISPATCH_DEPTH
    from hsx_service.prepare import prepare
    from hsx_workers.tiny_models import make_tiny_model
    from hsx_workers.worker import ExtractionWorker

    layers_n, hidden, heads, kv, inter = MODELS[model]
    model_dir = work / "model"
    make_tiny_model(model_dir, num_layers=layers_n, hidden_size=hidden, num_heads=heads,
                    num_kv_heads=kv, intermediate_size=inter)
    layers = sorted({1, layers_n // 2, layers_n - 1, layers_n})
    dataset = work / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"input_ids": p}) + "\n"
                               for p in _prompts(prompts_n, seed=0)))

    def job(output: Path, checks: str) -> Any:
        spec = JobSpec(model=str(model_dir), dataset=str(dataset), output=str(output),
                       layers=layers, max_seq_len=1024, unit_tokens=16384, checks=checks)
        return prepare(spec, stream=False)

    def units(worker: Any, prepared: Any) -> list[Any]:
        with ThreadPoolExecutor(DISPATCH_DEPTH) as pool:
            futures = [pool.submit(worker.run_unit, str(prepared.output), "bf16", u,
                                   checks=prepared.spec.checks) for u in prepared.pending]
            return [f.result() for f in futures]

    warm = job(work / "warm", "on")
    worker = ExtractionWorker("vllm", engine_config_for(warm.spec, warm.model, warm.layers),
                              name="bench")
    units(worker, warm)  # compiles, warms the engine
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    clock = CheckClock()
    try:
        for rep in range(reps):
            for variant in common.alternating(VARIANTS, rep):
                prepared = job(work / f"{variant}-{rep}", variant)
                before, before_cpu = clock.seconds, clock.cpu_s
                start = time.perf_counter()
                reports = units(worker, prepared)
                seconds = time.perf_counter() - start
                tokens = sum(r.tokens for r in reports)
                checked = sum(r.checks.get("samples", 0) for r in reports)
                if variant == "on" and checked != sum(r.samples for r in reports):
                    raise RuntimeError(f"checked {checked} samples of "
                                       f"{sum(r.samples for r in reports)}")
                results[variant].append({"seconds": seconds, "tokens": tokens,
                                         "tokens_per_s": tokens / seconds,
                                         "check_s": clock.seconds - before,
                                         "check_cpu_s": clock.cpu_s - before_cpu,
                                         "samples": sum(r.samples for r in reports)})
                shutil.rmtree(work / f"{variant}-{rep}")
    finally:
        clock.close()
        worker.shutdown()
    on = results["on"]
    return {
        "model": {"name": model, "num_layers": layers_n, "hidden_size": hidden,
                  "layers": layers},
        "prompts": prompts_n, "reps": reps,
        "runs": results,
        "ratios": {"on/off": common.compare(on, results["off"], "tokens_per_s",
                                            target=0.97)},
        "check_share": sum(r["check_s"] for r in on) / sum(r["seconds"] for r in on),
        "check_ms_per_sample": 1e3 * sum(r["check_s"] for r in on) / sum(
            r["samples"] for r in on),
        "check_cpu_share": sum(r["check_cpu_s"] for r in on) / sum(r["seconds"] for r in on),
        "check_cpu_ms_per_sample": 1e3 * sum(r["check_cpu_s"] for r in on) / sum(
            r["samples"] for r in on),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--quick", action="store_true", help="fewer prompts and repetitions")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temp dir)")
    args = p.parse_args(argv)
    prompts_n, reps = (96, 2) if args.quick else (240, 3)
    reps = args.reps or reps
    out = args.out or (common.RESULTS_DIR / f"{dt.date.today().isoformat()}-selfcheck"
                       / "selfcheck.json")
    with tempfile.TemporaryDirectory(prefix="hsx-bench-selfcheck-", dir=args.workdir) as tmp:
        payload = run(args.model, prompts_n, reps, Path(tmp))
    payload["command"] = " ".join(["python", "-m", "benchmarks.bench_selfcheck", *sys.argv[1:]])
    common.save_section(out, f"selfcheck-{args.model}", payload, common.machine_info())
    entry = payload["ratios"]["on/off"]
    print(common.table(common.RATIO_HEADERS, [common.ratio_row("on/off", entry)]))
    print(f"time inside the check: {payload['check_share']:.2%} of the `on` runs' wall "
          f"time ({payload['check_ms_per_sample']:.2f} ms a sample); its thread's CPU there: "
          f"{payload['check_cpu_share']:.2%} ({payload['check_cpu_ms_per_sample']:.3f} ms a "
          f"sample); results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
