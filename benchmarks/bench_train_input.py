"""Trainer input pipeline: how long the training loop waits for data.

An hsx output is written with ShardWriter (random bf16 states, lengths spread like chat
data) for a target of hidden size H, then `DraftTrainer` trains on it for one epoch.
Each step's time is split by the trainer itself into the wait for its batch (reading
shards, speculators' shift/collate, packing: all in the trainer's producer thread) and
the rest (host-to-device, forward, backward, optimizer).

- ratio `wait`: waiting ÷ total step time over the steady steps (the first
  `--warmup` steps, which include model warm-up and the first shard's page faults, are
  reported apart). Target < 0.05.
- `data-only tokens/s` (report): the producer alone, batches built and dropped, so
  `data-only ÷ training tokens/s` says how much headroom the pipeline has.

The target's weights matter to the trainer only through its embeddings, lm_head and
final norm (the draft's decoder layer copies its config), so the model written here has
one decoder layer; the manifest says the 32-layer shape [2, 16, 29, 32] a Llama-8B job
has. The vocabulary is the tiny tokenizer's (512), which makes the draft's logits
cheaper than a real 128k vocabulary's: the steps are shorter, the wait relatively
longer, so the target is harder to meet, not easier.

Run: `python -m benchmarks.bench_train_input [--quick]` (CPU, H=256) or
`--device cuda --hidden 4096 --out benchmarks/results/<date>-gpu-train-input/gpu-train.json` on
a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

TARGET = 0.05
SECTION = "train_input"


def write_output(root: Path, model: Path, hidden: int, tokens: int, seed: int = 0, *,
                 unit_tokens: int = 65536, vocab: int = 500) -> int:
    """An hsx output of ~`tokens` tokens in units of ~`unit_tokens` tokens (token ids
    below `vocab`); returns the samples."""
    from tests.unit.outputs import make_manifest, write_inputs_table, write_manifest

    from hsx.output import Output, ShardWriter

    rng = np.random.default_rng(seed)
    layers = [2, 16, 29, 32]
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(128, 2049)))
    root.mkdir(parents=True)
    units, start, unit, acc = [], 0, [], 0
    for i, n in enumerate(lengths):
        unit.append(i)
        acc += n
        if acc >= unit_tokens or i == len(lengths) - 1:
            units.append(unit)
            unit, acc = [], 0
    block = rng.standard_normal((4096, len(layers), hidden), dtype=np.float32)
    samples = []
    for n in lengths:
        ids = rng.integers(16, vocab, n).astype(np.int32)
        samples.append({"input_ids": ids, "loss_mask": np.ones(n, np.uint8)})
    ranges = []
    for ids in units:
        ranges.append((start, start + len(ids)))
        start += len(ids)
    write_manifest(root, make_manifest(layers=layers, hidden_size=hidden, num_layers=32,
                                       units=ranges, model=str(model)))
    write_inputs_table(root, list(range(len(lengths))), samples)
    for u, ids in enumerate(units):
        with ShardWriter(root, u, layers=layers, hidden_size=hidden,
                         storage_dtype="bf16") as w:
            for i in ids:
                n = lengths[i]
                off = int(rng.integers(0, 4096 - min(n, 2048)))
                states = block[off:off + n] if n <= 2048 else np.resize(block, (n, 4, hidden))
                w.add(i, samples[i]["input_ids"], samples[i]["loss_mask"], states)
            w.commit(errors=[])
    Output(root).mark_complete({})
    return len(lengths)


def data_only(root: Path, spec: Any, device: str) -> dict[str, float]:
    """The producer alone: every batch of one epoch built, nothing trained."""
    # Imported before the clock starts: seconds of imports are not data time.
    import speculators.models.eagle3.data
    import speculators.train.data
    import torch

    from hsx_workers.trainer import DraftTrainer

    del speculators

    trainer = DraftTrainer(root, spec)
    plan = trainer.prepare()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pad = trainer.device is not None and trainer.device.type == "cuda"  # as run() packs
    t0 = time.perf_counter()
    tokens = 0
    for step in trainer.data.batches(0, dtype, plan, pad=pad):  # the producer itself
        tokens += step.tokens
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def train(root: Path, spec: Any) -> list[dict[str, Any]]:
    from hsx_workers.trainer import DraftTrainer

    steps: list[dict[str, Any]] = []
    DraftTrainer(root, spec, on_metrics=lambda m: steps.append(dict(m.__dict__))).run()
    return steps


def summarize(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steady = steps[warmup:] or steps
    wait = sum(s["wait_s"] for s in steady)
    total = sum(s["step_s"] for s in steady)
    tokens = sum(s["tokens_per_s"] * s["step_s"] for s in steady)
    return {
        "steps": len(steps), "steady_steps": len(steady),
        "wait_fraction": wait / total if total else None,
        "wait_fraction_all": sum(s["wait_s"] for s in steps) / sum(s["step_s"] for s in steps),
        "warmup_wait_s": sum(s["wait_s"] for s in steps[:warmup]),
        "median_step_s": statistics.median(s["step_s"] for s in steady),
        "median_wait_s": statistics.median(s["wait_s"] for s in steady),
        "tokens_per_s": tokens / total if total else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the output")
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--draft-vocab", type=int, default=256)
    parser.add_argument("--loss-implementation", default="auto",
                        choices=["auto", "fused", "eager"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=common.campaign_path("cpu", "cpu.json"))
    args = parser.parse_args()
    gpu = args.device == "cuda"
    tokens = args.tokens or (300_000 if gpu else 60_000) // (4 if args.quick else 1)
    batch_tokens = args.batch_tokens or (8192 if gpu else 2048)
    repeats = 1 if args.quick else args.repeats

    from hsx.spec import TrainSpec
    from hsx_workers.tiny_models import make_tiny_model

    machine = common.machine_info()
    with tempfile.TemporaryDirectory(prefix="hsx-bench-train-") as tmp:
        base = Path(tmp)
        model = make_tiny_model(
            base / "target", "llama", num_layers=1, hidden_size=args.hidden,
            num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 512),
            intermediate_size=args.intermediate or 2 * args.hidden,
        )
        # The config says the 32 layers the manifest's ids need (speculators checks them
        # against it); only the embeddings, lm_head and norm are ever read.
        config = json.loads((model / "config.json").read_text())
        config["num_hidden_layers"] = 32
        (model / "config.json").write_text(json.dumps(config))
        t0 = time.perf_counter()
        samples = write_output(base / "out", model, args.hidden, tokens)
        print(f"output: {samples} samples, {tokens:,}+ tokens, H={args.hidden}, "
              f"written in {time.perf_counter() - t0:.1f}s", flush=True)
        spec = TrainSpec(draft_vocab_size=args.draft_vocab, batch_tokens=batch_tokens,
                         pack_tokens=batch_tokens, epochs=1, checkpoint_every=10**9,
                         device=args.device, follow=False, val_fraction=0.0,
                         loss_implementation=args.loss_implementation)
        runs = []
        for r in range(repeats):
            producer = data_only(base / "out", spec, args.device)
            import shutil

            shutil.rmtree(base / "out" / "draft", ignore_errors=True)
            steps = train(base / "out", spec)
            shutil.rmtree(base / "out" / "draft", ignore_errors=True)
            s = summarize(steps, args.warmup)
            s["data_only_tokens_per_s"] = producer["tokens_per_s"]
            s["headroom"] = producer["tokens_per_s"] / s["tokens_per_s"]
            runs.append(s)
            print(f"run {r}: wait {s['wait_fraction']:.3%} (all steps "
                  f"{s['wait_fraction_all']:.3%}), {s['tokens_per_s']:,.0f} tok/s training, "
                  f"{producer['tokens_per_s']:,.0f} tok/s data-only, "
                  f"median step {s['median_step_s'] * 1e3:.1f} ms", flush=True)
    value = statistics.median(r["wait_fraction"] for r in runs)
    result = {
        "config": {"device": args.device, "hidden": args.hidden, "tokens": tokens,
                   "batch_tokens": batch_tokens, "draft_vocab": args.draft_vocab,
                   "loss_implementation": args.loss_implementation,
                   "repeats": repeats, "warmup_steps": args.warmup},
        "runs": runs,
        "ratios": {"wait": {"value": value, "target": f"< {TARGET}",
                            "verdict": "PASS" if value < TARGET else "MISS",
                            "paired": [r["wait_fraction"] for r in runs],
                            "best": min(r["wait_fraction"] for r in runs)}},
    }
    common.save_section(args.out, SECTION, result, machine)
    print(common.table(common.RATIO_HEADERS,
                       [common.ratio_row("train input wait", result["ratios"]["wait"])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
