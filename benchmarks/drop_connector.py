"""The pipeline ceiling: capture with `extract_hidden_states`, copy the states out, drop them.

Loaded by vLLM through `kv_connector_module_path="drop_connector"` (benchmarks/ must be
on PYTHONPATH of the engine core process). Everything a real connector does up to the
point where the states sit in host memory happens here — the scheduler delays freeing the
request's blocks, the worker gathers the request's slots out of the cache-only KV cache
into host memory (a fresh tensor on CPU; on CUDA hsx's side-stream copy into pinned
memory, hostcopy.py) — and then the tensor is dropped: no file, no reader.
No capture pipeline can beat this, so `hsx / drop` is hsx's pipeline efficiency.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from hsx_workers.hostcopy import DoneEvent, gather_to_host, slots_of_blocks
from hsx_workers.vllm_compat import extract_states

__all__ = ["DoneEvent", "DropHiddenStatesConnector", "slot_mapping_of"]


def slot_mapping_of(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slot of every token of a request (as vLLM's example connector computes it)."""
    return slots_of_blocks(block_ids, block_size)


class DropHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Copies each finished request's hidden states into host memory and discards them."""

    # Statistics kept for a sanity check (worker side; not reported back to the client).
    copied_tokens = 0

    def wait_for_save(self) -> None:
        # No files, so no lock files either.
        return None

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("drop connector: KV caches were never registered")
        num_tokens = int(pending.token_ids.shape[0])
        slots = slot_mapping_of(pending.block_ids, self._block_size)
        stream = self._get_copy_stream() if self._kv_cache.is_cuda else None
        # The same gather and device-to-host copy as hsx's connector (side stream, pinned
        # memory on CUDA); the host tensors are then dropped.
        event, host = gather_to_host(self._kv_cache, slots, num_tokens, stream,
                                     extract=extract_states)
        DropHiddenStatesConnector.copied_tokens += num_tokens
        del host  # pinned blocks return to torch's host cache once the copy is done
        # get_finished() reports the request as done sending once its event has fired.
        self._req_copy_events[pending.req_id] = event
