"""The plan of a training run: what the spec leaves unset, chosen from the data and the
device (`plan_schedule`: steps sized from the training tokens, not one epoch; tokens per
step and learning rate per device), and the samples held out for validation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hsx.output import Output
from hsx.spec import TrainSpec


class TrainRefused(ValueError):
    """The output cannot train a draft (wrong layers, no samples); the message says why."""


@dataclass(frozen=True)
class DeviceDefaults:
    batch_tokens: int
    pack_tokens: int
    lr: float
    min_steps: int
    min_pack_tokens: int | None = None  # packs as short as the samples allow, from this


# CPU: small drafts and short runs; packs short enough that dense attention stays cheap:
# the smallest power of two from 128 to 512 that holds the longest training sample
# (`pack_length`). GPU: speculators' packed length (8192, block-sparse flex attention)
# and the learning rate of common EAGLE-3 recipes (a method may have its own:
# `DraftMethod.peak_lr`).
DEVICE_DEFAULTS = {
    "cpu": DeviceDefaults(batch_tokens=1024, pack_tokens=512, lr=1e-3, min_steps=500,
                          min_pack_tokens=128),
    "cuda": DeviceDefaults(batch_tokens=8192, pack_tokens=8192, lr=1e-4, min_steps=2000),
}
DEFAULT_PASSES = 3  # passes over the training tokens when nothing says otherwise
WARN_PASSES = 10  # more than this many passes: the data is too small for the schedule
MAX_WARMUP = 500
MAX_CHECKPOINT_EVERY = 2000


@dataclass(frozen=True)
class Plan:
    """The resolved schedule of one training run (recorded in draft/train.json)."""

    device: str
    workers: int
    steps: int
    batch_tokens: int  # per worker and step
    pack_tokens: int
    lr: float
    lr_schedule: str
    warmup_steps: int
    checkpoint_every: int
    train_samples: int
    train_tokens: int
    val_samples: int
    passes: float  # steps x tokens per step / training tokens
    warning: str | None = None
    online: str | None = None  # an online training: what the target captures for it
    anchors: int | None = None  # positions a pack trains from, where the method draws them

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak learning rate after `step` optimizer steps."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return 1.0
        span = max(1, self.steps - self.warmup_steps)
        done = min(1.0, (step - self.warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * done))


def plan_schedule(
    spec: TrainSpec, *, device: str, train_samples: int, train_tokens: int,
    val_samples: int, workers: int = 1, longest: int = 0,
) -> Plan:
    """Fill in what `spec` leaves unset from the data and the device (docs/TRAINING.md).
    `longest`: the tokens of the longest training sample, shifted (0: not known)."""
    if train_tokens <= 0:
        raise TrainRefused("no training samples: every sample is held out or empty")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    defaults = DEVICE_DEFAULTS[kind]
    batch = spec.batch_tokens or defaults.batch_tokens
    pack = min(spec.pack_tokens or pack_length(defaults, longest), batch)
    per_step = batch * workers
    if spec.steps is not None:
        steps = spec.steps
    elif spec.epochs is not None:
        steps = max(1, math.ceil(spec.epochs * train_tokens / per_step))
    else:
        steps = max(defaults.min_steps, math.ceil(DEFAULT_PASSES * train_tokens / per_step))
    passes = steps * per_step / train_tokens
    warning = None
    if passes > WARN_PASSES:
        warning = (
            f"the data is small for this schedule: {steps} steps of {per_step:,} tokens "
            f"go {passes:.0f} times over its {train_tokens:,} training tokens "
            f"({train_samples:,} samples), so the draft may learn them by heart instead "
            "of the target; extract more samples (EAGLE-3 drafts are usually trained on "
            "10^8 tokens or more), or set `steps` or `epochs`"
        )
    warmup = spec.warmup_steps if spec.warmup_steps is not None else min(
        MAX_WARMUP, steps // 20)
    every = spec.checkpoint_every or max(1, min(MAX_CHECKPOINT_EVERY, steps // 10))
    return Plan(
        device=device, workers=workers, steps=steps, batch_tokens=batch, pack_tokens=pack,
        lr=spec.lr or spec.draft.peak_lr.get(kind) or defaults.lr,
        lr_schedule=spec.lr_schedule, warmup_steps=warmup,
        checkpoint_every=every, train_samples=train_samples, train_tokens=train_tokens,
        val_samples=val_samples, passes=passes, warning=warning,
        anchors=spec.draft.anchors(spec, pack),
    )


def pack_length(defaults: DeviceDefaults, longest: int) -> int:
    """The default tokens of a pack: on CPU the smallest power of two from
    `min_pack_tokens` to `pack_tokens` that holds the longest sample (a longer one is cut
    to `pack_tokens`, as before); `pack_tokens` where there is no minimum, or `longest`
    is not known.

    On CPU a pack's attention is dense, so its cost per token grows with the pack's
    length, and each pack has a fixed cost too (its Python), so short samples train
    fastest in packs a little longer than the longest of them: neither many tiny packs
    nor one long dense one (benchmarks/bench_train_packs.py measures it). The validation
    is the same at every pack length (the loss weighs each pack by its tokens).
    """
    if defaults.min_pack_tokens is None or longest <= 0:
        return defaults.pack_tokens
    pack = defaults.min_pack_tokens
    while pack < min(longest, defaults.pack_tokens):
        pack *= 2
    return min(pack, defaults.pack_tokens)


def online_cost(plan: Plan, dataset_tokens: int, bytes_per_token: int) -> str:
    """What an online training costs the target, against what offline would store: the
    engines capture every sample (held-out ones too) once per epoch the schedule enters."""
    epochs = max(1, math.ceil(plan.passes - 1e-9))
    stored = dataset_tokens * bytes_per_token
    return (f"online: the engines capture the dataset {epochs} time"
            f"{'s' if epochs > 1 else ''} ({epochs * dataset_tokens:,} target tokens) for "
            f"{plan.passes:.1f} passes, instead of storing {stored / 1e9:,.2f} GB of states "
            "once")


def held_out(sample_indices: Sequence[int], fraction: float, max_samples: int,
             seed: int = 0) -> list[int]:
    """The samples held out for validation, sorted: the ones whose seeded hash of their
    sample index is smallest, `fraction` of them (at most `max_samples`, at most half).

    A function of the sample indices (and the seed) alone: the same on every run,
    resume and worker count, whatever order the units are committed in.
    """
    import numpy as np

    n = len(sample_indices)
    count = min(max_samples, math.ceil(fraction * n), n // 2) if fraction > 0 else 0
    if count <= 0:
        return []
    ids = np.asarray(sample_indices, dtype=np.uint64)
    keys = _splitmix64(ids + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15))
    chosen = ids[np.argsort(keys, kind="stable")[:count]]
    return sorted(int(i) for i in chosen)


def _splitmix64(x: Any) -> Any:
    import numpy as np

    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@dataclass
class InputsSummary:
    """What inputs.arrow says about the samples: indices, lengths, loss-masked tokens."""

    sample_indices: list[int]
    lengths: list[int]
    table: Any  # the pyarrow table


def read_inputs_summary(output: Output) -> InputsSummary:
    table = output.inputs()
    return InputsSummary(
        sample_indices=[int(i) for i in table.column("sample_index").to_pylist()],
        lengths=[int(n) for n in table.column("length").to_pylist()],
        table=table,
    )
