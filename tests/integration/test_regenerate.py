"""Regeneration with a real vLLM CPU engine: the target answers, then its answers are captured.

- One job (`turns: last`) on the shared chat dataset: the answers come from the engine
  and differ from the dataset's, the shard's token ids are the chat template of the
  regenerated conversation, truncation is flagged, every row is accounted for once, and
  each turn's seed is the one derived from the job seed and the sample.
- Another unit plan of the same job answers every sample token for token the same.
- `turns: each` on multi-turn chats: every assistant turn is answered, in order.
- `hsx extract` killed -9 mid-job, then rerun: every regeneration committed before the
  kill is byte-identical afterwards, and every row is in the output exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx.dataset import HiddenStatesDataset
from hsx.ingest import NOT_A_CHAT, load_tokenizer, tokenize_conversations
from hsx.output import Output
from hsx.output.layout import COMMITS_DIR
from hsx.progress import JobProgress
from hsx.regenerate import sample_seed
from hsx_service.dispatch import DispatchHooks
from hsx_service.runner import run_job
from hsx_workers.tiny_models import ChatDataset, make_chat_dataset

from .helpers import kill_tree

pytestmark = pytest.mark.integration

REGEN = {"max_tokens": 8, "temperature": 0.8, "top_p": 0.95, "seed": 7}


def _regenerations(output: Path) -> dict[int, dict[str, Any]]:
    """sample_index -> its regeneration, asserting no sample appears twice."""
    out = Output(output)
    rows: dict[int, dict[str, Any]] = {}
    for record in out.commits():
        table = out.read_regenerations(record)
        assert table is not None, f"unit {record.unit} has no regenerations"
        for row in table.to_pylist():
            assert row["sample_index"] not in rows
            rows[row["sample_index"]] = row
    return rows


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory, make_job: Any,
                engine_pool: Any) -> tuple[Path, list[JobProgress]]:
    output = tmp_path_factory.mktemp("regen") / "last"
    seen: list[JobProgress] = []
    run_job(make_job(output, regenerate=REGEN), pool=engine_pool,
            hooks=DispatchHooks(on_progress=seen.append))
    return output, seen


def test_answers_come_from_the_engine_and_states_are_captured_over_them(
    regenerated: tuple[Path, list[JobProgress]], tiny_llama: Path, chat_dataset: ChatDataset
) -> None:
    output, progress = regenerated
    ds = HiddenStatesDataset(output, backend="numpy")
    tokenizer = load_tokenizer(str(tiny_llama))
    reasons = {e["sample_index"]: e["reason"] for e in ds.errors()}
    errors = set(reasons)
    captured = [int(ds[i]["sample_index"]) for i in range(len(ds))]
    # Every row exactly once: a sample, or an error (the dataset's bad rows).
    assert len(set(captured)) == len(captured)
    assert sorted(captured + sorted(errors)) == list(range(chat_dataset.num_rows))
    assert errors >= set(chat_dataset.bad)
    # A conversation whose history already fills max_seq_len leaves no room to answer.
    for index in errors - set(chat_dataset.bad):
        assert "no room to answer within max_seq_len" in reasons[index]

    differ = 0
    for i in range(len(ds)):
        sample = ds[i]
        regen = sample["regeneration"]
        original = regen["original"]
        assert original == chat_dataset.rows[int(sample["sample_index"])]["messages"]
        last = max(j for j, m in enumerate(original) if m["role"] == "assistant")
        assert regen["messages"][:last] == original[:last]
        assert len(regen["messages"]) == last + 1
        differ += regen["messages"][last]["content"] != original[last]["content"]
        assert regen["seeds"] == [sample_seed(REGEN["seed"], int(sample["sample_index"]), 0)]
        # What the shard holds is the template of the regenerated conversation.
        ids, mask = tokenize_conversations(tokenizer, [regen["messages"]], 256)[0]
        assert sample["input_ids"].tolist() == ids.tolist()
        assert sample["loss_mask"].tolist() == mask.tolist()
        assert sample["hidden_states"].shape[0] == len(ids)
        assert regen["truncated"] == ("length" in regen["finish_reasons"])
        assert 0 < regen["generated_tokens"] <= REGEN["max_tokens"]
    assert differ == len(ds)  # a random model does not write the dataset's answers

    rows = _regenerations(output)
    # A random-weight model rarely ends a turn within 8 tokens: those are flagged.
    assert sum(r["truncated"] for r in rows.values()) > len(rows) // 2
    totals = Output(output).totals()
    assert totals.generated == len(ds)
    assert totals.generated_tokens == sum(r["generated_tokens"] for r in rows.values())
    assert progress[-1].samples_generated == len(ds)
    assert progress[-1].tokens_generated == totals.generated_tokens
    provenance = json.loads(Output(output).read_regenerations(ds.records[0])
                            .schema.metadata[b"hsx.regenerate"])
    assert provenance["model"] == str(tiny_llama)
    assert provenance["temperature"] == REGEN["temperature"]
    assert provenance["seed"] == REGEN["seed"]


def test_another_unit_plan_gives_every_sample_the_same_answer(
    regenerated: tuple[Path, list[JobProgress]], tmp_path: Path, make_job: Any,
    engine_pool: Any,
) -> None:
    """A turn's seed depends on the sample, not on its unit or batch: units of another
    size (other batches in the engine) answer token for token the same. vLLM's CPU
    build broke this (15 of 199 equal) until hsx fixed its sampling under capture
    (compat.fix_cpu_sampling_constraints)."""
    first = _regenerations(regenerated[0])
    output = tmp_path / "other-plan"
    run_job(make_job(output, regenerate=REGEN, unit_tokens=1024), pool=engine_pool)
    second = _regenerations(output)
    assert len(Output(output).commits()) > len(Output(regenerated[0]).commits())
    assert set(second) == set(first)
    differ = [i for i in first if first[i]["messages"] != second[i]["messages"]]
    assert not differ, f"{len(differ)} of {len(first)} answers differ, e.g. sample {differ[0]}"


def test_each_turn_is_answered_in_order(
    tmp_path: Path, make_job: Any, engine_pool: Any, chat_dataset: ChatDataset
) -> None:
    multi = [r for r in chat_dataset.rows
             if isinstance(r, dict) and sum(m["role"] == "assistant"
                                            for m in r.get("messages", [])) > 1][:12]
    dataset = tmp_path / "multi.jsonl"
    rows = [*multi, {"prompt": "a prompt is no conversation"}]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "each"
    run_job(make_job(output, dataset=str(dataset), regenerate={**REGEN, "turns": "each"}),
            pool=engine_pool)
    ds = HiddenStatesDataset(output, backend="numpy")
    assert len(ds) == len(multi)
    assert ds.errors() == [{"sample_index": len(multi), "reason": NOT_A_CHAT}]
    for i in range(len(ds)):
        sample = ds[i]
        index = int(sample["sample_index"])
        regen = sample["regeneration"]
        original = multi[index]["messages"]
        turns = [j for j, m in enumerate(original) if m["role"] == "assistant"]
        assert len(regen["finish_reasons"]) == len(turns)
        assert regen["seeds"] == [sample_seed(REGEN["seed"], index, k) for k in range(len(turns))]
        for j, message in enumerate(regen["messages"]):
            assert message["role"] == original[j]["role"]
            if message["role"] == "assistant":
                assert message["content"] != original[j]["content"]
            else:
                assert message["content"] == original[j]["content"]


# ----------------------------------------------------------------------------- crash

HSX = [sys.executable, "-m", "hsx.cli"]


def _start(job: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([*HSX, "extract", str(job), "--no-progress", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def _digests(output: Path) -> dict[int, tuple[str, str]]:
    """unit -> (its regenerations table's key, sha256 of its bytes), committed units."""
    out = Output(output)
    return {r.unit: (r.regenerations.key, hashlib.sha256(
        (output / r.regenerations.key).read_bytes()).hexdigest())
        for r in out.commits() if r.regenerations is not None}


def test_kill_mid_job_then_rerun_keeps_committed_regenerations(
    tmp_path: Path, tiny_llama: Path
) -> None:
    # 60 rows (2 bad) in units of 512 tokens: enough units that the kill lands mid-job,
    # few enough that the two runs' answers take little of CI's time.
    chat_dataset = make_chat_dataset(tmp_path / "chat.jsonl", n=60, seed=5, bad_rows=2)
    output = tmp_path / "killed"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": str(tiny_llama), "dataset": str(chat_dataset.path), "output": str(output),
        "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 512,
        "regenerate": REGEN,
        "ray_address": "local",  # never join another test's Ray on this machine
    }))
    proc = _start(job)
    try:
        deadline = time.monotonic() + 300
        while len(list((output / COMMITS_DIR).glob("*.json"))) < 2:
            if proc.poll() is not None:
                raise AssertionError(f"hsx extract ended early: {proc.communicate()}")
            if time.monotonic() > deadline:
                raise AssertionError("no unit committed in time")
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    before = _digests(output)
    units = len(Output(output).manifest().units)
    assert 2 <= len(before) < units, "the kill should land mid-job"

    rerun = _start(job)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert not summary["nothing_to_do"]
    after = _digests(output)
    assert len(after) == units
    for unit, digest in before.items():
        assert after[unit] == digest, f"unit {unit}'s regenerations changed"
    # No table but the committed ones is left, and every row is there exactly once.
    stored = {p.name for p in (output / "regenerations").iterdir()}
    assert stored == {Path(key).name for key, _ in after.values()}
    ds = HiddenStatesDataset(output, backend="numpy")
    captured = [int(ds[i]["sample_index"]) for i in range(len(ds))]
    assert len(set(captured)) == len(captured)
    errors = {e["sample_index"] for e in ds.errors()}
    assert not errors & set(captured)
    assert sorted([*captured, *errors]) == list(range(chat_dataset.num_rows))
    assert sorted(_regenerations(output)) == sorted(captured)
