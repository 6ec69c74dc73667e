"""One draft measured two ways by one vLLM engine, to tell a measurement's effect from a
draft's: `served`, as `hsx eval-draft` measures now (the held-out prompts, greedy, each
until the end of its turn or its answer's length), and `former`, as hsx measured before
(`ignore_eos`, at least 8 tokens a prompt), on the first 32 prompts (the former default
count) and on all of them.

    python -m benchmarks.measure_ways OUTPUT [--draft-dir DIR] [--prompts 150] --out F.json

DIR holds the draft in DIR/draft/ (`hsx train --draft-dir`); unset, the output's own.
The engine is tests/integration/serving.py's (one vLLM engine, each run's acceptance from
its counters before and after the run). vLLM and a GPU or vLLM's CPU build.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FORMER_PROMPTS = 32  # the former evaluation's default count
FORMER_MIN_TOKENS = 8  # the former evaluation's floor on each prompt's tokens


def measure(output: Path, draft_root: Path, prompts: int) -> dict[str, Any]:
    from tests.integration.serving import measure_serving

    from hsx.draft import read_train_state
    from hsx.methods import method_of_draft
    from hsx.output import Output
    from hsx.output.layout import DRAFT_DIR
    from hsx.train_spec import TrainSpec
    from hsx_workers.acceptance import held_out_prompts

    out = Output(str(output))
    state = read_train_state(draft_root) or {}
    spec = TrainSpec.model_validate(state.get("spec") or {})
    draft = draft_root / DRAFT_DIR
    way = method_of_draft(draft)
    held, source = held_out_prompts(out, spec, prompts, max_tokens=spec.eval_max_tokens)
    first = held[:FORMER_PROMPTS]
    config = way.speculative_config(str(draft), way.proposed_tokens(spec))
    runs = {
        "served": {"prompts": [p.token_ids for p in held],
                   "max_tokens": [p.max_tokens for p in held], "ignore_eos": False},
        f"former_{len(first)}": {
            "prompts": [p.token_ids for p in first],
            "max_tokens": [max(p.max_tokens, FORMER_MIN_TOKENS) for p in first],
            "ignore_eos": True},
        f"former_{len(held)}": {
            "prompts": [p.token_ids for p in held],
            "max_tokens": [max(p.max_tokens, FORMER_MIN_TOKENS) for p in held],
            "ignore_eos": True},
    }
    result = measure_serving(Path(out.manifest().model), config, runs)
    answer_tokens = sorted(p.max_tokens for p in held)
    return {"draft": str(draft), "method": way.name, "speculative_config": config,
            "prompts": f"{len(held)} {source}",
            "answer_tokens": {"min": answer_tokens[0], "median":
                              answer_tokens[len(answer_tokens) // 2],
                              "max": answer_tokens[-1]},
            "runs": result["runs"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--draft-dir", type=Path, default=None,
                        help="the folder that holds draft/ (default: the output)")
    parser.add_argument("--prompts", type=int, default=150)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = measure(args.output, args.draft_dir or args.output, args.prompts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({name: round(run["mean_acceptance_length"], 3)
                      for name, run in result["runs"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
