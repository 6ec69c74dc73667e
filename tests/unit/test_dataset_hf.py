"""HiddenStatesDataset to Hugging Face `datasets`: the same samples, and no copy made.

"No copy" is checked on addresses: the Arrow buffers of the map-style Dataset and the
tensors the IterableDataset yields point into the memory-mapped shard files.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from hsx.dataset import HiddenStatesDataset
from tests.unit.test_dataset import LAYERS, UNITS, output, sample, write_manifest, write_unit

__all__ = ["output"]  # the fixture, used by name below
datasets = pytest.importorskip("datasets")
BF16 = np.dtype(ml_dtypes.bfloat16)


def _mapped(ds: HiddenStatesDataset) -> list[tuple[int, int]]:
    """(start, end) addresses of every shard mapping the dataset holds."""
    ranges = []
    for reader in ds.shards():
        view = reader.tensor("hidden_states")
        base = view
        while not isinstance(base, mmap.mmap) and getattr(base, "base", None) is not None:
            base = base.base
        start = np.frombuffer(base, dtype=np.uint8).ctypes.data
        ranges.append((start, start + len(base)))
    return ranges


def _inside(address: int, ranges: list[tuple[int, int]]) -> bool:
    return any(a <= address < b for a, b in ranges)


def test_map_style_dataset_is_a_view_of_the_shards(output: Path) -> None:
    source = HiddenStatesDataset(output, backend="numpy")
    hf = source.to_hf_dataset()
    assert isinstance(hf, datasets.Dataset)
    assert hf.num_rows == len(source) == 12
    assert hf.column_names == ["sample_index", "input_ids", "loss_mask", "hidden_states"]
    assert hf["sample_index"] == [source[i]["sample_index"] for i in range(12)]
    ranges = _mapped(source)
    column = hf.data.column("hidden_states")
    assert column.num_chunks == len(UNITS)  # one chunk per shard
    for chunk in column.chunks:
        data = chunk.values.values.values.buffers()[1]
        assert _inside(data.address, ranges), "hidden_states were copied"
    for chunk in hf.data.column("input_ids").chunks:
        assert _inside(chunk.values.buffers()[1].address, ranges), "input_ids were copied"

    for i in (0, 5, 11):
        row = hf.with_format("arrow")[i]
        want = sample(row["sample_index"][0].as_py())
        bits = row["hidden_states"][0].values.flatten().flatten().to_numpy()
        states = bits.view(BF16).reshape(-1, len(LAYERS), want["hidden_states"].shape[-1])
        np.testing.assert_array_equal(states, want["hidden_states"].astype(BF16))
        np.testing.assert_array_equal(row["input_ids"][0].values.to_numpy(), want["input_ids"])
        assert hf[i]["loss_mask"] == want["loss_mask"].tolist()
    # The documented way back from datasets' numpy format (which makes int64 of them).
    as_numpy = hf.with_format("numpy")[3]["hidden_states"]
    back = np.asarray(as_numpy).astype(np.uint16).view(BF16)
    np.testing.assert_array_equal(back, sample(3)["hidden_states"].astype(BF16))


def test_map_style_dataset_of_fp8_keeps_its_scales(tmp_path: Path) -> None:
    root = tmp_path / "fp8"
    write_manifest(root, {0: [0, 1, 2]}, storage="fp8")
    write_unit(root, 0, [0, 1, 2], storage="fp8")
    source = HiddenStatesDataset(root, backend="numpy")
    hf = source.to_hf_dataset()
    assert hf.column_names[-2:] == ["hidden_states", "scales"]
    row = hf.with_format("arrow")[2]
    raw = source.shards().__next__().sample(2, dequantize=False)
    bits = row["hidden_states"][0].values.flatten().flatten().to_numpy()
    np.testing.assert_array_equal(bits, raw["hidden_states"].reshape(-1).view(np.uint8))
    scales = row["scales"][0].values.flatten().to_numpy()
    np.testing.assert_array_equal(scales, raw["scales"].reshape(-1))


def test_iterable_dataset_yields_the_views_themselves(output: Path) -> None:
    source = HiddenStatesDataset(output, backend="torch")
    hf = source.to_hf_iterable()
    assert isinstance(hf, datasets.IterableDataset)
    got = list(hf)
    assert [s["sample_index"] for s in got] == list(range(12))
    ranges = _mapped(source)
    for s in got:
        hs = s["hidden_states"]
        assert isinstance(hs, torch.Tensor) and hs.dtype == torch.bfloat16
        assert _inside(hs.data_ptr(), ranges), "the tensor was copied"
        want = sample(s["sample_index"])["hidden_states"].astype(BF16)
        np.testing.assert_array_equal(hs.view(torch.int16).numpy().view(BF16), want)


def test_iterable_dataset_in_a_dataloader_with_workers(output: Path) -> None:
    hf = HiddenStatesDataset(output, backend="torch").to_hf_iterable()
    assert hf.num_shards == len(UNITS)
    loader = torch.utils.data.DataLoader(hf, batch_size=None, num_workers=2)
    assert sorted(s["sample_index"] for s in loader) == list(range(12))


def test_empty_output_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    write_manifest(root, {0: [0]})
    with pytest.raises(ValueError, match="no committed shard"):
        HiddenStatesDataset(root).to_hf_dataset()
