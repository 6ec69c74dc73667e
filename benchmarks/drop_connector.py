"""The pipeline ceiling: capture with `extract_hidden_states`, copy the states out, drop them.

Loaded by vLLM through `kv_connector_module_path="drop_connector"` (benchmarks/ must be
on PYTHONPATH of the engine core process). Everything a real connector does up to the
point where the states sit in host memory happens here — the scheduler delays freeing the
request's blocks, the worker gathers the request's slots out of the cache-only KV cache
(a fresh host tensor on CPU) — and then the tensor is dropped: no file, no reader.
No capture pipeline can beat this, so `hsx / drop` is hsx's pipeline efficiency.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class DoneEvent:
    """Stands in for the CUDA copy event: on CPU the gather is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def slot_mapping_of(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slot of every token of a request (as vLLM's example connector computes it)."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(0, block_size, dtype=torch.long)
    return (offsets.reshape(1, block_size) + blocks.reshape(-1, 1) * block_size).flatten()


class DropHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Gathers each finished request's hidden states into host memory and discards them."""

    # Statistics kept for a sanity check (worker side; not reported back to the client).
    copied_tokens = 0

    def wait_for_save(self) -> None:
        # No files, so no lock files either.
        return None

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        num_tokens = int(pending.token_ids.shape[0])
        slots = slot_mapping_of(pending.block_ids, self._block_size)
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens)
        DropHiddenStatesConnector.copied_tokens += int(states.shape[0])
        del states
        # get_finished() reports the request as done sending once its event has fired.
        self._req_copy_events[pending.req_id] = DoneEvent()  # type: ignore[assignment]
