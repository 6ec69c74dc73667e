"""The preflight's answer about a model (`ModelReport`), as JSON (`as_dict`) and as the
text of `hsx inspect-model` (`format_report`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hsx_workers.engines.vllm.settings import CaptureArgs

Capture = Literal["extract_hidden_states", "hooks", "hf", "unsupported"]
EngineChoice = Literal["auto", "vllm", "hf"]


@dataclass
class ModelReport:
    """The preflight's answer; `as_dict()` is the JSON of `hsx inspect-model --json`."""

    model: str
    architecture: str
    wrapper: bool
    language_model_architecture: str | None
    num_layers: int
    hidden_size: int
    supports_eagle3: bool
    capture: Capture
    default_layers: list[int]
    valid_layers: list[int]
    bytes_per_token: dict[str, int]
    reasons: list[str]
    trust_remote_code_needed: bool
    vllm_class: str | None = None
    language_model_class: str | None = None
    engine_options: CaptureArgs = field(default_factory=CaptureArgs)
    """vLLM settings the capture path needs (language_model_only, enforce_eager); in the
    JSON, the ones set (`CaptureArgs.engine_args`)."""
    num_params: int | None = None
    weight_bytes: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_bytes: int | None = None
    weights_fit: bool | None = None
    """None when GPU memory is unknown (CPU, or no GPU visible to the preflight)."""
    vllm_available: bool = True
    """False when vLLM cannot be imported where the preflight ran (its answer is partial)."""
    dataset_tokens: int | None = None
    """The dataset's tokens after ingestion, estimated from `dataset_sampled` rows."""
    dataset_rows: int | None = None
    dataset_sampled: int | None = None
    output_bytes: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "engine_options": self.engine_options.engine_args()}

    @property
    def capturable(self) -> bool:
        return self.capture != "unsupported"


def format_report(report: ModelReport) -> str:
    """The human form of `hsx inspect-model`."""
    lines = [
        f"model          {report.model}",
        f"architecture   {report.architecture}"
        + (f" (wrapper around {report.language_model_architecture})" if report.wrapper else ""),
        f"vLLM class     {report.vllm_class or '-'}",
        f"layers         {report.num_layers} (hidden size {report.hidden_size})",
        f"EAGLE-3 aux    {'yes' if report.supports_eagle3 else 'no'}",
        f"capture        {report.capture}"
        + (f" with {args}" if (args := report.engine_options.engine_args()) else ""),
        f"default layers {report.default_layers}",
        f"valid ids      {report.valid_layers[0]}..{report.valid_layers[-1]}"
        if report.valid_layers else "valid ids      none",
        f"bytes/token    bf16 {report.bytes_per_token['bf16']}, "
        f"fp8 {report.bytes_per_token['fp8']}",
    ]
    if report.num_params is not None:
        fit = {True: "fit", False: "do NOT fit", None: "fit: unknown"}[report.weights_fit]
        lines.append(f"weights        ~{report.num_params / 1e9:.3g}B params, "
                     f"{gib(report.weight_bytes or 0)}; TP {report.tensor_parallel_size}: {fit}")
    if report.dataset_tokens is not None and report.output_bytes:
        lines.append(f"dataset        {report.dataset_rows} rows, about "
                     f"{report.dataset_tokens} tokens (from {report.dataset_sampled} sample "
                     f"rows) -> bf16 {gib(report.output_bytes['bf16'])}, "
                     f"fp8 {gib(report.output_bytes['fp8'])}")
    if report.trust_remote_code_needed:
        lines.append("remote code    needed (trust_remote_code)")
    lines.append("why:")
    lines.extend(f"  - {r}" for r in report.reasons)
    return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**24 else f"{n / 2**20:.1f} MiB"
