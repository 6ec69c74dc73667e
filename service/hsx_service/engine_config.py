"""The engine a job's spec asks for: `EngineConfig` for its capture engines, and the spec
fitted to what the model's engine can run (`fit_to_model`, by the vllm engine's rules).
Pure functions of the spec and the model's config, kept apart from the pool that starts
engines so preflight and the manifest's provenance can ask without importing the pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from hsx.modelinfo import ModelConfigError, ModelInfo, read_model_info
from hsx.spec import JobSpec

if TYPE_CHECKING:  # the workers' package is imported where an engine is built
    from hsx_workers.engines.base import ImageSettings
    from hsx_workers.engines.factory import AnyEngineConfig

SettingsT = TypeVar("SettingsT", bound=BaseModel)


def engine_config_for(spec: JobSpec, model: ModelInfo, layers: list[int],
                      memory: float | None = None) -> AnyEngineConfig:
    """The config of the job's capture engines: what every engine takes, and the typed
    settings of the job's engine (`VllmSettings`, `HfSettings`). `memory`: the fraction of
    each GPU's memory vLLM takes, as the job's plan says (`ResourcePlan.engine_memory`:
    less when an online trainer shares the GPU); default the spec's."""
    from hsx_workers.engines.base import EngineConfig
    from hsx_workers.engines.hf_settings import HfSettings
    from hsx_workers.engines.vllm.settings import VllmSettings

    def config(settings: SettingsT) -> EngineConfig[SettingsT]:
        return EngineConfig(
            model=spec.model,
            layers=layers,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            max_seq_len=spec.max_seq_len,
            settings=settings,
            tensor_parallel_size=spec.tensor_parallel_size,
            trust_remote_code=spec.trust_remote_code,
            dtype=spec.vllm.dtype,
            storage_dtype=spec.storage_dtype,
            images=image_settings(spec, model) if spec.images is not None else None,
        )

    if spec.engine == "hf":
        return config(HfSettings())
    options = spec.vllm.model_copy(
        update={"gpu_memory_utilization": memory or spec.vllm.gpu_memory_utilization})
    return config(VllmSettings(options=options, generates=spec.regenerate is not None))


def image_settings(spec: JobSpec, model: ModelInfo) -> ImageSettings:
    """What an engine of a job that takes images needs: how many a prompt may hold, how
    large (vLLM sizes its profiling by them), and the token the vision tokens carry."""
    from hsx_workers.engines.base import ImageSettings

    images = spec.images
    if images is None or model.image_token_id is None:
        raise ValueError(f"{spec.model} takes no images, or the job asks none")
    return ImageSettings(max_per_row=images.max_per_row, max_pixels=images.max_pixels,
                         image_token_id=model.image_token_id)


def fit_to_model(spec: JobSpec) -> JobSpec:
    """The spec as it runs on its model: a `max_seq_len` left at its default (4,096)
    that the model's positions cannot hold with vLLM's capture (2 beyond the prompt)
    becomes the longest they can. Called where a job enters (the coordinator's submit,
    `hsx extract`), so everything after, the ledger included, sees one spec; a
    `max_seq_len` the user set is theirs, and too long is refused (check_engine_args)."""
    from hsx_workers.engines.vllm.rules import longest_prompt, max_model_len

    if "max_seq_len" in spec.model_fields_set or spec.engine != "vllm":
        return spec
    try:
        positions = read_model_info(spec.model).max_positions
    except ModelConfigError:
        return spec  # preflight says what is wrong with the model
    if positions is None or max_model_len(spec.max_seq_len) <= positions or positions < 4:
        return spec
    return spec.model_copy(update={"max_seq_len": longest_prompt(positions)})
