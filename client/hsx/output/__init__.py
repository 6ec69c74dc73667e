"""The output of a job: the one owner of everything hsx writes into it and reads from it.

- `Output(uri)` (output.py): the location and every operation on it — the typed
  `Manifest` (published once), the inputs and errors tables, `CommitRecord`s, shard
  writers and readers, totals, the error list, the complete marker, orphan clean-up and
  verification. Everything else in hsx goes through it.
- The shard format (shards/): `ShardWriter` (writer.py), `ShardReader` (reader.py),
  `verify_shard` (verify.py), what the bytes mean and fp8 quantization (encoding.py).
- `Storage` (storage.py): where the objects live — local disk (a path or `file://`) or
  an object store (`s3://`, `gs://`, `az://`) — behind a few operations.
- The names of the objects (layout.py) and the format's JSON records (records.py).
"""

from __future__ import annotations

from hsx.output.output import BadShard, Output, OutputNotFound, OutputTotals
from hsx.output.records import (
    CommitRecord,
    IngestRecord,
    JobMismatch,
    Manifest,
    OutputCorrupt,
    PartRecord,
    RegenerationsRef,
    SampleError,
    UnitPlan,
)
from hsx.output.shards import CommitResult, ShardCorrupt, ShardReader, ShardWriter
from hsx.output.storage import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectWriter,
    Storage,
    StorageError,
)

__all__ = [
    "BadShard",
    "CommitRecord",
    "CommitResult",
    "IngestRecord",
    "JobMismatch",
    "Manifest",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectWriter",
    "Output",
    "OutputCorrupt",
    "OutputNotFound",
    "OutputTotals",
    "PartRecord",
    "RegenerationsRef",
    "SampleError",
    "ShardCorrupt",
    "ShardReader",
    "ShardWriter",
    "Storage",
    "StorageError",
    "UnitPlan",
]
