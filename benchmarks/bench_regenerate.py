"""Regeneration pays: a draft trained on the target's own answers against one trained on
a chat dataset whose answers follow another rule (CPU, vLLM CPU engines, about 15 min).

- Target: the learnable tiny model (hsx_workers.learnable, `TaskLanguage(seed=0)`) with
  its chat tokenizer: a user turn `copy w16 w40` is the prompt, the assistant turn the
  answer. Its greedy answers copy, map with its word map, then follow its chain.
- Dataset: CHATS chats whose prompts are the target's but whose answers follow
  `TaskLanguage(seed=1)`: the same copies, another word map and another chain.
- `as-is`: the dataset extracted as it is. `regenerated`: the same job with `regenerate:`
  (the defaults, greedy, but `max_tokens` 24: the language's longest answer, since the
  target never ends a turn). Each output is trained with `hsx train OUTPUT` (no options)
  and measured with `hsx eval-draft` (vLLM, k=3, greedy, on the held-out samples'
  prompts, the same for both: the held-out set is chosen by sample index).

Reported: mean acceptance length and acceptance per draft position of each draft, and
regenerated ÷ as-is. Results: benchmarks/results/<date>-regenerate/regenerate.json.

Run: `.venv/bin/python -m benchmarks.bench_regenerate [--chats N] [--workdir DIR]`.
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

RESULTS = campaign_path("regenerate", "regenerate.json")
MAX_TOKENS = 24  # TaskLanguage's longest answer: 6 words, then a chain of 18


def _hsx(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hsx.cli", *args], capture_output=True,
                          text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hsx {' '.join(args)} failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout


def _evaluate(output: Path) -> dict[str, Any]:
    lines = [x for x in _hsx("eval-draft", str(output), "--json").splitlines()
             if x.startswith('{"k"')]
    return dict(json.loads(lines[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, default=3000)
    p.add_argument("--workdir", default="/tmp/hsx-bench-regenerate")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from hsx.output import Output
    from hsx.spec import JobSpec
    from hsx_service.engine_pool import EnginePool, ensure_ray
    from hsx_service.runner import run_job
    from hsx_workers.learnable import (
        TaskLanguage,
        make_learnable_model,
        write_chat_tokenizer,
        write_language_chats,
    )

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    language, other = TaskLanguage(seed=0), TaskLanguage(seed=1)
    started = time.monotonic()
    trained = make_learnable_model(work / "target", language=language)
    target = work / "chat-target"
    if not target.exists():
        shutil.copytree(trained, target)
        write_chat_tokenizer(target, language)
    chats = write_language_chats(work / "chats.jsonl", args.chats, language=other)

    ensure_ray(None, cpus_needed=4)
    pool = EnginePool()
    runs: dict[str, Any] = {}
    try:
        for name, extra in (("as-is", {}),
                            ("regenerated", {"regenerate": {"max_tokens": MAX_TOKENS}})):
            output = work / name
            shutil.rmtree(output, ignore_errors=True)
            spec = JobSpec(model=str(target), dataset=str(chats), output=str(output),
                           max_seq_len=256, unit_tokens=8192, **extra)
            t0 = time.monotonic()
            summary = run_job(spec, pool=pool)
            runs[name] = {"extract_s": round(time.monotonic() - t0, 1),
                          "samples": summary.samples, "tokens": summary.tokens,
                          "generated_tokens": Output(output).totals().generated_tokens}
    finally:
        pool.shutdown()  # its engines' processes go with their actors
        import ray

        ray.shutdown()
    for name, run in runs.items():
        output = work / name
        t0 = time.monotonic()
        plan = [x for x in _hsx("train", str(output)).splitlines() if "plan:" in x]
        run["train_s"] = round(time.monotonic() - t0, 1)
        run["plan"] = plan[-1].strip() if plan else None
        evaluation = _evaluate(output)
        run["mean_acceptance_length"] = evaluation["mean_acceptance_length"]
        run["acceptance_per_position"] = evaluation["acceptance_per_position"]
        run["eval"] = evaluation
        print(f"{name}: mean acceptance length {run['mean_acceptance_length']:.2f}, "
              f"per position {run['acceptance_per_position']}", flush=True)
    a, r = runs["as-is"], runs["regenerated"]
    payload = {
        "chats": args.chats, "max_tokens": MAX_TOKENS, "runs": runs,
        "regenerated / as-is, mean acceptance length":
            round(r["mean_acceptance_length"] / a["mean_acceptance_length"], 3),
        "per position, regenerated - as-is": [
            round(x - y, 3) for x, y in zip(r["acceptance_per_position"],
                                            a["acceptance_per_position"], strict=True)],
        "seconds": round(time.monotonic() - started, 1),
    }
    save_section(Path(args.out), "regenerate", payload, machine_info())
    print(json.dumps({k: v for k, v in payload.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
