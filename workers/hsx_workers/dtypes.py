"""The dtype an engine computes in.

`dtype: auto` (the job's `vllm.dtype`, the default) means the model's own dtype, except on
a CPU without native bf16 math (neither AVX-512 BF16 nor AMX): there torch and vLLM's CPU
build emulate bf16 and fp16, and the same model computes ~4x faster in float32 (the
learnable target, one core without AVX-512, 2026-12-04: vLLM's prefill 1,526 tok/s in
bf16 against 8,179 in float32; hsx's capture of its 67k tokens 36 s against 9 s past the
first unit). The states are stored as the job's `storage_dtype` either way; computed in
float32 they are, if anything, nearer the model's exact ones. A job that names a dtype
gets it.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_has_native_bf16() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def compute_dtype(requested: str, *, on_cpu: bool) -> str:
    """`requested` as an engine on this machine should load the model: "float32" for
    "auto" on a CPU without native bf16, otherwise `requested` itself."""
    if requested == "auto" and on_cpu and not cpu_has_native_bf16():
        return "float32"
    return requested
