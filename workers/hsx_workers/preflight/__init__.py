"""Model preflight: whether and how hsx can capture a model, known before any GPU is used.

Answers from config.json alone — no weights, no image processor, no GPU:

- which vLLM class serves the architecture (vLLM's own model registry resolves it), and
  whether it is a multimodal wrapper around a text model (Kimi-K2.5 wraps DeepSeek-V3);
- whether that class has vLLM's EAGLE-3 aux outputs, decided with vLLM's
  `supports_eagle3()` helper or the class flag. Never `issubclass(cls, SupportsEagle3)`:
  the protocol has non-method members and raises TypeError (the crash hsx started from);
- the capture path (`extract_hidden_states`, `hooks`, `hf`, `unsupported`) and the
  reasons for it, in plain sentences;
- layer ids (default and valid), bytes per token, and with a dataset the output size;
- whether the weights fit the requested tensor parallelism, when GPU memory is known.

`environment_report` checks that the installed vLLM, torch, transformers, Triton and
speculators fit together (`hsx doctor`). vLLM and transformers are imported inside the
functions: importing this package stays light.

- model.py: `inspect_model` (and its cached form for job submission);
- report.py: `ModelReport`, its JSON and its human form;
- vLLM's side (hsx_workers.engines.vllm): classes.py, the vLLM class that serves an
  architecture and whether it has EAGLE-3 aux outputs; missing_torchvision.py, importing
  vLLM's multimodal modules where torchvision is missing;
- image_processors.py: whether a multimodal wrapper's image processor lets vLLM start;
- environment.py: `environment_report` (`hsx doctor`).
"""

from __future__ import annotations

from hsx_workers.preflight.environment import EnvCheck, environment_report
from hsx_workers.preflight.model import inspect_model, inspect_model_cached, warm_imports
from hsx_workers.preflight.report import Capture, EngineChoice, ModelReport, format_report

__all__ = [
    "Capture",
    "EngineChoice",
    "EnvCheck",
    "ModelReport",
    "environment_report",
    "format_report",
    "inspect_model",
    "inspect_model_cached",
    "warm_imports",
]
