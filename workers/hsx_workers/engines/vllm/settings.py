"""`VllmSettings`: what the vllm engine takes beside `EngineConfig`'s common fields;
`CaptureArgs`: the engine arguments a model's capture path sets (the model preflight's
answer, `ModelReport.engine_options`); `TargetSettings`: vLLM's settings for a job's
target outside capture (the draft's evaluation, hsx_workers/acceptance.py).

Light (pydantic and hsx.spec), so the service builds them without importing vLLM or
torch; engine.py reads them.
"""

from __future__ import annotations

from typing import Any, Literal

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


class TargetSettings(BaseModel):
    """vLLM's settings for a job's target outside capture (the draft's evaluation): as
    the job's engines load it, from its spec (`rules.target_settings`), with the
    evaluation's own tensor parallelism and executor. Without a job (`hsx eval-draft`
    with none), vLLM's defaults at `tensor_parallel_size`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: int = Field(1, ge=1, description=(
        "GPUs the target spans: the evaluation's, which a coordinator gives as many as "
        "the job's engines use (one rank on a CPU cluster)."))
    options: VllmOptions | None = Field(None, description=(
        "The job's `vllm:` section: its dtype, memory share and engine arguments; None: "
        "vLLM's defaults."))
    trust_remote_code: bool = Field(False, description="The job's `trust_remote_code`.")
    images_per_prompt: int | None = Field(None, gt=0, description=(
        "A job that takes images: the most one prompt holds (its vision tower loaded); "
        "None: a text job."))
    distributed_executor_backend: Literal["ray", "mp"] | None = Field(
        None, description=(
            "How vLLM runs its ranks, as for the job's engines (hsx_service/engine_pool."
            "engine_resources); None: vLLM's choice."))

    def engine_args(self) -> dict[str, Any]:
        """vLLM's `LLM(...)` arguments these settings make."""
        args: dict[str, Any] = {"tensor_parallel_size": self.tensor_parallel_size,
                                "trust_remote_code": self.trust_remote_code}
        if self.options is not None:
            args.update(dtype=self.options.dtype,
                        gpu_memory_utilization=self.options.gpu_memory_utilization,
                        **self.options.engine_args())
        if self.images_per_prompt is not None:
            args["limit_mm_per_prompt"] = {"image": self.images_per_prompt, "video": 0}
        if self.distributed_executor_backend is not None:
            args["distributed_executor_backend"] = self.distributed_executor_backend
        return args
