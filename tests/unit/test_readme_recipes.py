"""The guides' recipes, run where they can run on the CPU.

- docs/guides/gpu-node.md, "Three targets on one 8-GPU node": each row's plan is what the
  coordinator's planner makes of that job on an 8-GPU node, word for word; each
  `inspect-model` fragment is what the preflight says of a config of that model's
  published shape (its config.json, no weights: sizes from the model cards of
  Llama-3.1-8B/70B and Kimi-K2.5).
- docs/guides/datasets.md: a ShareGPT JSON array is ingested as it is (its bad row recorded
  and skipped); one split of an UltraChat download is read without the other splits'
  rows, and the download without a split is refused naming its splits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.output import Output
from hsx.spec import JobSpec
from hsx_service.placement import ClusterShape, plan_job

ROOT = Path(__file__).resolve().parents[2]
NODE = ClusterShape(gpus=8, cpus=128)

# The GPU node guide's rows by target: the job's fields and the model's config.json shape.
TARGETS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": {
        "job": {"train": {"workers": 1}},
        "arch": "llama",
        "config": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336,
                   "vocab_size": 128256, "head_dim": 128},
    },
    "Llama-3.1-70B": {
        "job": {"tensor_parallel_size": 2, "train": {"workers": 1}},
        "arch": "llama",
        "config": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "intermediate_size": 28672,
                   "vocab_size": 128256, "head_dim": 128},
    },
    "Kimi-K2.5": {
        "job": {"tensor_parallel_size": 8, "trust_remote_code": True, "train": {"workers": 1}},
        "arch": "kimi_k25",
        "text_config": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
                        "n_routed_experts": 384, "moe_intermediate_size": 2048,
                        "intermediate_size": 18432, "num_attention_heads": 64,
                        "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
                        "first_k_dense_replace": 1, "qk_nope_head_dim": 128,
                        "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts_per_tok": 8,
                        "n_shared_experts": 1},
    },
}


def readme_rows() -> dict[str, list[str]]:
    """The GPU node table: target name -> its cells."""
    text = (ROOT / "docs" / "guides" / "gpu-node.md").read_text()
    section = text.split("## Three targets on one 8-GPU node", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in TARGETS:
            if line.startswith("|") and cells[0].startswith(name):
                rows[name] = cells
    assert rows.keys() == TARGETS.keys(), rows.keys()
    return rows


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_plans_are_the_planners(name: str) -> None:
    spec = JobSpec(model="m", dataset="d.jsonl", output="/o", **TARGETS[name]["job"])
    summary = plan_job(spec, NODE).summary
    assert summary == f"8 GPUs: {readme_rows()[name][2]}"


def test_what_inspect_model_says_of_each_shape(tmp_path: Path) -> None:
    from hsx_workers.preflight import inspect_model
    from hsx_workers.preflight.report import format_report
    from hsx_workers.tiny_models import make_tiny_model

    rows = readme_rows()
    for name, target in TARGETS.items():
        path = make_tiny_model(tmp_path / name, target["arch"], num_layers=2)
        config = json.loads((path / "config.json").read_text())
        config.update(target.get("config", {}))
        config.get("text_config", {}).update(target.get("text_config", {}))
        (path / "config.json").write_text(json.dumps(config))
        said = " ".join(format_report(inspect_model(
            str(path), tensor_parallel_size=spec_tp(target))).split())
        for fragment in re.findall(r"`([^`]+)`", rows[name][3]):
            assert fragment in said, (name, fragment, said)


def spec_tp(target: dict[str, Any]) -> int:
    return int(target["job"].get("tensor_parallel_size", 1))


def _ingest(dataset: Any, tiny_llama: Path, out: Path) -> tuple[Any, Output]:
    from hsx.ingest import ingest

    output = Output(out)
    return ingest(dataset, str(tiny_llama), 256, output), output


def test_a_sharegpt_json_array_is_read_as_it_is(tmp_path: Path, tiny_llama: Path) -> None:
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "hello there"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "and you?"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "2+2"},
                                          {"from": "gpt", "value": "4"}]}]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(rows))
    result, output = _ingest(dataset, tiny_llama, tmp_path / "out")
    assert (result.num_rows, result.num_samples, result.num_errors) == (3, 2, 1)
    (error,) = output.ingest_errors().to_pylist()
    assert error["sample_index"] == 1 and "assistant" in error["reason"]


def test_one_split_of_an_ultrachat_download(tmp_path: Path, tiny_llama: Path) -> None:
    """`{path: ultrachat_200k, split: train_sft}` on the folder `hf download` leaves:
    that split's rows only; without a split, refused with the splits and what to write."""
    from hsx.ingest import DatasetFormatError
    from hsx.spec import DatasetSpec

    root = tmp_path / "ultrachat_200k"
    data = root / "data"
    data.mkdir(parents=True)

    def chats(split: str, n: int) -> pa.Table:
        return pa.table({"prompt": [f"{split} {i}" for i in range(n)], "messages": [
            [{"role": "user", "content": f"{split} question {i}"},
             {"role": "assistant", "content": f"{split} answer {i}"}] for i in range(n)]})

    for split, files in (("train_sft", 3), ("test_sft", 1), ("train_gen", 1)):
        for k in range(files):
            pq.write_table(chats(split, 4), data / f"{split}-0000{k}-of-0000{files}.parquet")
    chosen = DatasetSpec(path=str(root), split="train_sft")
    result, _ = _ingest(chosen, tiny_llama, tmp_path / "out")
    assert (result.num_samples, result.num_errors) == (12, 0)  # train_sft's rows only
    with pytest.raises(DatasetFormatError, match=r"has splits .*train_sft.*split:"):
        _ingest(str(root), tiny_llama, tmp_path / "out2")
