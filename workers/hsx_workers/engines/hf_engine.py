"""Capture with a Hugging Face transformers forward.

Layer ids follow docs/FORMAT.md ("manifest.json"): id k < N is `output_hidden_states[k]`
(the residual stream entering decoder layer k). Id N must be the last decoder layer's
output *before* the final norm, but transformers' `output_hidden_states[N]` is already
normed — so id N is taken from a forward pre-hook on the final norm instead. Storing the
normed one would make a trainer apply the norm twice.

Samples are batched by length with right padding: under a causal mask, padding after a
sequence cannot change the states of its real tokens.

A job that takes images (`EngineConfig.images`) loads the model as an image-text-to-text
model with its processor; a prompt with images runs alone: each placeholder expanded by
the processor (hsx.ingest.images.ImageTokens, as ingestion counts them), its pixels from
the processor's image processor. Its result's input_ids are the expanded ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from hsx_workers.dtypes import compute_dtype
from hsx_workers.engines.base import (
    IDLE_SLEEP_S,
    WAIT,
    CaptureRequest,
    CaptureResult,
    EngineConfig,
    GenerateRequest,
    GenerateResult,
    RequestStream,
)
from hsx_workers.engines.hf_settings import HfSettings

logger = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The final norm of the (inner) language model."""
    get_decoder: Any = getattr(model, "get_decoder", None)
    base = get_decoder() if callable(get_decoder) else model
    for name in ("norm", "final_layernorm", "ln_f"):
        norm = getattr(base, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    raise RuntimeError(
        f"hf engine: cannot find the final norm of {type(model).__name__}; "
        "id N (pre-norm last layer) cannot be captured"
    )


class HfEngine:
    """transformers forward with `output_hidden_states`, batched by a token budget."""

    def __init__(self, config: EngineConfig[HfSettings]):
        import transformers

        self.config = config
        settings = config.settings
        self.device = torch.device(
            settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype: Any = _DTYPES.get(
            compute_dtype(config.dtype, on_cpu=self.device.type == "cpu",
                          model=config.model), "auto")
        self.batch_tokens = settings.batch_tokens
        images = config.images
        auto = "AutoModelForImageTextToText" if images else "AutoModelForCausalLM"
        model: Any = getattr(transformers, auto).from_pretrained(
            config.model, dtype=dtype, trust_remote_code=config.trust_remote_code
        )
        self.image_tokens: Any = None
        if images:
            from hsx.ingest.images import ImageTokens

            self.image_tokens = ImageTokens.load(config.model, images.image_token_id,
                                                 trust_remote_code=config.trust_remote_code)
        self.model = model.to(self.device)
        self.model.eval()
        self._pre_norm: torch.Tensor | None = None
        _final_norm(self.model).register_forward_pre_hook(self._keep_pre_norm)

    def _keep_pre_norm(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._pre_norm = args[0]

    def capture(self, requests: RequestStream) -> Iterator[CaptureResult]:
        batch: list[CaptureRequest] = []
        longest = 0
        for req in requests:
            if req is WAIT:
                # Nothing more for now: run what is batched instead of holding it.
                if batch:
                    yield from self._forward(batch)
                    batch, longest = [], 0
                else:
                    time.sleep(IDLE_SLEEP_S)
                continue
            if isinstance(req, GenerateRequest):
                # The job spec refuses regenerate with this engine; a stray one is answered.
                req.on_done(GenerateResult(error="the hf engine does not generate"))
                continue
            if not isinstance(req, CaptureRequest):
                raise TypeError(f"capture takes CaptureRequest or WAIT, got {req!r}")
            if req.images:  # alone: its pixels go with it (the batch before it first)
                if batch:
                    yield from self._forward(batch)
                    batch, longest = [], 0
                yield self._forward_images(req)
                continue
            longest_if_added = max(longest, len(req.input_ids))
            if batch and longest_if_added * (len(batch) + 1) > self.batch_tokens:
                yield from self._forward(batch)
                batch, longest_if_added = [], len(req.input_ids)
            batch.append(req)
            longest = longest_if_added
        if batch:
            yield from self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: list[CaptureRequest]) -> Iterator[CaptureResult]:
        lengths = [len(r.input_ids) for r in batch]
        width = max(lengths)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, req in enumerate(batch):
            ids[row, : lengths[row]] = torch.tensor(req.input_ids)
            mask[row, : lengths[row]] = 1
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
            # Capture needs no logits; all of them cost a [tokens, vocab] matmul (~5%),
            # paid only by a batch with a request the head check takes.
            logits_to_keep=0 if any(r.predict for r in batch) else 1,
        )
        n = self.config.num_layers
        hidden = out.hidden_states
        if len(hidden) != n + 1:
            raise RuntimeError(
                f"hf engine: model returned {len(hidden)} hidden states, expected {n + 1}"
            )
        if self._pre_norm is None:
            raise RuntimeError("hf engine: the final-norm hook did not fire")
        picked = [self._pre_norm if k == n else hidden[k] for k in self.config.layers]
        stacked = torch.stack(picked, dim=2)  # [B, T, L, H]
        self._pre_norm = None
        for row, req in enumerate(batch):
            predicted = (out.logits[row, : lengths[row]].argmax(-1).tolist()
                         if req.predict else None)
            yield CaptureResult(
                sample_index=req.sample_index,
                input_ids=req.input_ids,
                hidden_states=stacked[row, : lengths[row]],
                predicted=predicted,
            )

    @torch.inference_mode()
    def _forward_images(self, req: CaptureRequest) -> CaptureResult:
        """One prompt with images: its placeholders expanded as the processor expands
        them, its pixels from the processor's image processor."""
        from hsx.ingest.images import decode

        tokens = self.image_tokens
        if tokens is None:
            raise RuntimeError("hf engine: a prompt with images on an engine built for text")
        images = [decode(data) for data in req.images or []]
        try:
            ids = tokens.expand(req.input_ids, [tokens.expansion(img) for img in images])
        except ValueError as err:
            return CaptureResult(req.sample_index, req.input_ids, error=str(err))
        pixels = tokens.processor.image_processor(images=images, return_tensors="pt")
        extra = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                 for k, v in pixels.items()}
        if "pixel_values" in extra:
            extra["pixel_values"] = extra["pixel_values"].to(self.model.dtype)
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=self.device),
            output_hidden_states=True, use_cache=False,
            logits_to_keep=0 if req.predict else 1, **extra)
        n = self.config.num_layers
        if self._pre_norm is None or len(out.hidden_states) != n + 1:
            raise RuntimeError("hf engine: the model's hidden states are not its N + 1")
        picked = [self._pre_norm if k == n else out.hidden_states[k]
                  for k in self.config.layers]
        self._pre_norm = None
        return CaptureResult(
            sample_index=req.sample_index, input_ids=ids,
            hidden_states=torch.stack(picked, dim=2)[0],
            predicted=out.logits[0].argmax(-1).tolist() if req.predict else None)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
