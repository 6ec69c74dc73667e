"""vllm_compat's fix of sampling under capture on vLLM's CPU platform (the platform of
these machines): the installed function expands per-request values over draft tokens the
way vLLM's kernel means to, where the CPU build's own returns uninitialized memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
rejection_sampler = pytest.importorskip("vllm.v1.sample.rejection_sampler")


def test_expansion_over_draft_tokens_is_exact() -> None:
    from vllm.platforms import current_platform

    from hsx_workers.vllm_compat import fix_cpu_sampling_constraints

    if not current_platform.is_cpu():
        pytest.skip("the fix applies to vLLM's CPU platform only")
    assert fix_cpu_sampling_constraints()
    assert fix_cpu_sampling_constraints()  # twice is once
    expand = rejection_sampler.expand_batch_to_tokens
    # Three requests with 2, 0 and 3 draft tokens; the second is greedy (-1 -> 1).
    temperature = torch.tensor([0.8, -1.0, 0.5])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = expand(temperature, cu, 5, replace_from=-1, replace_to=1)
    assert out.dtype == temperature.dtype
    assert out.tolist() == pytest.approx([0.8, 0.8, 0.5, 0.5, 0.5])
    top_k = torch.tensor([5, 7, -1], dtype=torch.int32)
    assert expand(top_k, torch.tensor([1, 3, 4]), 4).tolist() == [5, 7, 7, -1]
    # Every value is written: nothing is left of the memory it was given.
    for _ in range(20):
        assert torch.isfinite(expand(torch.rand(64), torch.arange(1, 65) * 2, 128)).all()
