"""hostcopy's gather of several requests at once (what the connector does for the requests
one engine step finished): each request's rows are exactly what a gather of that request
alone gives, in bf16 and fp8, whatever the lengths and however the blocks lie in the
cache."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hsx_workers.engines.vllm.hostcopy import (  # noqa: E402
    gather,
    gather_to_host,
    mark_stream,
    slots_of_blocks,
    slots_of_requests,
    split_rows,
)

BLOCK, LAYERS, HIDDEN, BLOCKS = 4, 3, 8, 64


def _requests(seed: int) -> tuple[list[list[int]], list[int]]:
    """Requests of 1..13 tokens on shuffled blocks (each with a spare block, as vLLM's
    requests keep room for the generated token), none sharing a block."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(BLOCKS, generator=g).tolist()
    blocks, lengths = [], []
    for n in [1, BLOCK, BLOCK + 1, 13, 2 * BLOCK, 3]:
        need = -(-n // BLOCK) + 1
        blocks.append([free.pop() for _ in range(need)])
        lengths.append(n)
    return blocks, lengths


def _bits(t: Any) -> Any:
    """Comparable in any dtype (torch compares no float8 tensors)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_slots_of_requests_are_each_requests_slots_one_after_another() -> None:
    blocks, lengths = _requests(0)
    expected = torch.cat([slots_of_blocks(b, BLOCK)[:n]
                          for b, n in zip(blocks, lengths, strict=True)])
    assert torch.equal(slots_of_requests(blocks, lengths, BLOCK), expected)
    assert slots_of_requests([], [], BLOCK).numel() == 0


def test_a_request_with_too_few_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="5 tokens need 2 blocks of 4, the request has 1"):
        slots_of_requests([[3]], [5], BLOCK)


@pytest.mark.parametrize("fp8", [False, True])
def test_one_gather_gives_each_request_what_its_own_gather_gives(fp8: bool) -> None:
    cache = torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN).to(torch.bfloat16)
    blocks, lengths = _requests(1)
    event, tensors = gather_to_host(cache, slots_of_requests(blocks, lengths, BLOCK),
                                    sum(lengths), fp8=fp8)
    event.synchronize()
    rows = split_rows(tensors, lengths)
    assert len(rows) == len(lengths)
    for b, n, got in zip(blocks, lengths, rows, strict=True):
        _, alone = gather_to_host(cache, slots_of_blocks(b, BLOCK), n, fp8=fp8)
        assert set(got) == set(alone)
        for name in alone:
            assert got[name].shape[0] == n
            assert torch.equal(_bits(got[name]), _bits(alone[name]))
        # and those are the request's tokens in the cache, position by position
        if not fp8:
            for t in range(n):
                block, offset = b[t // BLOCK], t % BLOCK
                assert torch.equal(got["hidden_states"][t], cache[block, :, offset])
    # The rows are views of one gather, not copies.
    base = tensors["hidden_states"]
    assert all(r["hidden_states"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
               for r in rows)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_states_computed_wider_reach_the_host_as_bf16(dtype: str) -> None:
    """An engine computing in float32 (a CPU without native bf16, dtypes.py) hands over
    what bf16 storage keeps, half the bytes: each row rounded as the shard would."""
    cache = torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN).to(getattr(torch, dtype))
    blocks, lengths = _requests(2)
    event, tensors = gather_to_host(cache, slots_of_requests(blocks, lengths, BLOCK),
                                    sum(lengths))
    event.synchronize()
    states = tensors["hidden_states"]
    assert states.dtype == torch.bfloat16
    block, offset = blocks[3][5 // BLOCK], 5 % BLOCK  # the 4th request's 6th token
    row = split_rows(tensors, lengths)[3]["hidden_states"][5]
    assert torch.equal(row, cache[block, :, offset].to(torch.bfloat16))


def test_gather_reads_the_32_layout() -> None:
    cache = torch.arange(BLOCKS * LAYERS * BLOCK * HIDDEN, dtype=torch.float32).reshape(
        BLOCKS, LAYERS, BLOCK, HIDDEN)
    states = gather(cache, torch.tensor([5, 6, 7, 8, 9]), 3)
    assert states.shape == (3, LAYERS, HIDDEN)
    assert torch.equal(states[2], cache[1, :, 3])


def test_no_mark_on_a_cpu_cache() -> None:
    assert mark_stream(None) is None
    assert mark_stream(torch.zeros(BLOCKS, LAYERS, BLOCK, HIDDEN)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gather_after_a_mark_sees_what_was_launched_before_it() -> None:
    """The connector's gather waits for the mark of its step's start, not for the work
    launched after it: states written before the mark (still queued behind a long
    kernel when the gather is launched) are what it copies, and a write launched after
    the mark to other blocks does not hold it back."""
    cache = torch.zeros(BLOCKS, LAYERS, BLOCK, HIDDEN, dtype=torch.bfloat16, device="cuda")
    blocks, lengths = _requests(2)
    values = torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN, device="cuda").to(torch.bfloat16)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keeps the stream busy well past the gather's launch
        busy = busy @ busy / 64
    used = sorted({b for bs in blocks for b in bs})
    cache[used] = values[used]
    mark = mark_stream(cache)
    later = [b for b in range(BLOCKS) if b not in used]
    cache[later] = 1.0  # the next step's forward, on blocks of other requests
    event, tensors = gather_to_host(cache, slots_of_requests(blocks, lengths, BLOCK),
                                    sum(lengths), after=mark)
    event.synchronize()
    for b, n, got in zip(blocks, lengths, split_rows(tensors, lengths), strict=True):
        for t in range(n):
            assert torch.equal(got["hidden_states"][t].cuda(), values[b[t // BLOCK], :, t % BLOCK])


@pytest.mark.parametrize("fp8", [False, True])
def test_the_gather_gives_the_row_norms_the_self_check_reads(fp8: bool) -> None:
    """`norms` are the rows' norms before any quantization: what selfcheck.row_norms
    computes from bf16 states, and within fp8's rounding of the stored ones; a row with
    NaN has a NaN norm."""
    from hsx_workers.selfcheck import row_norms

    cache = torch.randn(BLOCKS, LAYERS, BLOCK, HIDDEN).to(torch.bfloat16)
    blocks, lengths = _requests(3)
    cache[blocks[1][0], 1, 2, 3] = float("nan")  # request 1, token 2, layer 1
    slots = slots_of_requests(blocks, lengths, BLOCK)
    _, plain = gather_to_host(cache, slots, sum(lengths))
    _, tensors = gather_to_host(cache, slots, sum(lengths), fp8=fp8)
    norms = tensors["norms"]
    assert norms.dtype == torch.float32 and norms.shape == (sum(lengths), LAYERS)
    expected = row_norms(plain["hidden_states"])
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(norms)) and not finite.all()
    # float32 sums there, a bf16 result here
    assert torch.allclose(norms[finite], expected[finite], rtol=1e-2)
    if fp8:
        stored = row_norms(tensors["hidden_states"], tensors["scales"])
        rows = torch.isfinite(stored)
        assert torch.allclose(norms[rows], stored[rows], rtol=0.05)
    assert [r["norms"].shape[0] for r in split_rows(tensors, lengths)] == lengths
