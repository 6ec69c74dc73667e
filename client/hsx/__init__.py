"""hsx: hidden states of a target LLM, captured by vLLM engines, as the training data of
speculative-decoding drafts (EAGLE-3, DFlash, DSpark; hsx.methods).

The public names are few and light to import (no torch, vllm or ray):

- `JobSpec`, `load_job`: the job file.
- `HiddenStatesDataset`: read an output location from a training loop.
- `Client`: the coordinator's REST API (submit, watch, cancel jobs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Client", "HiddenStatesDataset", "JobSpec", "__version__", "load_job"]

if TYPE_CHECKING:
    from hsx.client import Client
    from hsx.dataset import HiddenStatesDataset
    from hsx.spec import JobSpec, load_job

_LAZY = {
    "Client": "hsx.client",
    "HiddenStatesDataset": "hsx.dataset",
    "JobSpec": "hsx.spec",
    "load_job": "hsx.spec",
}


def __getattr__(name: str) -> Any:
    # Imported on first use so `import hsx` stays fast and light.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hsx' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
