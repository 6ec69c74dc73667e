"""The dtype an engine computes in (hsx_workers/dtypes.py): `auto` on a CPU without native
bf16 is float32, what a job names it gets, a GPU keeps the model's own."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hsx_workers import dtypes


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_float32_only_on_a_cpu_without_native_bf16(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    assert dtypes.compute_dtype("auto", on_cpu=True) == ("auto" if native else "float32")
    assert dtypes.compute_dtype("auto", on_cpu=False) == "auto"
    for named in ("bfloat16", "float16", "float32"):
        assert dtypes.compute_dtype(named, on_cpu=True) == named
        assert dtypes.compute_dtype(named, on_cpu=False) == named
