"""`hsx export --format speculators`: speculators' own ArrowDataset reads what hsx wrote.

The hsx outputs here are made with hsx's own ShardWriter plus a manifest and inputs.arrow
as hsx_service.prepare writes them, so no engine is needed. The speculators side is read
with speculators.train.data.ArrowDataset, the class its offline trainer builds
(speculators/train/dataloader.py create_train_val_loaders), over the default
hs_connectors FileTransfer, with on_missing="raise" so that a missing file fails loudly
instead of asking a vLLM server for it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from hsx.cli import main
from hsx.dataset import HiddenStatesDataset
from hsx.export import EXPORT_RECORD, ExportError, export_output
from tests.unit.outputs import make_manifest, write_inputs_table, write_manifest

P = TypeVar("P", Path, str)

_speculators_data = pytest.importorskip("speculators.train.data")
ArrowDataset = _speculators_data.ArrowDataset
CollateFn = _speculators_data.CollateFn

NUM_LAYERS = 8
LAYERS = [2, 4, 5, 8]  # [2, N//2, N-3, N]: three auxiliary layers, then the last one
HIDDEN = 32
UNITS = {0: [0, 1, 2], 1: [3, 5, 6, 7], 2: [8, 9]}  # sample 4 failed during extraction


def sample(idx: int) -> dict[str, Any]:
    """Deterministic content, so every reader can be checked against the source."""
    rng = np.random.default_rng(idx)
    t = 3 + idx % 5
    return {
        "input_ids": rng.integers(0, 500, t).astype(np.int32),
        "loss_mask": (np.arange(t) >= t // 2).astype(np.uint8),
        "hidden_states": rng.standard_normal((t, len(LAYERS), HIDDEN)).astype(np.float32) * 3,
    }


def make_output(root: P, storage: str = "bf16", complete: bool = True,
                num_layers: int = NUM_LAYERS, model: str = "tiny") -> P:
    """An hsx output (a folder, or a bucket URI): manifest.json, inputs.arrow, committed
    shards (and complete.json)."""
    rows = [i for ids in UNITS.values() for i in ids] + [4]
    rows.sort()
    units, start = [], 0
    for ids in UNITS.values():
        n = len(ids) + (1 if ids == UNITS[1] else 0)  # unit 1 also planned sample 4
        units.append((start, start + n))
        start += n
    output = write_manifest(root, make_manifest(
        layers=LAYERS, hidden_size=HIDDEN, num_layers=num_layers, storage_dtype=storage,
        units=units, num_samples=len(rows), model=model))
    samples = [sample(i) for i in rows]
    write_inputs_table(output, rows, samples)
    for u in (2, 0, 1):  # commit order must not matter
        with output.shard_writer(u, layers=LAYERS, hidden_size=HIDDEN,
                                 storage_dtype=storage) as w:
            for i in UNITS[u]:
                s = sample(i)
                w.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
            w.commit(errors=[{"sample_index": 4, "reason": "engine failed"}] if u == 1 else [])
    if complete:
        output.mark_complete({})
    return root


def assert_same_as_hsx(src: Path, dest: Path) -> None:
    """Every exported sample, read by speculators, equals hsx's reading of the same sample."""
    hsx_ds = HiddenStatesDataset(src, backend="torch")
    spec_ds = ArrowDataset(max_len=64, datapath=dest, on_missing="raise")
    assert len(spec_ds) == len(hsx_ds) == 9
    assert spec_ds.approx_lengths == [int(hsx_ds[i]["input_ids"].shape[0]) for i in range(9)]
    record = json.loads((dest / EXPORT_RECORD).read_text())
    assert record["target_layer_ids"] == LAYERS[:-1] and record["samples"] == 9
    mapping = spec_ds.data.with_format(None)["hsx_sample_index"]
    assert mapping == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    for i in range(len(hsx_ds)):
        want = hsx_ds[i]
        got = spec_ds[i]
        assert isinstance(got, dict), f"speculators found no sample {i}: {got}"
        assert mapping[i] == want["sample_index"]
        hs = want["hidden_states"]  # [T, L, H] bf16 (dequantized when fp8)
        t = hs.shape[0]
        # speculators: aux layers flattened, in stored order; the last layer apart
        assert got["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_states"], hs[:, :-1].reshape(t, -1))
        assert torch.equal(got["verifier_last_hidden_states"], hs[:, -1])
        assert torch.equal(got["input_ids"], want["input_ids"].long())
        assert torch.equal(got["loss_mask"], want["loss_mask"].long())
        assert got["lengths"].tolist() == [t]


def test_speculators_arrow_dataset_reads_the_export(tmp_path: Path) -> None:
    src = make_output(tmp_path / "hsx")
    progress: list[tuple[int, int]] = []
    summary = export_output(src, tmp_path / "spec", on_progress=lambda d, n:
                                 progress.append((d, n)))
    assert summary.samples == 9 and summary.not_exported == 1 and summary.source_complete
    assert summary.tokens == sum(len(sample(i)["input_ids"]) for ids in UNITS.values()
                                 for i in ids)
    assert progress[-1] == (9, 9) and len(progress) == 9
    assert_same_as_hsx(src, tmp_path / "spec")
    # bf16 is exact: speculators' tensors are the bits hsx's writer stored
    spec_ds = ArrowDataset(max_len=64, datapath=tmp_path / "spec", on_missing="raise")
    want = torch.from_numpy(sample(5)["hidden_states"]).bfloat16()
    assert torch.equal(spec_ds[4]["verifier_last_hidden_states"], want[:, -1])
    # and its collate function packs them as its trainer would
    batch = CollateFn(64, HIDDEN, num_target_layers=len(LAYERS) - 1)([spec_ds[0], spec_ds[1]])
    assert batch["hidden_states"].shape == (1, 64, (len(LAYERS) - 1) * HIDDEN)
    assert batch["verifier_last_hidden_states"].shape == (1, 64, HIDDEN)
    assert batch["document_ids"][0, :8].tolist() == [0, 0, 0, 1, 1, 1, 1, -1]
    # nothing but the export itself next to it: the staging directory is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hsx", "spec"]


def test_token_freq_counts_loss_masked_tokens(tmp_path: Path) -> None:
    src = make_output(tmp_path / "hsx")
    export_output(src, tmp_path / "spec")
    freq = torch.load(tmp_path / "spec" / "token_freq.pt", weights_only=True)
    want: dict[int, int] = {}
    for ids in UNITS.values():
        for i in ids:
            s = sample(i)
            for tok in s["input_ids"][s["loss_mask"].astype(bool)].tolist():
                want[tok] = want.get(tok, 0) + 1
    assert freq == want


def test_fp8_output_is_dequantized_to_bf16(tmp_path: Path) -> None:
    src = make_output(tmp_path / "hsx", storage="fp8")
    summary = export_output(src, tmp_path / "spec")
    assert summary.source_storage_dtype == "fp8"
    assert_same_as_hsx(src, tmp_path / "spec")  # equal to hsx's own dequantization


def test_speculators_train_val_split_finds_its_files(tmp_path: Path) -> None:
    """The val split starts at a row offset; ArrowDataset maps it back to hs_{row}."""
    src = make_output(tmp_path / "hsx")
    export_output(src, tmp_path / "spec")
    hsx_ds = HiddenStatesDataset(src, backend="torch")
    val = ArrowDataset(max_len=64, datapath=tmp_path / "spec", on_missing="raise",
                       train_ratio=0.7, split="val")
    assert len(val) == 3
    for j in range(3):
        assert torch.equal(val[j]["input_ids"], hsx_ds[6 + j]["input_ids"].long())


def test_refusals(tmp_path: Path) -> None:
    src = make_output(tmp_path / "hsx")
    with pytest.raises(ExportError, match="must not contain or lie inside"):
        export_output(src, src / "spec")
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(ExportError, match="is not empty; pass --force"):
        export_output(src, other)
    with pytest.raises(ExportError, match="not an hsx export"):
        export_output(src, other, force=True)
    assert (other / "precious.txt").read_text() == "keep me"

    running = make_output(tmp_path / "running", complete=False)
    with pytest.raises(ExportError, match="not complete"):
        export_output(running, tmp_path / "r")
    assert not (tmp_path / "r").exists()
    assert export_output(running, tmp_path / "r", allow_incomplete=True).samples == 9

    # The stored ids no longer end with the last layer.
    no_last = make_output(tmp_path / "nolast", num_layers=9)
    with pytest.raises(ExportError, match="final layer"):
        export_output(no_last, tmp_path / "n")
    with pytest.raises(ExportError, match="no hsx output"):
        export_output(tmp_path / "missing", tmp_path / "m")


def test_force_replaces_an_earlier_export_and_empty_dest_is_fine(tmp_path: Path) -> None:
    src = make_output(tmp_path / "hsx")
    dest = tmp_path / "spec"
    dest.mkdir()
    export_output(src, dest)
    (dest / "stale.txt").write_text("from an earlier export")
    export_output(src, dest, force=True)
    assert not (dest / "stale.txt").exists()
    assert_same_as_hsx(src, dest)


def test_failure_leaves_no_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_output(tmp_path / "hsx")

    def boom(done: int, total: int) -> None:
        if done == 5:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        export_output(src, tmp_path / "spec", on_progress=boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hsx"]


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_output(tmp_path / "hsx")
    assert main(["export", "--format", "speculators", str(src), str(tmp_path / "spec"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == 9 and out["target_layer_ids"] == [2, 4, 5]
    assert main(["export", str(src), str(tmp_path / "spec")]) == 2
    assert "--force" in capsys.readouterr().err  # messages go to stderr
    assert main(["export", str(src), str(tmp_path / "spec"), "--force"]) == 0
    assert "--target-layer-ids 2 4 5" in capsys.readouterr().err


def test_the_printed_command_is_one_speculators_runs(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The `speculators train` command the export prints, as written, builds speculators'
    draft of the output's target (its `--dry-run`: the draft made and saved, no training
    step, which needs an accelerator): the auxiliary layers, the draft's vocabulary."""
    from hsx_workers.tiny_models import make_tiny_model

    target = make_tiny_model(tmp_path / "target", "llama", num_layers=NUM_LAYERS)
    src = make_output(tmp_path / "hsx", model=str(target))
    assert main(["export", str(src), str(tmp_path / "spec"), "--json"]) == 0
    command = shlex.split(json.loads(capsys.readouterr().out)["train_command"])
    assert command[:2] == ["speculators", "train"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    assert command[command.index("--draft-vocab-size") + 1] == str(min(32000, vocab))
    command[0] = str(Path(sys.executable).parent / "speculators")
    done = subprocess.run([*command, "--dry-run"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    draft = tmp_path / "spec-draft"
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == min(32000, vocab)


def test_fix_draft_gives_vllm_the_auxiliary_layer_count(tmp_path: Path, tiny_llama: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """A draft speculators builds on two auxiliary layers (as `--dry-run` saves it) reads
    as three in vLLM 0.25 (its reader leaves the count where the Llama EAGLE-3 does not
    look; the load then fails on fc's shape, seen on an H200); `hsx fix-draft`, printed
    after the train command, writes it where vLLM reads it, and eval-draft refuses the
    unfixed draft by name."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from tests.unit.test_trainer import make_output as two_aux_output

    src = two_aux_output(tmp_path / "hsx", tiny_llama)
    assert main(["export", str(src), str(tmp_path / "spec"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    command = shlex.split(printed["train_command"])
    command[0] = str(Path(sys.executable).parent / "speculators")
    done = subprocess.run([*command, "--dry-run"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    draft = tmp_path / "spec-draft"

    def vllm_aux_count() -> int:  # as llama_eagle3.LlamaModel.__init__ resolves it
        text = SpeculatorsConfig.extract_transformers_pre_trained_config(
            json.loads((draft / "config.json").read_text()))
        return text.get("num_aux_hidden_states") or len(
            (text.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []) or 3

    assert printed["target_layer_ids"] == [1, 2] and vllm_aux_count() == 3
    assert main(["eval-draft", str(src), "--draft", str(draft)]) == 2
    assert f"hsx fix-draft {draft}" in capsys.readouterr().err
    assert printed["fix_command"] == f"hsx fix-draft {draft}"
    assert main(shlex.split(printed["fix_command"])[1:]) == 0
    assert capsys.readouterr().out.strip() == str(draft / "config.json")
    assert vllm_aux_count() == 2
    assert main(["fix-draft", str(draft)]) == 0  # idempotent
    assert capsys.readouterr().out == ""


def test_one_capture_exports_each_methods_layers(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An output captured for EAGLE-3 and DFlash (`layers: [eagle3, dflash]`, N = 8:
    [2, 3, 4, 5, 6, 8]) exports, per method, only the layers that method's draft reads,
    and the printed command trains that method."""
    both = [2, 3, 4, 5, 6, 8]
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", both)
    src = make_output(tmp_path / "hsx")
    for method, aux in (("eagle3", [2, 4, 5]), ("dflash", [2, 3, 4, 5, 6])):
        dest = tmp_path / method
        summary = export_output(src, dest, method=method)
        assert summary.layers == [*aux, 8] and summary.target_layer_ids == aux
        assert f"--speculator-type {method}" in summary.train_command()
        picks = [both.index(k) for k in aux]
        spec_ds = ArrowDataset(max_len=64, datapath=dest, on_missing="raise")
        hs = HiddenStatesDataset(src, backend="torch")[0]["hidden_states"]
        got = spec_ds[0]
        assert isinstance(got, dict)
        assert torch.equal(got["hidden_states"], hs[:, picks].reshape(hs.shape[0], -1))
        assert torch.equal(got["verifier_last_hidden_states"], hs[:, -1])
    monkeypatch.setattr(sys.modules[__name__], "LAYERS", [2, 3])
    with pytest.raises(ExportError, match="id 8"):
        export_output(make_output(tmp_path / "short"), tmp_path / "x", method="dflash")
