"""Online against offline training of one draft: the same job, data, steps and seed, run
by `hsx extract` (CPU: vLLM CPU engines, the trainer in the same process tree).

- Target: the learnable tiny model (hsx_workers.learnable), CHATS samples of its
  language (~22 tokens each), layers [1, 2, 3, 4], units of 8,192 tokens.
- `offline`: `train: {steps: STEPS}`: the extraction stores its shards, then the draft
  trains on them (from already-stored shards), then vLLM measures it.
- `online`: the same with `online: true`: the engines capture each epoch again into the
  stream (/dev/shm), the trainer takes it from there; nothing is stored but the tables.

Reported for each: the whole command's seconds, the training's tokens/s (median of its
steps after the 10th) and the share of its time spent waiting for data, the bytes the
output holds besides draft/ (offline: the shards), the target's tokens captured (online:
every epoch's), vLLM's mean acceptance length at k=3; and online ÷ offline for the
training's tokens/s and the whole job's time. Results: benchmarks/results/<date>-online/online.json.

Run: `.venv/bin/python -m benchmarks.bench_online [--chats N] [--steps N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import campaign_path, machine_info, save_section

RESULTS = campaign_path("online", "online.json")


def _stored_bytes(output: Path) -> int:
    """Bytes under the output, its draft/ left out (what the extraction stored)."""
    return sum(p.stat().st_size for p in output.rglob("*")
               if p.is_file() and "draft" not in p.relative_to(output).parts)


def _run(work: Path, name: str, target: Path, rows: Path, train: dict[str, Any]
         ) -> dict[str, Any]:
    output = work / name
    shutil.rmtree(output, ignore_errors=True)
    job = {"model": str(target), "dataset": str(rows), "output": str(output),
           "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 8192, "train": train}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hsx.cli", "extract", str(path),
                           "--no-progress"], capture_output=True, text=True, timeout=7200,
                          check=False)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    metrics = [json.loads(x) for x in (output / "draft" / "metrics.jsonl").read_text()
               .splitlines()]
    steady = [m["tokens_per_s"] for m in metrics[10:]] or [m["tokens_per_s"] for m in metrics]
    evaluation = json.loads((output / "draft" / "eval.json").read_text())
    complete = json.loads((output / "complete.json").read_text())
    manifest = json.loads((output / "manifest.json").read_text())
    captures = complete.get("online", {}).get("captures")
    units = len(manifest["units"])
    return {
        "seconds": round(seconds, 1),
        "steps": metrics[-1]["step"],
        "train_tokens_per_s_median": round(statistics.median(steady), 1),
        "wait_fraction": round(metrics[-1]["wait_fraction"], 3),
        "stored_bytes": _stored_bytes(output),
        "units": units,
        "captures": captures if captures is not None else units,
        "target_tokens": manifest["num_tokens"] * (captures or units) // units,
        "mean_acceptance_length": evaluation["mean_acceptance_length"],
        "acceptance_per_position": evaluation["acceptance_per_position"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, default=3000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workdir", default="/tmp/hsx-bench-online")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from hsx_workers.learnable import TaskLanguage, make_learnable_model, write_language_dataset

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    language = TaskLanguage(seed=0)
    target = make_learnable_model(work / "target", language=language, steps=500)
    rows = write_language_dataset(work / "tasks.jsonl", args.chats, language=language)
    train = {"steps": args.steps, "eval_prompts": 16, "seed": 0}
    runs = {"offline": _run(work, "offline", target, rows, train),
            "online": _run(work, "online", target, rows, {**train, "online": True})}
    on, off = runs["online"], runs["offline"]
    payload = {
        "chats": args.chats, "steps": args.steps, "runs": runs,
        "online / offline, training tokens/s": round(
            on["train_tokens_per_s_median"] / off["train_tokens_per_s_median"], 3),
        "online / offline, whole job seconds": round(on["seconds"] / off["seconds"], 3),
        "online / offline, mean acceptance length": round(
            on["mean_acceptance_length"] / off["mean_acceptance_length"], 3),
        "bytes stored, offline / online": round(
            off["stored_bytes"] / max(1, on["stored_bytes"]), 1),
    }
    save_section(Path(args.out), "online", payload, machine_info())
    print(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
