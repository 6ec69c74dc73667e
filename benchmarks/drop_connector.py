"""The pipeline ceiling: capture with `extract_hidden_states`, copy the states out, drop them.

Loaded by vLLM through `kv_connector_module_path="benchmarks.drop_connector"` (the
repository's root must be on PYTHONPATH of the engine core process). Everything hsx's
connector does up to the point where the states sit in host memory happens here, by the
same code — the scheduler delays freeing the request's blocks, the worker gathers the
slots of the requests a step finished out of the cache-only KV cache into host memory (a
fresh tensor on CPU; on CUDA one side-stream copy into pinned memory, hostcopy.py) — and
then the tensors are dropped: no file, no reader. No capture pipeline can beat this, so
`hsx / drop` is hsx's pipeline efficiency.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    PendingSave,
)

from hsx_workers.engines.vllm.connector import HsxHiddenStatesConnector
from hsx_workers.engines.vllm.hostcopy import DoneEvent, slots_of_blocks

__all__ = ["DoneEvent", "DropHiddenStatesConnector", "slot_mapping_of"]


def slot_mapping_of(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slot of every token of a request (as vLLM's example connector computes it)."""
    return slots_of_blocks(block_ids, block_size)


class DropHiddenStatesConnector(HsxHiddenStatesConnector):
    """hsx's connector, with each request's host copy dropped instead of written."""

    # Statistics kept for a sanity check (worker side; not reported back to the client).
    copied_tokens = 0

    def _keep(self, pending: PendingSave, event: Any, tensors: dict[str, torch.Tensor]) -> None:
        # Pinned blocks return to torch's host cache once the copy is done; get_finished()
        # reports the request as done sending once `event` has fired.
        DropHiddenStatesConnector.copied_tokens += int(pending.token_ids.shape[0])
