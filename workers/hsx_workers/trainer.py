"""Train an EAGLE-3 draft (speculators' Eagle3DraftModel) on an hsx output.

`DraftTrainer(output, spec).run()` is the whole loop; the Ray actor in
trainer_actor.py and `hsx train` both call it.

- Output: read through `hsx.output.Output`, on local disk or an object store; the
  draft goes to `<output>/draft/`, or under `draft_root` (a local folder, which an
  object-store output needs: `hsx train URI --draft-dir DIR`).
- Data: committed shards through `HiddenStatesDataset`. The first epoch follows the
  extraction (`spec.follow`): a shard is trained on as soon as its commit lands, in
  commit order; later epochs shuffle units. Samples are turned into speculators'
  sample dicts (aux layers flattened, the last layer as the target's hidden state),
  shifted with speculators' `shift_batch` and packed by its `CollateFn` into one
  sequence of `batch_tokens`. A producer thread builds batches ahead of the step; the
  time the step waits on it is measured (`wait_fraction`).
- Model: the draft's decoder layer is the target's (text) config with `num_layers`
  layers; embeddings and lm_head come from the target (speculators'
  `load_verifier_weights`); d2t/t2d from the frequencies of loss-masked tokens in
  inputs.arrow (speculators' `build_vocab_mappings_from_distribution`).
- Checkpoints: `draft/checkpoints/step-N/` (speculators' save_pretrained + the
  optimizer in trainer_state.pt), written under draft/.tmp and published by a
  directory rename; the newest one's files are then hard-linked to `draft/` so that
  folder is always a complete draft vLLM can load. A restart resumes from the newest
  checkpoint: weights, optimizer, step, epoch and the units done in that epoch.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsx.dataset import HiddenStatesDataset
from hsx.draft import checkpoints, read_metrics
from hsx.modelinfo import draft_aux_layers
from hsx.output import Manifest, Output, ShardReader
from hsx.output.layout import (
    DRAFT_CHECKPOINTS,
    DRAFT_DIR,
    DRAFT_METRICS,
    DRAFT_STATE,
    checkpoint_name,
)
from hsx.spec import TrainSpec

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
Batch = tuple[dict[str, Any], list[int]]  # (packed batch, or {} with units just finished)
PUBLISHED_FILES = ("config.json", "config.py", "model.safetensors")


class TrainRefused(ValueError):
    """The output cannot train a draft (wrong layers, no samples); the message says why."""


@dataclass
class TrainState:
    """What a checkpoint restores besides the weights and the optimizer."""

    step: int = 0
    epoch: int = 0
    units_done: list[int] = field(default_factory=list)  # of the current epoch
    tokens: int = 0


@dataclass
class StepMetrics:
    step: int
    epoch: int
    loss: float
    acc: list[float]  # full accuracy per TTT step
    tokens: int
    tokens_per_s: float
    wait_fraction: float  # of the whole run so far
    wait_s: float  # this step: waiting for its batch
    step_s: float  # this step: waiting + compute
    lr: float
    time: float


# ---------------------------------------------------------------------- pieces


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


def token_frequencies(output: Output) -> Counter[int]:
    """Counts of loss-masked tokens of every ingested sample (what the draft must say)."""
    import numpy as np

    table = output.inputs()
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


# ---------------------------------------------------------------------- trainer


class DraftTrainer:
    """One training run over one output; see the module docstring."""

    def __init__(
        self,
        output: str | Path | Output,
        spec: TrainSpec,
        *,
        draft_root: str | Path | None = None,
        on_metrics: Callable[[StepMetrics], None] | None = None,
        stop: threading.Event | None = None,
        poll_interval: float = 0.5,
    ) -> None:
        self.output = Output.of(output)
        root = Path(draft_root) if draft_root is not None else self.output.local_root
        if root is None:
            raise TrainRefused(
                f"{self.output} is an object store: checkpoints are published by folder "
                "renames and hard links, so the draft needs a local folder (draft_root; "
                "`hsx train URI --draft-dir DIR`)"
            )
        self.root = root  # the folder that holds draft/: the output's own on local disk
        self.spec = spec
        self.on_metrics = on_metrics
        self.stop = stop or threading.Event()
        self.poll_interval = poll_interval
        self.draft = self.root / DRAFT_DIR
        self.state = TrainState()
        self.resumed_from: int | None = None
        self.first_step_at: float | None = None
        self.last: StepMetrics | None = None
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

    def _build_model(self, manifest: Manifest) -> Any:
        from speculators.models.eagle3 import Eagle3DraftModel
        from transformers import AutoConfig

        aux, _ = draft_layout(manifest)
        model_path = manifest.model
        trust = manifest.trust_remote_code
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
        text = draft_layer_config(getattr(config, "text_config", None) or config,
                                  self.spec.num_layers, len(aux))
        freqs = token_frequencies(self.output)
        if not freqs:
            raise TrainRefused(f"{self.output}: no loss-masked token in inputs.arrow")
        d2t, t2d, draft_vocab = vocab_mappings(
            freqs, self.spec.draft_vocab_size, int(text.vocab_size)
        )
        torch.manual_seed(self.spec.seed)
        # speculators' own choice on GPU (flex attention, compiled); eager on CPU, where
        # flex attention has no fast kernel.
        attn = "simple_flex_attention" if self.device.type == "cuda" else "eager"
        return Eagle3DraftModel.from_training_args(
            text, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab,
            norm_before_residual=self.spec.norm_before_residual,
            ttt_steps=self.spec.ttt_steps, verifier_name_or_path=model_path,
            target_layer_ids=aux, draft_attn_impl=attn, trust_remote_code=trust,
        )

    def _optimizer(self, model: Any) -> tuple[torch.optim.Optimizer, Any]:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.spec.lr, weight_decay=self.spec.weight_decay)
        warmup = self.spec.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        return opt, sched

    def _resume(self, model: Any, opt: torch.optim.Optimizer, sched: Any) -> None:
        saved_checkpoints = checkpoints(self.root)
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
        self.state = TrainState(**saved["state"])
        self.resumed_from = self.state.step
        # Records logged after the checkpoint are replayed by this run.
        kept = [m for m in read_metrics(self.root) if int(m.get("step", 0)) <= self.state.step]
        self._write_metrics(kept, replace=True)
        logger.info("resumed from %s (step %d, epoch %d)", ckpt.name, self.state.step,
                    self.state.epoch)

    # -- data

    def _units(self, ds: HiddenStatesDataset, epoch: int) -> Iterator[ShardReader]:
        done = set(self.state.units_done)
        if epoch == 0 and not ds.complete:
            shards = ds.shards()  # follow=True: as commits land
        else:
            ds.refresh()
            records = [r for r in ds.records if r.unit not in done]
            random.Random(self.spec.seed * 1000 + epoch).shuffle(records)
            shards = ds.shards(records)
        for reader in shards:
            if self.stop.is_set():
                return
            if unit_of(reader) not in done:
                yield reader

    def _wait_for_complete(self) -> None:
        while not self.output.is_complete() and not self.stop.is_set():
            time.sleep(self.poll_interval)

    def _batches(self, epoch: int, dtype: torch.dtype) -> Iterator[Batch]:
        """(packed batch, units finished with it) for one epoch, in order."""
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        if not self.spec.follow:
            self._wait_for_complete()
        ds = HiddenStatesDataset(self.output, follow=True, backend="torch",
                                 poll_interval=self.poll_interval)
        aux = len(ds.manifest.layers) - 1
        collate = CollateFn(self.spec.batch_tokens, ds.manifest.hidden_size,
                            num_target_layers=aux, dtype=dtype, preprocess=shift_batch)
        rng = random.Random(self.spec.seed * 7919 + epoch)
        pending: list[dict[str, Any]] = []
        tokens = 0
        for reader in self._units(ds, epoch):
            order = list(range(len(reader)))
            rng.shuffle(order)
            for j in order:
                sample = to_speculators_sample(reader.sample(j, backend="torch"), dtype)
                length = int(sample["lengths"][0]) - 1  # after shift_batch
                if pending and tokens + length > self.spec.batch_tokens:
                    # Whole samples only: what does not fit starts the next batch (a
                    # sample longer than batch_tokens alone is cut to it).
                    yield collate(pending), []
                    pending, tokens = [], 0
                pending.append(sample)
                tokens += length
            yield {}, [unit_of(reader)]  # marks the unit as done
        if pending:
            yield collate(pending), []

    def _prefetch(self, epoch: int, dtype: torch.dtype) -> Iterator[Batch]:
        q: queue.Queue[Any] = queue.Queue(maxsize=4)
        end = object()

        def produce() -> None:
            try:
                for item in self._batches(epoch, dtype):
                    while not self.stop.is_set():
                        try:
                            q.put(item, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if self.stop.is_set():
                        break
                q.put(end)
            except BaseException as err:
                q.put(err)

        thread = threading.Thread(target=produce, name="hsx-train-data", daemon=True)
        thread.start()
        while True:
            t0 = time.perf_counter()
            item = q.get()
            self._unbilled_wait += time.perf_counter() - t0
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    # -- the loop

    def run(self) -> TrainState:
        manifest = self._manifest()
        draft_layout(manifest)  # refuse before any weight is loaded
        self.device = resolve_device(self.spec.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = self._build_model(manifest).to(self.device)
        opt, sched = self._optimizer(model)
        self._resume(model, opt, sched)
        self._write_state("running")
        from speculators.losses import resolve_loss_config

        kernels = self.spec.loss_implementation
        if kernels == "auto":
            kernels = "fused" if self.device.type == "cuda" else "eager"
        loss_config = resolve_loss_config(self.spec.loss, kernels)
        model.train()
        max_steps = self.spec.max_steps
        try:
            while self.state.epoch < self.spec.epochs:
                for batch, units in self._prefetch(self.state.epoch, dtype):
                    if units:
                        self.state.units_done.extend(units)
                        continue
                    self._step(model, opt, sched, batch, loss_config)
                    if self.state.step % self.spec.checkpoint_every == 0:
                        self._checkpoint(model, opt, sched)
                    if self.stop.is_set() or (max_steps and self.state.step >= max_steps):
                        break
                if self.stop.is_set() or (max_steps and self.state.step >= max_steps):
                    break
                self.state.epoch += 1
                self.state.units_done = []
        except BaseException as err:
            self._write_state("failed", error=str(err))
            raise
        self._checkpoint(model, opt, sched)
        self._write_state("stopped" if self.stop.is_set() else "done")
        return self.state

    def _step(self, model: Any, opt: torch.optim.Optimizer, sched: Any,
              batch: dict[str, Any], loss_config: Any) -> None:
        t0 = time.perf_counter()
        waited, self._unbilled_wait = self._unbilled_wait, 0.0
        self._wait_s += waited
        inputs = {k: batch[k].to(self.device, non_blocking=True) for k in (
            "hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
            "verifier_last_hidden_states")}
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            _, loss, metrics = model(**inputs, ttt_steps=self.spec.ttt_steps,
                                     ttt_step_loss_decay=self.spec.ttt_step_loss_decay,
                                     loss_config=loss_config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {self.state.step + 1}")
        now = time.time()
        self.first_step_at = self.first_step_at or now
        self.state.step += 1
        tokens = int((batch["document_ids"] >= 0).sum())  # padding has document id -1
        self.state.tokens += tokens
        # The time spent waiting for this batch counts in this step's total.
        step_s = time.perf_counter() - t0 + waited
        self._step_s += step_s
        acc = []
        for k in range(self.spec.ttt_steps):
            total = float(metrics[f"full_acc_{k}_total"])
            acc.append(float(metrics[f"full_acc_{k}_sum"]) / total if total else 0.0)
        self.last = StepMetrics(
            step=self.state.step, epoch=self.state.epoch, loss=loss_value, acc=acc,
            tokens=self.state.tokens, tokens_per_s=tokens / step_s if step_s else 0.0,
            wait_fraction=self.wait_fraction, wait_s=waited, step_s=step_s,
            lr=float(sched.get_last_lr()[0]), time=now,
        )
        if self.state.step % self.spec.log_every == 0:
            self._write_metrics([self.last.__dict__])
            if self.on_metrics is not None:
                self.on_metrics(self.last)

    @property
    def wait_fraction(self) -> float:
        """Time spent waiting for data ÷ time of the steps so far (waits included)."""
        total = self._step_s
        return self._wait_s / total if total else 0.0

    # -- files

    def _write_metrics(self, rows: list[dict[str, Any]], replace: bool = False) -> None:
        path = self.root / DRAFT_METRICS
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if replace:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        else:
            with path.open("a") as f:
                f.write(text)

    def _write_state(self, state: str, error: str | None = None) -> None:
        self.draft.mkdir(parents=True, exist_ok=True)
        body = {"state": state, "step": self.state.step, "epoch": self.state.epoch,
                "resumed_from": self.resumed_from, "error": error, "time": time.time(),
                "spec": self.spec.model_dump(mode="json")}
        tmp = self.root / (DRAFT_STATE + ".tmp")
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, self.root / DRAFT_STATE)

    def _checkpoint(self, model: Any, opt: torch.optim.Optimizer, sched: Any) -> Path:
        name = checkpoint_name(self.state.step)
        folder = self.root / DRAFT_CHECKPOINTS
        final = folder / name
        if final.exists():
            return final
        tmp = self.draft / ".tmp" / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp))
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "state": self.state.__dict__.copy()}, tmp / TRAINER_STATE)
        # transformers writes the weights through a private temp file (mode 0600); a
        # draft in a shared bucket must be readable like the files beside it, so each
        # file gets the mode train.json got from the umask.
        mode = (self.root / DRAFT_STATE).stat().st_mode & 0o777
        for f in tmp.iterdir():
            f.chmod(mode)
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        folder.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, final)  # a checkpoint is there whole or not at all
        self._publish(final)
        for old in checkpoints(self.root)[: -self.spec.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
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
