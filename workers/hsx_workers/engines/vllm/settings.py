"""`VllmSettings`: what the vllm engine takes beside `EngineConfig`'s common fields.

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
