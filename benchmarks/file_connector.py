"""vLLM's ExampleHiddenStatesConnector made to run on CPU, and nothing else changed.

The upstream connector (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) fails on CPU at `torch.empty_like(...,
pin_memory=True)` and needs a CUDA stream. This subclass keeps its whole flow — one
safetensors file per request (`hidden_states` [T, L, H], `token_ids`) saved by an
8-thread pool into `shared_storage_path`, a `.lock` file per request created with
LOCK_EX in `wait_for_save` and released when the file is written — and only replaces
the CUDA side stream + pinned copy by the CPU gather (already a fresh host tensor).

Loaded through `kv_connector_module_path="benchmarks.file_connector"` (the repository's
root on PYTHONPATH).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from benchmarks.drop_connector import DoneEvent, slot_mapping_of


class CpuExampleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without pinned memory or CUDA streams."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        num_tokens = pending.token_ids.shape[0]
        slots = slot_mapping_of(pending.block_ids, self._block_size)
        # Upstream: gather on the copy stream, then copy into pinned host memory. On CPU
        # the gather already returns a new host tensor; copying it again would only add
        # work that hsx's connector does not do either.
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, num_tokens)
        copy_done = DoneEvent()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        prior = self._req_futures.get(pending.req_id)
        assert prior is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_path = pending.filename + ".lock"
            lock_fd = os.open(lock_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        future = self._executor.submit(
            self._write_tensors,
            tensors,
            copy_done,  # type: ignore[arg-type]
            pending.filename,
            lock_fd,
        )
        self._req_copy_events[pending.req_id] = copy_done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
