"""The shard format: round trips, safetensors compatibility, commit protocol, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file

from hsx.output import CommitRecord, Output, OutputCorrupt, Storage
from hsx.output.layout import COMMITS_DIR, SHARDS_DIR, TMP_DIR
from hsx.output.shards import (
    FP8_MAX,
    ShardCorrupt,
    ShardReader,
    ShardWriter,
    dequantize_fp8,
    quantize_fp8,
    verify_shard,
)

LAYERS = [2, 4, 5, 8]
BF16 = np.dtype(ml_dtypes.bfloat16)
REPO = Path(__file__).resolve().parents[2]


def make_samples(
    n: int, hidden: int = 32, layers: int = len(LAYERS), seed: int = 0, first: int = 100
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        t = int(rng.integers(1, 20))
        out.append({
            "sample_index": first + 3 * k,
            "input_ids": rng.integers(0, 50_000, t).astype(np.int64),
            "loss_mask": rng.integers(0, 2, t).astype(np.uint8),
            "hidden_states": (rng.standard_normal((t, layers, hidden)) * 4).astype(np.float32),
        })
    return out


def write_unit(
    root: Path, unit: int, samples: list[dict[str, Any]], storage: str = "bf16", **kw: Any
) -> CommitRecord:
    hidden = samples[0]["hidden_states"].shape[-1] if samples else kw.pop("hidden_size", 32)
    with ShardWriter(root, unit, layers=LAYERS, hidden_size=hidden,
                     storage_dtype=storage, **kw) as w:  # type: ignore[arg-type]
        for s in samples:
            w.add(s["sample_index"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        result = w.commit()
    assert result.won
    return result.record


def verify(root: Path, record: CommitRecord) -> None:
    verify_shard(Storage.for_uri(root), record)


def read_commits(root: Path) -> list[CommitRecord]:
    return Output(root).commits()


def committed_units(root: Path) -> set[int]:
    return Output(root).committed_units()


def names(folder: Path) -> list[str]:
    """The files in a folder of the output (none when it was never made)."""
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def test_bf16_round_trip_numpy_exact(tmp_path: Path) -> None:
    samples = make_samples(7)
    samples[3]["hidden_states"] = samples[3]["hidden_states"].astype(BF16)  # bf16 input too
    record = write_unit(tmp_path, 3, samples)
    assert record.samples == 7
    assert record.tokens == sum(len(s["input_ids"]) for s in samples)
    assert record.sample_indices_first == 100 and record.sample_indices_last == 118
    with ShardReader(tmp_path / record.shard) as r:
        assert len(r) == 7 and r.layers == LAYERS and r.unit == 3
        for i, s in enumerate(samples):
            got = r.sample(i)
            assert got["sample_index"] == s["sample_index"]
            assert got["hidden_states"].dtype == BF16
            np.testing.assert_array_equal(
                bits(got["hidden_states"]), bits(s["hidden_states"].astype(BF16))
            )
            np.testing.assert_array_equal(got["input_ids"], s["input_ids"])
            assert got["input_ids"].dtype == np.int32
            np.testing.assert_array_equal(got["loss_mask"], s["loss_mask"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bf16_round_trip_torch_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(t, len(LAYERS), 48, generator=gen).to(dtype) for t in (5, 1, 9)]
    with ShardWriter(tmp_path, 0, layers=LAYERS, hidden_size=48, storage_dtype="bf16") as w:
        for k, x in enumerate(tensors):
            t = x.shape[0]
            w.add(k, torch.arange(t), torch.ones(t, dtype=torch.bool), x)
        record = w.commit().record
    r = ShardReader(tmp_path / record.shard)
    for k, x in enumerate(tensors):
        got = r.sample(k, backend="torch")["hidden_states"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
        want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(bits(r.sample(k)["hidden_states"]), want)


def test_caller_may_reuse_its_buffer_after_add(tmp_path: Path) -> None:
    """The writer thread writes later; add() must not keep borrowing the caller's memory."""
    buf_np = np.ones((4, len(LAYERS), 16), BF16)
    buf_pt = torch.ones(4, len(LAYERS), 16, dtype=torch.bfloat16)
    with ShardWriter(tmp_path, 0, layers=LAYERS, hidden_size=16, storage_dtype="bf16") as w:
        w.add(0, [1, 2, 3, 4], [1, 1, 1, 1], buf_np)
        buf_np[:] = 7
        w.add(1, [1, 2, 3, 4], [1, 1, 1, 1], buf_pt)
        buf_pt.fill_(7)
        record = w.commit().record
    r = ShardReader(tmp_path / record.shard)
    for i in range(2):
        assert (r.sample(i)["hidden_states"].astype(np.float32) == 1).all()


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_fp8_round_trip_within_e4m3_tolerance(tmp_path: Path, source: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, len(LAYERS), 256)).astype(np.float32)
    x[:, 1] *= 1e-3  # per-token, per-layer scales must cope with very different ranges
    x[:, 2] *= 300
    x[5, 3] = 0.0  # an all-zero row gets scale 1.0
    hs: Any = torch.from_numpy(x) if source == "torch" else x
    with ShardWriter(tmp_path, 1, layers=LAYERS, hidden_size=256, storage_dtype="fp8") as w:
        w.add(0, np.arange(64), np.ones(64), hs)
        record = w.commit().record
    r = ShardReader(tmp_path / record.shard)
    got = r.sample(0)["hidden_states"]
    assert got.dtype == BF16 and got.shape == x.shape
    deq = got.astype(np.float32)
    err = np.abs(deq - x)
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    # e4m3: 3 mantissa bits -> rounding error <= 2^-4 relative; bf16 output adds 2^-9.
    assert (err <= 2**-3 * np.abs(x) + 2**-8 * absmax + 1e-30).all()
    assert (err <= 2**-3 * absmax + 1e-30).all()
    norm_err = np.linalg.norm(deq - x, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)
    assert norm_err.max() < 0.03
    assert (deq[5, 3] == 0).all()

    raw = r.sample(0, dequantize=False)
    assert raw["hidden_states"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert raw["scales"].shape == (64, len(LAYERS)) and raw["scales"][5, 3] == 1.0
    np.testing.assert_allclose(raw["scales"], np.maximum(absmax[..., 0], 0) / FP8_MAX + (
        absmax[..., 0] == 0), rtol=1e-6)
    tgot = r.sample(0, backend="torch")["hidden_states"]
    assert tgot.dtype == torch.bfloat16
    np.testing.assert_array_equal(tgot.view(torch.int16).numpy().view(np.uint16), bits(got))


def test_fp8_helpers_numpy_and_torch_agree() -> None:
    x = np.random.default_rng(3).standard_normal((10, 3, 64)).astype(np.float32)
    q, s = quantize_fp8(x)
    qt, st = quantize_fp8(torch.from_numpy(x))
    np.testing.assert_allclose(s, st.numpy(), rtol=1e-7)
    np.testing.assert_array_equal(q.view(np.uint8), qt.view(torch.uint8).numpy())
    d = dequantize_fp8(q, s)
    dt = dequantize_fp8(qt, st)
    np.testing.assert_array_equal(bits(d), dt.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_fp8(np.full((1, 1, 4), np.inf, np.float32))


def test_fp8_shard_is_about_half_the_size(tmp_path: Path) -> None:
    x = np.random.default_rng(4).standard_normal((1500, 4, 256)).astype(np.float32)
    sizes = {}
    for unit, storage in enumerate(["bf16", "fp8"]):
        with ShardWriter(tmp_path, unit, layers=LAYERS, hidden_size=256,
                         storage_dtype=storage) as w:  # type: ignore[arg-type]
            for k in range(3):
                w.add(k, np.arange(500), np.ones(500), x[k * 500 : (k + 1) * 500])
            sizes[storage] = w.commit().record.bytes
    assert 0.45 <= sizes["fp8"] / sizes["bf16"] <= 0.6


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_safetensors_library_reads_shard(tmp_path: Path, storage: str) -> None:
    samples = make_samples(5, hidden=24)
    record = write_unit(tmp_path, 9, samples, storage)
    path = tmp_path / record.shard
    ours = ShardReader(path)
    names = {"hidden_states", "offsets", "sample_index", "input_ids", "loss_mask",
             "sample_digests"}
    if storage == "fp8":
        names.add("scales")
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == names
        meta = f.metadata()
        assert meta == {
            "format": "hsx-shard", "format_version": "1", "unit": "9",
            "layers": json.dumps(LAYERS), "storage_dtype": storage, "hidden_size": "24",
            "sample_digest": "blake3",
        }
        for name in names:
            theirs = f.get_tensor(name)
            mine = ours.torch_tensor(name)
            assert theirs.dtype == mine.dtype and theirs.shape == mine.shape
            assert torch.equal(theirs.view(torch.uint8), mine.view(torch.uint8))
    if storage == "bf16":
        # safetensors' numpy path knows bfloat16 once ml_dtypes registered it.
        loaded = np_load_file(str(path))
        assert set(loaded) == names
        for name in names:
            np.testing.assert_array_equal(
                loaded[name].view(np.uint8), ours.tensor(name).view(np.uint8)
            )
    # The writer's offsets keep int64 tensors aligned for zero-copy views.
    info = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert info["hidden_states"]["data_offsets"][0] == 0
    assert (8 + len(json.dumps(info))) <= ours._data_start


def test_header_region_grows_when_too_small(tmp_path: Path) -> None:
    samples = make_samples(4)
    record = write_unit(tmp_path, 0, samples, header_reserve=64)
    path = tmp_path / record.shard
    verify(tmp_path, record)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("offsets").tolist()[-1] == record.tokens
    r = ShardReader(path)
    np.testing.assert_array_equal(
        bits(r.sample(2)["hidden_states"]), bits(samples[2]["hidden_states"].astype(BF16))
    )
    assert not any((tmp_path / TMP_DIR).iterdir())


def test_unit_without_samples(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, 4, layers=LAYERS, hidden_size=8, storage_dtype="fp8") as w:
        result = w.commit(errors=[{"sample_index": 11, "reason": "engine failed"}])
    record = result.record
    assert record.samples == 0 and record.sample_indices_first is None
    assert [e.model_dump() for e in record.errors] == [
        {"sample_index": 11, "reason": "engine failed"}]
    with safe_open(str(tmp_path / record.shard), framework="pt") as f:
        assert tuple(f.get_tensor("hidden_states").shape) == (0, len(LAYERS), 8)
    assert len(ShardReader(tmp_path / record.shard)) == 0
    verify(tmp_path, record)


def test_random_access_matches_what_was_written(tmp_path: Path) -> None:
    samples = make_samples(60, hidden=16, seed=5)
    record = write_unit(tmp_path, 2, samples)
    r = ShardReader(tmp_path / record.shard)
    order = np.random.default_rng(6).permutation(60)
    for i in order:
        s = samples[i]
        got = r.sample(int(i))
        assert got["sample_index"] == s["sample_index"]
        np.testing.assert_array_equal(got["input_ids"], s["input_ids"])
        np.testing.assert_array_equal(
            bits(got["hidden_states"]), bits(s["hidden_states"].astype(BF16))
        )
    assert r.sample(-1)["sample_index"] == samples[-1]["sample_index"]
    with pytest.raises(IndexError):
        r.sample(60)
    # Zero-copy: a sample's hidden states are a view on the mapped file.
    assert r.sample(0)["hidden_states"].base is not None
    assert not r.sample(0)["hidden_states"].flags.writeable


def test_add_validates_shapes(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, 0, layers=LAYERS, hidden_size=16, storage_dtype="bf16") as w:
        x = np.zeros((5, 4, 16), np.float32)
        with pytest.raises(ValueError, match="4 input_ids but hidden_states has 5 tokens"):
            w.add(0, [1] * 4, [1] * 5, x)
        with pytest.raises(ValueError, match="loss_mask"):
            w.add(0, [1] * 5, [1] * 4, x)
        with pytest.raises(ValueError, match="3 layers, expected 4"):
            w.add(0, [1] * 5, [1] * 5, np.zeros((5, 3, 16), np.float32))
        with pytest.raises(ValueError, match="hidden size 8, expected 16"):
            w.add(0, [1] * 5, [1] * 5, np.zeros((5, 4, 8), np.float32))
        with pytest.raises(ValueError, match=r"\[T, L, H\]"):
            w.add(0, [1] * 5, [1] * 5, np.zeros((5, 64), np.float32))
        with pytest.raises(ValueError, match="dtype int64"):
            w.add(0, [1] * 5, [1] * 5, np.zeros((5, 4, 16), np.int64))
        w.add(0, [1] * 5, [1] * 5, x)
        with pytest.raises(ValueError, match="already added"):
            w.add(0, [1] * 5, [1] * 5, x)
        with pytest.raises(ValueError, match=r"samples \[0\] are both written and listed"):
            w.commit(errors=[{"sample_index": 0, "reason": "x"}])
        with pytest.raises(ValueError, match="sample_index and reason"):
            w.commit(errors=[{"index": 0}])
        w.abort()
    assert not any((tmp_path / TMP_DIR).iterdir())
    assert read_commits(tmp_path) == []


def test_context_manager_aborts_on_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(
        tmp_path, 0, layers=LAYERS, hidden_size=32, storage_dtype="bf16"
    ) as w:
        s = make_samples(1)[0]
        w.add(s["sample_index"], s["input_ids"], s["loss_mask"], s["hidden_states"])
        raise RuntimeError("boom")
    assert not any((tmp_path / TMP_DIR).iterdir())
    assert names(tmp_path / SHARDS_DIR) == []
    assert committed_units(tmp_path) == set()


def commit_side_by_side(writers: list[ShardWriter]) -> CommitRecord:
    """Commit every writer at the same moment (a thread each); exactly one must win, and
    every one must report the winner's record, which is returned."""
    barrier = threading.Barrier(len(writers))
    results: dict[str, Any] = {}

    def run(w: ShardWriter) -> None:
        barrier.wait()
        results[w.attempt] = w.commit()

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r.record for r in results.values() if r.won]
    assert len(won) == 1 and len(results) == len(writers)
    assert all(r.record == won[0] for r in results.values())  # losers report the winner
    return won[0]


def test_commit_is_create_if_absent(tmp_path: Path) -> None:
    samples = make_samples(3)
    writers = [
        ShardWriter(tmp_path, 7, layers=LAYERS, hidden_size=32, storage_dtype="bf16",
                    attempt=name)
        for name in ("aaaa", "bbbb")
    ]
    for w in writers:
        for s in samples:
            w.add(s["sample_index"], s["input_ids"], s["loss_mask"], s["hidden_states"])
    winner = commit_side_by_side(writers)
    won = [winner.attempt]
    assert names(tmp_path / SHARDS_DIR) == [Path(winner.shard).name]
    assert [r.attempt for r in read_commits(tmp_path)] == won
    assert committed_units(tmp_path) == {7}
    assert not any((tmp_path / TMP_DIR).iterdir())
    verify(tmp_path, winner)

    # A third attempt much later loses too and leaves nothing behind.
    late = ShardWriter(tmp_path, 7, layers=LAYERS, hidden_size=32, storage_dtype="bf16")
    late.add(1, [1], [1], np.zeros((1, 4, 32), np.float32))
    assert late.commit().won is False
    assert len(list((tmp_path / SHARDS_DIR).iterdir())) == 1


CRASH_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from hsx.output.shards import ShardWriter

    w = ShardWriter(sys.argv[1], 5, layers=[2, 4, 5, 8], hidden_size=64, storage_dtype="bf16")
    for k in range(4):
        w.add(k, np.arange(50), np.ones(50), np.ones((50, 4, 64), np.float32))
    w.flush()
    print("written", flush=True)
    sys.stdin.read()  # wait here until killed
    """
)


def test_sigkill_mid_write_leaves_nothing_visible(tmp_path: Path) -> None:
    write_unit(tmp_path, 0, make_samples(3))
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == b"written", line
        partial = list((tmp_path / TMP_DIR).iterdir())
        assert len(partial) == 1 and partial[0].stat().st_size > 4 * 50 * 4 * 64 * 2
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert committed_units(tmp_path) == {0}
    assert [r.unit for r in read_commits(tmp_path)] == [0]
    # A shard renamed into shards/ whose commit never happened is invisible too.
    (tmp_path / SHARDS_DIR / "unit-000005-dead.safetensors").write_bytes(b"x" * 100)
    assert Output(tmp_path).clean_orphans(final=True) == 2
    assert not any((tmp_path / TMP_DIR).iterdir())
    assert len(list((tmp_path / SHARDS_DIR).iterdir())) == 1
    verify(tmp_path, read_commits(tmp_path)[0])
    assert Output(tmp_path).clean_orphans(final=True) == 0


def test_checksum_is_blake3_and_sha256_on_request(tmp_path: Path) -> None:
    import hashlib

    import blake3

    record = write_unit(tmp_path / "b", 0, make_samples(3))
    sha = write_unit(tmp_path / "s", 0, make_samples(3), checksum="sha256")
    data = (tmp_path / "b" / record.shard).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    tail = header_end + _hidden_bytes(data)
    assert record.checksum is not None and sha.checksum is not None
    assert record.checksum.model_dump() == {"algorithm": "blake3", "scheme": "samples",
                                  "header": blake3.blake3(data[:header_end]).hexdigest(),
                                  "data": blake3.blake3(data[tail:]).hexdigest()}
    assert sha.checksum.algorithm == "sha256"
    # The data sections differ: each holds its samples' digests in its own algorithm.
    data = (tmp_path / "s" / sha.shard).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    tail = header_end + _hidden_bytes(data)
    assert sha.checksum.data == hashlib.sha256(data[tail:]).hexdigest()
    verify(tmp_path / "s", sha)
    with pytest.raises(ValueError, match="checksum must be"):
        ShardWriter(tmp_path, 1, layers=LAYERS, hidden_size=32, storage_dtype="bf16",
                    checksum="md5")  # type: ignore[arg-type]


def _hidden_bytes(shard: bytes) -> int:
    n = int.from_bytes(shard[:8], "little")
    return int(json.loads(shard[8 : 8 + n])["hidden_states"]["data_offsets"][1])


def test_records_whose_data_digest_covers_the_whole_section_still_verify(
        tmp_path: Path) -> None:
    import blake3

    record = write_unit(tmp_path, 0, make_samples(3))
    assert record.checksum is not None
    data = (tmp_path / record.shard).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    fields = json.loads(record.to_json())
    del fields["checksum"]["scheme"]  # as records written before schemes were
    fields["checksum"]["data"] = blake3.blake3(data[header_end:]).hexdigest()
    whole = CommitRecord.parse(json.dumps(fields).encode(), "whole-section record")
    assert whole.checksum_scheme() == "whole"
    verify(tmp_path, whole)
    with pytest.raises(ShardCorrupt, match="data checksum mismatch"):
        # the same digest read under the samples scheme
        assert whole.checksum is not None
        mixed = whole.checksum.model_copy(update={"scheme": "samples"})
        verify(tmp_path, record.model_copy(update={"checksum": mixed}))
    fields["checksum"]["scheme"] = "chunks"
    with pytest.raises(ShardCorrupt, match="scheme 'chunks' is unknown; upgrade hsx"):
        verify(tmp_path, CommitRecord.model_validate(fields))


def test_records_from_before_checksum_named_its_algorithm_still_verify(tmp_path: Path) -> None:
    import hashlib

    record = write_unit(tmp_path, 0, make_samples(3), checksum="sha256")
    assert record.checksum is not None
    fields = record.model_dump(exclude={"checksum"})
    fields["header_sha256"] = record.checksum.header
    # Such records' data digest covers the whole data section.
    data = (tmp_path / record.shard).read_bytes()
    fields["data_sha256"] = hashlib.sha256(
        data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()
    old = CommitRecord.parse(json.dumps(fields).encode(), "old record")
    verify(tmp_path, old)
    assert old.checksums() == ("sha256", fields["header_sha256"], fields["data_sha256"])
    bad = CommitRecord.model_validate({**fields, "data_sha256": "0" * 64})
    with pytest.raises(ShardCorrupt, match="data checksum mismatch"):
        verify(tmp_path, bad)
    none = CommitRecord.model_validate({k: v for k, v in fields.items() if "sha256" not in k})
    with pytest.raises(OutputCorrupt, match="has no checksum"):
        verify(tmp_path, none)


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_fp8_quantized_elsewhere_is_stored_as_it_is(tmp_path: Path, source: str) -> None:
    samples = make_samples(3)
    encoded = []
    with ShardWriter(tmp_path, 0, layers=LAYERS, hidden_size=32, storage_dtype="fp8") as w:
        for smp in samples:
            x = smp["hidden_states"]
            q, scales = quantize_fp8(torch.from_numpy(x) if source == "torch" else x)
            w.add(smp["sample_index"], smp["input_ids"], smp["loss_mask"], q, scales=scales)
            encoded.append((q, scales))
        w.commit()
    reader = ShardReader(tmp_path / read_commits(tmp_path)[0].shard)
    for i, (q, scales) in enumerate(encoded):
        raw = reader.sample(i, dequantize=False)
        q_np = q.view(torch.uint8).numpy() if source == "torch" else q.view(np.uint8)
        assert np.array_equal(raw["hidden_states"].view(np.uint8), q_np)
        assert np.array_equal(raw["scales"], np.asarray(scales))
    nan_scales = np.full((2, len(LAYERS)), np.nan, np.float32)
    q, _ = quantize_fp8(np.ones((2, len(LAYERS), 32), np.float32))
    with ShardWriter(tmp_path, 1, layers=LAYERS, hidden_size=32, storage_dtype="fp8") as w, \
            pytest.raises(ValueError, match="not finite"):
        w.add(1, [1, 2], [0, 1], q, scales=nan_scales)
    with ShardWriter(tmp_path, 2, layers=LAYERS, hidden_size=32, storage_dtype="bf16") as w, \
            pytest.raises(ValueError, match="in a bf16 shard"):
        w.add(1, [1, 2], [0, 1], q, scales=nan_scales)


def test_quantize_fp8_without_check_marks_bad_rows_with_nan_scales() -> None:
    x = torch.ones((2, 3, 8))
    x[1, 2, 5] = float("inf")
    _, scales = quantize_fp8(x, check=False)
    assert torch.isnan(scales[1, 2]) and torch.isfinite(scales[0]).all()
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_fp8(x)


def test_verify_catches_flipped_bytes(tmp_path: Path) -> None:
    record = write_unit(tmp_path, 0, make_samples(4))
    path = tmp_path / record.shard
    verify(tmp_path, record)
    original = path.read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")

    def flipped(pos: int) -> bytes:
        data = bytearray(original)
        data[pos] ^= 0x01
        return bytes(data)

    # The first and last byte of every tensor, hidden_states' last sample included: the
    # data digest covers the tail, the samples' digests (in the tail) cover the rest.
    header = json.loads(original[8:header_end])
    header.pop("__metadata__")
    for name, info in header.items():
        start, end = info["data_offsets"]
        for pos in (start, end - 1):
            path.write_bytes(flipped(header_end + pos))
            with pytest.raises(ShardCorrupt, match="data checksum mismatch"):
                verify(tmp_path, record)
            assert name  # (for the report of a failing case)
    assert "sample_digests" in header and "hidden_states" in header
    path.write_bytes(flipped(20))
    with pytest.raises(ShardCorrupt, match="header checksum mismatch"):
        verify(tmp_path, record)
    path.write_bytes(flipped(header_end - 1))  # in the space padding
    with pytest.raises(ShardCorrupt, match="header checksum mismatch"):
        verify(tmp_path, record)
    path.write_bytes(original[:-1])
    with pytest.raises(ShardCorrupt, match="bytes, its commit record says"):
        verify(tmp_path, record)
    path.unlink()
    with pytest.raises(ShardCorrupt, match="missing"):
        verify(tmp_path, record)
    path.write_bytes(original)
    verify(tmp_path, record)


def test_reader_refuses_foreign_files(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ShardCorrupt, match="not an hsx shard"):
        ShardReader(tmp_path / "other.safetensors")
    bad = {"unit": 0, "shard": "../../etc/passwd", "attempt": "a", "samples": 0, "tokens": 0,
           "bytes": 1}
    with pytest.raises(OutputCorrupt, match="bad shard"):
        CommitRecord.parse(json.dumps(bad).encode(), "a record")


def test_read_commits_sorted_and_ignores_other_files(tmp_path: Path) -> None:
    for unit in (12, 3, 7):
        write_unit(tmp_path, unit, make_samples(1, seed=unit))
    (tmp_path / COMMITS_DIR / "notes.txt").write_text("hi")
    assert [r.unit for r in read_commits(tmp_path)] == [3, 7, 12]
    assert committed_units(tmp_path) == {3, 7, 12}
    assert Output(tmp_path).read_commit(7) == read_commits(tmp_path)[1]
    assert read_commits(tmp_path / "nowhere") == []
