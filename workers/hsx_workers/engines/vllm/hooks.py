"""The hook fallback: capture inside vLLM's worker with forward hooks, for models whose
vLLM class has no EAGLE-3 aux outputs (Gemma-class), so `extract_hidden_states`
refuses them.

`HookWorkerExtension` is mixed into vLLM's worker class by module path
(`worker_extension_cls="hsx_workers.engines.vllm.hooks.HookWorkerExtension"`); the engine then calls
`hsx_install_hooks` on every rank by name (`collective_rpc`), which needs no insecure
serialization. The hooks:

- a forward pre-hook on decoder layer k (for each asked id k < N) takes the residual
  stream entering it: `hidden_states + residual` (vLLM's decoder layers carry the two
  apart and fuse the add into the next norm; layer 0 gets `residual=None`, its input is
  the scaled embeddings);
- a forward pre-hook on the final norm takes id N the same way: the last layer's output
  before the norm.

These are HF's `output_hidden_states[k]` and hsx's id N, as the `hf` engine captures
them. Hooks see a forward only in eager mode (under torch.compile or CUDA graphs the
Python modules are not called), so the engine runs with `enforce_eager`. The engine
also schedules one request per forward with its whole prompt (`max_num_seqs=1`,
`max_num_batched_tokens >= max_model_len`), so the rows a hook sees are exactly one
request's prompt tokens; when the last asked layer has been seen, rank 0 writes them to
`<spool>/<request id>.safetensors` (published by rename, errors as `.error`), the same
hand-off the connector uses.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from hsx_workers.engines.vllm.spool import SPOOL_SUFFIX, publish_spool_file

logger = logging.getLogger(__name__)


def find_decoder(model: torch.nn.Module, num_layers: int) -> tuple[torch.nn.ModuleList, Any]:
    """(decoder layers, final norm) of a vLLM model, wrappers' inner models included."""
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers"
                and len(module) == num_layers):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            norm = getattr(parent, "norm", None)
            if isinstance(norm, torch.nn.Module):
                return module, norm
    raise RuntimeError(
        f"hsx hooks: no decoder ModuleList of {num_layers} layers beside a final `norm` "
        f"in {type(model).__name__}"
    )


def _stream(args: tuple[Any, ...], kwargs: dict[str, Any], first: int) -> torch.Tensor:
    """hidden_states + residual from a call's arguments (positional from `first`)."""
    hidden = kwargs.get("hidden_states", args[first] if len(args) > first else None)
    residual = kwargs.get("residual", args[first + 1] if len(args) > first + 1 else None)
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError("hsx hooks: the module was not called with hidden_states")
    return hidden if residual is None else hidden + residual


class HookCapture:
    """The hooks of one worker; see the module docstring."""

    def __init__(self, worker: Any, layers: list[int], num_layers: int, spool: str,
                 write: bool):
        self.worker = worker
        self.layers = list(layers)
        self.num_layers = num_layers
        self.spool = spool
        self.write = write
        self._rows: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []

    def install(self, model: torch.nn.Module) -> int:
        decoder, norm = find_decoder(model, self.num_layers)
        for k in self.layers:
            if k < self.num_layers:
                self.handles.append(decoder[k].register_forward_pre_hook(
                    self._hook(k, first=1), with_kwargs=True))  # (positions, hidden, residual)
            else:
                self.handles.append(norm.register_forward_pre_hook(
                    self._hook(k, first=0), with_kwargs=True))  # (hidden, residual)
        return len(self.handles)

    def _hook(self, k: int, first: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._rows[k] = _stream(args, kwargs, first).detach()
            if len(self._rows) == len(self.layers):
                rows, self._rows = self._rows, {}
                if self.write:
                    self._publish(rows)
            return None

        return hook

    def _request(self) -> tuple[str, torch.Tensor | None]:
        batch = self.worker.model_runner.input_batch
        req_ids = list(batch.req_ids)
        if len(req_ids) != 1:
            raise RuntimeError(f"hsx hooks: {len(req_ids)} requests in one forward (expected 1)")
        tokens = None
        num = getattr(batch, "num_tokens_no_spec", None)
        ids = getattr(batch, "token_ids_cpu", None)
        if num is not None and ids is not None:
            tokens = torch.as_tensor(ids[0][: int(num[0])]).to(torch.int64)
        return req_ids[0], tokens

    def _publish(self, rows: dict[int, torch.Tensor]) -> None:
        request_id, tokens = self._request()

        def tensors() -> dict[str, torch.Tensor]:
            states = torch.stack([rows[k] for k in self.layers], dim=1).to("cpu")
            out = {"hidden_states": states.contiguous()}
            if tokens is not None and tokens.numel() >= states.shape[0]:
                # token_ids_cpu holds the prompt and the sampled token; the rows are
                # the prompt's.
                out["token_ids"] = tokens[: states.shape[0]].contiguous()
            return out

        publish_spool_file(os.path.join(self.spool, request_id + SPOOL_SUFFIX), tensors)


class HookWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); methods called by name."""

    def hsx_install_hooks(self, layers: list[int], num_layers: int, spool: str) -> int:
        worker: Any = self
        model = worker.model_runner.model
        rank = int(getattr(worker, "rank", 0))
        capture = HookCapture(worker, layers, num_layers, spool, write=rank == 0)
        n = capture.install(model)
        worker.hsx_hooks = capture  # kept alive with the worker
        logger.info("hsx hooks: %d hooks on rank %d (layers %s)", n, rank, layers)
        return n
