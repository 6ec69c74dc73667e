"""Gathering captured states out of the cache-only KV cache into host memory.

torch only (no vLLM import), so the copy path can be checked and measured on a GPU
machine that has no vLLM. The connector (connector.py) calls `gather_to_host`.

On CUDA the gather and the device-to-host copy run on a side stream, into pinned host
memory: pageable copies were measured 40x slower than pinned ones on an H200 (1.35 vs
55 GB/s), and a side stream keeps the copy off the model's stream. On CPU the gather
already makes a fresh host tensor; nothing is pinned (pinning needs an accelerator).
"""

from __future__ import annotations

from typing import Any

import torch


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


def gather(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens, num_layers, hidden] out of a [blocks, layers, block_size, hidden] cache."""
    block_size = kv_cache.shape[2]
    return kv_cache[slot_mapping // block_size, :, slot_mapping % block_size][:num_tokens]


def gather_to_host(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    stream: torch.cuda.Stream | None = None,
) -> tuple[Any, torch.Tensor]:
    """Start copying one request's states to host memory; return (event, host tensor).

    The host tensor is valid once `event.synchronize()` returns (at once on CPU).
    """
    if not kv_cache.is_cuda:
        return DoneEvent(), gather(kv_cache, slot_mapping, num_tokens)
    stream = stream or torch.cuda.Stream(device=kv_cache.device)
    ready = torch.cuda.Event()
    ready.record()
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        slots = slot_mapping.to(kv_cache.device, non_blocking=True)
        states = gather(kv_cache, slots, num_tokens)
        # torch's caching host allocator reuses pinned blocks across requests.
        host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
        host.copy_(states, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    return done, host
