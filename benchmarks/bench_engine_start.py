"""A vLLM engine's start on a machine that never started one for this model (cold
caches): vLLM's model registry inspecting the model classes in the engine's process
(`here`, hsx's way: `compat.models_inspected_here`) against in fresh Python
processes (`elsewhere`, vLLM's own way).

Each start is `VllmEngine` (the engine an `ExtractionWorker` builds) on the tiny Llama,
in a fresh process with compile and model-info caches of its own, empty
(`VLLM_CACHE_ROOT`, `TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`); the variants
alternate. Measured: seconds from the engine's construction to ready, and from the
process's start. The child also says whether CUDA was initialized in its process once
the engine was ready (vLLM inspects elsewhere to keep a model module from doing that;
where it did, vLLM spawns its engine processes instead of forking them).

Ratio: elsewhere ÷ here of the medians (> 1: hsx's start is shorter). Where a warm
cache already knows the classes (any later start of the same vLLM), both are the same.

Run: `python -m benchmarks.bench_engine_start [--reps 2]` (results in
`results/<date>-engine-start/engine_start.json`; not part of `run_all.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

VARIANTS = ("here", "elsewhere")


def child(variant: str, model: str) -> dict[str, Any]:
    """One engine start in this (fresh) process."""
    started = time.perf_counter()
    from hsx.modelinfo import read_model_info
    from hsx.spec import JobSpec
    from hsx_service.engine_config import engine_config_for
    from hsx_workers.engines.factory import create_engine
    from hsx_workers.engines.vllm import compat as vllm_compat

    if variant == "elsewhere":
        vllm_compat.models_inspected_here = contextlib.nullcontext  # type: ignore[assignment]
    spec = JobSpec(model=model, dataset=model, output=model, max_seq_len=1024)
    config = engine_config_for(spec, read_model_info(model), [1, 2, 3, 4])
    t0 = time.perf_counter()
    engine = create_engine("vllm", config)
    ready = time.perf_counter()
    import torch

    cuda = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    engine.close()
    return {"variant": variant, "engine_s": round(ready - t0, 2),
            "process_s": round(ready - started, 2), "cuda_initialized_here": cuda}


def _caches(folder: Path) -> dict[str, str]:
    return {"VLLM_CACHE_ROOT": str(folder / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
            "TRITON_CACHE_DIR": str(folder / "triton")}


def run(*, reps: int, out: Path, workdir: Path | None, note: str | None) -> dict[str, Any]:
    from hsx_workers.tiny_models import make_tiny_model

    scratch = Path(tempfile.mkdtemp(dir=workdir, prefix="hsx-bench-engine-start-"))
    try:
        model = str(make_tiny_model(scratch / "model", "llama"))
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for rep in range(reps):
            for variant in common.alternating(VARIANTS, rep):
                env = {**os.environ, **_caches(scratch / f"cache-{variant}-{rep}")}
                proc = subprocess.run(
                    [sys.executable, "-m", __spec__.name, "--child", variant, model],
                    capture_output=True, text=True, env=env, check=False)
                if proc.returncode != 0:
                    raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
                record = json.loads(proc.stdout.strip().splitlines()[-1])
                runs[variant].append(record)
                print(f"{variant}: engine ready in {record['engine_s']} s "
                      f"({record['process_s']} s after the process started)", flush=True)
        here = common.median([r["engine_s"] for r in runs["here"]])
        elsewhere = common.median([r["engine_s"] for r in runs["elsewhere"]])
        section = {"date": common.now_iso(), "note": note, "reps": reps, "runs": runs,
                   "engine_s_median": {"here": here, "elsewhere": elsewhere},
                   "elsewhere_over_here": common.ratio(elsewhere, here)}
        common.save_section(out, "engine_start", section, common.machine_info())
        print(common.table(["cold engine start", "median s"],
                           [["model classes inspected here (hsx)", here],
                            ["inspected in fresh processes (vLLM)", elsewhere],
                            ["elsewhere ÷ here", section["elsewhere_over_here"]]]))
        return section
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        print(json.dumps(child(argv[1], argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path,
                   default=common.campaign_path("engine-start", "engine_start.json"))
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    args = p.parse_args(argv)
    run(reps=args.reps, out=args.out, workdir=args.workdir, note=args.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
