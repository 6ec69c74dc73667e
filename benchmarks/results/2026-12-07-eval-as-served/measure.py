"""vLLM serving an output's draft, three runs on one engine (README.md): new prompts of
the target's language as a client sends them, the job's held-out prompts as its
evaluation sent them, and the same the former way (`ignore_eos`, at least 8 tokens).

Usage: python measure.py OUTPUT TARGET REQUEST.json  (writes REQUEST.json, prints the runs)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tests.integration.serving import measure_serving

from hsx.draft import read_train_state
from hsx.output import Output
from hsx.spec import TrainSpec
from hsx_workers.acceptance import held_out_prompts
from hsx_workers.learnable import SEP_ID, language_of

NEW_PROMPTS = 400
SERVED_MAX_TOKENS = 64
FORMER_MIN_TOKENS = 8


def main() -> None:
    out, target, request_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    job_eval = json.loads((out / "draft" / "eval.json").read_text())
    spec = TrainSpec.model_validate(read_train_state(out)["spec"])
    language = language_of(target)
    rng = random.Random(7)
    new = [ids[: ids.index(SEP_ID) + 1]
           for ids, _ in (language.sample(rng) for _ in range(NEW_PROMPTS))]
    held, _ = held_out_prompts(Output(out), spec, 512)
    held_ids = [p.token_ids for p in held]
    runs = {
        "served": {"prompts": new, "max_tokens": [SERVED_MAX_TOKENS] * len(new),
                   "ignore_eos": False},
        "held_out_as_served": {"prompts": held_ids,
                               "max_tokens": [p.max_tokens for p in held],
                               "ignore_eos": False},
        "former": {"prompts": held_ids,
                   "max_tokens": [max(p.max_tokens, FORMER_MIN_TOKENS) for p in held],
                   "ignore_eos": True},
    }
    config = job_eval["measurement"]["speculative_config"]
    request_path.write_text(json.dumps({"target": str(target), "speculative_config": config,
                                        "runs": runs}))
    print(json.dumps(measure_serving(target, config, runs), indent=1))


if __name__ == "__main__":
    main()
