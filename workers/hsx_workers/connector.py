"""hsx's KV connector: hands captured hidden states from vLLM's worker to the hsx engine.

vLLM's `extract_hidden_states` speculative method writes the requested layers' hidden
states into the KV cache of a cache-only attention layer. A KV connector copies them
out when a request finishes. This one is loaded by module path
(`kv_connector_module_path="hsx_workers.connector"`), and it differs from vLLM's
`ExampleHiddenStatesConnector` where that one cannot serve hsx:

- It runs on CPU as well as CUDA (hostcopy.py): on CUDA a side stream and pinned host
  memory, on CPU a plain gather, nothing pinned.
- It writes into a spool directory private to one engine (tmpfs when there is room),
  publishing each request's file by atomic rename, so a reader never sees half a file
  and needs no lock files. The spool is a hand-off, not the output: the hsx engine
  reads each file once, feeds it to the shard writer and deletes it.

Who calls what (same split as every vLLM connector):
- scheduler side (engine core process): `build_connector_meta` names the spool file of
  each new request, `request_finished` delays freeing the request's blocks and queues
  a save — both inherited from vLLM's example connector.
- worker side (TP rank 0 only): `get_finished` gathers the states of finished
  requests out of the cache and writes them (`_submit_async_write`, overridden here).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from hsx_workers.hostcopy import gather_to_host, slots_of_blocks

logger = logging.getLogger(__name__)

SPOOL_SUFFIX = ".safetensors"
PARTIAL_SUFFIX = ".partial"
ERROR_SUFFIX = ".error"


def publish_spool_file(filename: str, make: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Write `make()`'s tensors to `filename` and publish it by rename.

    A failure (in `make` too) is published as `<file>.error`, so the reader stops
    waiting at once with the reason instead of timing out.
    """
    partial_name = filename + PARTIAL_SUFFIX
    try:
        save_file(make(), partial_name)
        os.replace(partial_name, filename)
    except BaseException as err:
        with open(filename + ERROR_SUFFIX, "w") as f:
            f.write(f"{type(err).__name__}: {err}")
        raise


def _write_spool_file(tensors: dict[str, torch.Tensor], event: Any, filename: str) -> None:
    """Thread-pool job: wait for the device-to-host copy, then publish."""

    def copied() -> dict[str, torch.Tensor]:
        event.synchronize()
        return tensors

    publish_spool_file(filename, copied)


class HsxHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only connector for `extract_hidden_states`, CPU and CUDA."""

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
        event, host_states = gather_to_host(
            self._kv_cache, slot_mapping, int(pending.token_ids.shape[0]), stream
        )

        tensors = {"hidden_states": host_states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        future: Future[None] = self._executor.submit(
            _write_spool_file, tensors, event, pending.filename
        )
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
