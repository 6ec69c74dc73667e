"""`hsx export --format specforge --method M`: SpecForge's own offline readers read it.

Each strategy is read the way SpecForge's offline trainer reads it: the strategy's
registered offline data provider (`specforge.algorithms.<m>.providers`) builds the
reader (every file, its keys checked eagerly with SPECFORGE_VALIDATE_OFFLINE_FEATURES=1),
`feature_store.load_feature_file` loads a file, the provider's normalizer turns it into
the training tensors and its collator batches them. What they give must equal hsx's own
reading of the same sample: the auxiliary layers concatenated, and (EAGLE-3, DSpark) the
target's final norm applied to id N.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.cli import main
from hsx.dataset import HiddenStatesDataset
from hsx.export import EXPORT_RECORD, ExportError, export_output
from hsx.export_specforge import SAMPLE_INDICES
from tests.unit.test_export import HIDDEN, LAYERS, NUM_LAYERS, make_output

pytest.importorskip("specforge.algorithms.dspark.providers")
from specforge.runtime.data_plane.feature_store import load_feature_file

MAX_LEN = 64


EPS = 1e-5


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint of the outputs' shape (N = 8, H = 32) holding what the export
    reads: a random final norm (and the embeddings its head is tied to)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("target")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": NUM_LAYERS, "hidden_size": HIDDEN, "vocab_size": 500,
        "num_attention_heads": 1, "rms_norm_eps": EPS, "tie_word_embeddings": True}))
    gen = torch.Generator().manual_seed(0)
    save_file({"model.norm.weight": (torch.rand(HIDDEN, generator=gen) * 2).bfloat16(),
               "model.embed_tokens.weight": torch.randn(500, HIDDEN, generator=gen).bfloat16()},
              str(folder / "model.safetensors"))
    return folder


def final_norm_of(model: Path) -> Any:
    """The target's final norm as transformers' Llama builds it, with the checkpoint's
    weight."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(HIDDEN, eps=EPS)
    norm.weight.data = load_file(str(model / "model.safetensors"))["model.norm.weight"].float()
    return norm


def provider(method: str) -> Any:
    module = importlib.import_module(f"specforge.algorithms.{method}.providers")
    return module.create_registration().providers.offline[0]


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_specforge_reads_each_strategys_export(method: str, tmp_path: Path, target: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_output(tmp_path / "hsx", model=str(target))
    dest = tmp_path / method
    summary = export_output(src, dest, fmt="specforge", method=method)
    assert summary.samples == 9 and summary.format == "specforge"
    assert summary.target_layer_ids == LAYERS[:-1]
    assert summary.specforge_layer_ids == [k - 1 for k in LAYERS[:-1]]
    offline = provider(method)
    monkeypatch.setenv("SPECFORGE_VALIDATE_OFFLINE_FEATURES", "1")
    refs = offline.build_reader(str(dest), run_id="hsx", ttt_length=7, max_len=MAX_LEN).read()
    assert len(refs) == 9
    indices = json.loads((dest / SAMPLE_INDICES).read_text())
    hsx_ds = HiddenStatesDataset(src, backend="torch")
    by_index = {int(hsx_ds[i]["sample_index"]): hsx_ds[i] for i in range(len(hsx_ds))}
    norm = final_norm_of(target)
    normalize = offline.build_normalizer(MAX_LEN)
    batch = []
    for ref in refs:
        path = ref.feature_store_uri.removeprefix("file://")
        raw = load_feature_file(path)
        assert tuple(sorted(raw)) == tuple(sorted(offline.capture_layout.output_names))
        export_index = int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))
        want = by_index[indices[export_index]]
        hs = want["hidden_states"]  # [T, L, H] bf16
        t = hs.shape[0]
        got = normalize(raw)
        batch.append(got)
        aux = got["hidden_state" if method == "eagle3" else "hidden_states"]
        assert aux.dtype == torch.bfloat16
        assert torch.equal(aux, hs[:, :-1].reshape(1, t, -1))
        assert torch.equal(got["input_ids"], want["input_ids"].long()[None])
        if method == "eagle3":  # its normalizer drops the last position from the loss
            assert got["loss_mask"][0, :-1].tolist() == want["loss_mask"].tolist()[:-1]
        else:
            assert torch.equal(got["loss_mask"], want["loss_mask"].long()[None])
        post = {"eagle3": "target", "dspark": "target_last_hidden_states"}.get(method)
        if post is None:
            assert set(got) == {"input_ids", "loss_mask", "hidden_states"}
            continue
        with torch.no_grad():
            ref_post = norm(hs[:, -1].float())
        assert got[post].shape == (1, t, HIDDEN) and got[post].dtype == torch.bfloat16
        err = (got[post][0].float() - ref_post).norm() / ref_post.norm()
        assert err < 1e-2, (method, float(err))
    collated = offline.build_collator()(batch[:2])
    assert collated["input_ids"].shape[0] == 2


def test_post_norm_strategies_need_the_targets_norm(tmp_path: Path, target: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An output whose model hsx cannot read (here "tiny", no checkpoint) exports DFlash
    (no post-norm state), refuses EAGLE-3 and DSpark naming what to pass, and `--model`
    names a local copy of the target."""
    src = make_output(tmp_path / "hsx")
    assert export_output(src, tmp_path / "dflash", fmt="specforge",
                         method="dflash").samples == 9
    with pytest.raises(ExportError, match="--model"):
        export_output(src, tmp_path / "dspark", fmt="specforge", method="dspark")
    assert not (tmp_path / "dspark").exists()
    assert main(["export", "--format", "specforge", "--method", "dspark", str(src),
                 str(tmp_path / "dspark"), "--model", str(target), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["specforge_layer_ids"] == [1, 3, 4]
    assert "training.strategy=dspark" in printed["train_hint"]
    assert "dflash_config.target_layer_ids = [1, 3, 4]" in printed["train_hint"]
    record = json.loads((tmp_path / "dspark" / EXPORT_RECORD).read_text())
    assert record["format"] == "specforge-offline-data" and record["strategy"] == "dspark"
    assert record["specforge_layer_ids"] == [1, 3, 4] and record["target_layer_ids"] == [2, 4, 5]


def test_specforge_export_is_eagle3_by_default(tmp_path: Path, target: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    src = make_output(tmp_path / "hsx", model=str(target))
    assert main(["export", "--format", "specforge", str(src), str(tmp_path / "sf")]) == 0
    err = capsys.readouterr().err
    assert "training.strategy=eagle3" in err
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 4]" in err
    raw = load_feature_file(str(tmp_path / "sf" / "rows_0-2000" / "data_0.ckpt"))
    assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
