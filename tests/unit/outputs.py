"""Building hsx outputs by hand in tests (no engines), on local disk or in a bucket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from hsx.output import Manifest, Output, UnitPlan
from hsx.output.layout import INPUTS, LAYER_CONVENTION


def make_manifest(
    *,
    layers: list[int],
    hidden_size: int,
    num_layers: int,
    units: list[tuple[int, int]] | dict[int, list[int]],
    storage_dtype: str = "bf16",
    model: str = "tiny",
    num_samples: int | None = None,
    **extra: Any,
) -> Manifest:
    """A manifest as `prepare` writes one. `units`: row ranges [start, end) per unit, or
    unit -> the rows it holds (contiguous)."""
    ranges = ([(rows[0], rows[-1] + 1) if rows else (0, 0) for _, rows in sorted(units.items())]
              if isinstance(units, dict) else list(units))
    numbers = sorted(units) if isinstance(units, dict) else list(range(len(ranges)))
    fields: dict[str, Any] = {
        "hsx_version": "test", "job_fingerprint": "job", "dataset_fingerprint": "data",
        "model": model, "architecture": "LlamaForCausalLM", "num_layers": num_layers,
        "hidden_size": hidden_size, "layers": layers, "layer_convention": LAYER_CONVENTION,
        "storage_dtype": storage_dtype, "engine": "vllm", "tokenizer_fingerprint": "tok",
        "max_seq_len": 4096,
        "num_samples": num_samples if num_samples is not None else max(
            (end for _, end in ranges), default=0),
        "num_errors": 0, "num_tokens": 0,
        "units": [UnitPlan(unit=u, rows=r, tokens=0) for u, r in zip(numbers, ranges,
                                                                     strict=True)],
        "created_at": 0.0, "spec": {},
        **extra,
    }
    return Manifest.model_validate(fields)


def write_manifest(output: Output | Path | str, manifest: Manifest) -> Output:
    """Publish `manifest` into the output (making a local folder first)."""
    out = Output.of(output)
    root = out.local_root
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    out.publish_manifest(manifest)
    return out


def write_inputs_table(output: Output | Path | str, rows: list[int],
                       samples: list[dict[str, Any]]) -> None:
    """inputs.arrow as ingestion writes it: one row per sample, in `rows` order."""
    table = pa.table({
        "sample_index": pa.array(rows, pa.int64()),
        "input_ids": pa.array([s["input_ids"].tolist() for s in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s["loss_mask"].tolist() for s in samples], pa.list_(pa.uint8())),
        "length": pa.array([len(s["input_ids"]) for s in samples], pa.int32()),
    })
    writer = Output.of(output).table_writer(INPUTS)
    for batch in table.to_batches():
        writer.write(batch)
    writer.commit()


def flip_sample_byte(shard: Path, sample: int, tensor: str = "hidden_states") -> int:
    """Flip one byte in the middle of sample `sample`'s rows of `tensor` in a shard file
    (in place, as a failing disk would); returns that sample's sample_index."""
    from hsx.output.shards import ShardReader
    from hsx.output.shards.encoding import NUMPY_DTYPES

    reader = ShardReader(shard)
    info = reader._tensors[tensor]
    row_bytes = NUMPY_DTYPES[info["dtype"]].itemsize
    for dim in info["shape"][1:]:
        row_bytes *= dim
    first, last = int(reader.offsets[sample]), int(reader.offsets[sample + 1])
    at = reader._data_start + info["data_offsets"][0] + (first + last) // 2 * row_bytes
    index = int(reader.sample_indices[sample])
    reader.close()
    with open(shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))
    return index
