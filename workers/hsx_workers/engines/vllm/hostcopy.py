"""Gathering captured states out of the cache-only KV cache into host memory.

torch only (no vLLM import), so the copy path can be checked and measured on its own.
The connector (connector.py) calls `gather_to_host` with vLLM's own gather function
(compat.extract_states), which knows the installed release's cache layout; tests
and benchmarks pass `gather` (the 0.32 layout) or their own.

The connector gathers all the requests one engine step finished at once: their slots
one after another (`slots_of_requests`, numpy, no torch call per request), one gather,
one copy, and each request's states are rows of the result (`split_rows`). Per request,
a gather and its copy were a few dozen torch calls on vLLM's engine thread: on short
rows that thread spent most of its time there, not computing (benchmarks/
bench_connector.py measures the two ways).

On CUDA the gather, the optional fp8 quantization and the device-to-host copy run on a
side stream, into pinned host memory: pageable copies are many times slower than
pinned ones, and a side stream keeps the copy off the
model's stream. Quantizing on the device halves the bytes that cross to the host and
leaves the host nothing to compute. On CPU the gather already makes a fresh host
tensor; nothing is pinned (pinning needs an accelerator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hsx.output.shards import quantize_fp8

Extract = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class DoneEvent:
    """Stands in for a CUDA event where the copy is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def slots_of_blocks(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slot of every token position of a request, from its block ids."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (offsets[None, :] + blocks[:, None] * block_size).flatten()


def slots_of_requests(block_ids: list[list[int]], num_tokens: list[int],
                      block_size: int) -> torch.Tensor:
    """Cache slot of every token of the requests, one request after another: request i's
    first `num_tokens[i]` positions, from its block ids."""
    blocks_needed = [-(-n // block_size) for n in num_tokens]
    for ids, need, n in zip(block_ids, blocks_needed, num_tokens, strict=True):
        if len(ids) < need:
            raise ValueError(f"{n} tokens need {need} blocks of {block_size}, "
                             f"the request has {len(ids)}")
    blocks = np.fromiter(
        (b for ids, need in zip(block_ids, blocks_needed, strict=True) for b in ids[:need]),
        dtype=np.int64, count=sum(blocks_needed))
    slots = (blocks[:, None] * block_size + np.arange(block_size)).ravel()
    # Each request's last block is cut at its length.
    spans = np.asarray(blocks_needed, dtype=np.int64) * block_size
    starts = np.repeat(np.cumsum(spans) - spans, spans)
    lengths = np.repeat(np.asarray(num_tokens, dtype=np.int64), spans)
    return torch.from_numpy(slots[np.arange(slots.size) - starts < lengths])


def split_rows(tensors: dict[str, torch.Tensor], num_tokens: list[int]
               ) -> list[dict[str, torch.Tensor]]:
    """Each request's rows of a gather over several requests (views, no copy)."""
    parts = {name: t.split(num_tokens) for name, t in tensors.items()}
    return [{name: parts[name][i] for name in tensors} for i in range(len(num_tokens))]


def gather(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens, num_layers, hidden] out of a [blocks, layers, block_size, hidden] cache
    (vLLM 0.32's layout; the connector uses the installed vLLM's own function)."""
    block_size = kv_cache.shape[2]
    return kv_cache[slot_mapping // block_size, :, slot_mapping % block_size][:num_tokens]


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    # torch's caching host allocator reuses pinned blocks across requests.
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def mark_stream(kv_cache: torch.Tensor | None) -> torch.cuda.Event | None:
    """An event recorded now on the current stream of `kv_cache`'s device (None on CPU,
    or before the cache exists): what a later gather may wait for instead of all the
    work launched by then."""
    if kv_cache is None or not kv_cache.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def row_norms_of(states: torch.Tensor) -> torch.Tensor:
    """[T, L] float32 L2 norm of each row of [T, L, H] states, computed where they are:
    what the self-check looks at (selfcheck.py), so the host never passes over the states
    for it (on the H100 that pass, 5.5 ms a sample of an 8B model, cost 4% of a job's
    throughput even off the capture thread). NaN or inf for a row that is not finite."""
    return torch.linalg.vector_norm(states, dim=-1, dtype=torch.float32)


def _stored(states: torch.Tensor, fp8: bool) -> torch.Tensor:
    """States computed in float32 or float16 (dtypes.py), as bf16 storage keeps them:
    half the bytes of float32 cross to the host and the spool."""
    if fp8 or states.dtype == torch.bfloat16:
        return states
    return states.to(torch.bfloat16)


def gather_to_host(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    stream: torch.cuda.Stream | None = None,
    *,
    extract: Extract = gather,
    fp8: bool = False,
    after: torch.cuda.Event | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Start copying one request's states to host memory; return (event, host tensors).

    The tensors are `hidden_states` [T, L, H] (bf16, or float8_e4m3fn when
    `fp8`), `norms` [T, L] (`row_norms_of` the states before any quantization) and, with
    `fp8`, `scales` [T, L] (hsx.output.shards.quantize_fp8's per-row scales, NaN for a row
    that is not finite: checking here would wait for the device).
    They are valid once `event.synchronize()` returns (at once on CPU). On CUDA the copy
    waits for `after` (`mark_stream`, recorded once the kernels that wrote these states
    were launched), else for all the work on the current stream.
    """
    if not kv_cache.is_cuda:
        states = _stored(extract(kv_cache, slot_mapping, num_tokens), fp8)
        norms = row_norms_of(states)
        if not fp8:
            return DoneEvent(), {"hidden_states": states, "norms": norms}
        q, scales = quantize_fp8(states, check=False)
        return DoneEvent(), {"hidden_states": q, "scales": scales, "norms": norms}
    stream = stream or torch.cuda.Stream(device=kv_cache.device)
    if after is None:
        after = torch.cuda.Event()
        after.record()
    stream.wait_event(after)
    with torch.cuda.stream(stream):
        # From pinned memory, or the upload waits for the side stream, which waits for
        # the model's stream: the engine's thread would stop at every finished request
        # until the batch just launched ends, and the next batch is not prepared in the
        # meantime (the overlap vLLM's async scheduling makes would be lost). Pinned, the
        # copy is queued like the rest; torch's host allocator keeps the block until the
        # copy has run.
        slots = slot_mapping.pin_memory().to(kv_cache.device, non_blocking=True)
        states = _stored(extract(kv_cache, slots, num_tokens), fp8)
        norms = _to_pinned(row_norms_of(states))
        if fp8:
            q, scales = quantize_fp8(states, check=False)
            host = {"hidden_states": _to_pinned(q), "scales": _to_pinned(scales),
                    "norms": norms}
        else:
            host = {"hidden_states": _to_pinned(states), "norms": norms}
    # A blocking event: the spool writer threads that wait on it sleep instead of
    # spinning (8 spinning threads took 7 cores of the engine core's process).
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    return done, host
