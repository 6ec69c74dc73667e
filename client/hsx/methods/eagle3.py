"""EAGLE-3 (the default): one decoder layer that drafts token after token, each from the
target's states at three layers and its own previous step (training-time test, TTT).

speculators' `Eagle3DraftModel`; vLLM serves it as `method: eagle3`, `ttt_steps` tokens
a step. Its states are shifted: token t + 1 is read with the target's states of token t.
The draft's decoder layer is the target's own for Llama and Qwen3 targets and a Llama
layer of the target's sizes for every other one, because vLLM serves EAGLE-3 drafts only
as `Eagle3LlamaForCausalLM` or `Eagle3Qwen3ForCausalLM`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from hsx.methods.base import DraftInputs, DraftMethod

if TYPE_CHECKING:
    from hsx.spec import TrainSpec

DRAFT_LAYER_TYPES = ("llama", "qwen3")  # vLLM's Eagle3 heads: Eagle3{Llama,Qwen3}ForCausalLM
VLLM_DEFAULT_AUX_LAYERS = 3  # what vLLM's Llama EAGLE-3 assumes when a config says nothing


class Eagle3(DraftMethod):
    name = "eagle3"
    title = "EAGLE-3"
    summary = "one token after another"
    specforge_features: ClassVar[tuple[str, str | None] | None] = (
        "aux_hidden_state", "hidden_state")
    specforge_layer_key = "eagle_config.eagle_aux_hidden_state_layer_ids"

    def aux_layers(self, num_layers: int) -> list[int]:
        """Ids 2, N/2 and N-3: low, middle and high layers, as EAGLE-3 reads them."""
        n = num_layers
        ids = {2, n // 2, n - 3}
        return sorted(k for k in ids if 0 <= k < n) or [max(0, n - 1)]

    def proposed_tokens(self, spec: TrainSpec) -> int:
        return spec.ttt_steps

    def fix_draft_config(self, config: dict[str, Any]) -> bool:
        """speculators 0.9 records the auxiliary layer ids at the top of the draft's config
        (`eagle_aux_hidden_state_layer_ids`); vLLM 0.25's speculators reader copies them
        to the top of the draft's text config, but its Llama EAGLE-3 takes the width of
        `fc` from `num_aux_hidden_states` or `eagle_config` in that text config and
        otherwise assumes 3 (vllm/model_executor/models/llama_eagle3.py): a draft on 2 or
        4 auxiliary layers failed to load ("Tried to load weights of size [H, 2H] to a
        parameter of size [H, 3H]"). The count goes into `transformer_layer_config`."""
        layers = config.get("eagle_aux_hidden_state_layer_ids")
        text = config.get("transformer_layer_config")
        if not layers or not isinstance(text, dict):
            return False
        said = text.get("num_aux_hidden_states") or len(
            (text.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])
        if (said or VLLM_DEFAULT_AUX_LAYERS) == len(layers):
            return False
        text["num_aux_hidden_states"] = len(layers)
        return True

    # -- training

    def build(self, inputs: DraftInputs) -> Any:
        from speculators.models.eagle3 import Eagle3DraftModel

        spec = inputs.spec
        text = draft_layer_config(inputs.text_config, inputs.num_layers, len(inputs.aux))
        model = Eagle3DraftModel.from_training_args(
            text, t2d=inputs.t2d, d2t=inputs.d2t, draft_vocab_size=inputs.draft_vocab,
            norm_before_residual=spec.norm_before_residual, ttt_steps=spec.ttt_steps,
            verifier_name_or_path=inputs.model_path, target_layer_ids=inputs.aux,
            draft_attn_impl=inputs.attn, trust_remote_code=inputs.trust_remote_code,
        )
        if inputs.attn == "eager" and hasattr(model, "_build_attn_mask"):
            model._build_attn_mask = dense_attention_mask
        return model

    def forward_kwargs(self, spec: TrainSpec, kernels: str, anchors: int | None
                       ) -> dict[str, Any]:
        from speculators.losses import resolve_loss_config

        return {"ttt_steps": spec.ttt_steps,
                "loss_config": resolve_loss_config(spec.loss_fn, kernels),
                "ttt_step_loss_decay": spec.ttt_step_loss_decay}

    # -- validation

    def score_names(self, spec: TrainSpec) -> list[str]:
        """Per TTT step k, the positions whose steps 0..k were all right."""
        return [f"full_acc_{k}" for k in range(spec.ttt_steps)]

    def conditional_accuracies(self, acc: Sequence[float]) -> list[float]:
        """acc[k] is P(steps 0..k all right): step k's conditional is acc[k] / acc[k-1]."""
        out, prev = [], 1.0
        for a in acc:
            out.append(a / prev if prev > 0 else 0.0)
            prev = a
        return out


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


def dense_attention_mask(doc_ids: Any, seq_len: int, device: Any,
                         sliding_window: int | None = None) -> Any:
    """The mask speculators' eager attention adds to a pack's scores ([1, 1, T, T],
    bf16: 0 where a token attends, -inf elsewhere), built with tensor operations.

    What speculators' `Eagle3DraftModel._build_attn_mask` returns for eager attention
    (`create_combined_mask_mod` through `create_float_mask`): causal within a document
    (and `sliding_window`), padding (document id -1) attending to nothing but itself.
    speculators evaluates its mask functions under `torch.vmap`, a fixed cost in Python
    for every pack whatever its length, several times what these tensor operations
    take on short packs. tests/unit/test_methods.py checks the two masks are equal.
    """
    import torch

    q = torch.arange(seq_len, device=device)[:, None]
    kv = torch.arange(seq_len, device=device)[None, :]
    doc = doc_ids.reshape(-1)[:seq_len].to(device)
    allowed = (q >= kv) & (doc[:, None] != -1) & (doc[:, None] == doc[None, :])
    if sliding_window is not None:
        allowed &= kv > q - sliding_window
    allowed |= q == kv
    mask = torch.zeros((1, 1, seq_len, seq_len), dtype=torch.bfloat16, device=device)
    return mask.masked_fill_(~allowed, float("-inf"))


METHOD = Eagle3()
