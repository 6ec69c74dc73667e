"""What image prompts are worth to a draft of a vision-language target (speculators #606
asks whether such a draft needs visual data at all), measured by vLLM.

- Target: the learnable target's vision-language twin (hsx_workers.learnable_vision): a
  tiny Llava (16 vision tokens per image around a 4-layer Llama) whose replies to an
  image prompt follow the image's colour, and to a text prompt the text rule.
- Three captures of CHATS chats each, `images:` jobs on vLLM's engines: `text` (text
  prompts only), `image` (image prompts only), `both` (half and half); each trained
  with `hsx train OUTPUT` (no options: the same plan for the three).
- Each draft measured by vLLM (`hsx eval-draft BOTH --draft D`, k=3, greedy) on the
  same held-out prompts of `both`, its image prompts and its text prompts apart
  (`per_modality`).

Reported: each draft's mean acceptance length on image prompts and on text prompts,
with the acceptance per draft position. Results: benchmarks/results/YYYY-MM-DD-vision/vision.json.
Runs on the CPU machine (vLLM's CPU build takes Llava's images: docs/MODELS.md) in
about an hour on 2 loaded cores; on a GPU node in minutes.

Run: `.venv/bin/python -m benchmarks.bench_vision [--chats N] [--workdir DIR]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import campaign_path, machine_info, save_section

RESULTS = campaign_path("vision", "vision.json")
DRAFTS = (("text", 0.0, 1), ("image", 1.0, 2), ("both", 0.5, 3))  # name, image share, seed


def _hsx(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hsx.cli", *args], capture_output=True,
                          text=True, timeout=4 * 3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hsx {' '.join(args)} failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout


def _evaluate(output: Path, draft: Path, prompts: int) -> dict[str, Any]:
    lines = [x for x in _hsx("eval-draft", str(output), "--draft", str(draft), "--json",
                             "--prompts", str(prompts)).splitlines()
             if x.startswith('{"k"')]
    return dict(json.loads(lines[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, default=3000)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--workdir", default="/tmp/hsx-bench-vision")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from hsx.spec import JobSpec
    from hsx_service.engine_pool import EnginePool, ensure_ray
    from hsx_service.runner import run_job
    from hsx_workers.learnable_vision import (
        language_of,
        make_learnable_vision_model,
        write_vision_chats,
    )

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    t0 = time.monotonic()
    target = make_learnable_vision_model(work / "target")
    target_s = round(time.monotonic() - t0, 1)
    language = language_of(target)
    accuracy = json.loads((target / "language.json").read_text())["greedy_accuracy"]

    ensure_ray(None, cpus_needed=4)
    pool = EnginePool()
    runs: dict[str, Any] = {}
    try:
        for name, share, seed in DRAFTS:
            chats = write_vision_chats(work / f"{name}.jsonl", args.chats, language=language,
                                       image_share=share, seed=seed)
            output = work / name
            if not (output / "complete.json").exists():
                shutil.rmtree(output, ignore_errors=True)
            spec = JobSpec(model=str(target), dataset=str(chats), output=str(output),
                           max_seq_len=256, unit_tokens=16384,
                           images={"max_per_row": 1})  # type: ignore[arg-type]
            t0 = time.monotonic()
            summary = run_job(spec, pool=pool)
            runs[name] = {"image_share": share, "extract_s": round(time.monotonic() - t0, 1),
                          "samples": summary.samples, "tokens": summary.tokens}
    finally:
        pool.shutdown()
        import ray

        ray.shutdown()
    for name, run in runs.items():
        t0 = time.monotonic()
        plan = [x for x in _hsx("train", str(work / name)).splitlines() if "plan:" in x]
        run["train_s"] = round(time.monotonic() - t0, 1)
        run["plan"] = plan[-1].strip() if plan else None
    for name, run in runs.items():
        evaluation = _evaluate(work / "both", work / name / "draft", args.prompts)
        run["eval"] = evaluation
        for modality, part in (evaluation.get("per_modality") or {}).items():
            run[modality] = {"mean_acceptance_length": part["mean_acceptance_length"],
                             "acceptance_per_position": part["acceptance_per_position"],
                             "prompts": part["prompts"]}
            print(f"draft trained on {name}: {modality} prompts: mean acceptance length "
                  f"{part['mean_acceptance_length']:.2f}, per position "
                  f"{[round(x, 3) for x in part['acceptance_per_position']]}", flush=True)
    payload = {
        "chats": args.chats, "prompts": args.prompts, "target_s": target_s,
        "target_greedy_accuracy": accuracy, "runs": runs,
        "image prompts, mean acceptance length": {
            name: runs[name].get("image", {}).get("mean_acceptance_length") for name in runs},
        "text prompts, mean acceptance length": {
            name: runs[name].get("text", {}).get("mean_acceptance_length") for name in runs},
        "seconds": round(time.monotonic() - started, 1),
    }
    save_section(Path(args.out), "vision", payload, machine_info())
    print(json.dumps({k: v for k, v in payload.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
