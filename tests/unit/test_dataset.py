"""HiddenStatesDataset: indexing, backends, errors, follow mode, DataLoader, FORMAT.md."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
import torch

from hsx.dataset import HiddenStatesDataset
from hsx.output import CommitRecord, Output, ShardCorrupt, ShardWriter
from hsx.output.layout import COMPLETE, ERRORS
from tests.unit.outputs import make_manifest, write_inputs_table
from tests.unit.outputs import write_manifest as publish_manifest

LAYERS = [1, 3, 4, 6]
HIDDEN = 16
BF16 = np.dtype(ml_dtypes.bfloat16)
REPO = Path(__file__).resolve().parents[2]


def sample(idx: int) -> dict[str, Any]:
    """Deterministic sample content, so any reader can check what it got."""
    rng = np.random.default_rng(idx)
    t = 1 + idx % 7
    return {
        "sample_index": idx,
        "input_ids": rng.integers(0, 1000, t).astype(np.int32),
        "loss_mask": (np.arange(t) % 2).astype(np.uint8),
        "hidden_states": rng.standard_normal((t, len(LAYERS), HIDDEN)).astype(np.float32),
    }


def write_manifest(root: Path | str, units: dict[int, list[int]], storage: str = "bf16"
                   ) -> None:
    """A manifest planning `units` (unit -> sample indices, one inputs row each) and the
    inputs table; works for a local folder and a bucket URI alike."""
    rows = sorted(i for ids in units.values() for i in ids)
    ranges, start = [], 0
    for u in sorted(units):
        ranges.append((start, start + len(units[u])))
        start += len(units[u])
    publish_manifest(root, make_manifest(
        layers=LAYERS, hidden_size=HIDDEN, num_layers=6, storage_dtype=storage,
        units=ranges, num_samples=len(rows)))
    samples = [sample(i) for i in rows]
    write_inputs_table(root, rows, samples)


def write_unit(
    root: Path | str, unit: int, ids: list[int], storage: str = "bf16",
    errors: list[dict[str, Any]] | None = None,
) -> CommitRecord:
    with ShardWriter(Output(root).storage, unit, layers=LAYERS, hidden_size=HIDDEN,
                     storage_dtype=storage) as w:  # type: ignore[arg-type]
        for i in ids:
            s = sample(i)
            w.add(i, s["input_ids"], s["loss_mask"], s["hidden_states"])
        return w.commit(errors=errors or []).record


UNITS = {0: [0, 1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9, 10, 11]}


@pytest.fixture()
def output(tmp_path: Path) -> Path:
    root = tmp_path / "out"
    write_manifest(root, UNITS)
    for unit in (2, 0, 1):  # commit order must not matter
        write_unit(root, unit, UNITS[unit])
    return root


def check(got: dict[str, Any], *, torch_out: bool) -> None:
    want = sample(got["sample_index"])
    hs = got["hidden_states"]
    if torch_out:
        assert isinstance(hs, torch.Tensor) and hs.dtype == torch.bfloat16
        hs = hs.view(torch.int16).numpy().view(BF16)
        ids = got["input_ids"].numpy()
    else:
        assert isinstance(hs, np.ndarray) and hs.dtype == BF16
        ids = got["input_ids"]
    assert hs.shape == want["hidden_states"].shape
    np.testing.assert_array_equal(hs.view(np.uint16),
                                  want["hidden_states"].astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(ids, want["input_ids"])


def test_len_and_getitem_in_unit_order(output: Path) -> None:
    ds = HiddenStatesDataset(output, backend="numpy")
    assert len(ds) == 12
    assert [ds[i]["sample_index"] for i in range(12)] == list(range(12))
    assert ds[-1]["sample_index"] == 11
    assert ds[np.int64(5)]["sample_index"] == 5
    with pytest.raises(IndexError):
        ds[12]
    for i in np.random.default_rng(0).permutation(12):
        check(ds[int(i)], torch_out=False)
    assert ds.manifest.layers == LAYERS
    assert [r.unit for r in ds.records] == [0, 1, 2]
    assert [s["sample_index"] for s in ds] == list(range(12))
    assert ds.verify() == 3


def test_backends(output: Path) -> None:
    check(HiddenStatesDataset(output, backend="torch")[3], torch_out=True)
    check(HiddenStatesDataset(output)[3], torch_out=True)  # auto: torch is installed here
    got = HiddenStatesDataset(output, backend="numpy")[3]
    check(got, torch_out=False)
    assert isinstance(got["loss_mask"], np.ndarray) and isinstance(got["sample_index"], int)
    with pytest.raises(ValueError, match="backend"):
        HiddenStatesDataset(output, backend="jax")  # type: ignore[arg-type]


def test_fp8_output_is_dequantized(tmp_path: Path) -> None:
    root = tmp_path / "fp8"
    write_manifest(root, {0: [0, 1, 2]}, storage="fp8")
    write_unit(root, 0, [0, 1, 2], storage="fp8")
    for backend in ("numpy", "torch"):
        ds = HiddenStatesDataset(root, backend=backend)  # type: ignore[arg-type]
        got = ds[2]["hidden_states"]
        got = got.float().numpy() if backend == "torch" else got.astype(np.float32)
        want = sample(2)["hidden_states"]
        rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
        assert rel.max() < 0.05  # H=16 rows are noisy; test_shards checks 3% at H=256


def test_uri_forms_and_missing_output(output: Path, tmp_path: Path) -> None:
    assert len(HiddenStatesDataset(f"file://{output}")) == 12
    assert len(HiddenStatesDataset(str(output))) == 12
    assert len(HiddenStatesDataset(Output(output))) == 12
    with pytest.raises(ValueError, match="unsupported storage URI"):
        HiddenStatesDataset("ftp://host/job")
    with pytest.raises(FileNotFoundError, match=f"no hsx output at {tmp_path / 'nope'}"):
        HiddenStatesDataset(tmp_path / "nope")


def test_errors_merge_ingestion_and_commit_records(tmp_path: Path) -> None:
    root = tmp_path / "out"
    write_manifest(root, {0: [0, 2], 1: [5]})
    table = pa.table({"sample_index": pa.array([4, 1], pa.int64()),
                      "reason": pa.array(["empty", "too long"])})
    with pa.OSFile(str(root / ERRORS), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    write_unit(root, 0, [0, 2], errors=[{"sample_index": 3, "reason": "engine failed"}])
    write_unit(root, 1, [5])
    ds = HiddenStatesDataset(root)
    assert ds.errors() == [
        {"sample_index": 1, "reason": "too long"},
        {"sample_index": 3, "reason": "engine failed"},
        {"sample_index": 4, "reason": "empty"},
    ]
    (root / ERRORS).unlink()
    assert ds.errors() == [{"sample_index": 3, "reason": "engine failed"}]


def test_refresh_and_complete(tmp_path: Path) -> None:
    root = tmp_path / "out"
    write_manifest(root, UNITS)
    ds = HiddenStatesDataset(root, backend="numpy")
    assert len(ds) == 0 and not ds.complete
    write_unit(root, 1, UNITS[1])
    assert len(ds) == 0  # nothing changes until refresh()
    assert ds.refresh() == 1 and len(ds) == 3
    write_unit(root, 0, UNITS[0])
    assert ds.refresh() == 1 and ds.refresh() == 0
    assert [ds[i]["sample_index"] for i in range(len(ds))] == list(range(7))
    (root / COMPLETE).write_text("{}")
    assert ds.complete


def test_follow_sees_shards_as_they_are_committed(tmp_path: Path) -> None:
    root = tmp_path / "out"
    write_manifest(root, UNITS)
    write_unit(root, 1, UNITS[1])
    progress: list[int] = []

    def job() -> None:
        for unit in (2, 0):
            while len(progress) < 3:  # wait until the reader has consumed unit 1
                time.sleep(0.01)
            time.sleep(0.1)
            write_unit(root, unit, UNITS[unit])
        time.sleep(0.1)
        (root / COMPLETE).write_text("{}")

    ds = HiddenStatesDataset(root, follow=True, backend="numpy", poll_interval=0.02, timeout=20)
    thread = threading.Thread(target=job)
    thread.start()
    try:
        for s in ds:
            progress.append(s["sample_index"])
            check(s, torch_out=False)
    finally:
        thread.join()
    assert progress == [4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3]
    assert len(ds) == 12


def test_follow_shards_and_timeout(output: Path) -> None:
    ds = HiddenStatesDataset(output, follow=True, poll_interval=0.02, timeout=0.2)
    seen = []
    with pytest.raises(TimeoutError, match="no new shard"):
        for reader in ds.shards():
            seen.append(reader.record.unit if reader.record else None)
    assert seen == [0, 1, 2]
    (output / COMPLETE).write_text("{}")
    assert [r.unit for r in ds.shards()] == [0, 1, 2]


def test_follow_ends_early_when_its_stop_says_so(output: Path) -> None:
    ds = HiddenStatesDataset(output, follow=True, poll_interval=0.02)  # no timeout
    asked: list[int] = []

    def stop() -> bool:  # "go on" once, then "stop"
        asked.append(len(ds.records))
        return len(asked) > 1

    units = [r.unit for r in ds.shards(stop=stop)]
    # Every committed shard first; the stop is asked only while waiting for the next.
    assert units == [0, 1, 2] and asked == [3, 3]


def test_verify_reports_corrupt_shards(output: Path) -> None:
    ds = HiddenStatesDataset(output)
    path = output / ds.records[1].shard
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match=r"1 corrupt shard.*unit 1.*data checksum mismatch"):
        ds.verify()


def test_pickle_drops_open_shards(output: Path) -> None:
    ds = HiddenStatesDataset(output, backend="numpy", max_open_shards=2)
    for i in range(12):
        ds[i]
    assert len(ds._readers) == 2  # bounded cache
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone._readers) == 0 and len(clone) == 12
    check(clone[7], torch_out=False)


def collate_list(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return batch


def read_with_workers(ds: HiddenStatesDataset, context: str) -> list[int]:
    """Every sample through a DataLoader with two workers, checked; their indices."""
    ds[0]  # the parent has open shards (and connections) when workers start
    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
        ds,  # type: ignore[arg-type]  # map-style by protocol, not by base class
        batch_size=3, num_workers=2, collate_fn=collate_list,
        multiprocessing_context=context, shuffle=True,
    )
    seen = []
    for batch in loader:
        for s in batch:
            check(s, torch_out=True)
            seen.append(s["sample_index"])
    return sorted(seen)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_with_two_workers(output: Path, context: str) -> None:
    assert read_with_workers(HiddenStatesDataset(output), context) == list(range(12))


def test_import_does_not_pull_heavy_modules() -> None:
    code = textwrap.dedent(
        """
        import sys
        import hsx.output, hsx.dataset
        from hsx.dataset import HiddenStatesDataset
        heavy = sorted(m for m in ("torch", "vllm", "ray") if m in sys.modules)
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_numpy_backend_never_imports_torch(output: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from hsx.dataset import HiddenStatesDataset
        ds = HiddenStatesDataset({str(output)!r}, backend="numpy")
        got = [ds[i] for i in range(len(ds))] + list(ds)
        ds.verify()
        ds.errors()
        print(type(got[0]["hidden_states"]).__name__, "torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "ndarray False", out.stdout + out.stderr


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_format_md_example_runs(tmp_path: Path, storage: str) -> None:
    """The "Reading without hsx" example in docs/FORMAT.md, run as written."""
    root = tmp_path / "out"
    write_manifest(root, {0: [3, 4]}, storage=storage)
    write_unit(root, 0, [3, 4], storage=storage)
    text = (REPO / "docs" / "FORMAT.md").read_text()
    section = text.split("## Reading without hsx", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    code = match.group(1)
    placeholder = 'output = Path("/path/to/output")'
    assert placeholder in code
    code = code.replace(placeholder, f"output = Path({str(root)!r})")
    namespace: dict[str, Any] = {}
    exec(compile(code, "FORMAT.md", "exec"), namespace)
    assert namespace["sample_index"] == 3
    hidden = namespace["hidden"]
    assert hidden.dtype == torch.bfloat16
    ours = HiddenStatesDataset(root, backend="torch")[0]["hidden_states"]
    assert torch.equal(hidden.view(torch.int16), ours.view(torch.int16))
