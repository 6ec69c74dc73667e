"""`VllmSettings`: what the vllm engine takes beside `EngineConfig`'s common fields;
`CaptureArgs`: the engine arguments a model's capture path sets (the model preflight's
answer, `ModelReport.engine_options`).

Light (pydantic and hsx.spec), so the service builds them without importing vLLM or
torch; engine.py reads them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hsx.spec import VllmOptions


class VllmSettings(BaseModel):
    """The vllm engine's own settings: the job's `vllm:` section as the job file was read
    (`VllmOptions` owns its fields, their bounds and the engine arguments passed through;
    nothing restates them here), and what the rest of the job and its plan ask of vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    options: VllmOptions = Field(description=(
        "The job's `vllm:` section; its gpu_memory_utilization is the plan's share "
        "(less where an online trainer shares the GPU: ResourcePlan.engine_memory). Its "
        "dtype is EngineConfig.dtype."))
    generates: bool = Field(False, description=(
        "The engine also answers prompts (a job with `regenerate:`): sampling with "
        "per-request seeds, prefilled whole on the CPU platform."))
    distributed_executor_backend: Literal["ray", "mp"] | None = Field(
        None, description=(
            "How vLLM runs its ranks, where the engine pool decides it (engine_pool."
            "engine_resources: ray for TP over GPUs, mp for TP on CPUs); None: vLLM's choice."))


class CaptureArgs(BaseModel):
    """The vLLM engine arguments a model's capture path sets whatever the job asks: the
    model preflight's answer (hsx_workers/preflight), shown to users as the arguments set
    (`engine_args`). Strict: a key or a value of another type is an error, not a silent
    default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    language_model_only: bool = Field(False, description=(
        "A multimodal wrapper captured through extract_hidden_states runs its text path "
        "only (unless a job takes images)."))
    enforce_eager: bool = Field(False, description=(
        "The hook fallback runs in eager mode: under torch.compile or CUDA graphs hooks "
        "see nothing."))

    def engine_args(self) -> dict[str, bool]:
        """The arguments set, by vLLM's names (empty where the capture path sets none)."""
        return self.model_dump(exclude_defaults=True)
