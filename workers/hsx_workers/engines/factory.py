"""Which capture engine a job names, imported only when it is built.

As vLLM's `KVConnectorFactory`: each engine is registered by the module path and class
name that implement it (`hsx.registry.ClassRegistry`), and its module (which imports
torch, vLLM or transformers) is imported the first time an engine of that name is
built. base.py is the interface alone and imports no engine; the engines import it.

Engines, and the settings each takes (`AnyEngineConfig`: the config of any of them,
so mypy checks a job's settings from the service to the engine that reads them):
- `vllm`: `VllmEngine` (engines/vllm/engine.py; `VllmSettings`), the default.
- `hf`: `HfEngine` (engines/hf_engine.py; `HfSettings`), the reference and the fallback.

Who calls what: `ExtractionWorker` (worker.py) calls `create_engine` once per actor.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from hsx.registry import ClassRegistry
from hsx_workers.engines.base import (
    CaptureEngine,
    EngineConfig,
    EngineStartFailed,
    describe_error,
)
from hsx_workers.engines.hf_settings import HfSettings
from hsx_workers.engines.vllm.settings import VllmSettings

AnyEngineConfig: TypeAlias = EngineConfig[VllmSettings] | EngineConfig[HfSettings]

ENGINES: ClassRegistry[Any] = ClassRegistry("engine")
ENGINES.register("vllm", "hsx_workers.engines.vllm.engine", "VllmEngine")
ENGINES.register("hf", "hsx_workers.engines.hf_engine", "HfEngine")


def create_engine(name: str, config: AnyEngineConfig) -> CaptureEngine:
    """The engine `name` started on `config`.

    Any failure to start (an unknown name, an import, the engine's own start) becomes
    `EngineStartFailed` with a one-line reason.
    """
    try:
        engine: CaptureEngine = ENGINES.load(name)(config)
    except Exception as err:
        raise EngineStartFailed(
            f"{name} engine could not start on {config.model}: {describe_error(err)}"
        ) from None
    return engine
