"""The server's policy on a job: what a submitter may ask of this coordinator.

A job names data and tunes an engine; it never names code. `vet_spec` is called by the
submit route before the scheduler sees a job, and refuses (422, the field named):

- `trust_remote_code` unless the operator allows models' own code;
- a `vllm:` option that is not on the list of engine options a job may set
  (`ENGINE_OPTIONS`: the ones that tune capture and memory, each taking one plain value),
  naming the option and the list. vLLM takes many options that load code or files
  (`log_config_file` hands a file to `logging.config.dictConfig`, whose handlers may be
  any callable; `model_class_overrides`, `compilation_config.backend`, `worker_cls`
  name classes to import), so the list says what is allowed rather than what is not.
  An operator extends it with `HSX_ENGINE_OPTIONS`, never a job;
- `ray_address`: a coordinator runs every job on its own Ray (`HSX_RAY_ADDRESS`, its
  operator's); a job that names another cluster is refused rather than silently run
  elsewhere than it says;
- any path outside the caller's roots (users.py gives each caller theirs), and hub ids
  where the hub is not allowed (paths.check_job_paths).

`hsx extract` runs none of this: it runs as its user, who may already run any code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from hsx.spec import JobSpec
from hsx_service.config import Settings
from hsx_service.errors import JobRefused
from hsx_service.paths import check_job_paths
from hsx_service.users import Caller

# The vLLM engine options a job may set, with what each tunes (docs/SECURITY.md lists
# them). Each takes a plain value (a string, a number, a boolean); none names code or a
# file. The typed fields of `vllm:` (dtype, gpu_memory_utilization, ...) are hsx's own.
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


def allowed_engine_options(extra: Iterable[str] = ()) -> frozenset[str]:
    """The engine options a job may set here: hsx's list and the operator's additions."""
    return frozenset(ENGINE_OPTIONS) | frozenset(extra)


def engine_options_problem(options: dict[str, Any], extra: Iterable[str] = ()) -> str | None:
    """Why a job's `vllm:` options are refused by this server's list; None if they pass.

    Options on hsx's list must have a plain value; those the operator added are passed
    as they are (the operator chose them)."""
    allowed = allowed_engine_options(extra)
    added = frozenset(extra)
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


def vet_spec(spec: JobSpec, settings: Settings, caller: Caller) -> None:
    """The server's policy on a job `caller` submits, checked before the scheduler sees
    it."""
    if spec.ray_address is not None:
        raise JobRefused(
            "ray_address: this coordinator runs every job on its own Ray cluster (its "
            "operator's HSX_RAY_ADDRESS); leave ray_address out of a submitted job (it is "
            "for `hsx extract`)")
    if spec.trust_remote_code and not settings.allow_trust_remote_code:
        raise JobRefused(
            "trust_remote_code: this server does not run models' own code "
            "(its operator can allow it with HSX_ALLOW_TRUST_REMOTE_CODE=1)"
        )
    problem = engine_options_problem(spec.vllm.engine_args(), settings.engine_options)
    if problem:
        raise JobRefused(f"vllm: {problem}")
    hosts = sorted(set(spec.images.allow_hosts) - set(settings.image_hosts)
                   ) if spec.images is not None else []
    if hosts:
        allowed = ", ".join(settings.image_hosts) or "none"
        raise JobRefused(
            f"images.allow_hosts: this server fetches no images from {', '.join(hosts)} "
            f"(its operator allows {allowed}: HSX_IMAGE_HOSTS)")
    check_job_paths(spec, caller.roots, hub_allowed=settings.hub_allowed)


# Keys whose values are kept out of statuses, logs and metrics.
_SECRET_KEY = re.compile(
    r"(?:^|[_-])(?:token|secret|password|passwd|credentials?|api_?key|access_?key|"
    r"secret_?key|private_?key|auth|authorization)(?:$|[_-])", re.IGNORECASE)
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
REDACTED = "***"


def _redact_value(key: str, value: Any) -> Any:
    if _SECRET_KEY.search(key):
        return REDACTED
    if isinstance(value, dict):
        return {k: _redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_value(key, v) for v in value]
    if isinstance(value, str):
        return _USERINFO.sub(rf"\1{REDACTED}@", value)
    return value


def redacted(spec: JobSpec) -> JobSpec:
    """The spec as others may read it: the values of keys that look secret (`hf_token`,
    `api_key`, ...) in `vllm:` and `chat_template_kwargs`, and the user:password of URIs,
    replaced by `***`."""
    data = spec.model_dump(mode="json")
    for field in ("model", "tokenizer", "output"):
        if isinstance(data.get(field), str):
            data[field] = _redact_value(field, data[field])
    data["dataset"] = _redact_value("dataset", data["dataset"])
    data["vllm"] = _redact_value("vllm", data["vllm"])
    data["chat_template_kwargs"] = _redact_value("chat_template_kwargs",
                                                 data["chat_template_kwargs"])
    return JobSpec.model_validate(data)
