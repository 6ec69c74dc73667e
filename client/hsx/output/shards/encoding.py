"""What a shard's bytes mean, for its writer, its reader and its verification: the
format's constants, the tensors' dtypes, fp8 quantization and the checksum algorithms.

This module imports numpy only; torch is imported inside functions, and only when the
caller handed in a torch tensor.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Literal

import ml_dtypes
import numpy as np

from hsx.output.records import OutputCorrupt

StorageDtype = Literal["bf16", "fp8"]
Backend = Literal["numpy", "torch"]
Checksum = Literal["blake3", "sha256"]

DEFAULT_CHECKSUM: Checksum = "blake3"
"""BLAKE3 runs at several GB/s on one core (sha256 at 0.7-1.4 GB/s, below a fast disk:
it was the writer's limit); sha256 stays available, and records of either are read."""
CHECKSUM_SCHEME = "samples"
"""What a commit record's data digest covers (docs/FORMAT.md, "Checksums"): `samples`,
the bytes after hidden_states, which hold each sample's digest (so every byte is hashed
once, not twice); `whole` (records without a scheme), the whole data section."""

SHARD_FORMAT_VERSION = "1"
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value; per-token scales map each row's absmax onto it."""

DEFAULT_HEADER_RESERVE = 64 * 1024 - 8
"""Bytes reserved for the JSON header before the streamed data, so that the data starts
at 64 KiB (aligned for direct I/O). A header is ~1 KiB; a larger one (very many samples
do not enlarge it, only odd metadata could) makes the writer rewrite the file with a
larger region instead of failing."""

HEADER_PREFIX = 8  # little-endian u64 header length, as safetensors defines

SAMPLE_DIGESTS = "sample_digests"
"""Optional tensor [n, 32] U8: each sample's digest (the shard's checksum algorithm, named
in the metadata's `sample_digest`) over its hidden_states rows, then its input_ids,
loss_mask, (images) modality_mask and (fp8) scales rows. Readers check it on every
sample they return, so a flipped byte is named with its sample; shards written before
it have none."""
SAMPLE_DIGEST_BYTES = 32

MODALITY_MASK = "modality_mask"
"""Optional tensor [T] U8, in shards of a job that takes images: each token's modality,
0 for text, 1 for an image's vision token (`IMAGE`). Shards without it hold text only.
A sample's digest covers its rows after loss_mask's, before fp8 scales'."""
TEXT, IMAGE = 0, 1

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

# safetensors dtype names <-> numpy dtypes, for the tensors a shard holds.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BF16": BF16,
    "F8_E4M3": FP8,
    "F32": np.dtype(np.float32),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U8": np.dtype(np.uint8),
}
HIDDEN_DTYPE: dict[str, str] = {"bf16": "BF16", "fp8": "F8_E4M3"}


class ShardCorrupt(OutputCorrupt):
    """A shard whose bytes are not what its commit record says, or not a shard."""


def is_torch_tensor(x: object) -> bool:
    # torch can only have made `x` if it is already imported; never import it to check.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def quantize_fp8(x: Any, *, check: bool = True) -> tuple[Any, Any]:
    """Quantize `x` [..., H] to float8_e4m3fn with one scale per row (per token and layer).

    scale = absmax(row) / 448 (1.0 for an all-zero row), q = x / scale, so every row
    uses the whole e4m3 range and the relative error stays ~2^-4 of the row's absmax.
    numpy input gives numpy (ml_dtypes.float8_e4m3fn, float32); a torch tensor is
    quantized with torch on its own device. Non-finite input raises ValueError: its
    scale would silently turn the whole row into garbage. With `check=False` (a device
    tensor, where checking would wait for the device) such a row's scale is NaN instead,
    for whoever reads the scales on the host to refuse.
    """
    if is_torch_tensor(x):
        import torch

        xf = x.detach().to(torch.float32)
        absmax = xf.abs().amax(dim=-1)
        finite = torch.isfinite(absmax)
        if check and not bool(finite.all()):
            raise ValueError("hidden states contain inf or nan; fp8 scales would be undefined")
        scales = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
        q = (xf / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if not check:
            scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
        return q, scales
    xa = np.asarray(x).astype(np.float32, copy=False)
    absmax = np.abs(xa).max(axis=-1) if xa.shape[-1] else np.zeros(xa.shape[:-1], np.float32)
    if not np.isfinite(absmax).all():
        raise ValueError("hidden states contain inf or nan; fp8 scales would be undefined")
    sc = np.where(absmax > 0, absmax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    # ml_dtypes turns out-of-range values into nan (torch saturates); rounding in the
    # division can land a hair above 448, so clip first.
    qa = np.clip(xa / sc[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return qa, sc


def dequantize_fp8(q: Any, scales: Any) -> Any:
    """Inverse of `quantize_fp8`: float(q) * scale, returned as bf16 (numpy or torch)."""
    if is_torch_tensor(q):
        import torch

        return (q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(torch.bfloat16)
    out = np.asarray(q).astype(np.float32) * np.asarray(scales, np.float32)[..., None]
    return out.astype(BF16)


def new_hasher(algorithm: str) -> Any:
    """A fresh hash object (`update`, `hexdigest`) of a checksum algorithm hsx writes."""
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"checksum must be 'blake3' or 'sha256', got {algorithm!r}")
