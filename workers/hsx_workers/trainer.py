"""Train an EAGLE-3 draft (speculators' Eagle3DraftModel) on an hsx output.

`DraftTrainer(output, spec).run()` is the whole loop in one process; `train_distributed`
runs it on N Ray Train workers (DDP); the Ray actor in trainer_actor.py and `hsx train`
call one or the other.

- Output: read through `hsx.output.Output`, on local disk or an object store; the
  draft goes to `<output>/draft/`, or under `draft_root` (a local folder). For an
  object-store output it is trained in a local working folder (`hsx.draft.draft_folder`)
  and the main worker copies each published checkpoint and draft/ into the bucket
  (`hsx.draft.BucketDraft`); a run whose folder lacks the bucket's newest checkpoint
  downloads it first.
- Plan: what the spec leaves unset is chosen from the data and the device
  (`plan_schedule`): steps sized from the training tokens (not one epoch), tokens per
  step and learning rate per device; too few tokens for the schedule gives a warning.
- Data: committed shards through `HiddenStatesDataset`. The first epoch follows the
  extraction (`spec.follow`): a shard is trained on as soon as its commit lands; later
  epochs shuffle units. Worker r of N reads the units u with u % N == r. Samples held
  out for validation (`held_out`: by sample index, the same on every run) are skipped.
  Each sample becomes speculators' sample dict (aux layers flattened, the last layer as
  the target's hidden state), shifted with speculators' `shift_batch` and packed, whole
  samples only, by its `CollateFn` into sequences of `pack_tokens`; a step is packs
  worth `batch_tokens`, their gradients summed. A producer thread builds steps ahead.
- Why packs: on CPU the draft's attention over one packed sequence is dense (eager
  attention and a [T, T] mask, growing to [T, 4T] over the TTT steps), so its cost grows
  with the square of the packed length although samples only attend to themselves;
  packs of 512 tokens keep a step's cost linear in `batch_tokens`.
- Model: the draft's decoder layer is the target's (text) config with `num_layers`
  layers; embeddings and lm_head come from the target (speculators'
  `load_verifier_weights`); d2t/t2d from the frequencies of loss-masked tokens of the
  training samples (speculators' `build_vocab_mappings_from_distribution`).
- Validation: at every checkpoint, the held-out samples give loss, per-TTT-step
  accuracy and the expected acceptance length 1 + sum_k P(steps 0..k all right).
- Checkpoints: `draft/checkpoints/step-N/` (speculators' save_pretrained, the optimizer
  in trainer_state.pt, the checkpoint's metrics in metrics.json), written under
  draft/.tmp and published by a directory rename; the best one by validation is then
  hard-linked into `draft/`, so that folder is always a complete draft vLLM can load. A
  restart resumes from the newest checkpoint: weights, optimizer, step, and each
  worker's epoch and units done in it; a checkpoint a crash left staged in draft/.tmp
  is dropped. `HSX_FAULT_POINT` (hsx.output.faults) kills the process at a step of
  writing a checkpoint, for crash tests.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsx.dataset import HiddenStatesDataset
from hsx.draft import (
    bucket_draft,
    checkpoint_metrics,
    checkpoints,
    draft_folder,
    expected_acceptance,
    read_metrics,
    read_validation,
    write_json,
)
from hsx.modelinfo import draft_aux_layers
from hsx.output import CommitRecord, Manifest, Output, ShardReader, StorageError, faults
from hsx.output.layout import (
    CHECKPOINT_METRICS,
    DRAFT_CHECKPOINTS,
    DRAFT_DIR,
    DRAFT_METRICS,
    DRAFT_STATE,
    DRAFT_STOP,
    DRAFT_VALIDATION,
    checkpoint_name,
)
from hsx.output.local_storage import fsync_dir
from hsx.spec import TrainSpec

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
PUBLISHED_FILES = ("config.json", "config.py", "model.safetensors")


class TrainRefused(ValueError):
    """The output cannot train a draft (wrong layers, no samples); the message says why."""


class WorkerDied(RuntimeError):
    """A Ray Train worker's process died: a new run resumes from the newest checkpoint."""


# ---------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class DeviceDefaults:
    batch_tokens: int
    pack_tokens: int
    lr: float
    min_steps: int


# CPU: small drafts and short runs; packs short enough that dense attention stays cheap.
# GPU: speculators' packed length (8192, block-sparse flex attention) and the learning
# rate of common EAGLE-3 recipes.
DEVICE_DEFAULTS = {
    "cpu": DeviceDefaults(batch_tokens=1024, pack_tokens=512, lr=1e-3, min_steps=800),
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
    val_samples: int, workers: int = 1,
) -> Plan:
    """Fill in what `spec` leaves unset from the data and the device (docs/TRAINING.md)."""
    if train_tokens <= 0:
        raise TrainRefused("no training samples: every sample is held out or empty")
    defaults = DEVICE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
    batch = spec.batch_tokens or defaults.batch_tokens
    pack = min(spec.pack_tokens or defaults.pack_tokens, batch)
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
        lr=spec.lr or defaults.lr, lr_schedule=spec.lr_schedule, warmup_steps=warmup,
        checkpoint_every=every, train_samples=train_samples, train_tokens=train_tokens,
        val_samples=val_samples, passes=passes, warning=warning,
    )


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


# ---------------------------------------------------------------------- pieces


@dataclass
class TrainState:
    """What a checkpoint restores for one worker besides the weights and the optimizer."""

    step: int = 0
    epoch: int = 0
    units_done: list[int] = field(default_factory=list)  # of the current epoch
    tokens: int = 0  # trained on by all workers


@dataclass
class StepMetrics:
    step: int
    epoch: int
    loss: float
    acc: list[float]  # full accuracy per TTT step (steps 0..k all right)
    tokens: int  # trained on so far, all workers
    step_tokens: int  # in this step, all workers
    tokens_per_s: float
    wait_fraction: float  # of the whole run so far
    wait_s: float  # this step: waiting for its batch
    step_s: float  # this step: waiting + compute
    lr: float
    time: float


@dataclass
class StepBatch:
    """One optimizer step of one worker: packed sequences and the units it finishes."""

    packs: list[dict[str, Any]]
    tokens: int
    units: list[int]


READER_JOIN_S = 30.0  # how long a finished training waits for its data thread to stop


@dataclass(frozen=True)
class EpochEnd:
    """This worker's data of `epoch` ended (the prefetch goes on with the next epoch)."""

    epoch: int


@dataclass
class Scores:
    """Sums over packs (and workers): loss x tokens, tokens, right and total per TTT step."""

    ttt_steps: int
    loss_sum: float = 0.0
    tokens: int = 0
    right: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.right = self.right or [0.0] * self.ttt_steps
        self.total = self.total or [0.0] * self.ttt_steps

    def add(self, loss: float, tokens: int, metrics: dict[str, Any]) -> None:
        self.loss_sum += loss * tokens
        self.tokens += tokens
        for k in range(self.ttt_steps):
            self.right[k] += float(metrics[f"full_acc_{k}_sum"])
            self.total[k] += float(metrics[f"full_acc_{k}_total"])

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.loss_sum, float(self.tokens), *self.right, *self.total],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, ttt_steps: int) -> Scores:
        v = t.tolist()
        return cls(ttt_steps, v[0], int(v[1]), v[2:2 + ttt_steps], v[2 + ttt_steps:])

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def acc(self) -> list[float]:
        """P(TTT steps 0..k all right), per k."""
        return [r / t if t else 0.0 for r, t in zip(self.right, self.total, strict=True)]

    @property
    def cond_acc(self) -> list[float]:
        """P(TTT step k right | steps before it right), per k."""
        out, prev = [], 1.0
        for a in self.acc:
            out.append(a / prev if prev > 0 else 0.0)
            prev = a
        return out

    @property
    def expected_acceptance_length(self) -> float:
        """Tokens per verification step a k-token draft would give: 1 + sum of the
        products of the conditional accuracies (= 1 + sum_k P(steps 0..k right))."""
        expected, product = 1.0, 1.0
        for c in self.cond_acc:
            product *= c
            expected += product
        return expected


def draft_layout(manifest: Manifest) -> tuple[list[int], int]:
    """(aux layer ids, num_layers N) for a draft trained on this output, or TrainRefused."""
    n = manifest.num_layers
    try:
        return draft_aux_layers(manifest.layers, n), n
    except ValueError as err:
        raise TrainRefused(str(err)) from None


DRAFT_LAYER_TYPES = ("llama", "qwen3")  # vLLM's Eagle3 heads: Eagle3{Llama,Qwen3}ForCausalLM


def draft_layer_config(text: Any, num_layers: int, num_aux: int) -> Any:
    """The draft's decoder-layer config: the target's own for Llama/Qwen3 targets, a
    Llama layer of the target's sizes for every other one (DeepSeek-V3, Kimi-K2.5,
    Gemma...), since vLLM serves EAGLE-3 drafts only with Llama or Qwen3 layers."""
    import copy

    from transformers import LlamaConfig

    if getattr(text, "model_type", None) in DRAFT_LAYER_TYPES:
        layer = copy.deepcopy(text)
    else:
        heads = int(text.num_attention_heads)
        rope = getattr(text, "rope_parameters", None) or {}
        layer = LlamaConfig(
            vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
            intermediate_size=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(text.hidden_size) // heads,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            rope_parameters={"rope_type": "default",
                             "rope_theta": float(rope.get("rope_theta", 10000.0))},
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
        )
        layer.architectures = ["LlamaForCausalLM"]
    layer.num_hidden_layers = num_layers
    # vLLM reads the fc's input width from this (its default is 3 auxiliary layers).
    layer.num_aux_hidden_states = num_aux
    return layer


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


def token_frequencies(output: Output, exclude: Sequence[int] = ()) -> Counter[int]:
    """Counts of loss-masked tokens of every ingested sample but `exclude` (what the
    draft must say)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    table = output.inputs()
    if exclude:
        keep = pc.invert(pc.is_in(table.column("sample_index"),
                                  value_set=pa.array(list(exclude), pa.int64())))
        table = table.filter(keep)
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    chosen = ids[mask.astype(bool)]
    values, counts = np.unique(chosen, return_counts=True)
    return Counter(dict(zip(values.tolist(), counts.tolist(), strict=True)))


def vocab_mappings(
    freqs: Counter[int], draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(d2t, t2d, draft vocab size); no mappings when the draft keeps the whole vocab."""
    if draft_vocab_size >= target_vocab_size:
        return None, None, target_vocab_size
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        dict(freqs), draft_vocab_size, target_vocab_size
    )
    return d2t, t2d, draft_vocab_size


def to_speculators_sample(sample: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """An hsx sample ([T, L, H] states) as speculators' dict, before `shift_batch`."""
    hidden = sample["hidden_states"]
    seq_len = hidden.shape[0]
    return {
        "hidden_states": hidden[:, :-1].flatten(1).to(dtype),
        "input_ids": sample["input_ids"].to(torch.long),
        "verifier_last_hidden_states": hidden[:, -1].to(dtype),
        "loss_mask": sample["loss_mask"].to(torch.bool),
        "lengths": torch.tensor([seq_len], dtype=torch.long),
        "position_ids": torch.arange(seq_len, dtype=torch.long),
    }


def unit_of(reader: ShardReader) -> int:
    if reader.record is None:
        raise ValueError(f"{reader.name}: opened without its commit record")
    return reader.record.unit


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainRefused("device cuda was asked for but torch sees no GPU")
        return torch.device("cuda")
    return torch.device("cpu")


def _seeded(*parts: int) -> random.Random:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + int(p)) % (1 << 61)
    return random.Random(value)


class _Group:
    """The workers of one training (torch.distributed), or just this process."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device("cpu")  # where a tensor must be to be reduced
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("a distributed training needs torch.distributed set up "
                                   "(Ray Train does it for train_distributed)")
            if dist.get_rank() != rank or dist.get_world_size() != world:
                raise RuntimeError(f"rank {rank}/{world} differs from torch.distributed's "
                                   f"{dist.get_rank()}/{dist.get_world_size()}")
            # NCCL reduces only tensors on this worker's GPU; gloo those on the CPU.
            if dist.get_backend() == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
            return on_device.to(t.device)
        return t

    def any(self, flag: bool) -> bool:
        return bool(self.sum(torch.tensor([1.0 if flag else 0.0])).item() > 0)

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


# ---------------------------------------------------------------------- trainer


class DraftTrainer:
    """One training run over one output, as worker `rank` of `world`; see the module
    docstring. With world > 1 it runs inside a Ray Train worker (`train_distributed`)."""

    def __init__(
        self,
        output: str | Path | Output,
        spec: TrainSpec,
        *,
        draft_root: str | Path | None = None,
        on_metrics: Callable[[StepMetrics], None] | None = None,
        on_plan: Callable[[Plan], None] | None = None,
        stop: threading.Event | None = None,
        poll_interval: float = 0.5,
        rank: int = 0,
        world: int = 1,
        device: torch.device | None = None,
        validate: Callable[[Any], Scores] | None = None,
    ) -> None:
        self.output = Output.of(output)
        self.root = draft_folder(self.output, draft_root)
        self.spec = spec
        self.on_metrics = on_metrics
        self.on_plan = on_plan
        self.stop = stop or threading.Event()
        self.poll_interval = poll_interval
        self.group = _Group(rank, world)
        self.device = device
        self._validate_fn = validate  # tests replace the validation; None: held-out samples
        self.draft = self.root / DRAFT_DIR
        self.bucket = bucket_draft(self.output, self.root)  # None on local disk
        self.state = TrainState()
        self.plan: Plan | None = None
        self.manifest: Manifest | None = None
        self.val_indices: list[int] = []
        self._val_set: frozenset[int] = frozenset()
        self._val_rows: dict[int, int] = {}  # held-out sample index -> row of inputs.arrow
        self.resumed_from: int | None = None
        self.first_step_at: float | None = None
        self.last: StepMetrics | None = None
        self.best: dict[str, Any] | None = None  # {"step", "expected_acceptance_length"}
        self.last_validation: dict[str, Any] | None = None
        self._unbilled_wait = 0.0  # waits since the last step, billed to the next one
        self._wait_s = 0.0  # waits billed to steps so far
        self._step_s = 0.0  # steps so far, their waits included

    # -- setup

    def _manifest(self) -> Manifest:
        deadline = time.monotonic() + 3600
        # The trainer may start before ingestion ends.
        while (manifest := self.output.read_manifest()) is None:
            if self.stop.is_set() or time.monotonic() > deadline:
                raise TrainRefused(f"no hsx output at {self.output}: its manifest never "
                                   "appeared")
            time.sleep(self.poll_interval)
        return manifest

    def _make_plan(self, manifest: Manifest) -> Plan:
        inputs = read_inputs_summary(self.output)
        self.val_indices = held_out(inputs.sample_indices, self.spec.val_fraction,
                                    self.spec.val_max_samples, self.spec.seed)
        self._val_set = frozenset(self.val_indices)
        row_of = {idx: row for row, idx in enumerate(inputs.sample_indices)}
        self._val_rows = {i: row_of[i] for i in self.val_indices}
        train = [(i, n) for i, n in zip(inputs.sample_indices, inputs.lengths, strict=True)
                 if i not in self._val_set]
        units = manifest.units
        if self.group.world > 1 and len(units) < self.group.world:
            raise TrainRefused(
                f"{len(units)} work unit(s) for {self.group.world} workers: each worker "
                "reads its own units; use fewer workers or a smaller unit_tokens")
        device = self.device.type if self.device is not None else "cpu"
        return plan_schedule(
            self.spec, device=device, train_samples=len(train),
            train_tokens=sum(max(0, n - 1) for _, n in train),
            val_samples=len(self.val_indices), workers=self.group.world,
        )

    def _build_model(self, manifest: Manifest) -> Any:
        from speculators.models.eagle3 import Eagle3DraftModel
        from transformers import AutoConfig

        aux, _ = draft_layout(manifest)
        model_path = manifest.model
        trust = manifest.trust_remote_code
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
        text = draft_layer_config(getattr(config, "text_config", None) or config,
                                  self.spec.num_layers, len(aux))
        freqs = token_frequencies(self.output, exclude=self.val_indices)
        if not freqs:
            raise TrainRefused(f"{self.output}: no loss-masked token in inputs.arrow")
        d2t, t2d, draft_vocab = vocab_mappings(
            freqs, self.spec.draft_vocab_size, int(text.vocab_size)
        )
        torch.manual_seed(self.spec.seed)
        # speculators' own choice on GPU (flex attention, compiled); eager on CPU, where
        # flex attention has no fast kernel.
        if self.device is None:
            raise RuntimeError("the device is resolved before the model is built")
        attn = "simple_flex_attention" if self.device.type == "cuda" else "eager"
        if self.device.type == "cuda":
            # speculators compiles the draft's forward; with torch 2.11 dynamo fails to
            # trace its fused loss's Triton kernel ("ListVariable ... already tracked for
            # mutation", seen on an H200). A frame dynamo cannot compile then runs eagerly
            # instead of ending the training.
            from torch._dynamo import config as dynamo_config

            dynamo_config.suppress_errors = True
        model = Eagle3DraftModel.from_training_args(
            text, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab,
            norm_before_residual=self.spec.norm_before_residual,
            ttt_steps=self.spec.ttt_steps, verifier_name_or_path=model_path,
            target_layer_ids=aux, draft_attn_impl=attn, trust_remote_code=trust,
        )
        # speculators starts the draft's lm_head as the target's but its final norm at
        # ones: a head that is neither. Starting the norm as the target's too makes the
        # draft's head the target's own (what it predicts), which matters where the
        # target's final norm has outlier weights, as real models' do.
        with torch.no_grad():
            model.norm.weight.copy_(model.verifier_norm.weight)
        return model

    def _optimizer(self, model: Any, plan: Plan) -> tuple[torch.optim.Optimizer, Any]:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=plan.lr, weight_decay=self.spec.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: plan.lr_factor(s))
        return opt, sched

    def _resume(self, model: Any, opt: torch.optim.Optimizer, sched: Any,
                plan: Plan) -> None:
        if self.bucket is not None and self.group.main:
            self.bucket.pull_checkpoints()  # a restart elsewhere: the bucket's newest
        self.group.barrier()
        saved_checkpoints = checkpoints(self.root)
        self._restore_best(saved_checkpoints)
        if not saved_checkpoints:
            return
        ckpt = saved_checkpoints[-1]
        from safetensors.torch import load_file

        weights = load_file(str(ckpt / "model.safetensors"), device=str(self.device))
        _missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected:
            raise TrainRefused(f"{ckpt}: weights the draft does not have: {unexpected[:5]}")
        saved = torch.load(ckpt / TRAINER_STATE, map_location=self.device, weights_only=False)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        # The spec in effect now decides the learning rate and its schedule.
        sched.base_lrs = [plan.lr] * len(opt.param_groups)
        for group in opt.param_groups:
            group["lr"] = plan.lr * plan.lr_factor(sched.last_epoch)
        ranks = saved.get("ranks")
        if ranks is not None and saved.get("world") == self.group.world:
            self.state = TrainState(**ranks[self.group.rank])
        else:
            state = TrainState(**saved["state"])
            if self.group.world > 1 or (ranks is not None and len(ranks) != 1):
                # Another number of workers: each starts its own units' epoch afresh.
                state = TrainState(step=state.step, tokens=state.tokens)
            self.state = state
        self.resumed_from = self.state.step
        if self.group.main:
            # Records logged after the checkpoint are replayed by this run.
            step = self.state.step
            self._rewrite(DRAFT_METRICS, [m for m in read_metrics(self.root)
                                          if int(m.get("step", 0)) <= step])
            self._rewrite(DRAFT_VALIDATION, [v for v in read_validation(self.root)
                                             if int(v.get("step", 0)) <= step])
        logger.info("resumed from %s (step %d, epoch %d)", ckpt.name, self.state.step,
                    self.state.epoch)

    def _restore_best(self, saved: list[Path]) -> None:
        """The best checkpoint so far, by the metrics each checkpoint keeps."""
        self.best = None
        for ckpt in saved:
            metrics = checkpoint_metrics(ckpt) or {}
            value = expected_acceptance(metrics.get("validation"))
            step = int(metrics.get("step", -1))
            if value is not None and (self.best is None
                                      or value > self.best["expected_acceptance_length"]):
                self.best = {"step": step, "expected_acceptance_length": value}

    # -- data

    def _own(self, unit: int) -> bool:
        return unit % self.group.world == self.group.rank

    def _units(self, ds: HiddenStatesDataset, epoch: int, done: set[int],
               halted: Callable[[], bool]) -> Iterator[ShardReader]:
        if epoch == 0 and not ds.complete:
            shards = ds.shards(stop=halted)  # follow=True: as commits land
        else:
            ds.refresh()
            records = [r for r in ds.records if r.unit not in done and self._own(r.unit)]
            _seeded(self.spec.seed, epoch, 1).shuffle(records)
            shards = ds.shards(records)
        for reader in shards:
            if halted():
                return
            unit = unit_of(reader)
            if unit not in done and self._own(unit):
                yield reader

    def _wait_for_complete(self, halted: Callable[[], bool]) -> None:
        while not self.output.is_complete() and not halted():
            time.sleep(self.poll_interval)

    def _collate(self, dtype: torch.dtype, hidden: int, aux: int) -> Callable[..., Any]:
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        plan = self._plan()
        pad = self.device is not None and self.device.type == "cuda"

        def collate(samples: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
            # Padded to pack_tokens on GPU (one shape for the compiled model); exactly
            # as long as its samples on CPU, where padding is compute thrown away.
            length = plan.pack_tokens if pad else max(1, tokens)
            fn = CollateFn(length, hidden, num_target_layers=aux, dtype=dtype,
                           preprocess=shift_batch)
            return fn(samples)

        return collate

    def _batches(self, epoch: int, dtype: torch.dtype, done: Sequence[int] = (),
                 halted: Callable[[], bool] | None = None) -> Iterator[StepBatch]:
        """This worker's steps of one epoch, in order; each names the units it finishes.
        `done`: units of this epoch trained before a resume, left out; `halted()`: stop
        reading (default: the training's stop)."""
        plan = self._plan()
        halted = halted or self.stop.is_set
        if not self.spec.follow:
            self._wait_for_complete(halted)
        ds = HiddenStatesDataset(self.output, follow=True, backend="torch",
                                 poll_interval=self.poll_interval)
        collate = self._collate(dtype, ds.manifest.hidden_size, len(ds.manifest.layers) - 1)
        packs: list[dict[str, Any]] = []
        pack: list[dict[str, Any]] = []
        pack_tokens = step_tokens = 0
        finished: list[int] = []
        for reader in self._units(ds, epoch, set(done), halted):
            unit = unit_of(reader)
            order = [j for j in range(len(reader))
                     if int(reader.sample_indices[j]) not in self._val_set]
            _seeded(self.spec.seed, epoch, unit, 2).shuffle(order)
            for j in order:
                sample = to_speculators_sample(reader.sample(j, backend="torch"), dtype)
                length = min(int(sample["lengths"][0]) - 1, plan.pack_tokens)  # shifted
                if length <= 0:
                    continue
                if (pack or packs) and step_tokens + pack_tokens + length > plan.batch_tokens:
                    if pack:
                        packs.append(collate(pack, pack_tokens))
                    yield StepBatch(packs, step_tokens + pack_tokens, finished)
                    packs, pack, pack_tokens, step_tokens, finished = [], [], 0, 0, []
                elif pack and pack_tokens + length > plan.pack_tokens:
                    # Whole samples only: what does not fit starts the next pack.
                    packs.append(collate(pack, pack_tokens))
                    step_tokens += pack_tokens
                    pack, pack_tokens = [], 0
                pack.append(sample)
                pack_tokens += length
            finished.append(unit)
        if pack:
            packs.append(collate(pack, pack_tokens))
        if packs or finished:
            yield StepBatch(packs, step_tokens + pack_tokens, finished)

    def _prefetch(self, epoch: int, dtype: torch.dtype) -> Iterator[StepBatch | EpochEnd]:
        """This worker's steps from `epoch` on (the units of it in state.units_done left
        out), an EpochEnd after each epoch's last. One thread reads ahead across epoch
        ends, so a new epoch's first step does not wait for its first unit to be read
        (with small data and several workers, epochs end every few steps). It ends when
        the training stops or the consumer stops reading."""
        q: queue.Queue[Any] = queue.Queue(maxsize=4)
        end = object()
        abandoned = threading.Event()  # the consumer stopped reading

        def halted() -> bool:
            return self.stop.is_set() or abandoned.is_set()

        def put(item: Any, give_up: Callable[[], bool]) -> bool:
            while not give_up():
                try:
                    q.put(item, timeout=0.5)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                done, current = list(self.state.units_done), epoch
                while not halted():
                    for batch in self._batches(current, dtype, done, halted):
                        if not put(batch, halted):
                            break
                    # An epoch cut short by the stop has not ended.
                    if halted() or not put(EpochEnd(current), halted):
                        break
                    done, current = [], current + 1
                put(end, abandoned.is_set)  # a stopped training still reads to the end
            except BaseException as err:
                put(err, abandoned.is_set)

        thread = threading.Thread(target=produce, name="hsx-train-data", daemon=True)
        thread.start()
        try:
            while True:
                t0 = time.perf_counter()
                item = q.get()
                self._unbilled_wait += time.perf_counter() - t0
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            abandoned.set()
            # A reader thread still inside torch or pyarrow when the interpreter exits
            # aborts the process ("terminate called without an active exception", after
            # the training succeeded): it is let reach its next check of `abandoned`.
            thread.join(timeout=READER_JOIN_S)

    def _val_samples(self, ds: HiddenStatesDataset) -> Iterator[dict[str, Any]]:
        """This worker's share of the held-out samples committed so far."""
        import bisect

        wanted = {i for n, i in enumerate(self.val_indices)
                  if n % self.group.world == self.group.rank}
        if not wanted:
            return
        mine = sorted(self._val_rows[i] for i in wanted)

        def holds(record: CommitRecord) -> bool:  # a unit holds rows [a, b) of inputs
            a, b = rows.get(record.unit, (0, 1 << 62))
            k = bisect.bisect_left(mine, a)
            return k < len(mine) and mine[k] < b

        rows = {u.unit: u.rows for u in ds.manifest.units}
        ds.refresh()
        for reader in ds.shards([r for r in ds.records if holds(r)]):
            for j, idx in enumerate(reader.sample_indices.tolist()):
                if int(idx) in wanted:
                    yield reader.sample(j, backend="torch")

    # -- the loop

    def _plan(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("the plan is made at the start of run()")
        return self.plan

    def prepare(self) -> Plan:
        """Wait for the manifest, check the layers, pick the device, make the plan."""
        self.manifest = manifest = self._manifest()
        draft_layout(manifest)  # refuse before any weight is loaded
        if self.device is None:
            self.device = resolve_device(self.spec.device)
        self.plan = plan = self._make_plan(manifest)
        if plan.warning and self.group.main:
            logger.warning("%s", plan.warning)
        if self.on_plan is not None and self.group.main:
            self.on_plan(plan)
        return plan

    def run(self) -> TrainState:
        plan = self.prepare()
        manifest = self.manifest
        if self.device is None or manifest is None:
            raise RuntimeError("prepare() reads the manifest and picks the device")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = self._build_model(manifest).to(self.device)
        opt, sched = self._optimizer(model, plan)
        self._resume(model, opt, sched, plan)
        if self.group.main:
            (self.root / DRAFT_STOP).unlink(missing_ok=True)
            # What a run killed mid-checkpoint left staged: never a checkpoint.
            shutil.rmtree(self.draft / ".tmp", ignore_errors=True)
            self._write_state("running")
        trained = model
        if self.group.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            trained = DistributedDataParallel(model, device_ids=ids)
        from speculators.losses import resolve_loss_config

        kernels = self.spec.loss_implementation
        if kernels == "auto":
            kernels = "fused" if self.device.type == "cuda" else "eager"
        loss_config = resolve_loss_config(self.spec.loss, kernels)
        model.train()
        end = min(plan.steps, self.spec.max_steps or plan.steps)
        stopped = False
        try:
            if self.state.step < end:  # else a resumed run that had already ended
                stepped, fresh = False, not self.state.units_done
                # The reader goes on from epoch to epoch; it ends only once the training is
                # asked to stop (or with the error it met, raised here).
                for batch in self._prefetch(self.state.epoch, dtype):
                    if isinstance(batch, EpochEnd):
                        if fresh and not stepped:
                            raise TrainRefused(f"worker {self.group.rank} of {self.group.world} "
                                               "found no training sample in its units")
                        self.state.epoch += 1
                        self.state.units_done = []
                        stepped, fresh = False, True
                        continue
                    if batch.packs:
                        if self._stop_requested():
                            stopped = True
                            break
                        self._step(trained, opt, sched, batch, loss_config)
                        stepped = True
                    self.state.units_done.extend(batch.units)
                    if batch.packs and self.state.step % plan.checkpoint_every == 0:
                        self._checkpoint(model, opt, sched)
                    if self.state.step >= end:
                        break
                else:
                    if self.stop.is_set():  # the data ended early because of the stop
                        stopped = self._stop_requested()
        except BaseException as err:
            if self.group.main:
                self._write_state("failed", error=f"{type(err).__name__}: {err}")
            raise
        self._checkpoint(model, opt, sched)
        if self.group.main:
            self._write_state("stopped" if stopped else "done")
        self.group.barrier()
        return self.state

    def _stop_requested(self) -> bool:
        """Whether any worker was asked to stop (collective: all stop at the same step)."""
        flag = self.stop.is_set() or (self.group.main and (self.root / DRAFT_STOP).exists())
        stop = self.group.any(flag)
        if stop:
            self.stop.set()
        return stop

    def _step(self, model: Any, opt: torch.optim.Optimizer, sched: Any,
              batch: StepBatch, loss_config: Any) -> None:
        if self.device is None:
            raise RuntimeError("prepare() picks the device")
        t0 = time.perf_counter()
        waited, self._unbilled_wait = self._unbilled_wait, 0.0
        self._wait_s += waited
        scores = Scores(self.spec.ttt_steps)
        opt.zero_grad(set_to_none=True)
        last = len(batch.packs) - 1
        for i, pack in enumerate(batch.packs):
            inputs = {k: pack[k].to(self.device, non_blocking=True) for k in (
                "hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                "verifier_last_hidden_states")}
            tokens = int((pack["document_ids"] >= 0).sum())  # padding has document id -1
            # Gradients of all packs are summed here and averaged over workers once.
            sync = contextlib.nullcontext() if i == last or not hasattr(
                model, "no_sync") else model.no_sync()
            with sync:
                with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                    enabled=self.device.type == "cuda"):
                    _, loss, metrics = model(**inputs, ttt_steps=self.spec.ttt_steps,
                                             ttt_step_loss_decay=self.spec.ttt_step_loss_decay,
                                             loss_config=loss_config)
                (loss * (tokens / max(1, batch.tokens))).backward()
            scores.add(float(loss.detach()), tokens, metrics)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        scores = Scores.from_tensor(self.group.sum(scores.as_tensor()), self.spec.ttt_steps)
        loss_value = scores.loss
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {self.state.step + 1}")
        now = time.time()
        self.first_step_at = self.first_step_at or now
        self.state.step += 1
        self.state.tokens += scores.tokens
        # The time spent waiting for this batch counts in this step's total.
        step_s = time.perf_counter() - t0 + waited
        self._step_s += step_s
        self.last = StepMetrics(
            step=self.state.step, epoch=self.state.epoch, loss=loss_value, acc=scores.acc,
            tokens=self.state.tokens, step_tokens=scores.tokens,
            tokens_per_s=scores.tokens / step_s if step_s else 0.0,
            wait_fraction=self.wait_fraction, wait_s=waited, step_s=step_s,
            lr=float(sched.get_last_lr()[0]), time=now,
        )
        if self.state.step % self.spec.log_every == 0 and self.group.main:
            self._append(DRAFT_METRICS, asdict(self.last))
            if self.on_metrics is not None:
                self.on_metrics(self.last)

    @property
    def wait_fraction(self) -> float:
        """Time spent waiting for data ÷ time of the steps so far (waits included)."""
        total = self._step_s
        return self._wait_s / total if total else 0.0

    # -- validation

    def _validate(self, model: Any) -> dict[str, Any] | None:
        """Loss, accuracy per TTT step and expected acceptance length on the held-out
        samples committed so far (collective); None when nothing is held out."""
        if self._validate_fn is not None:
            scores = self._validate_fn(model)
        elif not self.val_indices:
            return None
        else:
            scores = self._held_out_scores(model)
        if not scores.tokens:
            return None
        return {
            "step": self.state.step, "loss": scores.loss, "acc": scores.acc,
            "cond_acc": scores.cond_acc,
            "expected_acceptance_length": scores.expected_acceptance_length,
            "tokens": scores.tokens, "time": time.time(),
        }

    @torch.no_grad()
    def _held_out_scores(self, model: Any) -> Scores:
        from speculators.losses import resolve_loss_config

        plan = self._plan()
        dtype = torch.bfloat16 if self.device is not None and self.device.type == "cuda" \
            else torch.float32
        ds = HiddenStatesDataset(self.output, backend="torch")
        collate = self._collate(dtype, ds.manifest.hidden_size, len(ds.manifest.layers) - 1)
        loss_config = resolve_loss_config(self.spec.loss, "eager")
        scores = Scores(self.spec.ttt_steps)
        was_training = model.training
        model.eval()

        def run(pack: list[dict[str, Any]], tokens: int) -> None:
            batch = collate(pack, tokens)
            inputs = {k: batch[k].to(self.device) for k in (
                "hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                "verifier_last_hidden_states")}
            with torch.autocast(self.device.type if self.device else "cpu",
                                dtype=torch.bfloat16,
                                enabled=self.device is not None and self.device.type == "cuda"):
                _, loss, metrics = model(**inputs, ttt_steps=self.spec.ttt_steps,
                                         ttt_step_loss_decay=self.spec.ttt_step_loss_decay,
                                         loss_config=loss_config)
            scores.add(float(loss), int((batch["document_ids"] >= 0).sum()), metrics)

        pack: list[dict[str, Any]] = []
        pack_tokens = 0
        try:
            for raw in self._val_samples(ds):
                sample = to_speculators_sample(raw, dtype)
                length = min(int(sample["lengths"][0]) - 1, plan.pack_tokens)
                if length <= 0:
                    continue
                if pack and pack_tokens + length > plan.pack_tokens:
                    run(pack, pack_tokens)
                    pack, pack_tokens = [], 0
                pack.append(sample)
                pack_tokens += length
            if pack:
                run(pack, pack_tokens)
        finally:
            model.train(was_training)
        return Scores.from_tensor(self.group.sum(scores.as_tensor()), self.spec.ttt_steps)

    # -- files

    def _append(self, name: str, row: dict[str, Any]) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _rewrite(self, name: str, rows: list[dict[str, Any]]) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)

    def _write_state(self, state: str, error: str | None = None) -> None:
        body = {"state": state, "step": self.state.step, "epoch": self.state.epoch,
                "resumed_from": self.resumed_from, "error": error, "time": time.time(),
                "first_step_at": self.first_step_at,
                "plan": asdict(self.plan) if self.plan else None,
                "warning": self.plan.warning if self.plan else None,
                "best": self.best, "validation": self.last_validation,
                "spec": self.spec.model_dump(mode="json")}
        write_json(self.root / DRAFT_STATE, body)
        if self.bucket is not None:  # after each checkpoint too: it ends with this call
            try:
                self.bucket.push()
            except (StorageError, OSError) as err:
                if state != "failed":
                    raise
                logger.warning("%s: the failed state was not uploaded: %s", self.bucket, err)

    def _checkpoint(self, model: Any, opt: torch.optim.Optimizer, sched: Any) -> Path | None:
        """Validate, then (main worker) write the checkpoint and publish the best one."""
        name = checkpoint_name(self.state.step)
        final = self.root / DRAFT_CHECKPOINTS / name
        if self.group.any(self.group.main and final.exists()):
            return final  # written already (the last step was a checkpoint step)
        validation = self._validate(model)
        states = self.group.gather(asdict(self.state))
        if not self.group.main:
            return None
        self.last_validation = validation
        if validation is not None:
            self._append(DRAFT_VALIDATION, validation)
        tmp = self.draft / ".tmp" / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp))
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "state": dict(states[0]), "ranks": states, "world": self.group.world},
                   tmp / TRAINER_STATE)
        (tmp / CHECKPOINT_METRICS).write_text(json.dumps({
            "step": self.state.step, "validation": validation,
            "train": asdict(self.last) if self.last else None}, indent=2))
        # transformers writes the weights through a private temp file (mode 0600); a
        # draft in a shared bucket must be readable like the files beside it, so each
        # file gets the mode train.json got from the umask.
        mode = (self.root / DRAFT_STATE).stat().st_mode & 0o777
        for f in tmp.iterdir():
            f.chmod(mode)
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        faults.reached("after_checkpoint_write", str(tmp))
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, final)  # a checkpoint is there whole or not at all
        fsync_dir(final.parent)
        faults.reached("after_checkpoint_rename", str(final))
        value = expected_acceptance(validation)
        if not (self.val_indices or self._validate_fn is not None):
            self._publish(final)  # no validation: the newest is the draft
        elif value is not None and (self.best is None
                                    or value > self.best["expected_acceptance_length"]):
            self.best = {"step": self.state.step, "expected_acceptance_length": value}
            self._publish(final)
        elif self.best is None:
            self._publish(final)  # no held-out sample committed yet: the newest meanwhile
        faults.reached("after_checkpoint_publish", str(final))
        keep = checkpoint_name(self.best["step"]) if self.best else None
        for old in checkpoints(self.root)[: -self.spec.keep_checkpoints]:
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)
        self._write_state("running")
        return final

    def _publish(self, ckpt: Path) -> None:
        """Hard-link the checkpoint's files into draft/, each replaced atomically."""
        for name in PUBLISHED_FILES:
            src = ckpt / name
            if not src.exists():
                continue
            tmp = self.draft / f".{name}.tmp"
            tmp.unlink(missing_ok=True)
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
            os.replace(tmp, self.draft / name)


# ---------------------------------------------------------------------- Ray Train


def _train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: its rank's DraftTrainer (torch.distributed is set up)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    spec = TrainSpec.model_validate(config["spec"])
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, int(config.get("threads", 1))))
    trainer = DraftTrainer(config["output"], spec, draft_root=config["draft_root"],
                           rank=ctx.get_world_rank(),
                           world=ctx.get_world_size(), device=device,
                           poll_interval=float(config.get("poll_interval", 0.5)))
    trainer.run()


def train_distributed(
    output: str | Path | Output, spec: TrainSpec, *, draft_root: str | Path | None = None,
    use_gpu: bool | None = None, stop: threading.Event | None = None,
    poll_interval: float = 0.5,
) -> dict[str, Any]:
    """Train on `spec.workers` Ray Train workers (DDP; gloo on CPU, NCCL on GPU).

    Needs a connected Ray. Each worker trains on its own units; the main one writes
    metrics, validations and checkpoints into `<output>/draft/` (or `<draft_root>/draft/`)
    as `DraftTrainer` does alone; every worker must reach that folder (one host, or a
    shared file system). `stop` asks the workers to checkpoint and stop (through
    draft/.stop). Returns train.json's final content.
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    output = Output.of(output)
    root = draft_folder(output, draft_root)
    if use_gpu is None:
        use_gpu = spec.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
    if spec.device == "cuda" and not use_gpu:
        raise TrainRefused("device cuda was asked for but the Ray cluster has no GPU")
    (root / DRAFT_STOP).unlink(missing_ok=True)
    (root / DRAFT_DIR).mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        _train_worker,
        # The Output itself: it carries the storage settings resolved here.
        train_loop_config={"output": output, "draft_root": str(root),
                           "spec": spec.model_dump(mode="json"),
                           "poll_interval": poll_interval, "threads": 1},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=spec.workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"hsx-train-{os.getpid()}-{int(time.time())}",
                             storage_path=str(root / DRAFT_DIR / ".ray"),
                             failure_config=FailureConfig(max_failures=0)),
    )
    done = threading.Event()

    def relay_stop() -> None:
        while not done.is_set():
            if stop is not None and stop.wait(0.5):
                (root / DRAFT_STOP).touch()
                return
            if stop is None:
                return

    watcher = threading.Thread(target=relay_stop, name="hsx-train-stop", daemon=True)
    watcher.start()
    try:
        trainer.fit()
    except Exception as err:
        from ray.exceptions import RayActorError

        cause = _root_cause(err)
        if isinstance(cause, TrainRefused):
            raise cause from None
        message = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if isinstance(cause, RayActorError):
            raise WorkerDied(f"a training worker died: {message}") from err
        raise RuntimeError(f"distributed training failed: {message}") from err
    finally:
        done.set()
        (root / DRAFT_STOP).unlink(missing_ok=True)
    state = json.loads((root / DRAFT_STATE).read_text())
    return dict(state)


def _root_cause(err: BaseException) -> BaseException:
    """The worker's own exception inside Ray Train's wrappers (a worker group's first
    failure, a controller's failure, a task's cause), where one is there."""
    seen = set()
    while id(err) not in seen:
        seen.add(id(err))
        failures = getattr(err, "worker_failures", None)
        nxt = (next(iter(failures.values())) if isinstance(failures, dict) and failures
               else getattr(err, "controller_failure", None) or getattr(err, "cause", None)
               or err.__cause__)
        if not isinstance(nxt, BaseException):
            break
        err = nxt
    return err
