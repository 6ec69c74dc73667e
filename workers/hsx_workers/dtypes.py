"""The dtype an engine computes in.

`dtype: auto` (the job's `vllm.dtype`, the default) means the model's own dtype, except on
a CPU without native bf16 math (neither AVX-512 BF16 nor AMX): there torch and vLLM's CPU
build emulate bf16 and fp16, and the same model computes several times faster in
float32 (benchmarks/README.md has the figures). The states are stored as the job's
`storage_dtype` either way; computed in float32 they are, if anything, nearer the
model's exact ones.

float32 doubles a bf16 model's weights in memory, so `auto` takes it only for an
unquantized model whose float32 weights need at most FLOAT32_MEMORY_SHARE of the host's
memory (a model too large, quantized, or of a size its config does not tell keeps its
own dtype). A job that names a dtype gets it.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

FLOAT32_MEMORY_SHARE = 0.25


@functools.cache
def cpu_has_native_bf16() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def float32_weight_bytes(model: str) -> int | None:
    """4 bytes a parameter of an unquantized model; None for a quantized one, or one whose
    size its config does not tell."""
    from hsx.modelinfo import read_model_info

    try:
        info = read_model_info(model)
    except Exception:  # a hub id not on this machine, no config: its size is unknown
        return None
    if info.config.get("quantization_config") or info.shape.get("quantization_config"):
        return None
    params = info.estimate_num_params()
    return None if params is None else 4 * params


def compute_dtype(requested: str, *, on_cpu: bool, model: str) -> str:
    """`requested` as an engine of `model` on this machine should load it: "float32" for
    "auto" on a CPU without native bf16 where the float32 weights fit the memory share,
    otherwise `requested` itself."""
    if requested != "auto" or not on_cpu or cpu_has_native_bf16():
        return requested
    need = float32_weight_bytes(model)
    if need is None or need > FLOAT32_MEMORY_SHARE * host_memory_bytes():
        logger.info("%s keeps its own dtype on this CPU without native bf16: its float32 "
                    "weights (%s) would take more than %d%% of the host's memory, or "
                    "cannot be sized", model, "unknown" if need is None else
                    f"{need / 2**30:.1f} GiB", round(100 * FLOAT32_MEMORY_SHARE))
        return requested
    return "float32"


def vllm_dtype(requested: str, model: str) -> str:
    """`compute_dtype` for a vLLM engine of `model` started by this process."""
    from vllm.platforms import current_platform

    return compute_dtype(requested, on_cpu=current_platform.is_cpu(), model=model)
