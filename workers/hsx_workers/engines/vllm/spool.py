"""The spool: how captured states cross from vLLM's processes to the engine's actor.

vLLM's V1 engine computes in its own processes (engine core, TP ranks), and the states
leave the cache there: in hsx's KV connector (connector.py) or in the hook fallback
(hooks.py). Each request's states become one file in a directory private to one engine
(in /dev/shm when it has room), written under a `.partial` name and published by
rename, so a reader never sees half a file; a failure is published as `<file>.error`
with its reason. The actor (engines/vllm/engine.py) maps each file once, zero-copy, and
unlinks it at once: the mapping keeps the pages until the shard writer has written them
into the shard and dropped the arrays. Nothing in the spool ever reaches the output.

A spool file is a safetensors file: `hidden_states` [T, L, H] (bf16, or float8_e4m3fn
with `scales` [T, L] f32 when the connector quantized on the device), `norms` [T, L]
f32 (each row's L2 norm, computed on the device for the self-check; the hook fallback
writes none) and `token_ids` [T] (int64), the token ids vLLM actually processed. hsx
writes it itself (`_save`), with its data starting on a page, so the shard writer can
send the mapped states to the disk without copying them (local_storage.DIRECT_ALIGN).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SPOOL_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"
ERROR_SUFFIX = ".error"

_DTYPES: dict[str, Any] = {}
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _numpy_dtype(name: str) -> Any:
    if not _DTYPES:
        import ml_dtypes

        _DTYPES.update({
            "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
            "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
        })
    if name not in _DTYPES:
        raise ValueError(f"spool file holds a tensor of dtype {name}")
    return _DTYPES[name]


def spool_root(min_free_bytes: int) -> Path:
    """tmpfs when it has room (no disk I/O for a hand-off), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > min_free_bytes:
        return shm
    return Path(tempfile.gettempdir())


def publish_spool_file(filename: str, make: Callable[[], dict[str, Any]]) -> None:
    """Write `make()`'s torch tensors to `filename` and publish it by rename.

    A failure (in `make` too) is published as `<file>.error`, so the reader stops
    waiting at once with the reason instead of timing out.
    """
    partial_name = filename + PARTIAL_SUFFIX
    try:
        _save(make(), partial_name)
        os.replace(partial_name, filename)
    except BaseException as err:
        with open(filename + ERROR_SUFFIX, "w") as f:
            f.write(f"{type(err).__name__}: {err}")
        raise


SPOOL_ALIGN = 4096
"""A spool file's data starts on a page (its header is padded with spaces, as
safetensors allows), so the first tensor, hidden_states, is page-aligned in the reader's
mapping: the shard writer can hand those pages to the disk without copying them
(local_storage.DIRECT_ALIGN)."""

_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32",
                       "float16": "F16", "int64": "I64", "int32": "I32"}


def _save(tensors: dict[str, Any], path: str) -> None:
    """A safetensors file of CPU torch tensors, data aligned to SPOOL_ALIGN, each tensor
    copied once (straight from its memory into the file)."""
    import torch

    header: dict[str, Any] = {}
    parts = []
    pos = 0
    for name, tensor in tensors.items():
        dtype = _SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"spool tensor {name} has dtype {tensor.dtype}")
        flat = tensor.contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape),
                        "data_offsets": [pos, pos + data.nbytes]}
        parts.append(data)
        pos += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    n = -(-(8 + len(raw)) // SPOOL_ALIGN) * SPOOL_ALIGN - 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + raw.ljust(n, b" "))
        for data in parts:
            f.write(data.data)


def take_spool_file(path: str) -> dict[str, np.ndarray]:
    """Map a published spool file, unlink it, and return its tensors as numpy views.

    The views share the mapping (no copy); it lives until the last view is dropped. The
    mapping is populated at once (Linux): one call here instead of a page fault per 4 KiB
    in each of the shard writer's threads that read it.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE,
                       prot=mmap.PROT_READ) if size else None
    os.unlink(path)
    if mm is None or size < 8:
        raise ValueError(f"spool file {path} is empty")
    (n,) = struct.unpack_from("<Q", mm, 0)
    if 8 + n > size:
        raise ValueError(f"spool file {path} is truncated")
    header = json.loads(bytes(mm[8 : 8 + n]))
    header.pop("__metadata__", None)
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        dtype = _numpy_dtype(info["dtype"])
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        if 8 + n + end > size:
            raise ValueError(f"spool file {path}: tensor {name} lies outside the file")
        array = np.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + start)
        out[name] = array.reshape(info["shape"])
    return out


def read_error(path: str) -> str | None:
    """The reason published for `path`'s request, removing it; None if there is none."""
    error_file = path + ERROR_SUFFIX
    try:
        reason = Path(error_file).read_text()
    except FileNotFoundError:
        return None
    os.unlink(error_file)
    return reason
