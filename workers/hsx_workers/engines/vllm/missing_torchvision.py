"""Importing vLLM's multimodal modules where torchvision is missing.

vLLM's multimodal wrappers (and the transformers image processors they import) import
torchvision at module load; no PyPI torchvision works beside the CPU torch. Their text
path never calls it, so stubbed modules let the class load for `language_model_only`
capture: for one import (`torchvision_stub`), or for the rest of an engine actor's
process (`install_torchvision_stub`).

The preflight and the engine call these through this module (`missing_torchvision.
torchvision_missing()`), so that one answer, a test's pretended one included, holds
for every step of the preflight.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import torchvision...` give empty modules whose attributes are dummies.

    vLLM's multimodal wrappers (and the transformers image processors they import)
    import torchvision at module load; no PyPI torchvision works beside the CPU torch
    (ENVIRONMENT.md). Their text path never calls it, so stubbed modules let the class
    load for `language_model_only` capture. Images would need the real package.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _stub_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_STUB_FINDER = _TorchvisionStub()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any
        if name[:1].isupper():  # a class (InterpolationMode, Compose, ...)
            value = type(name, (), {"__init__": lambda self, *a, **k: None,
                                    "__module__": self.__name__})
        else:
            value = sys.modules.get(f"{self.__name__}.{name}") or _stub_module(
                f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _stub_module(name: str) -> types.ModuleType:
    module = _StubModule(name)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, _STUB_FINDER, is_package=True)
    module.__dict__["__version__"] = "0.0.0+hsx-stub"
    sys.modules[name] = module
    return module


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


@contextlib.contextmanager
def torchvision_stub() -> Iterator[None]:
    """Stub torchvision while importing a multimodal module, where it is not installed.

    transformers must be imported first (it caches that torchvision is absent and so
    never calls it). The stub is removed afterwards; modules imported meanwhile keep
    their dummy references.
    """
    import transformers  # noqa: F401 - see the docstring

    if not torchvision_missing():
        yield
        return
    sys.meta_path.insert(0, _STUB_FINDER)
    try:
        yield
    finally:
        sys.meta_path.remove(_STUB_FINDER)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


def install_torchvision_stub() -> bool:
    """Stub torchvision for the rest of this process (an engine actor's), if missing.

    The vLLM engine of a multimodal wrapper imports the model's module in this process
    and in the engine processes it forks, and may import more of torchvision lazily; a
    process that exists to run that one engine keeps the stub. True if installed.
    """
    import transformers  # noqa: F401 - it must cache "no torchvision" first

    if not torchvision_missing() or _STUB_FINDER in sys.meta_path:
        return False
    sys.meta_path.insert(0, _STUB_FINDER)
    logger.warning("torchvision is missing: stubbed for the text path of a multimodal model")
    return True
