"""engine_config_for: the typed settings of a job's engine, built from its spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx.modelinfo import read_model_info
from hsx.spec import JobSpec, RegenerateSpec
from hsx_service.engine_config import engine_config_for
from hsx_service.provenance import engine_arguments
from hsx_workers.engines.hf_settings import HfSettings
from hsx_workers.engines.vllm.settings import VllmSettings
from hsx_workers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=3,
                           weights=False)


def _spec(model: Path, **fields: object) -> JobSpec:
    return JobSpec.model_validate({"model": str(model), "dataset": "d.jsonl",
                                   "output": "/tmp/o", "max_seq_len": 256, **fields})


def test_a_vllm_job_s_settings_carry_its_vllm_section_with_the_plan_s_memory(
        model: Path) -> None:
    spec = _spec(model, vllm={"max_inflight_tokens": 4096, "max_num_seqs": 8},
                 regenerate=RegenerateSpec(max_tokens=64).model_dump())
    config = engine_config_for(spec, read_model_info(str(model)), [1, 3], memory=0.5)
    settings = config.settings
    assert isinstance(settings, VllmSettings)
    assert settings.options.max_inflight_tokens == 4096
    assert settings.options.engine_args() == {"max_num_seqs": 8}
    assert settings.options.gpu_memory_utilization == 0.5
    assert spec.vllm.gpu_memory_utilization == 0.85  # the job itself is unchanged
    assert settings.generates and config.images is None


def test_an_hf_job_gets_the_hf_engine_s_settings(model: Path) -> None:
    config = engine_config_for(_spec(model, engine="hf"), read_model_info(str(model)), [1])
    assert config.settings == HfSettings()


def test_a_vllm_job_s_provenance_records_its_vllm_options(model: Path) -> None:
    spec = _spec(model, vllm={"enforce_eager": True, "seed": 3})
    assert engine_arguments(spec, read_model_info(str(model)), [1]) == {
        "engine": "vllm", "dtype": "auto", "tensor_parallel_size": 1, "max_seq_len": 256,
        "trust_remote_code": False, "cpu_kvcache_gib": 1, "enforce_eager": True,
        "gpu_memory_utilization": 0.85, "max_inflight_tokens": 65536,
        "engine_args": {"seed": 3}}
