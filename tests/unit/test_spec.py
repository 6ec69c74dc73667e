"""The job file: unknown fields, bad values and layer ids are refused with the field named."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from hsx.methods import default_layers
from hsx.modelinfo import ModelConfigError, read_model_info
from hsx.plan import FIRST_UNIT_TOKENS, UnitPlanner, first_unit_tokens, plan_units
from hsx.spec import DatasetSpec, JobSpec, SpecError, load_job, parse_job

BASE = {"model": "/m", "dataset": "/d.jsonl", "output": "/o"}


def test_minimal_job_gets_defaults() -> None:
    spec = parse_job(dict(BASE))
    assert spec.engine == "vllm"
    assert spec.storage_dtype == "bf16"
    assert spec.replicas is None  # as many as fit (placement.plan_job)
    assert spec.layers is None


def test_unknown_field_is_named() -> None:
    with pytest.raises(SpecError, match=r"replica: unknown field"):
        parse_job({**BASE, "replica": 2})


def test_nested_unknown_field_is_named() -> None:
    with pytest.raises(SpecError, match=r"train\.lrr: unknown field"):
        parse_job({**BASE, "train": {"lrr": 1e-4}})


def test_vllm_section_passes_other_keys_through_as_engine_args() -> None:
    spec = parse_job({**BASE, "vllm": {"load_format": "dummy", "max_num_seqs": 64,
                                       "gpu_memory_utilization": 0.5}})
    assert spec.vllm.engine_args() == {"load_format": "dummy", "max_num_seqs": 64}
    assert spec.vllm.gpu_memory_utilization == 0.5


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("engine", "sglang", "engine"),
        ("storage_dtype", "fp4", "storage_dtype"),
        ("replicas", 0, "replicas"),
        ("max_seq_len", 0, "max_seq_len"),
        ("layers", [1, 1, 3], "duplicate layer ids"),
        ("layers", [-1, 2], "must be >= 0"),
        ("layers", [], "must not be empty"),
    ],
)
def test_bad_values_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        parse_job({**BASE, field: value})
    assert field in str(info.value)


def test_missing_model_is_named() -> None:
    with pytest.raises(SpecError, match="model: Field required"):
        parse_job({"dataset": "/d", "output": "/o"})


def test_a_job_files_fields_are_set_from_the_command_line(tmp_path: Path) -> None:
    """`hsx extract JOB --set KEY=VALUE`: a dotted key names a section's field, the value
    is YAML; what the set makes is checked as the file would be."""
    job = tmp_path / "job.yaml"
    job.write_text("model: m\ndataset: d.jsonl\noutput: out\ntrain: {steps: 10}\n")
    spec = load_job(job, ["train.online=true", "train.workers=2", "train.place=apart",
                          "train.node_labels={hsx-role: trainer}", "replicas=3"])
    assert spec.train is not None and spec.train.steps == 10  # the file's own kept
    assert (spec.train.online, spec.train.workers, spec.train.place) == (True, 2, "apart")
    assert spec.train.node_labels == {"hsx-role": "trainer"} and spec.replicas == 3
    with pytest.raises(SpecError, match=r"train\.place"):
        load_job(job, ["train.place=beside"])
    with pytest.raises(SpecError, match="expected key=value"):
        load_job(job, ["train.place"])
    with pytest.raises(SpecError, match=r"train\.node_labels"):
        load_job(job, ["train.node_labels={hsx-role: 'a b'}"])


def test_layers_are_sorted() -> None:
    assert parse_job({**BASE, "layers": [4, 1, 2]}).layers == [1, 2, 4]


def test_every_field_has_a_description() -> None:
    for model in (JobSpec, DatasetSpec):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


def test_a_dataset_is_a_path_or_a_path_and_a_split() -> None:
    plain = parse_job({**BASE, "dataset": "/d"})
    same = parse_job({**BASE, "dataset": {"path": "/d"}})
    split = parse_job({**BASE, "dataset": {"path": "/d", "split": "train_sft"}})
    # `{path: P}` is the plain `P`: one job, one fingerprint, one form on the wire.
    assert same.dataset == plain.dataset == "/d"
    assert same.data_fingerprint() == plain.data_fingerprint()
    assert plain.dataset_spec == DatasetSpec(path="/d")
    assert split.dataset == split.dataset_spec == DatasetSpec(path="/d", split="train_sft")
    assert split.data_fingerprint() != plain.data_fingerprint()
    assert split.model_dump(mode="json")["dataset"] == {"path": "/d", "split": "train_sft"}
    assert JobSpec.model_validate_json(split.model_dump_json()) == split
    assert str(split.dataset_spec) == "/d (split train_sft)"
    with pytest.raises(SpecError, match=r"dataset\.DatasetSpec\.splt: unknown field"):
        parse_job({**BASE, "dataset": {"path": "/d", "splt": "x"}})
    # Only the form written is reported on, not "should be a string" beside it.
    with pytest.raises(SpecError) as typo:
        parse_job({**BASE, "dataset": {"path": "/d", "splt": "x"}})
    assert "string" not in str(typo.value)
    with pytest.raises(SpecError, match="dataset"):
        parse_job({**BASE, "dataset": ""})
    with pytest.raises(SpecError, match="dataset"):
        parse_job({**BASE, "dataset": {"path": "/d", "split": ""}})


def test_fingerprint_ignores_replicas_but_not_layers() -> None:
    a = parse_job({**BASE, "layers": [1, 2]})
    same = parse_job({**BASE, "layers": [1, 2], "replicas": 4})
    assert a.data_fingerprint() == same.data_fingerprint()
    assert a.data_fingerprint() != parse_job({**BASE, "layers": [1, 3]}).data_fingerprint()


def test_load_job_resolves_paths_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text("")
    job = tmp_path / "job.yaml"
    job.write_text("model: model\ndataset: data.jsonl\noutput: out\nlayers: [3, 1]\n")
    spec = load_job(job)
    assert spec.model == str(tmp_path / "model")
    assert spec.dataset == str(tmp_path / "data.jsonl")
    assert spec.output == str(tmp_path / "out")
    assert spec.layers == [1, 3]


def test_load_job_resolves_the_path_of_a_split_dataset(tmp_path: Path) -> None:
    (tmp_path / "ultrachat").mkdir()
    job = tmp_path / "job.yaml"
    job.write_text("model: m\ndataset: {path: ultrachat, split: train_sft}\noutput: o\n")
    assert load_job(job).dataset == DatasetSpec(path=str(tmp_path / "ultrachat"),
                                                split="train_sft")
    job.write_text("model: m\ndataset: {path: org/hub-name, split: train}\noutput: o\n")
    assert load_job(job).dataset == DatasetSpec(path="org/hub-name", split="train")


def test_load_job_reports_yaml_errors(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job(job)
    with pytest.raises(SpecError, match="cannot read job file"):
        load_job(tmp_path / "missing.yaml")


def test_default_layers() -> None:
    assert default_layers(32) == [2, 16, 29, 32]
    assert default_layers(61) == [2, 30, 58, 61]
    assert default_layers(4) == [1, 2, 4]
    # DFlash's: five ids evenly from 2 to N-2 (its reference code's 1 .. N-3, one less:
    # it counts a layer's output where hsx counts the next layer's input), and N.
    assert default_layers(36, "dflash") == [2, 10, 18, 26, 34, 36]
    assert default_layers(4, "dflash") == [2, 4]


def test_layers_by_method_name(tmp_path: Path) -> None:
    """`layers:` may name methods (the union of their ids); without `layers:` a job
    captures its training's method's ids."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "num_hidden_layers": 36, "hidden_size": 64, "vocab_size": 100}))
    info = read_model_info(str(tmp_path))
    base = {"model": str(tmp_path), "dataset": "d.jsonl", "output": "o"}
    both = parse_job({**base, "layers": ["dflash", "eagle3"]})
    assert both.layers == ["dflash", "eagle3"]
    assert info.job_layers(both.layers) == [2, 10, 18, 26, 33, 34, 36]
    mixed = parse_job({**base, "layers": [7, "eagle3"]})
    assert info.job_layers(mixed.layers) == [2, 7, 18, 33, 36]
    dflash = parse_job({**base, "train": {"method": "dflash"}})
    assert dflash.layers is None and dflash.layers_method == "dflash"
    assert info.job_layers(dflash.layers, method=dflash.layers_method) == [2, 10, 18, 26, 34, 36]
    assert info.job_layers(None) == [2, 18, 33, 36]
    with pytest.raises(SpecError, match="layers"):
        parse_job({**base, "layers": ["medusa"]})
    with pytest.raises(SpecError, match="duplicate"):
        parse_job({**base, "layers": ["eagle3", "eagle3"]})


def test_model_info_reads_text_config_of_wrappers(tmp_path: Path) -> None:
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840},
        "vision_config": {"hidden_size": 1152},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    info = read_model_info(str(tmp_path))
    assert info.wrapper
    assert (info.num_layers, info.hidden_size) == (61, 7168)
    assert info.default_layers() == [2, 30, 58, 61]
    with pytest.raises(ModelConfigError, match=r"ids \[62\] are outside 0\.\.61"):
        info.check_layers([2, 62])


def test_model_info_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        read_model_info(str(tmp_path / "nope"))
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        read_model_info(str(tmp_path))


def test_plan_units_is_contiguous_and_bounded() -> None:
    lengths = [100, 300, 50, 700, 10, 10, 2000, 5]
    units = plan_units(lengths, 500)
    assert units[0].row_start == 0 and units[-1].row_end == len(lengths)
    for a, b in itertools.pairwise(units):
        assert a.row_end == b.row_start
    for u in units:
        assert u.tokens == sum(lengths[u.row_start : u.row_end])
        assert u.samples == 1 or u.tokens <= 500
    assert plan_units(lengths, 500) == units
    assert plan_units([], 500) == []


def test_units_planned_part_by_part_are_the_units_of_the_whole_table() -> None:
    """Ingestion plans units as each part of the inputs lands: however the rows are cut
    into parts, the plan is plan_units' of all of them (the same shards, a resumed job
    finds its committed units)."""
    rng = random.Random(7)
    for _ in range(200):
        lengths = [rng.randint(1, 900) for _ in range(rng.randint(0, 120))]
        unit_tokens = rng.choice([1, 300, 1000, 5000])
        first = rng.choice([0, 1, 100, 1000])
        planner = UnitPlanner(unit_tokens, first)
        units, start = [], 0
        while start < len(lengths):
            step = rng.randint(0, 17)
            units += planner.add(lengths[start:start + step])
            start += step
        units += planner.finish()
        assert units == plan_units(lengths, unit_tokens, first)
        assert planner.finish() == []


def test_the_first_units_ramp_up_to_unit_tokens() -> None:
    """A new job's first unit is cut at first_unit_tokens, each next at twice the last,
    up to unit_tokens; without the rule (0, as older drivers planned) every unit is cut
    at unit_tokens."""
    lengths = [100] * 400  # 40,000 tokens
    ramped = plan_units(lengths, 16_000, 2_000)
    assert [u.tokens for u in ramped] == [2_000, 4_000, 8_000, 16_000, 10_000]
    assert [u.tokens for u in plan_units(lengths, 16_000)] == [16_000, 16_000, 8_000]
    assert plan_units(lengths, 16_000, 16_000) == plan_units(lengths, 16_000)
    assert plan_units([5_000, 10], 16_000, 2_000)[0].tokens == 5_000  # one sample at least
    assert first_unit_tokens(65_536) == FIRST_UNIT_TOKENS < 65_536
    assert first_unit_tokens(FIRST_UNIT_TOKENS) == 0  # no smaller unit to start with
    with pytest.raises(ValueError, match="first_unit_tokens"):
        UnitPlanner(16_000, -1)
