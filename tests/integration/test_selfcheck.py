"""The self-check end to end: wrong states put in on purpose (HSX_FAULT_STATES, read by
the driver and passed with each unit to the session's shared engines) fail the job in
its first unit, with a message naming the sample and the layer; `checks: warn` goes on
and records them. A correct job's checks are asserted in test_extract.py (its reference
run checks every sample)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output
from hsx_service.errors import JobFailed
from hsx_service.runner import run_job
from hsx_workers.state_faults import ENV
from hsx_workers.tiny_models import ChatDataset

pytestmark = pytest.mark.integration

ROWS = 120  # two units of the tiny job (unit_tokens 4096): a fault stops the second too


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory, chat_dataset: ChatDataset) -> Path:
    """The first ROWS rows of the session's chat dataset: a job of two units, tokenized
    in a moment (the engines are the session's: the same engine config)."""
    path = tmp_path_factory.mktemp("selfcheck") / "rows.jsonl"
    lines = chat_dataset.path.read_text().splitlines(keepends=True)[:ROWS]
    path.write_text("".join(lines))
    return path


def _faulty_sample(chat_dataset: ChatDataset) -> int:
    return [i for i in chat_dataset.good_indices if i < ROWS][5]  # in the first unit


@pytest.mark.parametrize("fault, words", [
    ("zeros", ["all zeros"]),
    ("nan:{sample}", ["NaN or inf", "layer 3"]),
    ("copy_layer", ["layers 1 and 2 hold identical states"]),
    ("scale:1e4:{sample}", ["times the job's first samples'"]),
    ("scale:1e9", ["median row RMS"]),
    ("postnorm", ["layer 4", "after the final norm"]),
    ("swap", ["layer 4", "agrees with the engine's own next token"]),
])
def test_wrong_states_fail_the_job_in_its_first_unit(
    tmp_path: Path, make_job: Any, engine_pool: Any, small_dataset: Path,
    chat_dataset: ChatDataset, monkeypatch: pytest.MonkeyPatch, fault: str,
    words: list[str],
) -> None:
    sample = _faulty_sample(chat_dataset)
    monkeypatch.setenv(ENV, fault.format(sample=sample))
    spec = make_job(tmp_path / "out", engine="vllm", dataset=str(small_dataset))
    with pytest.raises(JobFailed) as caught:
        run_job(spec, pool=engine_pool, max_attempts=3)
    message = str(caught.value)
    # Units 0 and 1 are on the engine together (the order of Ray's calls decides which
    # computes first): the one that tripped names itself, the other is stopped with it.
    assert message.startswith(("unit 0: self-check failed", "unit 1: self-check failed")), \
        message
    assert "sample " in message and "layer" in message, message
    if "{sample}" in fault:
        assert f"sample {sample} " in message, message
    for word in words:
        assert word in message, message
    # The unit that tripped is not committed and left no shard; the other unit was
    # stopped with it, unless it had computed first (a fault in one sample: its states
    # are right) and committed whole. Every shard there is a committed one.
    output = Output(tmp_path / "out")
    committed = output.committed_units()
    tripped = int(message.split(":")[0].removeprefix("unit "))
    assert tripped not in committed and committed <= {0, 1}
    if "{sample}" not in fault and fault != "swap":
        assert committed == set()
    shards = {p.name for p in (tmp_path / "out").glob("shards/*")}
    assert shards == {Path(output.read_commit(u).shard).name for u in committed}


def test_checks_warn_completes_and_records_what_it_found(
    tmp_path: Path, make_job: Any, engine_pool: Any, small_dataset: Path,
    chat_dataset: ChatDataset, monkeypatch: pytest.MonkeyPatch,
) -> None:
    sample = _faulty_sample(chat_dataset)
    monkeypatch.setenv(ENV, f"nan:{sample}")
    spec = make_job(tmp_path / "out", engine="vllm", dataset=str(small_dataset),
                    checks="warn")
    summary = run_job(spec, pool=engine_pool)
    assert summary.check_problems == 1
    good = [i for i in chat_dataset.good_indices if i < ROWS]
    assert summary.samples_checked == summary.samples == len(good)
    ds = HiddenStatesDataset(tmp_path / "out")
    assert ds.complete and ds.manifest.checks == {
        "mode": "warn",
        "checks": ["nonfinite", "zero", "identical", "scale", "prenorm", "agreement"]}
    found = [f for r in ds.records for f in (r.checks.found if r.checks else [])]
    assert len(found) == 1 and f"sample {sample} " in found[0] and "NaN" in found[0]
    complete = json.loads((tmp_path / "out" / "complete.json").read_text())
    assert complete["checks"]["mode"] == "warn"
    assert complete["checks"]["samples"] == len(good) and complete["checks"]["problems"] == 1
    assert complete["checks"]["head_rows"] >= 8 * 16
    assert complete["checks"]["head_agreed"] >= 0.98 * complete["checks"]["head_rows"]


def test_checks_off_checks_nothing(
    tmp_path: Path, make_job: Any, engine_pool: Any, small_dataset: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "zeros")
    spec = make_job(tmp_path / "out", engine="vllm", dataset=str(small_dataset),
                    checks="off")
    summary = run_job(spec, pool=engine_pool)
    assert summary.samples > 0 and summary.samples_checked == 0
    manifest = HiddenStatesDataset(tmp_path / "out").manifest
    assert manifest.checks == {"mode": "off", "checks": []}
