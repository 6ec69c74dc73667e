"""vLLM serving a draft, measured apart from hsx's own evaluation: one engine with the
target and the draft answers runs of prompts, each run's acceptance from the engine's
counters before and after it (`python -m tests.integration.serving REQUEST.json`, in a
process of its own, as a server is).

A run is what a client sends: token prompts, each with its `max_tokens`, greedy,
stopping at the target's EOS unless `ignore_eos` (how hsx measured before it generated
as a server does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def measure_serving(target: Path, speculative_config: dict[str, Any],
                    runs: dict[str, dict[str, Any]], timeout: float = 900) -> dict[str, Any]:
    """Each run's mean acceptance length, drafts and tokens: `runs` maps a name to
    {"prompts": [[token ids]], "max_tokens": [int], "ignore_eos": bool}."""
    request = {"target": str(target), "speculative_config": speculative_config, "runs": runs}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.integration.serving",
                           json.dumps(request)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith('{"runs"')]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"serving failed: {done.stdout[-2000:]}{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _counters(llm: Any) -> tuple[int, int]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return (int(metrics["vllm:spec_decode_num_drafts"].value),
            int(metrics["vllm:spec_decode_num_accepted_tokens"].value))


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hsx_workers.dtypes import vllm_dtype

    request = json.loads(sys.argv[1])
    runs = request["runs"]
    longest = max(len(p) + m for run in runs.values()
                  for p, m in zip(run["prompts"], run["max_tokens"], strict=True))
    target = request["target"]
    k = int(request["speculative_config"]["num_speculative_tokens"])
    llm = LLM(model=target, speculative_config=request["speculative_config"],
              disable_log_stats=False, enforce_eager=True, max_model_len=longest + k + 1,
              dtype=vllm_dtype("auto", target))
    out: dict[str, Any] = {}
    for name, run in runs.items():
        drafts, accepted = _counters(llm)
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in run["prompts"]],
            [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=run["ignore_eos"])
             for m in run["max_tokens"]], use_tqdm=False)
        drafts_after, accepted_after = _counters(llm)
        d, a = drafts_after - drafts, accepted_after - accepted
        out[name] = {"prompts": len(results), "drafts": d, "accepted_tokens": a,
                     "mean_acceptance_length": 1.0 + a / d if d else 1.0,
                     "generated_tokens": sum(len(r.outputs[0].token_ids) for r in results),
                     "stopped_at_eos": sum(r.outputs[0].finish_reason == "stop"
                                           for r in results)}
    sys.stdout.write(json.dumps({"runs": out}) + "\n")


if __name__ == "__main__":
    main()
