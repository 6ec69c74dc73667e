"""DFlash: a block drafter. The target's token (the anchor) and `block_size` - 1 mask
tokens go through five decoder layers that attend to the target's states before the
anchor, and the block is proposed in one forward pass.

speculators' `DFlashDraftModel`; vLLM serves it as `method: dflash`, `block_size` - 1
tokens a step. It reads about five target layers spread over the model (its published
Qwen3-8B drafts: `[1, 9, 17, 25, 33]` in DFlash's numbering), unshifted: a block is
trained from the states as captured, at `max_anchors` positions of a pack drawn at random.
Its defaults follow speculators' DFlash recipe where they differ from EAGLE-3's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from hsx.methods.base import DraftInputs, DraftMethod

if TYPE_CHECKING:
    from hsx.spec import TrainSpec

# DFlash's drafts read this many target layers, spread over the model (its published
# Qwen3-8B drafts: five).
DFLASH_TARGET_LAYERS = 5
MAX_ANCHORS = 512  # speculators' default for its packs of 8,192 tokens


class DFlash(DraftMethod):
    name = "dflash"
    title = "DFlash"
    summary = "a block of tokens in one forward pass"
    # speculators' recipe: five decoder layers (with one, a block's later positions are
    # not learnt: on the learnable target one layer accepts position 1 of a block and
    # almost none after it), cross-entropy with D-PACE position weights.
    default_draft_layers = 5
    loss = "ce"
    shift = 0
    # A block drafter's loss moves more from step to step (its anchors are drawn at
    # random): the second moment follows it faster, as DFlash's own recipe does.
    betas = (0.9, 0.95)
    peak_lr: ClassVar[Mapping[str, float]] = {"cpu": 5e-3, "cuda": 3e-4}
    specforge_features: ClassVar[tuple[str, str | None] | None] = ("hidden_states", None)
    specforge_layer_key = "dflash_config.target_layer_ids"
    run_metric = "eal"

    def aux_layers(self, num_layers: int) -> list[int]:
        """Evenly from id 2 to N-2, as DFlash's reference drafts read them (its code
        writes them as 1 .. N-3, k - 1)."""
        n = num_layers
        low, high = 2, max(2, n - 2)
        count = min(DFLASH_TARGET_LAYERS, high - low + 1)
        step = (high - low) / max(1, count - 1)
        ids = {round(low + i * step) for i in range(count)}
        return sorted(k for k in ids if 0 <= k < n) or [max(0, n - 1)]

    def proposed_tokens(self, spec: TrainSpec) -> int:
        """The anchor is the target's own token: given, not proposed."""
        return spec.block_size - 1

    def proposed_by(self, spec: TrainSpec) -> str:
        return f"block_size {spec.block_size} less the target's own token"

    def anchors(self, spec: TrainSpec, pack_tokens: int) -> int | None:
        """`max_anchors`, else one per block's length of the pack, at most 512
        (speculators' 512 in 8,192 tokens is one per 16).

        Every anchor costs a block of queries whether the pack has room for it or not
        (speculators pads the missing ones), so a count fixed for GPU packs would make a
        CPU pack of 128 tokens compute 4,096 queries for at most 120 real blocks.
        """
        if spec.max_anchors is not None:
            return spec.max_anchors
        return max(1, min(MAX_ANCHORS, pack_tokens // spec.block_size))

    # -- training

    def build(self, inputs: DraftInputs) -> Any:
        from speculators.models.dflash import DFlashDraftModel

        return self._build(DFlashDraftModel, self.layer_config(inputs), inputs)

    def layer_config(self, inputs: DraftInputs) -> Any:
        """Qwen3 decoder layers of the target's sizes, all full attention (vLLM's
        drafting kernel refuses sliding attention without a window)."""
        from transformers import Qwen3Config

        text, layers = inputs.text_config, inputs.num_layers
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
        return layer

    def _build(self, cls: Any, layer: Any, inputs: DraftInputs) -> Any:
        """speculators' block drafter `cls` on `layer`, with the mask token vLLM fills a
        block with (without one its kernel fails).

        The anchor is given (the target's bonus token) and each mask slot predicts its
        own position, DFlash's layout, for DSpark too (dspark.py says why)."""
        from speculators.train.utils import resolve_mask_token_id

        text = inputs.text_config
        mask_token = resolve_mask_token_id(inputs.model_path, int(text.vocab_size),
                                           trust_remote_code=inputs.trust_remote_code)
        return cls.from_training_args(
            layer, t2d=inputs.t2d, d2t=inputs.d2t, draft_vocab_size=inputs.draft_vocab,
            block_size=inputs.spec.block_size, verifier_name_or_path=inputs.model_path,
            target_layer_ids=inputs.aux, draft_attn_impl=inputs.attn,
            mask_token_id=mask_token, trust_remote_code=inputs.trust_remote_code,
            sample_from_anchor=False,
        )

    def forward_kwargs(self, spec: TrainSpec, kernels: str, anchors: int | None
                       ) -> dict[str, Any]:
        from speculators.losses import resolve_loss_config

        if anchors is None:
            raise ValueError(f"a {self.name} draft trains on the plan's anchors per pack; "
                             "none were given")
        return {"loss_config": resolve_loss_config(spec.loss_fn, kernels),
                "max_anchors": anchors,
                "per_position_loss_weight": "dpace" if spec.loss_fn == "ce"
                else "fixed-exp-decay"}

    # -- validation

    def score_names(self, spec: TrainSpec) -> list[str]:
        """Each proposed slot of a block (slot 0 is the anchor, given)."""
        return [f"position_{i}_acc" for i in range(1, spec.block_size)]

    def expected_acceptance_length(self, acc: Any, run: float | None) -> float:
        """The mean accepted run of the blocks plus the bonus token, as vLLM counts
        acceptance (speculators' `eal`), not a product of the positions' accuracies."""
        return run if run is not None else 1.0


METHOD = DFlash()
