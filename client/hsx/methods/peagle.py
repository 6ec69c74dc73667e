"""P-EAGLE (parallel EAGLE): EAGLE-3's draft, reading EAGLE-3's target layers, that
drafts `block_size` tokens in one forward pass instead of one after the other: the first
from the target's token and states, as EAGLE-3's first step, the others from mask tokens
and a learnt mask state in their place.

speculators' `PEagleDraftModel`, trained with its conditional-on-distribution (COD)
sampling: depth d trains a geometrically shrinking sample (max(0.7^d, 0.2)) of the
positions a depth-(d-1) prediction was trained at, the next token each, so a pack of T
tokens with A answer tokens trains at most T + 2.4 A predictions for 8 depths, not 8 T.
vLLM serves it as an EAGLE-3 draft with `parallel_drafting` (its speculators reader maps
`peagle` there; the mask token is its `pard_token`), on the CPU build too. A capture for
EAGLE-3 serves it: the same layers, shifted as EAGLE-3's.

Its validation counts each depth on its own (a depth's prediction does not see whether
the depths before it were right), so its expected acceptance length is 1 + the sum over
k of the product of depths 0..k's accuracies: exact if the depths erred independently;
they err together, so vLLM accepts at least about as much.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from hsx.methods.base import DraftInputs
from hsx.methods.eagle3 import Eagle3, draft_layer_config

if TYPE_CHECKING:
    from hsx.spec import TrainSpec

# speculators' COD sampling: depth d keeps max(0.7^d, 0.2) of the positions.
DOWN_SAMPLE_RATIO = 0.7
DOWN_SAMPLE_RATIO_MIN = 0.2


class PEagle(Eagle3):
    name = "peagle"
    title = "P-EAGLE"
    summary = "EAGLE-3's draft, its tokens drafted at once (parallel drafting)"
    default_draft_layers = 4
    specforge_features: ClassVar[tuple[str, str | None] | None] = None  # SpecForge has none

    def proposed_tokens(self, spec: TrainSpec) -> int:
        """All `block_size` depths are proposed (depth 0 is EAGLE-3's first token)."""
        return spec.block_size

    def proposed_by(self, spec: TrainSpec) -> str:
        return f"block_size {spec.block_size}"

    def speculative_config(self, draft: str, k: int) -> dict[str, Any]:
        return {"method": "eagle3", "parallel_drafting": True, "model": draft,
                "num_speculative_tokens": k}

    def anchors(self, spec: TrainSpec, pack_tokens: int) -> int | None:
        """`max_anchors`, else every answer token (speculators' default)."""
        return spec.max_anchors

    # -- training

    def build(self, inputs: DraftInputs) -> Any:
        from speculators.models.peagle import PEagleDraftModel
        from speculators.train.utils import resolve_mask_token_id

        spec, text = inputs.spec, inputs.text_config
        layer = draft_layer_config(text, inputs.num_layers, len(inputs.aux))
        mask_token = resolve_mask_token_id(inputs.model_path, int(text.vocab_size),
                                           trust_remote_code=inputs.trust_remote_code)
        model = PEagleDraftModel.from_training_args(
            layer, t2d=inputs.t2d, d2t=inputs.d2t, draft_vocab_size=inputs.draft_vocab,
            norm_before_residual=spec.norm_before_residual,
            verifier_name_or_path=inputs.model_path, target_layer_ids=inputs.aux,
            draft_attn_impl=inputs.attn, trust_remote_code=inputs.trust_remote_code,
            mask_token_id=mask_token, num_depths=spec.block_size,
        )
        if inputs.attn == "eager":
            model._create_mask_fn = broadcast_float_mask
        return model

    def forward_kwargs(self, spec: TrainSpec, kernels: str, anchors: int | None
                       ) -> dict[str, Any]:
        from speculators.losses import resolve_loss_config

        return {"loss_config": resolve_loss_config(spec.loss_fn, kernels),
                "max_anchors": anchors, "num_depths": spec.block_size,
                "down_sample_ratio": DOWN_SAMPLE_RATIO,
                "down_sample_ratio_min": DOWN_SAMPLE_RATIO_MIN}

    # -- validation

    def score_names(self, spec: TrainSpec) -> list[str]:
        """Each depth, scored on its own."""
        return [f"position_{d}_acc" for d in range(spec.block_size)]

    def conditional_accuracies(self, acc: Any) -> list[float]:
        return list(acc)


def broadcast_float_mask(mask_mod: Any, B: Any = None, H: Any = None,
                         Q_LEN: int = 0, KV_LEN: int = 0, device: Any = None) -> Any:
    """speculators' `create_float_mask` (the [1, 1, Q, KV] bf16 mask eager attention adds:
    0 where `mask_mod` allows, -inf elsewhere) with `mask_mod` evaluated once on
    broadcast index tensors instead of under `torch.vmap`, whose fixed cost in Python
    came with every pack. tests/unit/test_methods.py checks the two are equal."""
    import torch

    q = torch.arange(Q_LEN, device=device)[:, None]
    kv = torch.arange(KV_LEN, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    allowed = torch.as_tensor(mask_mod(zero, zero, q, kv), device=device)
    allowed = allowed.expand(Q_LEN, KV_LEN)
    mask = torch.zeros((1, 1, Q_LEN, KV_LEN), dtype=torch.bfloat16, device=device)
    return mask.masked_fill_(~allowed, float("-inf"))


METHOD = PEagle()
