"""What a draft method is (`DraftMethod`), and where each one is found.

A draft method is one module of this package, named as the method (eagle3.py, dflash.py,
dspark.py, peagle.py), whose `METHOD` is an instance of a `DraftMethod` subclass. The
rest of hsx asks that object whatever differs between methods, and never compares a
method's name:

- the target layers a draft reads (`aux_layers`, `layers`): a job's default layers,
  preflight, the trainer, the export;
- its defaults (decoder layers, loss, learning rate, optimizer, anchors): `TrainSpec`
  and the trainer's plan;
- whether its samples are shifted (`shift`, `preprocess`): the trainer's data;
- the model speculators builds for it and its forward's arguments (`build`,
  `forward_kwargs`): trainer/draft_model.py and the loop;
- its validation scores and their expected acceptance length: trainer/scores.py;
- the tokens it proposes a step and vLLM's `speculative_config` for it, and whether
  vLLM's CPU build serves it: the evaluation, `hsx train`'s serve hint;
- its keys in speculators' and SpecForge's layouts: `hsx export`, `hsx fix-draft`.

Two sides in one object. The light side (layer ids, defaults, vLLM's config, export
keys, the scores' formula) is plain Python, so `import hsx` stays free of torch. The
heavy side (`build`, `forward_kwargs`, `preprocess`) imports torch, transformers and
speculators inside the methods, and only the trainer (hsx_workers) calls it. A method
built on another subclasses it (DSpark is DFlash's blocks with more heads; P-EAGLE is
EAGLE-3's layers drafting in parallel).

The methods are listed from this folder's files and a method's module is imported when
it is first asked for (`method(name)`), as hsx/registry.py's registries import their
variants: base.py never imports a method, and a new method is its file alone.

Layer ids follow hsx's (and vLLM's, and speculators' `aux_hidden_state_layer_ids`)
convention: id k < N is the input of decoder layer k, id N the last layer's output
before the final norm (docs/FORMAT.md). Tools that count a layer's output (DFlash's
reference code, vLLM's `dflash_config.target_layer_ids`) write k - 1 for the same state.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from hsx.spec import TrainSpec

DEFAULT_METHOD = "eagle3"
"""The method of a training or a capture that names none."""

_FOLDER = Path(__file__).parent
_NOT_METHODS = frozenset({"base"})


@dataclass(frozen=True)
class DraftInputs:
    """What the trainer hands a method to build a new draft (trainer/draft_model.py)."""

    text_config: Any  # the target's (text) config, transformers'
    spec: TrainSpec
    num_layers: int  # decoder layers of the draft
    aux: list[int]  # the target layer ids it reads besides N
    t2d: Any  # vocabulary mappings (None: the whole vocabulary)
    d2t: Any
    draft_vocab: int
    model_path: str  # the target
    trust_remote_code: bool
    attn: str  # speculators' attention: "eager" on CPU, flex attention on GPU


class DraftMethod:
    """A draft method where hsx meets it. Subclasses set the class attributes and
    override what differs; the defaults here are an autoregressive draft's (EAGLE-3's)."""

    name: ClassVar[str]
    """As speculators (`speculators_model_type`) and the job file name it."""
    title: ClassVar[str]
    """As the method's authors write it (the docs and `hsx train --help`)."""
    summary: ClassVar[str]
    """How its draft proposes, in a few words."""
    default_draft_layers: ClassVar[int] = 1
    """Decoder layers of a new draft (`TrainSpec.num_layers` unset)."""
    loss: ClassVar[str] = "kl_div"
    """speculators' default loss of the method (`TrainSpec.loss` unset)."""
    shift: ClassVar[int] = 1
    """Tokens a sample's states lead its tokens in training: 1 where the draft reads
    token t + 1 with the states of token t (speculators' `shift_batch`), 0 where it
    reads the states as captured."""
    betas: ClassVar[tuple[float, float]] = (0.9, 0.999)
    """AdamW's betas."""
    peak_lr: ClassVar[Mapping[str, float]] = {}
    """The peak learning rate per device kind ("cpu", "cuda") where the method's own
    differs from the device's default (`TrainSpec.lr` unset)."""
    vllm_cpu_refuses: ClassVar[str | None] = None
    """Why vLLM's CPU build cannot serve such a draft; None where it can."""
    specforge_features: ClassVar[tuple[str, str | None] | None] = None
    """SpecForge's offline features of the method: the auxiliary layers', the post-norm
    final state's (None: it has none); None where SpecForge has no such strategy."""
    specforge_layer_key: ClassVar[str] = ""
    """Where a SpecForge draft config holds the target layer ids."""

    # -- layers

    def aux_layers(self, num_layers: int) -> list[int]:
        """The ids the draft reads besides N (its training target), ascending."""
        raise NotImplementedError

    def layers(self, num_layers: int) -> list[int]:
        """Every id a capture for this method holds: its auxiliary ids and N."""
        return [*self.aux_layers(num_layers), num_layers]

    # -- what it proposes, and how vLLM serves it

    def proposed_tokens(self, spec: TrainSpec) -> int:
        """Tokens the draft proposes per verification step (vLLM's
        num_speculative_tokens)."""
        raise NotImplementedError

    def proposed_by(self, spec: TrainSpec) -> str:
        """The setting that makes `proposed_tokens`, in words (`hsx train --help`)."""
        return f"ttt_steps {spec.ttt_steps}"

    def speculative_config(self, draft: str, k: int) -> dict[str, Any]:
        """vLLM's `speculative_config` that serves the draft in folder `draft`, k tokens
        a step."""
        return {"method": self.name, "model": draft, "num_speculative_tokens": k}

    def fix_draft_config(self, config: dict[str, Any]) -> bool:
        """Change a speculators draft's config.json (as read) where vLLM would read it
        wrongly; True when it changed anything. Nothing to change by default."""
        return False

    # -- training

    def anchors(self, spec: TrainSpec, pack_tokens: int) -> int | None:
        """Positions a pack trains from (`max_anchors` of speculators' forward); None
        where the method trains every position."""
        return None

    def preprocess(self) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
        """What speculators' CollateFn applies to each sample first (its `shift_batch`
        where `shift` is 1)."""
        if not self.shift:
            return None
        from speculators.models.eagle3.data import shift_batch

        return shift_batch  # type: ignore[no-any-return]

    def build(self, inputs: DraftInputs) -> Any:
        """A new draft: speculators' model of the method, on the CPU until moved."""
        raise NotImplementedError

    def forward_kwargs(self, spec: TrainSpec, kernels: str, anchors: int | None
                       ) -> dict[str, Any]:
        """The method's own arguments of the draft's forward (besides the pack's
        tensors): its loss with speculators' `kernels` ("fused" or "eager"), and
        `anchors` per pack where it takes them (the plan's)."""
        raise NotImplementedError

    # -- validation

    run_metric: ClassVar[str | None] = None
    """speculators' metric of the accepted run of each block plus the bonus token (a
    block drafter's `eal`), where its forward reports one."""

    def score_names(self, spec: TrainSpec) -> list[str]:
        """The keys of speculators' metrics scored per draft position."""
        raise NotImplementedError

    def conditional_accuracies(self, acc: Sequence[float]) -> list[float]:
        """P(position k right | the positions before it right), per k, from `acc` (the
        positions' scores as speculators counts them)."""
        return list(acc)

    def expected_acceptance_length(self, acc: Sequence[float], run: float | None) -> float:
        """Tokens per verification step the draft would give: 1 + the sum over k of
        P(positions 0..k all right), from the conditional accuracies. `run`: the mean
        accepted run plus bonus token, where the forward reports it (`run_metric`)."""
        expected, product = 1.0, 1.0
        for c in self.conditional_accuracies(acc):
            product *= c
            expected += product
        return expected

    def __repr__(self) -> str:
        return f"<draft method {self.name}>"


def method_names() -> tuple[str, ...]:
    """The methods there are (the modules of this package): the default first, then by
    name."""
    return _names()


@functools.cache
def _names() -> tuple[str, ...]:
    found = sorted(info.name for info in pkgutil.iter_modules([str(_FOLDER)])
                   if info.name not in _NOT_METHODS and not info.name.startswith("_"))
    return (DEFAULT_METHOD, *(n for n in found if n != DEFAULT_METHOD))


@functools.cache
def method(name: str) -> DraftMethod:
    """The method called `name`, its module imported now if it was not yet; ValueError
    naming the known ones."""
    if name not in _names():
        raise ValueError(f"unknown draft method {name!r}; known: {', '.join(_names())}")
    found = importlib.import_module(f"{__package__}.{name}").METHOD
    if not isinstance(found, DraftMethod) or found.name != name:
        raise TypeError(f"{__package__}.{name}.METHOD must be the DraftMethod {name!r}, "
                        f"not {found!r}")
    return found


def all_methods() -> list[DraftMethod]:
    """Every method, in `method_names()` order."""
    return [method(name) for name in _names()]


def method_of_draft(draft: str | Path) -> DraftMethod:
    """The method a saved speculators draft (a folder with config.json) was trained
    with: its `speculators_model_type`, the default where the config names none."""
    try:
        config = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, ValueError):
        return method(DEFAULT_METHOD)
    return method(str(config.get("speculators_model_type") or DEFAULT_METHOD))


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


def default_layers(num_layers: int, method_name: str = DEFAULT_METHOD) -> list[int]:
    """The ids a capture for `method_name` holds when the job names none."""
    return method(method_name).layers(num_layers)


def draft_aux_layers(layers: list[int], num_layers: int, method_name: str = DEFAULT_METHOD
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
    known = set().union(*(m.layers(n) for m in all_methods()))
    if set(own) <= set(layers) <= known:
        return own
    return list(layers[:-1])
