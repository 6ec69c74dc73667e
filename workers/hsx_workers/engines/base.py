"""The one interface every capture engine implements.

Variants, each with the settings it takes beside the common ones (`EngineConfig.settings`):
- `VllmEngine` (engines/vllm/engine.py; `VllmSettings`, engines/vllm/settings.py):
  vLLM's `extract_hidden_states` method with hsx's connector. The default.
- `HfEngine` (engines/hf_engine.py; `HfSettings`, engines/hf_settings.py): a
  transformers forward. The reference the vLLM engine is tested against, and the
  fallback for architectures vLLM cannot capture.

This module is the interface alone and imports no engine; the engines import it.
`create_engine` (engines/factory.py) maps an engine's name to its module, imported when
that engine is first built.

Who calls what: `ExtractionWorker` (worker.py) builds one engine per actor with
`create_engine`, then calls `capture` once per work unit. Per-sample problems come back
as `CaptureResult.error`; anything that means the engine itself is gone raises
`EngineDead`, and the worker's owner restarts the actor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch


class EngineDead(RuntimeError):
    """The engine cannot go on; the actor that owns it must be restarted."""


class EngineStartFailed(RuntimeError):
    """The engine could not be built (bad model, no memory, version mismatch)."""


def describe_error(err: BaseException, max_lines: int = 2) -> str:
    """`Type: message`, cut to its first lines: errors cross Ray as plain text.

    Some library exceptions (pydantic's among them) cannot be pickled, and their
    messages run to pages; the first lines say what went wrong.
    """
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("For further information")]
    return f"{type(err).__name__}: {' '.join(lines[:max_lines])}" if lines else type(err).__name__


@dataclass
class CaptureRequest:
    sample_index: int
    input_ids: list[int]
    # The self-check's head check takes this sample: the engine also reports its own
    # top-1 token at every position (CaptureResult.predicted), where it can.
    predict: bool = False
    # A prompt with images (a job that takes them): each image's bytes, in the order of
    # its placeholders in `input_ids`; the engine expands each placeholder into the
    # image's vision tokens, and its CaptureResult.input_ids are the expanded ones.
    images: list[bytes] | None = None
    # Tokens the engine will compute (its images expanded); 0: len(input_ids).
    tokens: int = 0

    @property
    def length(self) -> int:
        return self.tokens or len(self.input_ids)


@dataclass
class GenerateResult:
    """The engine's answer to a GenerateRequest (or why there is none)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length"
    error: str | None = None


@dataclass
class GenerateRequest:
    """Answer a prompt (a regenerating job's turn) inside a capture stream.

    It travels in the same request stream as CaptureRequests, so the engine keeps
    capturing one unit while it generates the next one's answers; its result goes to
    `on_done` (called on the thread that pulls the request stream), not into the stream
    of CaptureResults.
    """

    sample_index: int
    input_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    on_done: Callable[[GenerateResult], None]


class _Wait:
    """See WAIT."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()
"""Yielded by a request stream that has nothing to hand over right now but is not
finished (a worker between work units): the engine goes on with what it has in flight
and asks again, instead of draining as at the end of the stream."""

RequestStream = Iterable["CaptureRequest | GenerateRequest | _Wait"]

IDLE_SLEEP_S = 0.002
"""How long an engine with nothing in flight sleeps after a WAIT before asking again."""


@dataclass
class CaptureResult:
    sample_index: int
    input_ids: list[int]  # the tokens the engine computed (a prompt's images expanded)
    # [T, L, H], layers in ascending id order (a torch tensor, or a numpy array mapped
    # from the spool); None when `error` is set.
    hidden_states: torch.Tensor | Any = None
    error: str | None = None
    # True when nobody else holds hidden_states (the consumer may keep it, uncopied).
    owned: bool = False
    # [T, L] fp8 scales when hidden_states is already quantized (float8_e4m3fn).
    scales: Any = None
    # time.monotonic() when the engine reported the request computed, and when its
    # states were taken from the spool (0.0 where an engine does not tell): the
    # stages of a unit's hand-off, in UnitReport.marks.
    computed_at: float = 0.0
    spooled_at: float = 0.0
    # [T, L] float32 L2 norm of each row, where the engine computed it next to the states
    # (the vllm engine's connector, on the device): the self-check's input. None: the
    # check computes it from the states.
    norms: Any = None
    # For a request with `predict`: the engine's top-1 next token after each position
    # [T] (None where it was not asked, or the engine cannot tell).
    predicted: list[int] | None = None


class ImageSettings(BaseModel):
    """What an engine of a job that takes images needs (either engine): how many a prompt
    may hold, how large (vLLM sizes its profiling by them), and the token its images'
    placeholders carry. Built from the job's `images:` and the model's config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_per_row: int = Field(gt=0, description="The most images one prompt holds.")
    max_pixels: int = Field(gt=0, description="The most pixels of one image.")
    image_token_id: int = Field(ge=0, description="The model's image placeholder token.")


SettingsT = TypeVar("SettingsT", bound=BaseModel)


@dataclass
class EngineConfig(Generic[SettingsT]):
    """What an engine needs to start: what every engine takes, and `settings`, the typed
    settings of the one engine it is for (`VllmSettings`, `HfSettings`). Built by the
    service from the JobSpec (hsx_service/engine_config.py)."""

    model: str
    layers: list[int]
    num_layers: int
    hidden_size: int
    max_seq_len: int
    settings: SettingsT
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    dtype: str = "auto"
    # How the shards store states; the vllm engine's connector quantizes fp8 on the device.
    storage_dtype: str = "bf16"
    # A job that takes images; None: text prompts only.
    images: ImageSettings | None = None


class CaptureEngine(Protocol):
    """An engine built on an `EngineConfig` of its own settings (`create_engine`)."""

    def capture(self, requests: RequestStream) -> Iterator[CaptureResult]:
        """Yield one result per CaptureRequest, in request order. `requests` may yield
        WAIT, and GenerateRequests (answered through their `on_done`; an engine that
        cannot generate answers each with an error). An engine may pull `requests` on
        a thread of its own (the vllm engine does), never on two at once."""
        ...

    def close(self) -> None: ...

