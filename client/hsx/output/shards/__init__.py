"""The shard format: how one work unit's hidden states are written, published and read.

A shard is one standard safetensors file holding every sample of one work unit,
concatenated along tokens (docs/FORMAT.md has the byte-level description):

- `hidden_states` [T_total, L, H] BF16, or F8_E4M3 with `scales` [T_total, L] F32
- `offsets` [n+1] I64, `sample_index` [n] I64, `input_ids` [T_total] I32,
  `loss_mask` [T_total] U8

Who calls what (through `hsx.output.Output`, which owns the rest of the output):

- Workers (inside Ray actors) write with `ShardWriter` (writer.py): `add()` per sample,
  then `commit()`. The shard streams through the output's `Storage` (a local file, or a
  multipart upload to an object store) and becomes an object only when whole; the
  commit record `commits/unit-XXXXXX.json` is then created if absent, so when Ray runs
  a unit twice exactly one attempt becomes visible and the other deletes its shard.
- Readers (`hsx.dataset.HiddenStatesDataset`, trainers) open the shards that commit
  records name with `ShardReader` (reader.py): memory-mapped on local disk (zero-copy
  views), ranged reads on object stores (one GET per sample); O(1) per sample either
  way. Nothing else in the output is ever read, so a crash at any moment leaves nothing
  visible but whole, committed shards.
- `verify_shard` (verify.py) checks a committed shard against its record's checksums
  (`hsx verify`, `Output.check_shards`).
- What the bytes mean, for all three (encoding.py): tensor names and dtypes, fp8
  quantization, checksums.

This package imports numpy only; torch is imported inside functions, and only when the
caller handed in a torch tensor or asked for torch output.
"""

from __future__ import annotations

from hsx.output.shards.encoding import (
    CHECKSUM_SCHEME,
    DEFAULT_CHECKSUM,
    DEFAULT_HEADER_RESERVE,
    FP8_MAX,
    IMAGE,
    MODALITY_MASK,
    SAMPLE_DIGESTS,
    SHARD_FORMAT_VERSION,
    Backend,
    Checksum,
    ShardCorrupt,
    StorageDtype,
    dequantize_fp8,
    new_hasher,
    quantize_fp8,
)
from hsx.output.shards.reader import ShardReader
from hsx.output.shards.verify import verify_shard
from hsx.output.shards.writer import (
    BACKGROUND_NICE_ENV,
    CommitResult,
    ShardWriter,
    background_priority,
)

__all__ = [
    "BACKGROUND_NICE_ENV",
    "CHECKSUM_SCHEME",
    "DEFAULT_CHECKSUM",
    "DEFAULT_HEADER_RESERVE",
    "FP8_MAX",
    "IMAGE",
    "MODALITY_MASK",
    "SAMPLE_DIGESTS",
    "SHARD_FORMAT_VERSION",
    "Backend",
    "Checksum",
    "CommitResult",
    "ShardCorrupt",
    "ShardReader",
    "ShardWriter",
    "StorageDtype",
    "background_priority",
    "dequantize_fp8",
    "new_hasher",
    "quantize_fp8",
    "verify_shard",
]
