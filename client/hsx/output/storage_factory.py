"""Which `Storage` variant serves a URI, imported only when a URI of its scheme is opened.

As vLLM's `KVConnectorFactory`: each variant is registered by the module path and class
name that implement it (`hsx.registry.ClassRegistry`), and its module is imported the
first time a URI of one of its schemes is opened. storage.py is the interface alone and
imports no variant; the variants import it. So `import hsx` never loads obstore, and no
module of `hsx.output` imports one that imports it back.

Variants:
- `file` (and plain paths): `LocalStorage` (local_storage.py).
- `s3`, `gs`, `az`: `ObjectStoreStorage` (object_storage.py, through obstore).

Who calls what: `Storage.for_uri` (an `Output`, a `ShardWriter` given a path, tests and
benchmarks) calls `open_storage`; a variant's own `from_uri` checks the rest of the URI
and the options.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hsx.registry import ClassRegistry

if TYPE_CHECKING:
    from hsx.output.storage import Storage

STORAGES: ClassRegistry[Storage] = ClassRegistry("storage scheme")
STORAGES.register("file", "hsx.output.local_storage", "LocalStorage")
STORAGES.register("s3", "hsx.output.object_storage", "ObjectStoreStorage")
STORAGES.register("gs", "hsx.output.object_storage", "ObjectStoreStorage")
STORAGES.register("az", "hsx.output.object_storage", "ObjectStoreStorage")


def open_storage(uri: str | os.PathLike[str], **options: Any) -> Storage:
    """The storage for a path or a URI of a registered scheme (see `Storage.for_uri`)."""
    text = os.fspath(uri)
    scheme, sep, _ = text.partition("://")
    scheme = scheme.lower() if sep else "file"
    if scheme not in STORAGES:
        *others, last = (f"{s}://" for s in STORAGES.names())
        raise ValueError(
            f"unsupported storage URI {text!r}: use a path, {', '.join(others)} or {last}"
        )
    return STORAGES.load(scheme).from_uri(text, **options)
