"""hsx's KV connector: hands captured hidden states from vLLM's worker to the hsx engine.

vLLM's `extract_hidden_states` speculative method writes the requested layers' hidden
states into the KV cache of a cache-only attention layer. A KV connector copies them
out when a request finishes. This one is loaded by module path
(`kv_connector_module_path="hsx_workers.connector"`), and it differs from vLLM's
`ExampleHiddenStatesConnector` where that one cannot serve hsx:

- It runs on CPU as well as CUDA (hostcopy.py): on CUDA a side stream and pinned host
  memory, on CPU a plain gather, nothing pinned.
- It reads the cache with the installed vLLM's own gather (vllm_compat.py): the cache's
  layout differs between the releases hsx supports.
- With `storage_dtype: fp8` it quantizes on the device, so half the bytes cross to the
  host and the actor has nothing left to compute.
- It writes into the engine's spool (spool.py), publishing each request's file by
  atomic rename, so a reader never sees half a file and needs no lock files.

Who calls what (same split as every vLLM connector):
- scheduler side (engine core process): `build_connector_meta` names the spool file of
  each new request, `request_finished` delays freeing the request's blocks and queues
  a save — both inherited from vLLM's example connector.
- worker side (TP rank 0 only): `get_finished` gathers the states of finished
  requests out of the cache and writes them (`_submit_async_write`, overridden here).

`kv_connector_extra_config`: `shared_storage_path` (the spool directory),
`storage_dtype` (`bf16` or `fp8`), `num_writer_threads` (vLLM's, default 8).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from hsx.output.shards import background_priority
from hsx_workers.hostcopy import gather_to_host, slots_of_blocks
from hsx_workers.spool import publish_spool_file
from hsx_workers.vllm_compat import extract_states, fix_cpu_sampling_constraints

logger = logging.getLogger(__name__)

# vLLM loads this module in each engine process; the one that samples needs the fix.
fix_cpu_sampling_constraints()

SKIP_SAVE = "hsx_skip_save"
"""In a request's kv_transfer_params: generation only, its states are not wanted."""


def _write_spool_file(tensors: dict[str, torch.Tensor], event: Any, filename: str) -> None:
    """Thread-pool job: wait for the device-to-host copy, then publish."""
    background_priority()

    def copied() -> dict[str, torch.Tensor]:
        event.synchronize()
        return tensors

    publish_spool_file(filename, copied)


class HsxHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only connector for `extract_hidden_states`, CPU and CUDA."""

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # A regenerating job's generation requests have no states to keep: their blocks
        # are freed at once and nothing is written to the spool.
        if (request.kv_transfer_params or {}).get(SKIP_SAVE):
            self._request_filenames.pop(request.request_id, None)
            self._pending_saves.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)  # type: ignore[no-any-return]

    def wait_for_save(self) -> None:
        # No lock files: spool files are published by rename.
        return None

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hsx connector: KV caches were never registered")
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"hsx connector: request {pending.req_id} saved twice")

        slot_mapping = slots_of_blocks(pending.block_ids, self._block_size)
        stream = self._get_copy_stream() if self._kv_cache.is_cuda else None
        fp8 = self._kv_transfer_config.get_from_extra_config("storage_dtype", "bf16") == "fp8"
        event, tensors = gather_to_host(
            self._kv_cache, slot_mapping, int(pending.token_ids.shape[0]), stream,
            extract=extract_states, fp8=fp8,
        )
        tensors["token_ids"] = pending.token_ids.clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        future: Future[None] = self._executor.submit(
            _write_spool_file, tensors, event, pending.filename
        )
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
