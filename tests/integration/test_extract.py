"""Extraction end to end with real vLLM CPU engines in real Ray actors.

One bf16 vLLM run is the reference that the other runs (hf engine, two replicas, fp8,
a rerun) are compared against; all share the session's engine pool.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output
from hsx.progress import JobProgress
from hsx_service.dispatch import DispatchHooks
from hsx_service.runner import JobSummary, run_job
from hsx_workers.tiny_models import ChatDataset

from .helpers import by_sample, relative_error, snapshot

pytestmark = pytest.mark.integration

# Words that the reason of each kind of bad row must contain.
REASON_WORDS = {
    "malformed_json": "json",
    "empty_messages": "empty",
    "unknown_role": "role",
    "no_assistant": "assistant",
    "no_field": "field",
}


@dataclass
class Run:
    output: Path
    summary: JobSummary
    progress: list[dict[str, Any]]


def _run(spec: Any, pool: Any) -> Run:
    seen: list[dict[str, Any]] = []

    def on_progress(p: JobProgress) -> None:
        seen.append(p.as_dict())

    summary = run_job(spec, pool=pool, hooks=DispatchHooks(on_progress=on_progress))
    return Run(Path(spec.output), summary, seen)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory, make_job: Any, engine_pool: Any) -> Run:
    out = tmp_path_factory.mktemp("vllm-bf16") / "out"
    return _run(make_job(out, engine="vllm"), engine_pool)


@pytest.fixture(scope="module")
def vllm_samples(vllm_run: Run) -> dict[int, dict[str, torch.Tensor]]:
    return by_sample(vllm_run.output)


def _same_samples(got: dict[int, Any], ref: dict[int, Any]) -> None:
    """The same samples, tokens and masks as the reference run, and its states: the same
    engine config, but batches differ between runs, so bf16 rounding is allowed."""
    assert sorted(got) == sorted(ref)
    for index, sample in got.items():
        assert torch.equal(sample["input_ids"], ref[index]["input_ids"])
        assert torch.equal(sample["loss_mask"], ref[index]["loss_mask"])
        assert relative_error(sample["hidden_states"],
                              ref[index]["hidden_states"]).max() < 1e-2


def test_every_good_row_is_in_exactly_one_shard(
    vllm_run: Run, vllm_samples: dict[int, Any], chat_dataset: ChatDataset
) -> None:
    ds = HiddenStatesDataset(vllm_run.output)
    assert ds.complete
    assert len(ds.records) > 1, "the job should span several units"
    assert sorted(vllm_samples) == chat_dataset.good_indices
    assert vllm_run.summary.samples == len(chat_dataset.good_indices) >= 200
    # Every bad row is in errors() with a reason that names its problem.
    errors = {e["sample_index"]: e["reason"] for e in ds.errors()}
    assert set(errors) == set(chat_dataset.bad)
    for index, kind in chat_dataset.bad.items():
        assert REASON_WORDS[kind] in errors[index].lower(), (kind, errors[index])
    assert ds.verify() == len(ds.records)
    # Inputs travel with the data: the shards' tokens are the ingested ones.
    inputs = Output(vllm_run.output).inputs()
    rows = dict(zip(inputs.column("sample_index").to_pylist(),
                    inputs.column("input_ids").to_pylist(), strict=True))
    for index, sample in vllm_samples.items():
        assert sample["input_ids"].tolist() == rows[index]
        assert sample["hidden_states"].shape == (len(rows[index]), 4, 256)
    assert ds.manifest.layers == [1, 2, 3, 4]
    assert ds.manifest.num_layers == 4
    # The self-check (on by default) looked at every sample and found nothing wrong.
    assert ds.manifest.checks is not None and ds.manifest.checks["mode"] == "on"
    assert all(r.checks is not None and r.checks.samples == r.samples
               and r.checks.problems == 0 for r in ds.records)
    assert vllm_run.summary.samples_checked == vllm_run.summary.samples
    assert vllm_run.progress[-1]["samples_checked"] == vllm_run.summary.samples
    # Its head check took the engine's first 8 requests: lm_head(norm(h_N)) gives the
    # engine's own next token on the rows compared (up to bf16 near-ties).
    summary = vllm_run.summary
    assert sum(r.checks.head_samples for r in ds.records if r.checks) >= 8
    assert summary.head_rows_checked >= 8 * 16
    assert summary.head_rows_agreed >= 0.98 * summary.head_rows_checked
    assert all(r.checks.head_missing == "" for r in ds.records if r.checks)
    assert vllm_run.progress[-1]["head_rows_checked"] == summary.head_rows_checked
    # Provenance: which libraries and engine arguments computed the states, on which config.
    provenance = ds.manifest.provenance or {}
    assert provenance["versions"]["vllm"] and provenance["versions"]["torch"]
    assert set(provenance["versions"]) == {"vllm", "torch", "transformers", "speculators",
                                           "hsx"}
    assert provenance["engine_args"]["max_seq_len"] == 256
    config = (Path(ds.manifest.model) / "config.json").read_bytes()
    assert provenance["model_config_sha256"] == hashlib.sha256(config).hexdigest()


def test_lengths_are_mixed(vllm_samples: dict[int, Any]) -> None:
    lengths = [len(s["input_ids"]) for s in vllm_samples.values()]
    assert min(lengths) < 64 and max(lengths) == 256  # some rows were truncated at 256


def test_rerun_does_nothing(vllm_run: Run, make_job: Any, engine_pool: Any) -> None:
    before = snapshot(vllm_run.output)
    summary = run_job(make_job(vllm_run.output, engine="vllm"), pool=engine_pool)
    assert summary.nothing_to_do
    assert summary.samples == vllm_run.summary.samples
    assert snapshot(vllm_run.output) == before


def test_units_start_while_the_dataset_is_tokenized(
    tmp_path: Path, make_job: Any, engine_pool: Any, vllm_samples: dict[int, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dataset in parts of 32 samples, and the ingestion held after its first part
    (before it publishes the second) until a unit is committed: the job's first units
    run while the rest of its rows are still tokenized, its progress shows both, and the
    plan is the one `plan_units` makes of the whole table (ramping up from the first
    unit's tokens, as ingest.json records), so the samples are the reference run's. This
    process never loads the tokenizer: a child of its own tokenizes (hsx.ingest.bounded)."""
    import threading

    import hsx.plan
    from hsx.ingest import pipeline
    from hsx.plan import plan_units

    monkeypatch.setattr(pipeline, "ROWS_PER_PART", 32)
    monkeypatch.setattr(hsx.plan, "FIRST_UNIT_TOKENS", 256)
    from hsx.ingest import slices

    monkeypatch.setattr(slices, "_WORKER_TOKENIZER", {})
    committed = threading.Event()
    held: list[bool] = []
    publish = Output.publish_part

    def hold_then_publish(self: Output, record: Any) -> None:
        if record.part == 1:  # in the ingestion's thread: the job goes on without it
            held.append(committed.wait(timeout=900))
        publish(self, record)

    monkeypatch.setattr(Output, "publish_part", hold_then_publish)
    planned: list[tuple[int, bool, bool]] = []  # (units, ingested, a unit committed yet)
    seen: list[JobProgress] = []
    spec = make_job(tmp_path / "out", engine="vllm", unit_tokens=1024)
    summary = run_job(spec, pool=engine_pool, hooks=DispatchHooks(
        on_unit_done=lambda _report: committed.set(),
        on_planned=lambda _job, units, done: planned.append(
            (len(units), done, committed.is_set())),
        on_progress=seen.append))
    assert held == [True], "no unit was committed while the ingestion waited"
    assert planned[-1][1] and not planned[0][1]  # units came before the plan was whole
    assert any(p.ingesting and p.units_done > 0 and p.rows_tokenized > 0 for p in seen)
    out = Output(spec.output)
    records = out.part_records()
    assert len(records) > 3 and records[-1].last
    lengths = out.inputs().column("length").to_pylist()
    record = out.read_ingest_record()
    assert record is not None and record.first_unit_tokens == 256
    assert out.manifest().work_units == plan_units(lengths, 1024, 256)
    assert plan_units(lengths, 1024, 256) != plan_units(lengths, 1024)  # it ramped
    assert summary.shards == len(out.manifest().units)
    assert not slices._WORKER_TOKENIZER  # the rows were tokenized by the child
    _same_samples(by_sample(Path(spec.output)), vllm_samples)


def test_vllm_equals_hf_reference(
    tmp_path: Path, make_job: Any, engine_pool: Any, vllm_samples: dict[int, Any]
) -> None:
    hf = _run(make_job(tmp_path / "hf", engine="hf"), engine_pool)
    hf_samples = by_sample(hf.output)
    assert sorted(hf_samples) == sorted(vllm_samples)
    worst = torch.zeros(4)
    for index, ref in hf_samples.items():
        got = vllm_samples[index]
        assert torch.equal(got["input_ids"], ref["input_ids"])
        worst = torch.maximum(worst, relative_error(got["hidden_states"], ref["hidden_states"]))
    # bf16 both sides; measured ~0.4-0.9% here. Layer N must be pre-norm on both sides,
    # or it would be off by far more than this.
    assert worst.max().item() < 1e-2, f"max relative error per layer {worst.tolist()}"
    # The hf engine's head check compares with its own logits.
    assert hf.summary.head_rows_checked >= 8 * 16
    assert hf.summary.head_rows_agreed >= 0.98 * hf.summary.head_rows_checked


@pytest.mark.slow  # make test-slow; test_service's jobs run 2 replicas
def test_two_replicas_run_at_once_and_yield_the_same_data(
    tmp_path: Path, make_job: Any, engine_pool: Any, vllm_samples: dict[int, Any]
) -> None:
    spec = make_job(tmp_path / "two", engine="vllm", replicas=2, unit_tokens=1024)
    # Both engines warm first: a warm engine would otherwise finish this small job alone
    # while the second one is still starting.
    engine_pool.start(spec)
    run = _run(spec, engine_pool)
    busy_at_once = max(
        sum(state == "busy" for state in p["workers"].values()) for p in run.progress
    )
    assert busy_at_once == 2, "both engines should have worked at the same time"
    _same_samples(by_sample(run.output), vllm_samples)


def test_fp8_round_trip_and_half_size(
    tmp_path: Path, make_job: Any, engine_pool: Any, vllm_run: Run, vllm_samples: dict[int, Any]
) -> None:
    run = _run(make_job(tmp_path / "fp8", engine="vllm", storage_dtype="fp8"), engine_pool)
    # The head check on fp8 states, dequantized: agreement as with bf16.
    print("fp8 head agreement", run.summary.head_rows_agreed, run.summary.head_rows_checked)
    assert run.summary.head_rows_agreed >= 0.98 * run.summary.head_rows_checked > 0
    ds = HiddenStatesDataset(run.output)
    assert ds.manifest.storage_dtype == "fp8"
    fp8 = by_sample(run.output)
    assert sorted(fp8) == sorted(vllm_samples)
    worst = 0.0
    for index, sample in fp8.items():
        ref = vllm_samples[index]["hidden_states"]
        # e4m3 keeps 3 mantissa bits: a per-token relative error of a few percent.
        err = (sample["hidden_states"] - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
        worst = max(worst, err.max().item())
    assert worst < 0.06, worst
    ratio = run.summary.bytes / vllm_run.summary.bytes
    assert 0.45 < ratio < 0.6, ratio


@pytest.mark.slow  # make test-slow; TP=2 runs on GPUs in tests/gpu
def test_tensor_parallel_engine_yields_the_same_data(
    tmp_path: Path, make_job: Any, engine_pool: Any, vllm_samples: dict[int, Any]
) -> None:
    # TP=2 on CPU: one placement-group bundle of 2 CPUs, vLLM's multiprocessing executor
    # with one thread-bound process per rank; only rank 0 writes states.
    run = _run(make_job(tmp_path / "tp2", engine="vllm", tensor_parallel_size=2), engine_pool)
    tp2 = by_sample(run.output)
    assert sorted(tp2) == sorted(vllm_samples)
    worst = torch.zeros(4)
    for index, sample in tp2.items():
        ref = vllm_samples[index]
        assert torch.equal(sample["input_ids"], ref["input_ids"])
        worst = torch.maximum(worst, relative_error(sample["hidden_states"],
                                                    ref["hidden_states"]))
    assert worst.max().item() < 1e-2, worst.tolist()


def test_hsx_extract_trains_the_draft_of_a_job_with_train(
    vllm_run: Run, make_job: Any, tmp_path: Path
) -> None:
    """`hsx extract job.yaml` with a `train:` section: the extraction (here already
    complete: nothing to extract, no engine started), then the draft trained on it in
    the same command, resumable, its plan and result printed."""
    import json
    import subprocess
    import sys

    import yaml

    from hsx.output.layout import DRAFT_DIR

    output = tmp_path / "out"
    subprocess.run(["cp", "-al", str(vllm_run.output), str(output)], check=True)
    spec = make_job(output, engine="vllm", train={
        "steps": 4, "batch_tokens": 256, "checkpoint_every": 2, "draft_vocab_size": 64,
        "eval_prompts": 0})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True)))
    done = subprocess.run([sys.executable, "-m", "hsx.cli", "extract", str(job),
                           "--no-progress"], capture_output=True, text=True, timeout=600,
                          check=False)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "nothing to do" in text and "plan: 4 steps of 256 tokens" in text, text[-3000:]
    assert "trained 4 steps" in text, text[-3000:]
    state = json.loads((output / DRAFT_DIR / "train.json").read_text())
    assert state["state"] == "done" and state["step"] == 4
    assert (output / DRAFT_DIR / "model.safetensors").exists()


def test_the_exported_post_norm_state_is_transformers_final_state(
    vllm_run: Run, tiny_llama: Path, tmp_path: Path
) -> None:
    """`hsx export --format specforge --method dspark` on a real vLLM capture: its
    `target_last_hidden_states` (the final norm, read from the checkpoint, applied to the
    captured id N) equals transformers' final hidden state, the one after the norm that
    the head reads (and SpecForge's own capture stores), to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from hsx.export import export_output

    dest = tmp_path / "specforge"
    summary = export_output(vllm_run.output, dest, fmt="specforge", method="dspark")
    indices = json.loads((dest / "hsx_sample_index.json").read_text())
    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    normed: dict[str, torch.Tensor] = {}
    model.model.norm.register_forward_hook(lambda _m, _a, out: normed.__setitem__("h", out))
    worst = 0.0
    for i in range(summary.samples):
        group = i // 2000 * 2000
        raw = torch.load(dest / f"rows_{group}-{group + 2000}" / f"data_{i}.ckpt")
        with torch.no_grad():
            out = model(input_ids=raw["input_ids"][None], output_hidden_states=True)
        want = normed["h"][0]  # norm(h_N), the final norm's own output
        assert torch.equal(out.hidden_states[-1][0], want)  # transformers' last state
        got = raw["target_last_hidden_states"][0].float()
        worst = max(worst, float((got - want).norm() / want.norm()))
    assert sorted(indices) == indices and len(indices) == summary.samples
    assert worst < 1e-2, worst
