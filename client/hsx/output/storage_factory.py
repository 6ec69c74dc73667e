"""Which `Storage` variant serves a URI, imported only when a URI of its scheme is opened.

As vLLM's `KVConnectorFactory`: each variant is registered by the module path and class
name that implement it, and its module is imported the first time a URI of one of its
schemes is opened. storage.py is the interface alone and imports no variant; the
variants import it. So `import hsx` never loads obstore, and no module of `hsx.output`
imports one that imports it back.

Variants:
- `file` (and plain paths): `LocalStorage` (local_storage.py).
- `s3`, `gs`, `az`: `ObjectStoreStorage` (object_storage.py, through obstore).

Who calls what: `Storage.for_uri` (an `Output`, a `ShardWriter` given a path, tests and
benchmarks) calls `StorageFactory.create`; a variant's own `from_uri` checks the rest of
the URI and the options.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.output.storage import Storage


class StorageFactory:
    """Scheme -> (module path, class name) of the `Storage` that serves it."""

    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register(cls, scheme: str, module_path: str, class_name: str) -> None:
        """Serve `scheme://` URIs with `module_path.class_name` (imported when first used)."""
        if scheme in cls._registry:
            raise ValueError(f"storage scheme {scheme!r} is already registered")
        cls._registry[scheme] = (module_path, class_name)

    @classmethod
    def storage_class(cls, scheme: str) -> type[Storage]:
        """The class serving `scheme`, its module imported now if it was not yet."""
        module_path, class_name = cls._registry[scheme]
        found: type[Storage] = getattr(importlib.import_module(module_path), class_name)
        return found

    @classmethod
    def create(cls, uri: str | os.PathLike[str], **options: Any) -> Storage:
        """The storage for a path or a URI of a registered scheme (see `Storage.for_uri`)."""
        text = os.fspath(uri)
        scheme, sep, _ = text.partition("://")
        scheme = scheme.lower() if sep else "file"
        if scheme not in cls._registry:
            *others, last = (f"{s}://" for s in cls._registry)
            raise ValueError(
                f"unsupported storage URI {text!r}: use a path, {', '.join(others)} or {last}"
            )
        return cls.storage_class(scheme).from_uri(text, **options)


StorageFactory.register("file", "hsx.output.local_storage", "LocalStorage")
StorageFactory.register("s3", "hsx.output.object_storage", "ObjectStoreStorage")
StorageFactory.register("gs", "hsx.output.object_storage", "ObjectStoreStorage")
StorageFactory.register("az", "hsx.output.object_storage", "ObjectStoreStorage")
