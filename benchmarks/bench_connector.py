"""Connector: the engine thread's time to hand off one step's finished requests.

vLLM calls the KV connector's `get_finished` on its engine thread, between steps: what
the connector does there is time the GPU may wait. This measures that host-side time
for steps of many short requests (the case where it showed: 128-token rows,
results/2026-12-02-gpu-peer-3/), alternating:

- `per-request`  what the connector did until 2026-12-02 (and vLLM's own connector
  does): for each request its slot mapping (`slots_of_blocks`), a gather and a copy
  into host memory (`gather_to_host`), i.e. a few dozen torch calls per request;
- `per-step`     what it does now: the step's slot mappings at once in numpy
  (`slots_of_requests`), one gather and one copy, each request's rows a view
  (`split_rows`).

Timed: submitting the step (the engine thread's part), not waiting for the copies, which
the writer threads do. On CUDA the copies run on a side stream into pinned memory, as in
the connector; on CPU the gather is the copy. The ratio reported is per-request seconds
÷ per-step seconds (higher is better for per-step). The cache is small (a CPU machine
holds it), the cost measured is per call, not per byte.

Run: `python -m benchmarks.bench_connector [--quick]` (or through run_all.py); results in
results/<date>-cpu/cpu.json (section `connector`), or `--out`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

TARGET = 2.0  # the engine thread's hand-off at least twice as fast per step


def run(requests: int, tokens: int, steps: int, reps: int) -> dict[str, Any]:
    import torch

    from hsx_workers.engines.vllm.hostcopy import (
        gather_to_host,
        slots_of_blocks,
        slots_of_requests,
        split_rows,
    )

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    layers, hidden, block = 4, 256, 16
    blocks_per = -(-tokens // block) + 1
    cache = torch.randn(requests * blocks_per * 2, layers, block, hidden,
                        dtype=torch.bfloat16, device=dev)
    g = torch.Generator().manual_seed(0)
    step_blocks = [torch.randperm(cache.shape[0], generator=g)[: requests * blocks_per]
                   .view(requests, blocks_per).tolist() for _ in range(steps)]
    stream = torch.cuda.Stream() if cuda else None

    def per_request(blocks: list[list[int]]) -> list[Any]:
        held = []
        for ids in blocks:
            held.append(gather_to_host(cache, slots_of_blocks(ids, block), tokens, stream))
        return held

    def per_step(blocks: list[list[int]]) -> list[Any]:
        lengths = [tokens] * len(blocks)
        event, host = gather_to_host(cache, slots_of_requests(blocks, lengths, block),
                                     sum(lengths), stream)
        return [(event, rows) for rows in split_rows(host, lengths)]

    variants = {"per-request": per_request, "per-step": per_step}
    # Same states either way (checked once, outside the timing).
    a, b = per_request(step_blocks[0]), per_step(step_blocks[0])
    for (ea, ta), (eb, tb) in zip(a, b, strict=True):
        ea.synchronize()
        eb.synchronize()
        assert torch.equal(ta["hidden_states"], tb["hidden_states"])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for rep in range(reps + 1):  # the first round warms both up and is not kept
        for name in common.alternating(list(variants), rep):
            fn = variants[name]
            held: list[Any] = []
            start = time.perf_counter()
            for blocks in step_blocks:
                held.extend(fn(blocks))
            seconds = time.perf_counter() - start
            for event, _ in held:
                event.synchronize()
            if rep:
                runs[name].append({"seconds": seconds, "steps_per_s": steps / seconds,
                                   "ms_per_request": seconds / (steps * requests) * 1e3})
    entry = common.compare(runs["per-step"], runs["per-request"], "steps_per_s", TARGET)
    return {
        "device": dev, "requests_per_step": requests, "tokens_per_request": tokens,
        "steps": steps, "reps": reps, "runs": runs,
        "ms_per_request": {n: round(common.median([r["ms_per_request"] for r in rs]), 4)
                           for n, rs in runs.items()},
        "ratios": {"per-step/per-request": entry},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--requests", type=int, default=128, help="requests a step finishes")
    p.add_argument("--tokens", type=int, default=128, help="tokens of a request")
    p.add_argument("--out", type=Path, default=common.campaign_path("cpu", "cpu.json"))
    p.add_argument("--note", help="free text stored with the results")
    args = p.parse_args(argv)
    steps, reps = (5, 3) if args.quick else (20, 5)
    result = run(args.requests, args.tokens, steps, reps)
    if args.note:
        result["note"] = args.note
    common.save_section(args.out, "connector", result, common.machine_info())
    e = result["ratios"]["per-step/per-request"]
    print(common.table(common.RATIO_HEADERS, [common.ratio_row("per-step/per-request", e)]))
    print(f"ms per request: {result['ms_per_request']} ({result['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
