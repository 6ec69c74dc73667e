"""Which capture engine a job names, imported only when it is built.

As vLLM's `KVConnectorFactory`: each engine is registered by the module path and class
name that implement it, and its module (which imports torch, vLLM or transformers) is
imported the first time an engine of that name is built. base.py is the interface
alone and imports no engine; the engines import it.

Engines:
- `vllm`: `VllmEngine` (engines/vllm_engine.py), the default.
- `hf`: `HfEngine` (engines/hf_engine.py), the reference and the fallback.

Who calls what: `ExtractionWorker` (worker.py) calls `create_engine` once per actor.
"""

from __future__ import annotations

import importlib
from typing import Any

from hsx_workers.engines.base import (
    CaptureEngine,
    EngineConfig,
    EngineStartFailed,
    describe_error,
)


class EngineFactory:
    """Engine name -> (module path, class name) of the `CaptureEngine` that implements it."""

    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register(cls, name: str, module_path: str, class_name: str) -> None:
        """Build engine `name` with `module_path.class_name` (imported when first used)."""
        if name in cls._registry:
            raise ValueError(f"engine {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def engine_class(cls, name: str) -> Any:
        """The class of engine `name`, its module imported now if it was not yet."""
        if name not in cls._registry:
            expected = " or ".join(repr(n) for n in cls._registry)
            raise ValueError(f"unknown engine {name!r} (expected {expected})")
        module_path, class_name = cls._registry[name]
        return getattr(importlib.import_module(module_path), class_name)


EngineFactory.register("vllm", "hsx_workers.engines.vllm_engine", "VllmEngine")
EngineFactory.register("hf", "hsx_workers.engines.hf_engine", "HfEngine")


def create_engine(name: str, config: EngineConfig) -> CaptureEngine:
    """The engine `name` started on `config`.

    Any failure to start (an unknown name, an import, the engine's own start) becomes
    `EngineStartFailed` with a one-line reason.
    """
    try:
        engine: CaptureEngine = EngineFactory.engine_class(name)(config)
    except Exception as err:
        raise EngineStartFailed(
            f"{name} engine could not start on {config.model}: {describe_error(err)}"
        ) from None
    return engine
