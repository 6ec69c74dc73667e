"""The output of a job: where its objects live and how they are written and read.

Storage is the layer every reader and writer of an output goes through: local disk
(a path or `file://`) and object stores (`s3://`, `gs://`, `az://`) behind one small
interface (`Storage.for_uri`). See `hsx.output.storage`.
"""

from __future__ import annotations

from hsx.output.storage import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectWriter,
    Storage,
    StorageError,
)

__all__ = [
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectWriter",
    "Storage",
    "StorageError",
]
