"""The self-check's verdicts on states made here (no engine): right states pass, each
kind of wrong one is named with its sample and layer; `warn` records, `off` skips."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from hsx_workers import state_faults
from hsx_workers.selfcheck import (
    MAX_RECORDED,
    StatesCheck,
    StatesCheckFailed,
    is_check_failure,
    row_norms,
)

LAYERS = [2, 8, 13, 16]


def _sample(seed: int, tokens: int = 64, hidden: int = 128) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.array([0.02, 0.5, 1.0, 3.0], dtype=np.float32)[None, :, None]
    x = rng.standard_normal((tokens, len(LAYERS), hidden), dtype=np.float32) * scale
    return x.astype(ml_dtypes.bfloat16)


def _run(mode: str, fault: str | None = None, samples: int = 12) -> dict[str, Any]:
    """A unit of `samples` checked; its report."""
    check = StatesCheck(mode, LAYERS)
    for i in range(samples):
        states, scales = _sample(i), None
        if fault is not None:
            states, scales = state_faults.apply(fault, i, states, scales)
        check.check(i, states, scales)
    return check.take_report()


def test_right_states_pass() -> None:
    report = _run("on")
    assert report == {"mode": "on", "samples": 12, "problems": 0, "found": [],
                      "head_samples": 0, "head_rows": 0, "head_agreed": 0,
                      "head_missing": "no head loaded"}


@pytest.mark.parametrize("fault, words", [
    ("zeros", "sample 0 (dataset row 0), layer 2: 64 of 64 rows are all zeros"),
    ("nan:3", "sample 3 (dataset row 3), layer 13: 1 of 64 rows hold NaN or inf"),
    ("copy_layer", "sample 0 (dataset row 0), layers 2 and 8 hold identical states"),
    ("scale:1e4:9", "sample 9 (dataset row 9), layer 2: its median row RMS is"),
    ("scale:1e4:1", "sample 1 (dataset row 1), layer 2: its median row RMS is"),  # reference
    ("scale:1e-4:10", "times the job's first samples'"),
    ("scale:1e9", "outside [1e-06, 100000]"),
])
def test_each_wrong_state_trips_naming_sample_and_layer(fault: str, words: str) -> None:
    with pytest.raises(StatesCheckFailed) as caught:
        _run("on", fault)
    assert words in str(caught.value), str(caught.value)
    assert is_check_failure(caught.value)


def test_warn_records_and_goes_on_off_skips() -> None:
    report = _run("warn", "nan:3")
    assert report["samples"] == 12 and report["problems"] == 1
    assert "sample 3 " in report["found"][0]
    assert len(_run("warn", "zeros")["found"]) == MAX_RECORDED
    assert _run("off", "zeros")["samples"] == 0


def test_a_zero_embedding_row_is_no_problem_but_a_zero_layer_is() -> None:
    check = StatesCheck("on", [0, 4])
    states = np.ones((8, 2, 16), dtype=np.float32)
    states[3, 0] = 0  # a padding token's embedding
    check.check(0, states)
    assert check.take_report()["problems"] == 0
    states = states.copy()  # a sample's states are not written to while it is checked
    states[:, 0] = 0
    check.check(1, states)
    with pytest.raises(StatesCheckFailed, match="layer 0: 8 of 8 rows are all zeros"):
        check.take_report()


def test_norms_of_fp8_with_scales_and_of_torch_states() -> None:
    x = np.full((4, 2, 16), 0.5, dtype=np.float32)
    q = x.astype(ml_dtypes.float8_e4m3fn)
    scales = np.full((4, 2), 2.0, dtype=np.float32)
    assert torch.allclose(row_norms(q, scales), torch.full((4, 2), 4.0))
    assert torch.allclose(row_norms(torch.from_numpy(x)), torch.full((4, 2), 2.0))
    check = StatesCheck("on", [1, 2])
    check.check(0, q, scales)
    with pytest.raises(StatesCheckFailed, match="identical"):
        check.take_report()
    with pytest.raises(StatesCheckFailed, match="identical"):  # and at the next sample
        check.check(1, q, scales)


def test_a_fault_names_a_known_kind() -> None:
    with pytest.raises(ValueError, match="names no fault"):
        state_faults.parse("nan")
