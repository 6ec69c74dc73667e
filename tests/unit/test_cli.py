"""Bad jobs are refused before any engine starts, with a message that names the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx.spec import JobSpec
from hsx_service import engine_pool, runner
from hsx_service.errors import JobRefused
from hsx_workers.tiny_models import ChatDataset

HSX = [sys.executable, "-m", "hsx.cli"]


def _hsx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HSX, *args], capture_output=True, text=True, timeout=120)


def _job(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A config-only model folder: enough for every check that runs before engines."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
        '"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 512}'
    )
    return model


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "hello"}\n')
    return path


@pytest.fixture
def no_engines(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails the test if anything tries to start Ray or an engine."""
    started: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        started.append("engine")
        raise AssertionError("an engine was started for a job that should be refused")

    monkeypatch.setattr(engine_pool.EnginePool, "slots", refuse)
    monkeypatch.setattr(runner, "connect_ray", refuse)
    return started


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layers": [1, 9]}, r"layers: ids \[9\] are outside 0..4"),
        ({"model": "/nonexistent/model"}, "model: directory /nonexistent/model does not exist"),
        ({"dataset": "/nonexistent/data.jsonl"}, "dataset: /nonexistent/data.jsonl does not exist"),
        ({"engine": "hf", "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"output": "ftp://bucket/x"}, "output: unsupported storage URI 'ftp://bucket/x'"),
    ],
)
def test_refused_before_any_engine(
    fields: dict[str, Any], message: str, model_dir: Path, dataset: Path, tmp_path: Path,
    no_engines: list[str],
) -> None:
    spec = JobSpec(**{"model": str(model_dir), "dataset": str(dataset),
                      "output": str(tmp_path / "out"), **fields})
    with pytest.raises(JobRefused, match=message):
        runner.run_job(spec)
    assert no_engines == []
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_unwritable_output_is_refused(
    model_dir: Path, dataset: Path, tmp_path: Path, no_engines: list[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spec = JobSpec(model=str(model_dir), dataset=str(dataset), output=str(blocker / "out"))
    with pytest.raises(JobRefused, match="is not writable"):
        runner.run_job(spec)


def test_output_of_another_job_is_refused(
    tiny_tokenizer: Path, tmp_path: Path, chat_dataset: ChatDataset, no_engines: list[str]
) -> None:
    # A config next to the tokenizer makes a model folder that ingestion can use.
    (tiny_tokenizer / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 256}'
    )
    from hsx_service.prepare import prepare

    out = tmp_path / "out"
    first = JobSpec(model=str(tiny_tokenizer), dataset=str(chat_dataset.path), output=str(out),
                    layers=[1, 4], max_seq_len=128)
    job = prepare(first, stream=False)
    assert job.samples_total == len(chat_dataset.good_indices)
    assert prepare(first, stream=False).manifest == job.manifest  # found again, not redone
    with pytest.raises(JobRefused, match="already holds a different job"):
        prepare(first.model_copy(update={"layers": [2, 4]}), stream=False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replica": 2}, "replica: unknown field"),
        ({"layers": [1, 9]}, r"layers: ids \[9\] are outside 0..4"),
        ({"storage_dtype": "fp4"}, "storage_dtype"),
    ],
)
def test_cli_exits_2_with_the_reason(
    fields: dict[str, Any], message: str, model_dir: Path, dataset: Path, tmp_path: Path
) -> None:
    job = _job(tmp_path, model=str(model_dir), dataset=str(dataset),
               output=str(tmp_path / "out"), **fields)
    result = _hsx("extract", str(job), "--no-progress")
    assert result.returncode == 2, result.stderr
    assert "hsx: error:" in result.stderr
    import re

    assert re.search(message, " ".join(result.stderr.split())), result.stderr
    assert "Ray" not in result.stderr  # refused before Ray was started


def test_cli_missing_job_file(tmp_path: Path) -> None:
    result = _hsx("extract", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "cannot read job file" in result.stderr


def test_import_hsx_stays_light() -> None:
    code = (
        "import sys, hsx, hsx.spec, hsx.output, hsx.dataset, hsx.ingest, hsx.cli, "
        "hsx.plan, hsx.progress, hsx.modelinfo; hsx.HiddenStatesDataset; hsx.JobSpec; "
        "hsx.Client; print(','.join(m for m in ('torch', 'vllm', 'ray', 'transformers', "
        "'fastapi', 'uvicorn', 'hsx_service') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
