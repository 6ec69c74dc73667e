"""DraftTrainer without engines: outputs written by hand with ShardWriter for the tiny
Llama (random hidden states), trained for a few steps on CPU.

What is checked: the samples speculators' Eagle3 model gets, the vocabulary mapping,
refusals, the draft layer config vLLM can serve, checkpoints (whole, published,
pruned), resume (weights, optimizer, step, units), stop, and following an extraction
whose shards arrive while training runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx.cli import main
from hsx.output import Output, ShardWriter
from hsx.output.layout import COMPLETE, DRAFT_CHECKPOINTS, DRAFT_DIR, DRAFT_METRICS
from hsx.spec import JobSpec, SpecError, TrainSpec, parse_job
from hsx_workers.trainer import (
    DraftTrainer,
    StepMetrics,
    TrainRefused,
    draft_layer_config,
    draft_layout,
    to_speculators_sample,
    token_frequencies,
    vocab_mappings,
)
from tests.unit.outputs import make_manifest, write_inputs_table, write_manifest

pytest.importorskip("speculators.models.eagle3")

LAYERS = [1, 2, 4]
HIDDEN = 256
UNITS = {0: list(range(0, 6)), 1: list(range(6, 12)), 2: list(range(12, 18))}


def sample(idx: int) -> dict[str, Any]:
    rng = np.random.default_rng(idx)
    t = 12 + idx % 7
    return {
        "input_ids": rng.integers(16, 200, t).astype(np.int32),
        "loss_mask": (np.arange(t) >= 2).astype(np.uint8),
        "hidden_states": rng.standard_normal((t, len(LAYERS), HIDDEN)).astype(np.float32),
    }


def write_unit(root: Path, unit: int) -> None:
    with ShardWriter(root, unit, layers=LAYERS, hidden_size=HIDDEN, storage_dtype="bf16") as w:
        for i in UNITS[unit]:
            s = sample(i)
            w.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
        w.commit(errors=[])


def make_output(root: Path, model: Path, units: tuple[int, ...] = (0, 1, 2),
                complete: bool = True) -> Path:
    root.mkdir(parents=True)
    rows = sorted(i for ids in UNITS.values() for i in ids)
    write_manifest(root, make_manifest(layers=LAYERS, hidden_size=HIDDEN, num_layers=4,
                                       units=UNITS, model=str(model)))
    write_inputs_table(root, rows, [sample(i) for i in rows])
    for u in units:
        write_unit(root, u)
    if complete:
        (root / COMPLETE).write_text("{}")
    return root


def spec(**overrides: Any) -> TrainSpec:
    fields = {"draft_vocab_size": 128, "batch_tokens": 48, "checkpoint_every": 2,
              "lr": 1e-3, "keep_checkpoints": 2, "epochs": 20, **overrides}
    return TrainSpec.model_validate(fields)


# ---------------------------------------------------------------------- pieces


def test_specs() -> None:
    with pytest.raises(ValueError, match="extra"):
        TrainSpec.model_validate({"epoch": 2})
    job = parse_job({"model": "m", "dataset": "d", "output": "o",
                     "train": {"epochs": 2, "lr": 3e-4}})
    assert job.train is not None and job.train.epochs == 2 and job.train.follow
    plain = JobSpec(model="m", dataset="d", output="o")
    assert job.data_fingerprint() == plain.data_fingerprint()  # training is not data
    with pytest.raises(SpecError, match=r"train\.batch_tokens"):
        parse_job({"model": "m", "dataset": "d", "output": "o", "train": {"batch_tokens": 0}})


def test_speculators_sample_layout_and_shift() -> None:
    from speculators.models.eagle3.data import shift_batch

    raw = sample(3)
    hs = torch.from_numpy(raw["hidden_states"]).to(torch.bfloat16)
    ids = torch.from_numpy(raw["input_ids"])
    mask = torch.from_numpy(raw["loss_mask"])
    got = to_speculators_sample({"hidden_states": hs, "input_ids": ids, "loss_mask": mask},
                                torch.float32)
    t = hs.shape[0]
    assert torch.equal(got["hidden_states"], hs[:, :-1].reshape(t, -1).float())
    assert torch.equal(got["verifier_last_hidden_states"], hs[:, -1].float())
    assert got["input_ids"].dtype == torch.long and got["loss_mask"].dtype == torch.bool
    shifted = shift_batch(got)
    # Token t+1 is read with the states of token t; the target is the state at t+1.
    assert torch.equal(shifted["input_ids"], ids[1:].long())
    assert torch.equal(shifted["hidden_states"], got["hidden_states"][:-1])
    assert torch.equal(shifted["verifier_last_hidden_states"], hs[1:, -1].float())


def test_token_frequencies_and_vocab_mapping(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    freqs = token_frequencies(Output(root))
    want: dict[int, int] = {}
    for i in range(18):
        s = sample(i)
        for tok in s["input_ids"][s["loss_mask"].astype(bool)]:
            want[int(tok)] = want.get(int(tok), 0) + 1
    assert dict(freqs) == want
    d2t, t2d, size = vocab_mappings(freqs, 64, 512)
    assert size == 64 and d2t is not None and t2d is not None
    chosen = (torch.arange(64) + d2t).tolist()
    top = sorted(want, key=lambda k: (-want[k], k))[:64]
    assert sorted(chosen) == sorted(top)
    assert t2d.sum() == 64 and t2d[chosen].all()
    assert vocab_mappings(freqs, 512, 512) == (None, None, 512)


def test_refusals() -> None:
    def manifest(layers: list[int], n: int) -> Any:
        return make_manifest(layers=layers, num_layers=n, hidden_size=HIDDEN, units={})

    with pytest.raises(TrainRefused, match="last layer"):
        draft_layout(manifest([1, 2, 3], 4))
    with pytest.raises(TrainRefused, match="at least one auxiliary"):
        draft_layout(manifest([4], 4))
    assert draft_layout(manifest([2, 4, 5, 8], 8)) == ([2, 4, 5], 8)


def test_draft_layer_config_is_one_vllm_serves() -> None:
    from transformers import DeepseekV3Config, LlamaConfig

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


# ---------------------------------------------------------------------- training


def test_train_checkpoints_and_resume(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    seen: list[StepMetrics] = []
    first = DraftTrainer(root, spec(max_steps=5), on_metrics=seen.append)
    state = first.run()
    assert state.step == 5 and [m.step for m in seen] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(m.loss) and len(m.acc) == 3 for m in seen)
    draft = root / DRAFT_DIR
    ckpts = sorted(p.name for p in (root / DRAFT_CHECKPOINTS).iterdir())
    assert ckpts == ["step-00000004", "step-00000005"]  # keep_checkpoints=2, final included
    newest = root / DRAFT_CHECKPOINTS / ckpts[-1]
    # draft/ holds the newest checkpoint's files (hard links), vLLM-loadable as is.
    assert os.stat(draft / "model.safetensors").st_ino == os.stat(
        newest / "model.safetensors").st_ino
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    assert config["draft_vocab_size"] == 128
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    assert not list((draft / ".tmp").iterdir())
    umask = os.umask(0)
    os.umask(umask)
    assert (draft / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert json.loads((draft / "train.json").read_text())["state"] == "done"

    from safetensors.torch import load_file

    saved = load_file(str(newest / "model.safetensors"))
    resumed = torch.load(newest / "trainer_state.pt", weights_only=False)
    assert resumed["state"]["step"] == 5 and resumed["optimizer"]["state"]
    second = DraftTrainer(root, spec(max_steps=8))
    state = second.run()
    assert second.resumed_from == 5 and state.step == 8
    lines = [json.loads(x) for x in (root / DRAFT_METRICS).read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 9))
    assert saved["fc.weight"].shape == (HIDDEN, 2 * HIDDEN)


def test_resume_drops_metrics_past_the_checkpoint(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    DraftTrainer(root, spec(max_steps=4)).run()
    with (root / DRAFT_METRICS).open("a") as f:  # a crash after step 4's checkpoint
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + '{"step": 6, "lo')
    DraftTrainer(root, spec(max_steps=6)).run()
    steps = [json.loads(x)["step"] for x in (root / DRAFT_METRICS).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_stop_checkpoints_where_it_stands(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    stop = threading.Event()

    def on_metrics(m: StepMetrics) -> None:
        if m.step == 3:
            stop.set()

    state = DraftTrainer(root, spec(epochs=50, checkpoint_every=100), on_metrics=on_metrics,
                         stop=stop).run()
    assert state.step == 3
    assert (root / DRAFT_CHECKPOINTS / "step-00000003").is_dir()
    assert json.loads((root / DRAFT_DIR / "train.json").read_text())["state"] == "stopped"


def test_follows_shards_committed_while_it_trains(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama, units=(0,), complete=False)
    trainer = DraftTrainer(root, spec(checkpoint_every=100, epochs=1), poll_interval=0.05)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(state=trainer.run()))
    thread.start()
    deadline = time.monotonic() + 120
    while trainer.first_step_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert trainer.first_step_at is not None, "no step on the first shard"
    assert thread.is_alive()  # waiting for more shards, the job not being complete
    write_unit(root, 1)
    write_unit(root, 2)
    later = time.time()
    (root / COMPLETE).write_text("{}")
    thread.join(timeout=120)
    state = result["state"]
    assert trainer.first_step_at < later
    assert state.epoch == 1  # the one epoch ended with the job
    tokens = sum(len(sample(i)["input_ids"]) - 1 for ids in UNITS.values() for i in ids)
    assert state.tokens == tokens  # every shifted token of every unit, once


def test_cli(tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_output(tmp_path / "out", tiny_llama, complete=False)
    assert main(["train", str(root)]) == 2
    assert "pass --follow" in capsys.readouterr().err
    assert main(["train", str(root), "--set", "epochs=0"]) == 2
    assert "epochs" in capsys.readouterr().err
    assert main(["train", str(root), "--set", "nonsense=1"]) == 2
    assert "unknown field" in capsys.readouterr().err
    (root / COMPLETE).write_text("{}")
    assert main(["train", str(root), "--set", "max_steps=2", "--set", "batch_tokens=48",
                 "--set", "draft_vocab_size=128"]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err  # progress goes to stderr, like `hsx extract`'s
    assert "train: step 2" in out and "trained 2 steps" in out and "eagle3" in out


def test_coordinator_status_reads_the_draft_folder(tmp_path: Path, tiny_llama: Path) -> None:
    from hsx_service.ledger import Ledger
    from hsx_service.training import Trainings

    root = make_output(tmp_path / "out", tiny_llama)
    DraftTrainer(root, spec(max_steps=3)).run()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    row = ledger.put_training("job-1", spec(max_steps=3))
    trainings = Trainings(ledger)
    status = trainings.status(row, root)
    assert [p.step for p in status.history] == [1, 2, 3]
    assert status.step == 3 and status.checkpoint_step == 3 and len(status.acc) == 3
    with (root / DRAFT_METRICS).open("a") as f:
        f.write(json.dumps({"step": 4, "loss": 0.5}) + "\n")
    assert [p.step for p in trainings.status(row, root).history] == [1, 2, 3, 4]
