"""hsx's KV connector: hands captured hidden states from vLLM's worker to the hsx engine.

vLLM's `extract_hidden_states` speculative method writes the requested layers' hidden
states into the KV cache of a cache-only attention layer. A KV connector copies them
out when a request finishes. This one is loaded by module path
(`kv_connector_module_path="hsx_workers.engines.vllm.connector"`), and it differs from vLLM's
`ExampleHiddenStatesConnector` where that one cannot serve hsx:

- It runs on CPU as well as CUDA (hostcopy.py): on CUDA a side stream and pinned host
  memory, on CPU a plain gather, nothing pinned.
- It reads the cache with the installed vLLM's own gather (engines/vllm/compat.py): the cache's
  layout differs between the releases hsx supports.
- With `storage_dtype: fp8` it quantizes on the device, so half the bytes cross to the
  host and the actor has nothing left to compute.
- It writes into the engine's spool (spool.py), publishing each request's file by
  atomic rename, so a reader never sees half a file and needs no lock files.

Who calls what (same split as every vLLM connector):
- scheduler side (engine core process): `build_connector_meta` names the spool file of
  each new request, `request_finished` delays freeing the request's blocks and queues
  a save — both inherited from vLLM's example connector.
- worker side (TP rank 0 only): `get_finished` gathers the states of the requests a
  step finished out of the cache, all at once (one slot mapping, one gather, one copy:
  hostcopy.py), and writes each request's rows to its spool file (`_keep`).

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
from hsx_workers.engines.vllm.compat import extract_states, fix_cpu_sampling_constraints
from hsx_workers.engines.vllm.hostcopy import (
    gather_to_host,
    mark_stream,
    slots_of_requests,
    split_rows,
)
from hsx_workers.engines.vllm.spool import publish_spool_file

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._taken: set[str] = set()  # requests this step's get_finished gathered
        self._made_dirs: set[str] = set()  # spool directories known to exist
        self._step_start: Any = None  # the device's stream as this step began

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Called as a step begins, before its forward is launched. The saves this step
        # carries are of requests an earlier step finished: every kernel that wrote
        # their states (the target's forward, the drafter that writes the captured
        # layers) was launched before now. Their gather waits for this mark, not for
        # this step's forward, which it then overlaps: the states reach the spool a
        # step sooner.
        self._step_start = mark_stream(self._kv_cache)

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

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        # Every request this step finished, gathered and copied at once; vLLM's loop
        # below then polls their copies (and hands each to _submit_async_write, which
        # finds it taken).
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        pending: list[PendingSave] = list(getattr(meta, "pending_saves", None) or [])
        self._taken = set()
        for group in _groups(pending, GATHER_TOKENS):
            self._submit_step(group)
        return super().get_finished(finished_req_ids)  # type: ignore[no-any-return]

    def _submit_async_write(self, pending: PendingSave) -> None:
        if pending.req_id not in self._taken:
            self._submit_step([pending])

    def _submit_step(self, pending: list[PendingSave]) -> None:
        """One gather and one device-to-host copy for these requests, then each request's
        rows go to `_keep`."""
        self._taken.update(p.req_id for p in pending)
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hsx connector: KV caches were never registered")
        for p in pending:
            if p.req_id in self._req_futures:
                raise RuntimeError(f"hsx connector: request {p.req_id} saved twice")
        lengths = [int(p.token_ids.shape[0]) for p in pending]
        slot_mapping = slots_of_requests([p.block_ids for p in pending], lengths,
                                         self._block_size)
        stream = self._get_copy_stream() if self._kv_cache.is_cuda else None
        event, tensors = gather_to_host(
            self._kv_cache, slot_mapping, sum(lengths), stream,
            extract=extract_states, fp8=self._storage_fp8(), after=self._step_start,
        )
        for p, rows in zip(pending, split_rows(tensors, lengths), strict=True):
            self._req_copy_events[p.req_id] = event
            self._keep(p, event, rows)

    def _storage_fp8(self) -> bool:
        return self._kv_transfer_config.get_from_extra_config("storage_dtype", "bf16") == "fp8"

    def _keep(self, pending: PendingSave, event: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Write one request's states to its spool file once `event` has fired."""
        tensors["token_ids"] = pending.token_ids.clone()
        directory = os.path.dirname(pending.filename)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)
        future: Future[None] = self._executor.submit(
            _write_spool_file, tensors, event, pending.filename
        )
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


GATHER_TOKENS = 65536
"""At most this many tokens in one gather (2 GiB of bf16 states at 32 KiB a token): a
step's finished requests stay within vLLM's batch, but a few requests finished by one
step can each be long."""


def _groups(pending: list[PendingSave], limit: int) -> list[list[PendingSave]]:
    """`pending` in order, cut into groups of at most `limit` tokens (a longer request
    alone)."""
    groups: list[list[PendingSave]] = []
    tokens = limit
    for p in pending:
        n = int(p.token_ids.shape[0])
        if tokens + n > limit:
            groups.append([])
            tokens = 0
        groups[-1].append(p)
        tokens += n
    return groups
