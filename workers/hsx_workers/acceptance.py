"""How well a trained draft does in vLLM: mean acceptance length on real generation.

`measure_acceptance(target, draft, prompts)` runs vLLM with
`speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k}`,
greedy, and reads vLLM's own counters (`llm.get_metrics()`, `disable_log_stats=False`):
mean acceptance length = 1 + accepted / drafts. `hsx eval-draft` calls it; run it in a
process of its own (vLLM's engine core is spawned, and its settings are per process).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.output import Output


@dataclass
class Acceptance:
    k: int
    prompts: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    mean_acceptance_length: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompts_from_output(output: Output | str | Path, n: int = 8, prefix: int = 8
                        ) -> list[list[int]]:
    """The first `prefix` tokens of the first `n` samples of an output's inputs.arrow."""
    from hsx.output import Output

    table = Output.of(output).input_rows(0, n)
    ids = table.column("input_ids").to_pylist()
    return [list(map(int, row[:prefix])) for row in ids if row]


def _counter(metrics: dict[str, Any], name: str) -> Any:
    metric = metrics.get(name)
    if metric is None:
        raise RuntimeError(f"vLLM reported no {name}; is speculative decoding on?")
    return metric


def measure_acceptance(
    target: str, draft: str, prompts: list[list[int]], *, k: int = 3, max_tokens: int = 48,
    max_model_len: int = 1024, enforce_eager: bool = True,
) -> Acceptance:
    import time

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts:
        raise ValueError("no prompts to generate from")
    llm = LLM(
        model=target, max_model_len=max_model_len, disable_log_stats=False,
        enforce_eager=enforce_eager,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k},
    )
    t0 = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    seconds = time.perf_counter() - t0
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = int(_counter(metrics, "vllm:spec_decode_num_drafts").value)
    draft_tokens = int(_counter(metrics, "vllm:spec_decode_num_draft_tokens").value)
    accepted = int(_counter(metrics, "vllm:spec_decode_num_accepted_tokens").value)
    per_pos = [int(v) for v in _counter(
        metrics, "vllm:spec_decode_num_accepted_tokens_per_pos").values]
    return Acceptance(
        k=k, prompts=len(prompts),
        generated_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
        accepted_per_position=per_pos,
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0, seconds=seconds,
    )
