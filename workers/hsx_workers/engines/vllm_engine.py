"""Capture with vLLM: the `extract_hidden_states` speculative method plus hsx's connector.

Each sample becomes one request with `max_tokens=1`; vLLM writes the asked layers into
a cache-only attention layer during prefill, and `HsxHiddenStatesConnector` (loaded by
module path) copies them out into this engine's spool directory when the request ends.
`capture` drives vLLM's `LLMEngine` step by step instead of `LLM.generate`, so states
stream out while later requests still compute, and the number of requests in flight
(hence spool space) stays bounded.

The CPU build of vLLM runs the same code: create the engine in a process that is not
`__main__`'s import (Ray actors are fine), keep `VLLM_CPU_KVCACHE_SPACE` small.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hsx_workers.connector import ERROR_SUFFIX
from hsx_workers.engines.base import CaptureRequest, CaptureResult, EngineConfig, EngineDead

logger = logging.getLogger(__name__)

SPOOL_TIMEOUT_S = 120.0


def _spool_root(min_free_bytes: int) -> Path:
    """tmpfs when it has room (no disk I/O for a hand-off), else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > min_free_bytes:
        return shm
    return Path(tempfile.gettempdir())


class VllmEngine:
    """One vLLM engine (TP ranks included) capturing hidden states for hsx."""

    def __init__(self, config: EngineConfig):
        self.config = config
        opts = config.options
        if opts.get("cpu_kvcache_gib") is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts["cpu_kvcache_gib"]))
        self.max_inflight_tokens = int(opts.get("max_inflight_tokens", 262144))
        bytes_per_token = 2 * len(config.layers) * config.hidden_size
        self.spool = _spool_root(2 * self.max_inflight_tokens * bytes_per_token) / (
            f"hsx-spool-{uuid.uuid4().hex[:12]}"
        )
        self.spool.mkdir(parents=True)

        import torch
        from vllm import LLM

        # This process only moves bytes (vLLM computes in its own processes); torch
        # threads here would spin on the cores the model runs on.
        torch.set_num_threads(1)

        engine_args: dict[str, Any] = dict(
            model=config.model,
            tensor_parallel_size=config.tensor_parallel_size,
            # +1 for the one generated token, +1 for the speculative slot.
            max_model_len=config.max_seq_len + 2,
            dtype=config.dtype,
            trust_remote_code=config.trust_remote_code,
            enable_prefix_caching=False,
            disable_log_stats=True,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": list(config.layers)}
                },
            },
            kv_transfer_config={
                "kv_connector": "HsxHiddenStatesConnector",
                "kv_connector_module_path": "hsx_workers.connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.spool)},
            },
        )
        for key in ("max_num_batched_tokens", "gpu_memory_utilization", "enforce_eager",
                    "distributed_executor_backend"):
            if opts.get(key) is not None:
                engine_args[key] = opts[key]
        self._text_path_of_wrapper(engine_args)
        self.hooks = self._capture_path() == "hooks"
        if self.hooks:
            self._hook_args(engine_args)
        started = time.monotonic()
        self.llm = LLM(**engine_args)
        if self.hooks:
            self.llm.collective_rpc(
                "hsx_install_hooks",
                args=(list(config.layers), config.num_layers, str(self.spool)),
            )
        logger.info("vLLM engine ready in %.1fs (spool %s%s)", time.monotonic() - started,
                    self.spool, ", hook capture" if self.hooks else "")
        self._next_id = 0

    def _capture_path(self) -> str:
        """The model preflight's capture path for this model with the vllm engine."""
        from hsx_workers.preflight import inspect_model_cached

        report = inspect_model_cached(self.config.model, "vllm", tuple(self.config.layers),
                                      self.config.trust_remote_code)
        return str(report.capture)

    def _hook_args(self, engine_args: dict[str, Any]) -> None:
        """vLLM settings of the hook fallback (hooks.py): no extract_hidden_states, eager
        mode, one whole prompt per forward, hooks installed by a worker extension."""
        del engine_args["speculative_config"], engine_args["kv_transfer_config"]
        engine_args["max_model_len"] = self.config.max_seq_len + 1
        engine_args.update(
            enforce_eager=True, max_num_seqs=1,
            max_num_batched_tokens=max(engine_args["max_model_len"],
                                       int(engine_args.get("max_num_batched_tokens") or 0)),
            worker_extension_cls="hsx_workers.hooks.HookWorkerExtension",
        )

    def _text_path_of_wrapper(self, engine_args: dict[str, Any]) -> None:
        """A multimodal wrapper (Kimi-K2.5, Qwen2.5-VL, Llava) runs its text path only.

        vLLM's `language_model_only` skips the vision tower and multimodal inputs; the
        capture layers are set on the wrapper, which forwards them to its language model.
        Where torchvision is missing (the CPU machine), it is stubbed in this process,
        since the wrapper's module imports it at load time.
        """
        from hsx.modelinfo import ModelConfigError, read_model_info

        try:
            info = read_model_info(self.config.model)
        except ModelConfigError:
            return  # vLLM's own loader reports what is wrong with the model
        if not info.wrapper:
            return
        engine_args["language_model_only"] = True
        from hsx_workers.preflight import install_torchvision_stub

        if install_torchvision_stub():
            # The stub lives in this process only: vLLM's engine-core and worker
            # processes (spawned) and its model inspection subprocess would import the
            # real, missing torchvision. So the whole engine runs here (one rank only),
            # and the class imported here is registered to skip the inspection process.
            if self.config.tensor_parallel_size > 1:
                raise RuntimeError(
                    "a multimodal wrapper needs torchvision for tensor_parallel_size > 1 "
                    "(its module imports it in every rank's process); without it, only "
                    "tensor_parallel_size 1 runs, with torchvision stubbed"
                )
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            engine_args["distributed_executor_backend"] = "uni"
            from vllm.model_executor.models.registry import ModelRegistry

            entry = ModelRegistry.models.get(info.architecture)
            load = getattr(entry, "load_model_cls", None)
            if callable(load):
                ModelRegistry.register_model(info.architecture, load())
        logger.info("multimodal wrapper: capturing its text path (language_model_only)")

    def capture(self, requests: Iterable[CaptureRequest]) -> Iterator[CaptureResult]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=1, detokenize=False)
        pending = iter(requests)
        order: list[int] = []  # sample indexes in request order
        running: dict[str, CaptureRequest] = {}  # request id -> request, inside vLLM
        arriving: dict[str, tuple[CaptureRequest, float]] = {}  # spool path -> (request, since)
        ready: dict[int, CaptureResult] = {}
        inflight_tokens = 0
        exhausted = False
        emitted = 0

        while True:
            while not exhausted and inflight_tokens < self.max_inflight_tokens:
                req = next(pending, None)
                if req is None:
                    exhausted = True
                    break
                order.append(req.sample_index)
                request_id = f"s{req.sample_index}-{self._next_id}"
                self._next_id += 1
                try:
                    engine.add_request(
                        request_id, TokensPrompt(prompt_token_ids=list(req.input_ids)), params
                    )
                except ValueError as err:  # vLLM refuses this prompt (too long, bad ids)
                    ready[req.sample_index] = CaptureResult(
                        req.sample_index, req.input_ids, error=f"vLLM refused the prompt: {err}"
                    )
                    continue
                running[request_id] = req
                inflight_tokens += len(req.input_ids)

            # Emit in request order as results become ready.
            while emitted < len(order) and order[emitted] in ready:
                yield ready.pop(order[emitted])
                emitted += 1
            if exhausted and emitted == len(order):
                return

            if running:
                try:
                    outputs = engine.step()
                except Exception as err:
                    raise EngineDead(f"vLLM engine failed: {type(err).__name__}: {err}") from err
                for out in outputs:
                    if not out.finished:
                        continue
                    req = running.pop(self._base_request_id(out.request_id, running))
                    path = self._spool_file(out)
                    if not path:
                        inflight_tokens -= len(req.input_ids)
                        ready[req.sample_index] = CaptureResult(
                            req.sample_index, req.input_ids,
                            error="vLLM returned no hidden states for this request",
                        )
                    else:
                        arriving[path] = (req, time.monotonic())
            elif arriving:
                # The engine core publishes the last files on its own, a step or two
                # after the outputs; wait for them without busy-spinning. An engine
                # core running in this process (no multiprocessing) moves only when
                # stepped, so step it.
                if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                    try:
                        engine.step()
                    except Exception as err:
                        raise EngineDead(
                            f"vLLM engine failed: {type(err).__name__}: {err}") from err
                time.sleep(0.001)

            for path, (req, since) in list(arriving.items()):
                if not (os.path.exists(path) or os.path.exists(path + ERROR_SUFFIX)):
                    if time.monotonic() - since > SPOOL_TIMEOUT_S:
                        raise EngineDead(
                            f"hidden states of sample {req.sample_index} never arrived at {path}"
                        )
                    continue
                del arriving[path]
                inflight_tokens -= len(req.input_ids)
                ready[req.sample_index] = self._collect(req, path)

    def _spool_file(self, out: Any) -> str | None:
        if self.hooks:
            # hooks.py names the file after the request id the worker saw: vLLM's
            # internal one, ours plus a "-<hex>" suffix. The hook wrote it during the
            # forward, so it is there once the request has finished.
            pattern = re.compile(re.escape(out.request_id) + r"(-[0-9a-f]+)?\.safetensors")
            for name in os.listdir(self.spool):
                base = name.removesuffix(ERROR_SUFFIX)
                if pattern.fullmatch(base):
                    return str(self.spool / base)
            return str(self.spool / f"{out.request_id}.safetensors")
        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        return str(path) if path else None

    @staticmethod
    def _base_request_id(request_id: str, running: dict[str, CaptureRequest]) -> str:
        # vLLM may append a suffix to the id it was given.
        if request_id in running:
            return request_id
        for known in running:
            if request_id.startswith(known + "-"):
                return known
        raise EngineDead(f"vLLM returned an unknown request id {request_id!r}")

    def _collect(self, req: CaptureRequest, path: str) -> CaptureResult:
        import torch
        from safetensors.torch import load_file

        error_file = path + ERROR_SUFFIX
        if os.path.exists(error_file):
            reason = Path(error_file).read_text()
            os.unlink(error_file)
            return CaptureResult(req.sample_index, req.input_ids, error=f"capture failed: {reason}")
        tensors = load_file(path)
        os.unlink(path)
        expected = torch.tensor(req.input_ids, dtype=torch.int64)
        token_ids = tensors.get("token_ids", expected)
        if tensors["hidden_states"].shape[0] != len(req.input_ids) or not torch.equal(
                token_ids.to(torch.int64), expected):
            return CaptureResult(
                req.sample_index, req.input_ids,
                error="vLLM processed other token ids than were sent (prompt mismatch)",
            )
        states = tensors["hidden_states"]
        # Freshly loaded from the spool: nobody else holds it.
        return CaptureResult(req.sample_index, req.input_ids, hidden_states=states, owned=True)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
                llm.llm_engine.engine_core, "shutdown", None
            )
            if callable(shutdown):
                shutdown()
            del self.llm
        shutil.rmtree(self.spool, ignore_errors=True)
