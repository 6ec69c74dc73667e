"""What vLLM asks of a job, owned beside the engine that follows it: the service asks
here instead of restating it.

- `max_model_len`, `longest_prompt`: capture runs each prompt with one generated token
  and one speculative slot after it, so vLLM needs 2 positions beyond the prompt;
- `job_problem`: a job's `vllm:` against the installed vLLM and capture (the preflight,
  hsx_service/prepare.py): its length, the settings under which this vLLM captures wrong
  states (compat.py), engine arguments vLLM lacks or hsx sets itself (`ARGS_HSX_SETS`);
- `ENGINE_OPTIONS`, `engine_options_problem`: the engine arguments a job may pass through
  on a coordinator (policy.py), an allow-list because vLLM's arguments that load code or
  files outnumber any deny-list;
- `engine_memory`: vLLM's share of a GPU an online trainer shares;
- `binds_cpu_cores`: where vLLM's CPU build binds each rank to cores of its own;
- `engine_env`: the environment vLLM reads in the process that builds an engine (the
  engine pool's actors, hsx_service/engine_pool.py);
- `target_settings`: vLLM's settings for the job's target outside capture (the draft's
  evaluation).

Light: pydantic and hsx alone at import; vLLM is imported inside compat.py's functions.
The engine itself (engine.py) builds its arguments with `max_model_len` and
`ARGS_HSX_SETS`' keys.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from typing import Literal

from hsx.modelinfo import ModelInfo
from hsx.spec import JobSpec, VllmOptions
from hsx_workers.engines.vllm.settings import TargetSettings

CAPTURE_POSITIONS = 2
"""Positions capture needs beyond the prompt: the one generated token and the
speculative slot of `extract_hidden_states`."""

# Engine arguments hsx sets itself for capture; a job that names one is refused.
ARGS_HSX_SETS = {
    "model": "the job's `model`",
    "tensor_parallel_size": "the job's `tensor_parallel_size`",
    "max_model_len": f"the job's `max_seq_len` (+{CAPTURE_POSITIONS})",
    "trust_remote_code": "the job's `trust_remote_code`",
    "speculative_config": "capture itself (extract_hidden_states)",
    "kv_transfer_config": "capture itself (hsx's connector)",
    "enable_prefix_caching": "capture (every prompt token must be computed)",
    "disable_log_stats": "hsx",
    "skip_tokenizer_init": "hsx",
    "language_model_only": "the model preflight (wrappers run their text path)",
    "worker_extension_cls": "the hook fallback",
}

# The vLLM engine options a job may set on a coordinator, with what each tunes
# (docs/SECURITY.md lists them). Each takes a plain value (a string, a number, a
# boolean); none names code or a file. The typed fields of `vllm:` (dtype,
# gpu_memory_utilization, ...) are hsx's own (hsx.spec.VllmOptions).
ENGINE_OPTIONS: dict[str, str] = {
    "load_format": "how weights are read (one of LOAD_FORMATS; dummy: random weights)",
    "quantization": "the weights' quantization method, by vLLM's name",
    "kv_cache_dtype": "the KV cache's dtype (auto, fp8, ...)",
    "max_num_seqs": "sequences in one engine step",
    "block_size": "tokens per KV cache block",
    "swap_space": "CPU swap space per GPU, GiB",
    "cpu_offload_gb": "weights kept in CPU memory, GiB",
    "kv_cache_memory_bytes": "bytes of KV cache per GPU, instead of a memory share",
    "num_gpu_blocks_override": "KV cache blocks, instead of profiling",
    "enable_chunked_prefill": "split long prompts across engine steps",
    "max_num_partial_prefills": "prompts prefilled in parts at once",
    "max_long_partial_prefills": "long prompts prefilled in parts at once",
    "long_prefill_token_threshold": "tokens from which a prompt counts as long",
    "enable_expert_parallel": "a MoE model's experts spread over the engine's GPUs",
    "disable_custom_all_reduce": "NCCL's all-reduce instead of vLLM's own",
    "disable_cascade_attn": "no cascade attention",
    "calculate_kv_scales": "fp8 KV cache scales computed on the fly",
    "async_scheduling": "schedule the next step while this one runs",
    "seed": "the engine's random seed",
    "revision": "the model's hub revision (a hub model only)",
    "tokenizer_revision": "the tokenizer's hub revision (a hub model only)",
}

# `load_format` values that read weights as data (no tensorizer, no plugin's loader).
LOAD_FORMATS = frozenset({
    "auto", "safetensors", "pt", "npcache", "dummy", "fastsafetensors", "bitsandbytes",
    "gguf", "sharded_state", "mistral",
})

_PLAIN = (str, int, float, bool)

UNBUDGETED_GPU_SHARE = 0.05
"""Of a GPU an online trainer shares with an engine, the memory neither vLLM nor the
trainer budgets for: CUDA contexts, and what vLLM allocates beyond its budget."""


def max_model_len(max_seq_len: int) -> int:
    """vLLM's `max_model_len` for capturing prompts of up to `max_seq_len` tokens."""
    return max_seq_len + CAPTURE_POSITIONS


def longest_prompt(positions: int) -> int:
    """The longest prompt a model of `positions` positions can be captured on."""
    return positions - CAPTURE_POSITIONS


def job_problem(spec: JobSpec, info: ModelInfo) -> str | None:
    """Why the job's vllm engines cannot capture `info`'s model as it asks, the field
    named first (`max_seq_len: ...`, `vllm.dtype: ...`); None if they can. Where vLLM is
    not installed, only what needs no vLLM is checked: the engine's own start then says
    what it refuses."""
    from hsx_workers.engines.vllm import compat

    positions = info.max_positions
    if positions is not None and max_model_len(spec.max_seq_len) > positions:
        return (f"max_seq_len: {spec.max_seq_len} is too long for {spec.model}: it has "
                f"{positions} positions (max_position_embeddings) and vLLM's capture needs "
                f"{CAPTURE_POSITIONS} beyond the prompt; set max_seq_len to "
                f"{longest_prompt(positions)} or less")
    problem = compat.capture_problem(uses_mla=info.uses_mla,
                                     enforce_eager=spec.vllm.enforce_eager)
    if problem:
        return f"vllm.enforce_eager: {problem}"
    problem = compat.dtype_problem(uses_linear_attention=info.uses_linear_attention,
                                   requested=spec.vllm.dtype, model=spec.model,
                                   model_dtype=info.torch_dtype)
    if problem:
        return f"vllm.dtype: {problem}"
    passed = spec.vllm.engine_args()
    if not passed:
        return None
    try:
        known: frozenset[str] | None = compat.engine_arg_names()
    except ImportError:  # no vLLM here: the engine's own start says what it refuses
        known = None
    problem = engine_args_problem(passed, known)
    return f"vllm: {problem}" if problem else None


def engine_args_problem(names: Iterable[str], known: frozenset[str] | None) -> str | None:
    """Why some of `names` cannot be passed to vLLM: hsx sets them itself, or (when the
    installed vLLM's argument names are `known`) vLLM has no such argument. None if fine."""
    from hsx_workers.engines.vllm.compat import vllm_version

    problems = []
    for name in sorted(names):
        if name in ARGS_HSX_SETS:
            problems.append(f"`{name}` is set by {ARGS_HSX_SETS[name]}")
        elif known is not None and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            problems.append(f"`{name}` is not an engine argument of vLLM {vllm_version()}{hint}")
    return "; ".join(problems) or None


def allowed_engine_options(extra: Iterable[str] = ()) -> frozenset[str]:
    """The engine options a job may set on a coordinator: hsx's list and the operator's
    additions (HSX_ENGINE_OPTIONS)."""
    return frozenset(ENGINE_OPTIONS) | frozenset(extra)


def engine_options_problem(vllm: VllmOptions, extra: Iterable[str] = ()) -> str | None:
    """Why the engine arguments of a job's `vllm:` section are refused by a coordinator's
    list; None if they pass.

    Options on hsx's list must have a plain value; those the operator added are passed
    as they are (the operator chose them)."""
    allowed = allowed_engine_options(extra)
    added = frozenset(extra)
    options = vllm.engine_args()
    unlisted = sorted(name for name in options if name not in allowed)
    if unlisted:
        return (f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not among "
                f"the engine options a job may set on this server ({', '.join(sorted(allowed))}"
                "; its operator can add others with HSX_ENGINE_OPTIONS)")
    for name, value in sorted(options.items()):
        if name in added:
            continue
        if value is not None and not isinstance(value, _PLAIN):
            return f"{name} takes one plain value (a string, number or boolean), not a " \
                   f"{type(value).__name__}"
        if name == "load_format" and value not in LOAD_FORMATS:
            return (f"load_format {value!r} is not one this server reads weights with "
                    f"({', '.join(sorted(LOAD_FORMATS))})")
    return None


def engine_memory(wanted: float, share: float) -> float:
    """The fraction of each GPU's memory vLLM takes: `wanted` (the job's
    `vllm.gpu_memory_utilization`), less what a trainer sharing the GPU takes (`share`)
    and the memory neither budgets for (`UNBUDGETED_GPU_SHARE`)."""
    if share <= 0:
        return wanted
    return round(min(wanted, 1.0 - share - UNBUDGETED_GPU_SHARE), 3)


def binds_cpu_cores(tensor_parallel_size: int) -> bool:
    """Whether vLLM's CPU build binds each rank of an engine to cores of its own (it does
    for more than one rank), so its ranks must fit the machine's cores."""
    return tensor_parallel_size > 1


def engine_env(cpu_kvcache_gib: int, *, tp: int, gpus: bool, part: float = 1.0,
               replica: int = 0, replicas: int = 1) -> dict[str, str]:
    """The environment of the process that builds engine `replica` of `replicas` (TP
    `tp`, each rank `part` of a GPU on a GPU cluster): vLLM reads these at start, not
    from its arguments. vLLM's CPU build allocates its KV cache (`cpu_kvcache_gib`, the
    job's `vllm.cpu_kvcache_gib`) and binds each rank to its own cores (`cpu_binding`);
    ranks of vLLM's Ray executor take `part` of a GPU each, to fit a group's bundles
    when an online trainer shares the GPUs (hsx_service/engine_pool.engine_bundles)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(cpu_kvcache_gib),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if not gpus:
        binding = cpu_binding(replica, replicas, tp)
        if binding:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    elif part < 1 and tp > 1:
        env["VLLM_RAY_PER_WORKER_GPUS"] = f"{part:g}"
    return env


def cpu_binding(replica: int, replicas: int, tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND giving each rank of engine `replica` its own cores, when
    there are enough.

    vLLM's CPU build refuses TP>1 on a small machine unless threads are bound by hand.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_rank = len(cores) // (replicas * tp)
    if per_rank < 1:
        return None
    ranks = []
    for rank in range(tp):
        first = (replica * tp + rank) * per_rank
        chosen = cores[first : first + per_rank]
        ranks.append(f"{chosen[0]}-{chosen[-1]}" if len(chosen) > 1 else str(chosen[0]))
    return "|".join(ranks)


def target_settings(spec: JobSpec, *, tensor_parallel_size: int | None = None,
                    distributed_executor_backend: Literal["ray", "mp"] | None = None
                    ) -> TargetSettings:
    """vLLM's settings for the job's target outside capture (the draft's evaluation): as
    the job's engines load it — tensor parallelism (unless the evaluation has its own),
    dtype, memory share, remote code and the job's own `vllm:` engine arguments; a job
    that takes images, its vision tower with as many images a prompt as its rows hold."""
    return TargetSettings(
        tensor_parallel_size=tensor_parallel_size or spec.tensor_parallel_size,
        options=spec.vllm, trust_remote_code=spec.trust_remote_code,
        images_per_prompt=spec.images.max_per_row if spec.images is not None else None,
        distributed_executor_backend=distributed_executor_backend)
