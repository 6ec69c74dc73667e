"""Names mapped to the module path and class name that serve them, each module imported
when its name is first asked for: how vLLM's `KVConnectorFactory` registers KV connectors.

A family's base module (its interface) never imports its variants; they are registered
by path (in the base, or in a factory beside it), so importing the base brings none of
the variants' imports (obstore, torch, vLLM) with it, and the variants can import the
base without a circle.
Registries: `STORAGES` in hsx/output/storage.py (storage by URI scheme),
hsx_workers/engines/factory.py (capture engines by name).
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class ClassRegistry(Generic[T]):
    """Name -> (module path, class name) of the class that serves it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        """What a name names, for messages ("engine", "storage scheme")."""
        self._paths: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Serve `name` with `module_path.class_name` (imported when first asked for)."""
        if name in self._paths:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._paths[name] = (module_path, class_name)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def names(self) -> list[str]:
        """The registered names, in the order they were registered."""
        return list(self._paths)

    def load(self, name: str) -> type[T]:
        """The class serving `name`, its module imported now if it was not yet."""
        if name not in self._paths:
            expected = " or ".join(repr(n) for n in self._paths)
            raise ValueError(f"unknown {self.kind} {name!r} (expected {expected})")
        module_path, class_name = self._paths[name]
        found: type[T] = getattr(importlib.import_module(module_path), class_name)
        return found
