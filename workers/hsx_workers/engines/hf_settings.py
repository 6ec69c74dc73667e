"""`HfSettings`: what the hf engine takes beside `EngineConfig`'s common fields.

Light (pydantic alone), so the service builds them without importing torch or
transformers; hf_engine.py reads them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HfSettings(BaseModel):
    """The hf engine's own settings. A job sets none of them (its engine runs with these
    defaults); benchmarks/gpu/bench_gpu.py sets both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str | None = Field(None, description=(
        "The torch device the model runs on; None: cuda where there is one, else cpu."))
    batch_tokens: int = Field(16384, gt=0, description=(
        "Padded tokens of one forward: samples are batched by length up to it."))
