"""Draft methods (hsx.methods): found by name from their files, each one's layers,
defaults, proposals, vLLM config and scores; the heavy helpers they build drafts with
equal speculators' own; and no code outside the methods' files tells methods apart by
name.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.methods import (
    DEFAULT_METHOD,
    all_methods,
    default_layers,
    draft_aux_layers,
    method,
    method_names,
    method_of_draft,
)
from hsx.spec import TrainSpec

REPO = Path(__file__).resolve().parents[2]
METHODS_DIR = REPO / "client" / "hsx" / "methods"


def test_the_methods_are_their_files() -> None:
    files = sorted(p.stem for p in METHODS_DIR.glob("*.py")
                   if p.stem not in ("__init__", "base"))
    assert sorted(method_names()) == files == ["dflash", "dspark", "eagle3", "peagle"]
    assert method_names()[0] == DEFAULT_METHOD == "eagle3"
    assert [m.name for m in all_methods()] == list(method_names())
    with pytest.raises(ValueError, match="unknown draft method 'medusa'; known: eagle3"):
        method("medusa")
    with pytest.raises(ValueError, match="unknown draft method"):
        TrainSpec(method="medusa")


def test_importing_the_methods_imports_no_framework() -> None:
    """Each method's module is light at import; the base imports none of them."""
    code = ("import sys, hsx.methods.base as b; b.method_names(); "
            "first = sorted(m for m in sys.modules if m.startswith('hsx.methods.')); "
            "b.all_methods(); "
            "print(first, sorted(x for x in ('torch', 'vllm', 'ray', 'speculators', "
            "'transformers') if x in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "['hsx.methods.base'] []"


@pytest.mark.parametrize(("name", "n", "ids"), [
    ("eagle3", 4, [1, 2, 4]), ("eagle3", 36, [2, 18, 33, 36]),
    ("peagle", 36, [2, 18, 33, 36]),  # EAGLE-3's: one capture serves both
    ("dflash", 4, [2, 4]), ("dflash", 36, [2, 10, 18, 26, 34, 36]),
    ("dspark", 36, [2, 10, 18, 26, 34, 36]),
])
def test_layers(name: str, n: int, ids: list[int]) -> None:
    assert method(name).layers(n) == ids == default_layers(n, name)


def test_each_method_trains_and_is_served_as_before() -> None:
    """Defaults and vLLM's view per method: EAGLE-3, DFlash and DSpark as they were
    before the methods were objects; P-EAGLE drafting `block_size` at once."""
    rows = {}
    for m in all_methods():
        spec = TrainSpec(method=m.name)
        rows[m.name] = (spec.proposed_tokens, spec.loss_fn, m.default_draft_layers, m.shift,
                        m.betas, dict(m.peak_lr), m.anchors(spec, 128),
                        m.speculative_config("D", spec.proposed_tokens))
    assert rows == {
        "eagle3": (3, "kl_div", 1, 1, (0.9, 0.999), {}, None,
                   {"method": "eagle3", "model": "D", "num_speculative_tokens": 3}),
        "dflash": (7, "ce", 5, 0, (0.9, 0.95), {"cpu": 5e-3, "cuda": 3e-4}, 16,
                   {"method": "dflash", "model": "D", "num_speculative_tokens": 7}),
        "dspark": (7, "kl_div", 5, 0, (0.9, 0.95), {"cpu": 5e-3, "cuda": 3e-4}, 16,
                   {"method": "dspark", "model": "D", "num_speculative_tokens": 7}),
        "peagle": (8, "kl_div", 4, 1, (0.9, 0.999), {}, None,
                   {"method": "eagle3", "parallel_drafting": True, "model": "D",
                    "num_speculative_tokens": 8}),
    }
    assert [m.name for m in all_methods() if m.vllm_cpu_refuses] == ["dspark"]
    assert [m.name for m in all_methods() if m.specforge_features is None] == ["peagle"]


def test_expected_acceptance_length_per_method() -> None:
    acc = [0.9, 0.72, 0.54]
    eagle3, peagle, dflash = method("eagle3"), method("peagle"), method("dflash")
    # EAGLE-3's acc[k] is P(steps 0..k right): the sum is the expectation.
    assert eagle3.conditional_accuracies(acc) == pytest.approx([0.9, 0.8, 0.75])
    assert eagle3.expected_acceptance_length(acc, None) == pytest.approx(1 + sum(acc))
    # P-EAGLE's depths are scored each on its own: their product.
    assert peagle.expected_acceptance_length(acc, None) == pytest.approx(
        1 + 0.9 + 0.9 * 0.72 + 0.9 * 0.72 * 0.54)
    # A block drafter counts its accepted runs itself.
    assert dflash.expected_acceptance_length(acc, 3.25) == 3.25
    assert dflash.expected_acceptance_length(acc, None) == 1.0


def test_a_saved_draft_names_its_method(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    assert method_of_draft(tmp_path).name == "peagle"
    assert method_of_draft(tmp_path / "missing").name == DEFAULT_METHOD


def test_draft_aux_layers_of_a_capture_for_several_methods() -> None:
    both = sorted({*method("eagle3").layers(8), *method("dflash").layers(8)})
    assert draft_aux_layers(both, 8, "peagle") == draft_aux_layers(both, 8) == [2, 4, 5]
    assert draft_aux_layers(both, 8, "dflash") == [2, 3, 4, 5, 6]


def test_eagle3_fixes_the_aux_count_vllm_reads() -> None:
    eagle3 = method("eagle3")
    config = {"eagle_aux_hidden_state_layer_ids": [1, 2],
              "transformer_layer_config": {"model_type": "llama"}}
    assert eagle3.fix_draft_config(config)
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    assert not eagle3.fix_draft_config(config)  # idempotent
    three = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "transformer_layer_config": {}}
    assert not eagle3.fix_draft_config(three)  # vLLM's default is right
    assert not method("dflash").fix_draft_config(dict(config))


# ---------------------------------------------------------------------- heavy helpers


def test_draft_layer_config_is_one_vllm_serves() -> None:
    from transformers import DeepseekV3Config, LlamaConfig

    from hsx.methods.eagle3 import draft_layer_config

    llama = LlamaConfig(hidden_size=256, num_attention_heads=4, num_hidden_layers=4)
    own = draft_layer_config(llama, 1, 2)
    assert own.model_type == "llama" and own.num_hidden_layers == 1
    assert own.num_aux_hidden_states == 2 and llama.num_hidden_layers == 4  # a copy
    ds = DeepseekV3Config(hidden_size=256, num_attention_heads=4, num_hidden_layers=3,
                          vocab_size=512, intermediate_size=384, rms_norm_eps=1e-6)
    layer = draft_layer_config(ds, 1, 3)
    assert layer.model_type == "llama" and layer.architectures == ["LlamaForCausalLM"]
    assert (layer.hidden_size, layer.vocab_size, layer.head_dim) == (256, 512, 64)
    assert layer.num_hidden_layers == 1 and layer.num_aux_hidden_states == 3


@pytest.mark.parametrize(("length", "window"), [(7, None), (64, None), (64, 5), (512, 16)])
def test_the_dense_attention_mask_is_speculators_own(length: int, window: int | None) -> None:
    """hsx builds EAGLE-3's CPU attention mask with tensor operations; it must be the
    one speculators' mask functions give: packs of whole samples, padding at the end."""
    from speculators.models.attention import create_float_mask
    from speculators.models.eagle3.attention import create_combined_mask_mod

    from hsx.methods.eagle3 import dense_attention_mask

    rng = np.random.default_rng(length)
    sizes = rng.integers(1, 40, size=length)
    doc = torch.from_numpy(np.repeat(np.arange(length), sizes)[:length])
    doc[length - length // 10:] = -1
    theirs = create_float_mask(create_combined_mask_mod(doc, length, sliding_window=window),
                               B=None, H=None, Q_LEN=length, KV_LEN=length, device="cpu")
    assert torch.equal(dense_attention_mask(doc, length, "cpu", sliding_window=window), theirs)
    assert theirs.dtype == torch.bfloat16 and theirs.shape == (1, 1, length, length)


@pytest.mark.parametrize("window", [None, 16])
def test_the_peagle_mask_is_speculators_own(window: int | None) -> None:
    """P-EAGLE's mask over its COD sample, evaluated on broadcast indices, equals
    speculators' `create_float_mask` (vmap) of the same mask function."""
    from speculators.models.attention import create_float_mask
    from speculators.models.peagle.attention import create_peagle_mask_mod
    from speculators.models.peagle.data import generate_cod_sample_indices

    from hsx.methods.peagle import broadcast_float_mask

    torch.manual_seed(0)
    length = 128
    loss_mask = torch.zeros(1, length)
    loss_mask[0, 10:60] = loss_mask[0, 70:120] = 1
    doc = torch.cat([torch.zeros(60), torch.ones(60), -torch.ones(8)]).long()
    anchors, depth = generate_cod_sample_indices(length, loss_mask, 8)
    mod = create_peagle_mask_mod(anchors, depth, doc, sliding_window=window)
    n = int(anchors.shape[0])
    theirs = create_float_mask(mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device="cpu")
    assert torch.equal(broadcast_float_mask(mod, B=None, H=None, Q_LEN=n, KV_LEN=n,
                                            device="cpu"), theirs)


# ---------------------------------------------------------------------- one place each


def _method_comparisons(path: Path, root: Path = REPO) -> list[str]:
    """Comparisons of a method's name (`x == "dflash"`, `x in ("dspark",)`) and reads of
    a `.block` attribute in one module."""
    names = set(method_names())
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = [c for side in sides for c in ast.walk(side)
                      if isinstance(c, ast.Constant) and c.value in names]
            if consts:
                found.append(f"{path.relative_to(root)}:{node.lineno}: compares "
                             f"{consts[0].value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "block":
            found.append(f"{path.relative_to(root)}:{node.lineno}: .block")
    return found


def test_no_code_outside_the_methods_tells_methods_apart_by_name() -> None:
    """What differs between methods is asked of the method's object (hsx.methods); a
    method added as a file of its own then needs no branch anywhere else."""
    found = []
    for tree in ("client", "workers", "service"):
        for path in sorted((REPO / tree).rglob("*.py")):
            if METHODS_DIR not in path.parents:
                found += _method_comparisons(path)
    assert not found, "\n".join(found)


def test_the_walk_sees_a_comparison(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text('if m == "dspark" or m in ("eagle3",):\n    pass\nx = s.block\n'
                    'y = {"dflash": 1}\n')
    assert sorted(f.rpartition(": ")[2] for f in _method_comparisons(path, tmp_path)) == [
        ".block", "compares 'dspark'", "compares 'eagle3'"]
