"""The head check against transformers' own forward: lm_head(norm(h_N)) read from the
checkpoint gives the model's next token, where the head lives (plain, tied, a wrapper's
language model); a normed id N and another request's states are found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hsx_workers import state_faults
from hsx_workers.headcheck import (
    AGREEMENT_ROWS,
    HEAD_FIRST_ROWS,
    HEAD_ROWS,
    FinalHead,
    HeadSample,
    HeadVerdict,
    check_samples,
    pooled_problem,
)
from hsx_workers.selfcheck import StatesCheck, StatesCheckFailed
from hsx_workers.tiny_models import make_tiny_model


def _check_one(head: FinalHead, *fields: Any, **named: Any) -> HeadVerdict:
    """The head check of one sample (HeadSample's fields)."""
    return check_samples(head, [HeadSample(*fields, **named)])[0]


def _forward(model_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """(id N before the final norm [T, H], the model's own top-1 per position)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    kept: dict[str, torch.Tensor] = {}
    model.model.norm.register_forward_pre_hook(lambda _m, a: kept.__setitem__("h", a[0]))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    return kept["h"][0], logits.float().argmax(-1).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", num_layers=2)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # a head of its own; tied, 1+w norm
def test_the_head_read_from_the_checkpoint_gives_the_models_next_token(
    arch: str, llama: Path, tmp_path: Path,
) -> None:
    model = llama if arch == "llama" else make_tiny_model(tmp_path, arch, num_layers=2)
    head = FinalHead.load(str(model))
    assert head.missing == "" and head.offset == (arch == "gemma2")
    ids = torch.randint(0, head.head_weight.shape[0], (96,), generator=torch.Generator()
                        .manual_seed(0))
    last, top1 = _forward(model, ids)
    verdict = _check_one(head, last, top1, layer=2)
    assert verdict.problems == [] and verdict.rows == 64
    assert verdict.agreed >= 0.98 * verdict.rows


def test_an_engine_with_random_weights_has_no_head_to_compare(llama: Path) -> None:
    head = FinalHead.of_engine(str(llama), {"load_format": "dummy"})
    assert "load_format: dummy" in head.missing
    assert FinalHead.of_engine(str(llama), {}).missing == ""


def test_a_wrappers_head_is_read_under_its_prefix(tmp_path: Path) -> None:
    head = FinalHead.load(str(make_tiny_model(tmp_path, "kimi_k25", num_layers=2)))
    assert head.missing == "" and head.head_weight.ndim == 2


def test_a_model_whose_norm_hsx_does_not_know_has_no_head(llama: Path, tmp_path: Path
                                                           ) -> None:
    import json
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(llama, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "newarch"}))
    assert "model type 'newarch'" in FinalHead.load(str(copy)).missing


def test_a_normed_last_state_and_another_requests_states_are_found(llama: Path) -> None:
    head = FinalHead.load(str(llama))
    g = torch.Generator().manual_seed(1)
    vocab = head.head_weight.shape[0]
    last, top1 = _forward(llama, torch.randint(0, vocab, (80,), generator=g))
    normed = _check_one(head, head.norm(last).to(last.dtype), top1, layer=2)
    assert any("after the final norm" in p for p in normed.problems)
    other, _ = _forward(llama, torch.randint(0, vocab, (80,), generator=g))
    swapped = _check_one(head, other, top1, layer=2)
    assert any("agrees with the engine's own next token" in p for p in swapped.problems)


def test_samples_checked_in_one_product_get_each_its_own_verdict(llama: Path) -> None:
    head = FinalHead.load(str(llama))
    g = torch.Generator().manual_seed(2)
    vocab = head.head_weight.shape[0]
    last, top1 = _forward(llama, torch.randint(0, vocab, (80,), generator=g))
    other, _ = _forward(llama, torch.randint(0, vocab, (40,), generator=g))
    samples = [HeadSample(last, top1, 2, 2.0**-8), HeadSample(other, top1[:40], 2, 2.0**-4),
               HeadSample(head.norm(last).to(last.dtype), None, 2, 2.0**-8),
               HeadSample(last[:30], top1[:30], 2, 0.0)]
    together = check_samples(head, [*samples, HeadSample(last, top1, 2, rows=32)])
    assert together[:4] == [_check_one(head, *sample) for sample in samples]
    assert together[4].rows == 32 and together[4].agreed >= 31
    assert together[0].problems == [] and together[0].rows == 64
    assert "agrees with the engine's own next token" in together[1].problems[0]
    assert together[2].rows == 0 and "after the final norm" in together[2].problems[0]
    assert together[3].rows == 30 and together[3].agreed >= 29


def test_the_pooled_agreement_is_judged_once_enough_rows_are_in() -> None:
    assert pooled_problem(100, 50, 4) is None  # too few rows to judge
    assert pooled_problem(1000, 990, 4) is None
    problem = pooled_problem(1000, 960, 4)  # as vLLM #50815 measured
    assert problem is not None and "960 of 1000" in problem and "layer 4" in problem


def test_the_self_check_takes_the_first_requests_then_one_in_a_thousand(llama: Path
                                                                        ) -> None:
    head = FinalHead.load(str(llama))
    check = StatesCheck("on", [1, 2], num_layers=2, head=head)
    picked = [i for i in range(3000) if check.picks(i)]
    assert picked == [0, 1, 2, 3, 4, 5, 6, 7, 999, 1999, 2999]
    # the first ones' rows are together what the pooled agreement is judged from
    assert [check._picked[i] for i in picked] == [HEAD_FIRST_ROWS] * 8 + [HEAD_ROWS] * 3
    assert HEAD_FIRST_ROWS * 8 == AGREEMENT_ROWS
    assert StatesCheck("on", [0, 1], num_layers=2, head=head).head_missing == \
        "id N (2) is not captured"
    assert not StatesCheck("off", [1, 2], num_layers=2, head=head).picks(0)


def test_a_postnorm_fault_trips_the_check_before_the_unit_commits(llama: Path) -> None:
    head = FinalHead.load(str(llama))
    check = StatesCheck("on", [1, 2], num_layers=2, head=head)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, head.head_weight.shape[0], (40,), generator=g)
    last, top1 = _forward(llama, ids)
    states = torch.stack([last * 0.5, last], dim=1)  # [T, 2, H]: id 1 stands in
    assert check.picks(7)
    faulty, _ = state_faults.apply("postnorm", 7, states, None, head=head, last=check.last)
    with pytest.raises(StatesCheckFailed, match=r"sample 7 .*layer 2: every row"):
        check.check(7, faulty, None, top1)
        check.settle(check.finish())  # as the worker's committer does


def _float32_agrees(head: FinalHead, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The check as a float32 product of the whole head computes it (bf16 states)."""
    from hsx_workers.headcheck import BF16_ROUNDOFF, TIE_SIGMAS, TIE_ULPS

    normed = head.norm(states).to(head.head_weight.dtype).float()
    weight = head.head_weight.float()
    logits = normed @ weight.T
    best, best_id = logits.max(-1)
    theirs = logits.gather(1, tokens[:, None])[:, 0]
    step = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - 7)
    noise = torch.linalg.vector_norm(weight[best_id] * normed, dim=-1) * BF16_ROUNDOFF / 3**0.5
    return theirs >= best - TIE_ULPS * step - TIE_SIGMAS * noise


@pytest.mark.parametrize("threads", [1, 2])  # the worker's one thread: vocabulary slices
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp16: a float32 copy
def test_the_head_dtype_product_gives_the_float32_products_verdicts(
    threads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 head (the product in bf16, split over threads when torch keeps one; the
    top logits again in float32) and a float16 one (through its float32 copy) agree with
    a float32 product of the whole head on every row: the argmax tokens, near-ties just
    inside and outside the tolerance, and random tokens. A candidate list that missed the
    true argmax would pass random tokens."""
    import hsx_workers.headcheck as headcheck
    from hsx.finalnorm import FinalNorm

    gen = torch.Generator().manual_seed(1)
    vocab, hidden, rows = 5003, 64, 300
    weight = torch.randn(vocab, hidden, generator=gen).to(dtype)
    head = FinalHead(FinalNorm(torch.ones(hidden).to(dtype), 1e-6, False), weight)
    states = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    logits = head.norm(states).to(dtype).float() @ weight.float().T
    ranked = logits.argsort(-1, descending=True)
    # Per row: the argmax, the 2nd..9th largest (near-ties), or a random token.
    kind = torch.arange(rows) % 3
    near = ranked[torch.arange(rows), 1 + torch.arange(rows) % 8]
    tokens = torch.where(kind == 0, ranked[:, 0],
                         torch.where(kind == 1, near,
                                     torch.randint(0, vocab, (rows,), generator=gen)))
    monkeypatch.setattr(headcheck, "_product_threads", lambda: 3)  # slices of 1,668
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = head.agrees(states, tokens)
    finally:
        torch.set_num_threads(previous)
    expected = _float32_agrees(head, states, tokens)
    assert torch.equal(got, expected)
    assert bool(got[kind == 0].all()) and not bool(got[kind == 2].any())
    if dtype == torch.bfloat16:  # the tolerance's band, exercised: some ties, not all
        assert 0 < int(got[kind == 1].sum()) < int((kind == 1).sum())
