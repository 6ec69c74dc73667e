"""The draft model: speculators' model of the training's method (Eagle3DraftModel,
DFlashDraftModel) for an output's target, its decoder layer's config, and its vocabulary
mapped from the training samples' token counts.

The draft's decoder layer is the target's (text) config with `num_layers` layers (a
Llama layer for targets vLLM cannot serve a draft of); embeddings and lm_head come from
the target (speculators' `load_verifier_weights`); d2t/t2d from the frequencies of
loss-masked tokens of the training samples (speculators'
`build_vocab_mappings_from_distribution`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from hsx.methods import draft_aux_layers
from hsx.output import Manifest, Output
from hsx.spec import TargetModel, TrainSpec
from hsx_workers.trainer.plan import TrainRefused


class _EagerFrameInOneLine(logging.Filter):
    """dynamo's warning that it runs a frame eagerly, cut to one line: the frame and the
    exception's first two lines. dynamo writes the whole traceback twice into it; a GPU
    DSpark training's log held 2,522 such lines for six frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg if isinstance(record.msg, str) else ""
        if text.startswith("WON'T CONVERT"):
            error = record.exc_info[1] if record.exc_info else None
            lines = [x.strip() for x in str(error or "").splitlines() if x.strip()]
            why = f"{type(error).__name__}: {' '.join(lines[:2])[:300]}" if error else "?"
            record.msg = "torch.compile runs %s eagerly: %s"
            record.args = (text.splitlines()[0].removeprefix("WON'T CONVERT ").strip(), why)
            record.exc_info = record.exc_text = None
        return True


def eager_frames_in_one_line() -> None:
    """Make dynamo's notes of frames it runs eagerly one line each (in this process)."""
    log = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(f, _EagerFrameInOneLine) for f in log.filters):
        log.addFilter(_EagerFrameInOneLine())


def draft_layout(manifest: Manifest, method: str = "eagle3") -> tuple[list[int], int]:
    """(aux layer ids, num_layers N) for a `method` draft trained on this output, or
    TrainRefused naming what the output lacks."""
    n = manifest.num_layers
    try:
        return draft_aux_layers(manifest.layers, n, method), n
    except ValueError as err:
        raise TrainRefused(str(err)) from None


def layer_picks(manifest: Manifest, method: str = "eagle3") -> list[int]:
    """Where the draft's auxiliary ids sit on a sample's layer axis (N is the last)."""
    aux, _ = draft_layout(manifest, method)
    return [manifest.layers.index(k) for k in aux]


def forward_kwargs(spec: TrainSpec, kernels: str, anchors: int | None = None
                   ) -> dict[str, Any]:
    """The method's own arguments of the draft's forward (besides the pack's tensors):
    its loss with speculators' `kernels` (`fused` or `eager`) among them, and a block
    drafter's `anchors` per pack (the plan's)."""
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config(spec.loss_fn, kernels)
    if not spec.draft.block:
        return {"ttt_steps": spec.ttt_steps, "loss_config": loss_config,
                "ttt_step_loss_decay": spec.ttt_step_loss_decay}
    if anchors is None:
        raise ValueError(f"a {spec.method} draft trains on the plan's anchors per pack; "
                         "none were given")
    out = {"loss_config": loss_config, "max_anchors": anchors,
           "per_position_loss_weight": "dpace" if spec.loss_fn == "ce" else "fixed-exp-decay"}
    if spec.method == "dspark":  # its total-variation term, with the same kernels
        out["tv_loss_fn"] = resolve_loss_config("tv", kernels)["tv"][0]
    return out


DRAFT_LAYER_TYPES = ("llama", "qwen3")  # vLLM's Eagle3 heads: Eagle3{Llama,Qwen3}ForCausalLM


def draft_layer_config(text: Any, num_layers: int, num_aux: int) -> Any:
    """The draft's decoder-layer config: the target's own for Llama/Qwen3 targets, a
    Llama layer of the target's sizes for every other one (DeepSeek-V3, Kimi-K2.5,
    Gemma...), since vLLM serves EAGLE-3 drafts only with Llama or Qwen3 layers."""
    import copy

    from transformers import LlamaConfig

    if getattr(text, "model_type", None) in DRAFT_LAYER_TYPES:
        layer = copy.deepcopy(text)
    else:
        heads = int(text.num_attention_heads)
        rope = getattr(text, "rope_parameters", None) or {}
        layer = LlamaConfig(
            vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
            intermediate_size=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(text.hidden_size) // heads,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            rope_parameters={"rope_type": "default",
                             "rope_theta": float(rope.get("rope_theta", 10000.0))},
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
        )
        layer.architectures = ["LlamaForCausalLM"]
    layer.num_hidden_layers = num_layers
    # vLLM reads the fc's input width from this (its default is 3 auxiliary layers).
    layer.num_aux_hidden_states = num_aux
    return layer


def token_frequencies(output: Output, exclude: Sequence[int] = ()) -> Counter[int]:
    """Counts of loss-masked tokens of every ingested sample but `exclude` (what the
    draft must say)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    table = output.inputs()
    if exclude:
        keep = pc.invert(pc.is_in(table.column("sample_index"),
                                  value_set=pa.array(list(exclude), pa.int64())))
        table = table.filter(keep)
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    chosen = ids[mask.astype(bool)]
    values, counts = np.unique(chosen, return_counts=True)
    return Counter(dict(zip(values.tolist(), counts.tolist(), strict=True)))


def vocab_mappings(
    freqs: Counter[int], draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(d2t, t2d, draft vocab size); no mappings when the draft keeps the whole vocab."""
    if draft_vocab_size >= target_vocab_size:
        return None, None, target_vocab_size
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        dict(freqs), draft_vocab_size, target_vocab_size
    )
    return d2t, t2d, draft_vocab_size


def build_draft_model(output: Output, manifest: Manifest, spec: TrainSpec,
                      device: torch.device, exclude: Sequence[int],
                      target: TargetModel) -> Any:
    """A new draft for `target` (the job's model, trained on this output), its
    vocabulary mapped from the loss-masked tokens of every sample but `exclude` (the
    held-out ones); on the CPU until moved."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    aux, _ = draft_layout(manifest, spec.method)
    model_path, trust = target.model, target.trust_remote_code
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
    text_config = getattr(config, "text_config", None) or config
    layers = spec.num_layers or spec.draft.default_draft_layers
    freqs = token_frequencies(output, exclude=exclude)
    if not freqs:
        raise TrainRefused(f"{output}: no loss-masked token in inputs.arrow")
    vocab = int(text_config.vocab_size)
    d2t, t2d, draft_vocab = vocab_mappings(freqs, spec.draft_vocab_size, vocab)
    torch.manual_seed(spec.seed)
    # speculators' own choice on GPU (flex attention, compiled); eager on CPU, where
    # flex attention has no fast kernel.
    attn = "simple_flex_attention" if device.type == "cuda" else "eager"
    if device.type == "cuda":
        # speculators compiles the draft's forward; with torch 2.11 dynamo fails to
        # trace its fused loss's Triton kernel ("ListVariable ... already tracked for
        # mutation", seen on an H200). A frame dynamo cannot compile then runs eagerly
        # instead of ending the training.
        from torch._dynamo import config as dynamo_config

        dynamo_config.suppress_errors = True
        eager_frames_in_one_line()
    if spec.draft.block:
        model = _block_drafter(text_config, spec, layers, aux, t2d, d2t, draft_vocab,
                               model_path, trust, attn)
    else:
        text = draft_layer_config(text_config, layers, len(aux))
        model = Eagle3DraftModel.from_training_args(
            text, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab,
            norm_before_residual=spec.norm_before_residual,
            ttt_steps=spec.ttt_steps, verifier_name_or_path=model_path,
            target_layer_ids=aux, draft_attn_impl=attn, trust_remote_code=trust,
        )
        if attn == "eager" and hasattr(model, "_build_attn_mask"):
            model._build_attn_mask = dense_attention_mask
    # speculators starts the draft's lm_head as the target's but its final norm at
    # ones: a head that is neither. Starting the norm as the target's too makes the
    # draft's head the target's own (what it predicts), which matters where the
    # target's final norm has outlier weights, as real models' do.
    with torch.no_grad():
        model.norm.weight.copy_(model.verifier_norm.weight)
    return model


def _block_drafter(text: Any, spec: TrainSpec, layers: int, aux: list[int], t2d: Any,
                   d2t: Any, draft_vocab: int, model_path: str, trust: bool,
                   attn: str) -> Any:
    """A new DFlash or DSpark draft: Qwen3 decoder layers of the target's sizes, all full
    attention (vLLM's drafting kernel refuses sliding attention without a window), with
    the mask token vLLM fills a block with (without one its kernel fails)."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.utils import resolve_mask_token_id
    from transformers import Qwen3Config

    heads = int(text.num_attention_heads)
    rope = getattr(text, "rope_parameters", None) or {}
    layer = Qwen3Config(
        vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
        intermediate_size=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(rope.get("rope_theta", 10000.0))},
        layer_types=["full_attention"] * layers, tie_word_embeddings=False,
    )
    layer.architectures = ["Qwen3ForCausalLM"]
    if spec.method == "dspark":
        # vLLM 0.25.1 sizes a DSpark draft's input projection by the `target_layer_ids`
        # of `dflash_config` in the layer config, else by its decoder layer count (it
        # sets DSpark's ids elsewhere): a draft reading fewer target layers than it has
        # decoder layers failed to load there ("Tried to load weights of size
        # [256, 256] to a parameter of size [256, 1280]"). The ids are vLLM's (aux - 1).
        layer.dflash_config = {"target_layer_ids": [i - 1 for i in aux]}
    mask_token = resolve_mask_token_id(model_path, int(text.vocab_size),
                                       trust_remote_code=trust)
    cls = DSparkDraftModel if spec.method == "dspark" else DFlashDraftModel
    # The anchor is given (the target's bonus token) and each mask slot predicts its own
    # position, DFlash's layout, for DSpark too: vLLM 0.25.1 serves every speculators
    # DSpark draft that way (`dspark_bonus_anchor`, whatever the config says), and vLLM
    # 0.32 reads `sample_from_anchor`. speculators trains DSpark anchor-first by default
    # (slot k predicts token k + 1): such a draft trained to a held-out 6.15 accepted 1.02
    # in vLLM 0.25.1, every proposal one token early (benchmarks/results/2026-12-06-dspark-gpu/).
    return cls.from_training_args(
        layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab, block_size=spec.block_size,
        verifier_name_or_path=model_path, target_layer_ids=aux, draft_attn_impl=attn,
        mask_token_id=mask_token, trust_remote_code=trust, sample_from_anchor=False,
    )


def dense_attention_mask(doc_ids: torch.Tensor, seq_len: int, device: Any,
                         sliding_window: int | None = None) -> torch.Tensor:
    """The mask speculators' eager attention adds to a pack's scores ([1, 1, T, T],
    bf16: 0 where a token attends, -inf elsewhere), built with tensor operations.

    What speculators' `Eagle3DraftModel._build_attn_mask` returns for eager attention
    (`create_combined_mask_mod` through `create_float_mask`): causal within a document
    (and `sliding_window`), padding (document id -1) attending to nothing but itself.
    speculators evaluates its mask functions under `torch.vmap`, a fixed cost in Python
    for every pack whatever its length, several times what these tensor operations
    take on short packs. tests/unit/test_trainer.py checks the two masks are equal.
    """
    q = torch.arange(seq_len, device=device)[:, None]
    kv = torch.arange(seq_len, device=device)[None, :]
    doc = doc_ids.reshape(-1)[:seq_len].to(device)
    allowed = (q >= kv) & (doc[:, None] != -1) & (doc[:, None] == doc[None, :])
    if sliding_window is not None:
        allowed &= kv > q - sliding_window
    allowed |= q == kv
    mask = torch.zeros((1, 1, seq_len, seq_len), dtype=torch.bfloat16, device=device)
    return mask.masked_fill_(~allowed, float("-inf"))
