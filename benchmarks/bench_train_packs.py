"""Trainer step time on CPU: one packed sequence per step vs packs of `pack_tokens`.

speculators' Eagle3 draft attends over a packed sequence with eager attention and a
dense mask on CPU: the scores are [T, T] at the first TTT step and grow to [T, 3T], so a
step of T tokens in one sequence costs ~T² although each sample only attends to itself.
The trainer now cuts a step of `batch_tokens` into packs of `pack_tokens` (512 on CPU)
and sums their gradients.

An output of short samples (like chats: 12..40 tokens) is written with ShardWriter for
the tiny Llama shape (H=256); `DraftTrainer` trains `--steps` steps of `batch_tokens`
tokens with pack_tokens = batch_tokens (one sequence, as before) and with packs of 512,
alternating, for each batch size asked. Reported: median step seconds and training
tokens/s of each, and ratio = one-sequence step time ÷ packed step time (how much the
packs save; report).

Run: `python -m benchmarks.bench_train_packs [--batch 1024,8192] [--steps 3]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common

SECTION = "train_packs"


def write_short_output(root: Path, model: Path, hidden: int, samples: int) -> int:
    """Samples of 12..40 tokens, one unit; returns the tokens."""
    from tests.unit.outputs import make_manifest, write_inputs_table, write_manifest

    from hsx.output import Output, ShardWriter

    rng = np.random.default_rng(0)
    layers = [2, 16, 29, 32]
    lengths = [int(n) for n in rng.integers(12, 41, samples)]
    rows = [{"input_ids": rng.integers(16, 500, n).astype(np.int32),
             "loss_mask": np.ones(n, np.uint8)} for n in lengths]
    root.mkdir(parents=True)
    write_manifest(root, make_manifest(layers=layers, hidden_size=hidden, num_layers=32,
                                       units=[(0, samples)], model=str(model)))
    write_inputs_table(root, list(range(samples)), rows)
    block = rng.standard_normal((64, len(layers), hidden), dtype=np.float32)
    with ShardWriter(root, 0, layers=layers, hidden_size=hidden, storage_dtype="bf16") as w:
        for i, row in enumerate(rows):
            w.add(i, row["input_ids"], row["loss_mask"], block[: lengths[i]])
        w.commit(errors=[])
    Output(root).mark_complete({})
    return sum(lengths)


def run(root: Path, batch: int, pack: int, steps: int) -> list[dict[str, Any]]:
    from hsx.spec import TrainSpec
    from hsx_workers.trainer import DraftTrainer

    shutil.rmtree(root / "draft", ignore_errors=True)
    spec = TrainSpec(draft_vocab_size=256, batch_tokens=batch, pack_tokens=pack,
                     steps=steps, checkpoint_every=10**6, val_fraction=0.0, device="cpu",
                     follow=False)
    out: list[dict[str, Any]] = []
    DraftTrainer(root, spec, on_metrics=lambda m: out.append(dict(m.__dict__))).run()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1024,8192", help="batch_tokens values")
    parser.add_argument("--pack", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=common.campaign_path("cpu", "cpu.json"))
    args = parser.parse_args()

    import torch

    from hsx_workers.tiny_models import make_tiny_model

    torch.set_num_threads(2)
    machine = common.machine_info()
    results: dict[str, Any] = {"config": {"pack_tokens": args.pack, "steps": args.steps,
                                          "hidden": 256, "sample_tokens": "12..40"},
                               "runs": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="hsx-bench-packs-") as tmp:
        base = Path(tmp)
        model = make_tiny_model(base / "target", "llama", num_layers=1)
        config = json.loads((model / "config.json").read_text())
        config["num_hidden_layers"] = 32  # the manifest's ids need it; weights unread
        (model / "config.json").write_text(json.dumps(config))
        tokens = write_short_output(base / "out", model, 256, 3000)
        print(f"output: 3000 samples, {tokens:,} tokens", flush=True)
        for batch in (int(b) for b in args.batch.split(",")):
            row: dict[str, Any] = {}
            for label, pack in (("one_sequence", batch), ("packs", min(args.pack, batch))):
                t0 = time.perf_counter()
                steps = run(base / "out", batch, pack, args.steps)
                # The first step also builds the model's caches: left out.
                steady = steps[1:] or steps
                row[label] = {
                    "pack_tokens": pack,
                    "median_step_s": statistics.median(s["step_s"] for s in steady),
                    "step_s": [round(s["step_s"], 3) for s in steps],
                    "tokens_per_s": sum(s["step_tokens"] for s in steady)
                    / sum(s["step_s"] for s in steady),
                    "wall_s": time.perf_counter() - t0,
                }
                print(f"batch {batch}, {label} (pack {pack}): median step "
                      f"{row[label]['median_step_s']:.2f}s, "
                      f"{row[label]['tokens_per_s']:,.0f} tok/s", flush=True)
            results["runs"][str(batch)] = row
            ratio = row["one_sequence"]["median_step_s"] / row["packs"]["median_step_s"]
            results["ratios"][f"step_{batch}"] = {
                "value": ratio, "target": "report", "verdict": "report",
                "paired": [row["one_sequence"]["median_step_s"],
                           row["packs"]["median_step_s"]]}
    common.save_section(args.out, SECTION, results, machine)
    for name, r in results["ratios"].items():
        print(f"{name}: one sequence ÷ packs = {r['value']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
