"""`DraftTrainer`: one training run over one output, in one process or as one worker of
`train_distributed` (see the package docstring for what it does)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
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
    read_visits,
    write_json,
)
from hsx.output import Manifest, Output, StorageError, faults
from hsx.output.layout import (
    CHECKPOINT_METRICS,
    DRAFT_CHECKPOINTS,
    DRAFT_DIR,
    DRAFT_METRICS,
    DRAFT_STATE,
    DRAFT_STOP,
    DRAFT_VALIDATION,
    DRAFT_VISITS,
    checkpoint_name,
)
from hsx.output.local_storage import (
    fsync_dir,
    make_output_dirs,
    open_output_file,
    output_file_mode,
    replace_output_file,
)
from hsx.output.quota import QUOTA_ENV, folder_bytes, output_quota
from hsx.output.shards.encoding import HIDDEN_DTYPE, NUMPY_DTYPES
from hsx.spec import TargetModel, TrainSpec
from hsx_workers.trainer.data import EpochEnd, StepBatch, TrainingData
from hsx_workers.trainer.draft_model import build_draft_model, draft_layout
from hsx_workers.trainer.group import WorkerGroup
from hsx_workers.trainer.plan import (
    Plan,
    TrainRefused,
    online_cost,
    plan_schedule,
    read_inputs_summary,
)
from hsx_workers.trainer.scores import Scores

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
PUBLISHED_FILES = ("config.json", "config.py", "model.safetensors")


@dataclass
class TrainState:
    """What a checkpoint restores for one worker besides the weights and the optimizer."""

    step: int = 0
    epoch: int = 0
    units_done: list[int] = field(default_factory=list)  # of the current epoch
    tokens: int = 0  # trained on by all workers
    # Samples of the current epoch trained in units not finished yet: unit -> indices
    # (a resume leaves them out, so no sample is trained twice in an epoch).
    partial: dict[int, list[int]] = field(default_factory=dict)


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


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainRefused("device cuda was asked for but torch sees no GPU")
        return torch.device("cuda")
    return torch.device("cpu")


def read_trainer_state(path: Path, device: torch.device | None = None) -> dict[str, Any]:
    """A checkpoint's trainer state (optimizer, scheduler, each worker's `TrainState`),
    read without running anything it holds, or TrainRefused naming the file.

    The checkpoint lies in the output, which whoever can write there controls (a shared
    folder, a bucket): unpickling it as a whole would run any code a crafted file names.
    torch's weights-only loader rebuilds tensors and plain containers only, which is all
    `DraftTrainer._checkpoint` writes."""
    # torch before 2.6 let a crafted file run code through its weights-only loader
    # (CVE-2025-32434).
    if torch.__version__ < "2.6":
        raise TrainRefused(f"{path}: torch {torch.__version__} cannot read a checkpoint "
                           "safely; resuming needs torch 2.6 or newer")
    advice = (f"start the training afresh (remove {path.parent.parent}, the checkpoints "
              "folder) or restore the checkpoint from a copy you trust")
    try:
        saved = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise TrainRefused(f"{path} is missing: the checkpoint is incomplete; {advice}") from None
    except Exception as err:  # anything torch's refusing loader raises, for any bad file
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainRefused(f"{path} is not a checkpoint hsx can read safely ({reason}); "
                           f"{advice}") from None
    if not isinstance(saved, dict) or not {"optimizer", "scheduler", "state"} <= saved.keys():
        raise TrainRefused(f"{path} is not a checkpoint hsx can read safely (not a trainer "
                           f"state); {advice}")
    return saved


def ray_node() -> str:
    """The Ray node this process runs on ('' outside Ray)."""
    ray = sys.modules.get("ray")
    return str(ray.get_runtime_context().get_node_id()) if ray and ray.is_initialized() else ""


class ShareTooSmall(RuntimeError):
    """An online trainer sharing an engine's GPU ran out of memory inside its share."""


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
        memory_share: float | None = None,
        target: TargetModel | None = None,
    ) -> None:
        self.output = Output.of(output)
        # The target as the job (or the person training) names it; None: the model the
        # output's manifest names, never with its own code (the manifest is the
        # output's, and whoever can write there could name any).
        self.target = target
        self.root = draft_folder(self.output, draft_root)
        self.spec = spec
        self.on_metrics = on_metrics
        self.on_plan = on_plan
        self.stop = stop or threading.Event()
        self.poll_interval = poll_interval
        self.group = WorkerGroup(rank, world)
        self.device = device
        # Of the GPU's memory, at most (an online trainer sharing the GPU with an engine).
        self.memory_share = memory_share
        self._validate_fn = validate  # tests replace the validation; None: held-out samples
        self.draft = self.root / DRAFT_DIR
        self.bucket = bucket_draft(self.output, self.root)  # None on local disk
        self.state = TrainState()
        self.plan: Plan | None = None
        self.manifest: Manifest | None = None
        self.data = TrainingData(self.output, spec, self.group, stop=self.stop,
                                 poll_interval=poll_interval)
        self.val_indices: list[int] = []
        self.resumed_from: int | None = None
        self.first_step_at: float | None = None
        self.last: StepMetrics | None = None
        self.best: dict[str, Any] | None = None  # {"step", "expected_acceptance_length"}
        self.last_validation: dict[str, Any] | None = None
        self._wait_s = 0.0  # waits billed to steps so far
        self._step_s = 0.0  # steps so far, their waits included
        # This worker's visits since the last checkpoint, each {step, rank, epoch, samples}:
        self._visits: list[dict[str, Any]] = []  # the main writes all into visits.jsonl
        self.nodes: list[str] = []  # the Ray node of each worker, by rank ('' outside Ray)

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
        self.val_indices = self.data.hold_out(inputs.sample_indices)
        held = frozenset(self.val_indices)
        train = [(i, n) for i, n in zip(inputs.sample_indices, inputs.lengths, strict=True)
                 if i not in held]
        units = manifest.units
        if self.group.world > 1 and len(units) < self.group.world:
            raise TrainRefused(
                f"{len(units)} work unit(s) for {self.group.world} workers: each worker "
                "reads its own units; use fewer workers or a smaller unit_tokens")
        device = self.device.type if self.device is not None else "cpu"
        plan = plan_schedule(
            self.spec, device=device, train_samples=len(train),
            train_tokens=sum(max(0, n - 1) for _, n in train),
            val_samples=len(self.val_indices), workers=self.group.world,
            longest=max((n - 1 for _, n in train), default=0),
        )
        if self.spec.online:
            width = NUMPY_DTYPES[HIDDEN_DTYPE[manifest.storage_dtype]].itemsize
            plan = replace(plan, online=online_cost(
                plan, sum(inputs.lengths), len(manifest.layers) * manifest.hidden_size * width))
        return plan

    def _optimizer(self, model: Any, plan: Plan) -> tuple[torch.optim.Optimizer, Any]:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=plan.lr, betas=self.spec.draft.betas,
                                weight_decay=self.spec.weight_decay)
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
        saved = read_trainer_state(ckpt / TRAINER_STATE, self.device)
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
            self._rewrite(DRAFT_VISITS, [v for v in read_visits(self.root)
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

    # -- the loop

    @property
    def _pad(self) -> bool:
        """Packs are padded to pack_tokens on GPU (one shape for the compiled model)."""
        return self.device is not None and self.device.type == "cuda"

    def _plan(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("the plan is made at the start of run()")
        return self.plan

    def prepare(self) -> Plan:
        """Wait for the manifest, check the layers, pick the device, make the plan."""
        self.manifest = manifest = self._manifest()
        draft_layout(manifest, self.spec.method)  # refuse before any weight is loaded
        if self.device is None:
            self.device = resolve_device(self.spec.device)
        if self.memory_share and self.device.type == "cuda":
            # Beyond its share the trainer runs out of memory itself, instead of taking
            # what the engine's vLLM budgeted for its KV cache.
            index = self.device.index
            torch.cuda.set_per_process_memory_fraction(
                float(self.memory_share), torch.cuda.current_device() if index is None else index)
        self.plan = plan = self._make_plan(manifest)
        if plan.warning and self.group.main:
            logger.warning("%s", plan.warning)
        if self.on_plan is not None and self.group.main:
            self.on_plan(plan)
        return plan

    def run(self) -> TrainState:
        try:
            return self._run()
        except torch.OutOfMemoryError as err:
            if not self.memory_share:
                raise
            raise ShareTooSmall(self._share_advice(err)) from err

    def _share_advice(self, err: BaseException) -> str:
        """What to change when the trainer ran out of its share of an engine's GPU."""
        size, share = "", self.memory_share or 0.0
        if self.device is not None and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            size = f": {share * total / 2**30:.0f} of {total / 2**30:.0f} GiB"
        batch = f" ({self.plan.batch_tokens:,})" if self.plan is not None else ""
        return (f"the trainer ran out of GPU memory inside its share of the engine's GPU "
                f"(train.gpu_share {share:g}{size}); raise train.gpu_share (vLLM "
                f"then takes less of the GPU) or lower train.batch_tokens{batch}. "
                f"{str(err).splitlines()[0] if str(err) else ''}")

    def _run(self) -> TrainState:
        plan = self.prepare()
        manifest = self.manifest
        if self.device is None or manifest is None:
            raise RuntimeError("prepare() reads the manifest and picks the device")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        target = self.target or TargetModel(manifest.model)
        model = build_draft_model(self.output, manifest, self.spec, self.device,
                                  exclude=self.val_indices, target=target).to(self.device)
        opt, sched = self._optimizer(model, plan)
        self._resume(model, opt, sched, plan)
        self.nodes = self.group.gather(ray_node())  # where each worker runs (train.json)
        if self.group.main:
            (self.root / DRAFT_STOP).unlink(missing_ok=True)
            # What a run killed mid-checkpoint left staged: never a checkpoint.
            shutil.rmtree(self.draft / ".tmp", ignore_errors=True)
            self._write_state("running")
        stream = self.data.stream
        if stream is not None:  # online: the driver captures what this run needs
            stream.start_run(self.state.epoch, self.state.units_done)
        trained = model
        if self.group.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            trained = DistributedDataParallel(model, device_ids=ids)
        kernels = self.spec.loss_implementation
        if kernels == "auto":
            kernels = "fused" if self.device.type == "cuda" else "eager"
        forward = self.spec.draft.forward_kwargs(self.spec, kernels, plan.anchors)
        model.train()
        end = min(plan.steps, self.spec.max_steps or plan.steps)
        stopped = False
        try:
            if self.state.step < end:  # else a resumed run that had already ended
                stepped, fresh = False, not self.state.units_done
                # The reader goes on from epoch to epoch; it ends only once the training is
                # asked to stop (or with the error it met, raised here).
                for batch in self.data.prefetch(self.state.epoch, dtype, plan, pad=self._pad,
                                                done=list(self.state.units_done),
                                                partial=dict(self.state.partial)):
                    if isinstance(batch, EpochEnd):
                        if fresh and not stepped:
                            raise TrainRefused(f"worker {self.group.rank} of {self.group.world} "
                                               "found no training sample in its units")
                        self.state.epoch += 1
                        self.state.units_done = []
                        self.state.partial = {}
                        stepped, fresh = False, True
                        continue
                    if batch.packs:
                        if self._stop_requested():
                            stopped = True
                            break
                        self._step(trained, opt, sched, batch, forward)
                        stepped = True
                    self._units_trained(batch)
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
            if stream is not None:
                stream.set_trainer("stopped" if stopped else "done", step=self.state.step)
        self.group.barrier()
        return self.state

    def _units_trained(self, batch: StepBatch) -> None:
        """What a step trained goes into the state a checkpoint keeps (and the visits
        log: each sample trained, by step and epoch)."""
        finished = set(batch.units)
        for unit, idx in batch.samples:
            if unit not in finished:
                self.state.partial.setdefault(unit, []).append(idx)
        for unit in batch.units:
            self.state.partial.pop(unit, None)
        self.state.units_done.extend(batch.units)
        if batch.samples:
            self._visits.append({"step": self.state.step, "rank": self.group.rank,
                                 "epoch": self.state.epoch,
                                 "samples": [i for _, i in batch.samples]})

    def _stop_requested(self) -> bool:
        """Whether any worker was asked to stop (collective: all stop at the same step)."""
        flag = self.stop.is_set() or (self.group.main and (self.root / DRAFT_STOP).exists())
        stop = self.group.any(flag)
        if stop:
            self.stop.set()
        return stop

    def _step(self, model: Any, opt: torch.optim.Optimizer, sched: Any,
              batch: StepBatch, forward: dict[str, Any]) -> None:
        if self.device is None:
            raise RuntimeError("prepare() picks the device")
        t0 = time.perf_counter()
        waited = self.data.take_wait()
        self._wait_s += waited
        scores = Scores.of(self.spec)
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
                    _, loss, metrics = model(**inputs, **forward)
                (loss * (tokens / max(1, batch.tokens))).backward()
            scores.add(float(loss.detach()), tokens, metrics)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        scores = scores.from_tensor(self.group.sum(scores.as_tensor()))
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
        plan = self._plan()
        dtype = torch.bfloat16 if self.device is not None and self.device.type == "cuda" \
            else torch.float32
        ds = HiddenStatesDataset(self.output, backend="torch")
        collate = self.data.collate(dtype, ds.manifest, plan, pad=self._pad)
        forward = self.spec.draft.forward_kwargs(self.spec, "eager", plan.anchors)
        scores = Scores.of(self.spec)
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
                _, loss, metrics = model(**inputs, **forward)
            scores.add(float(loss), int((batch["document_ids"] >= 0).sum()), metrics)

        pack: list[dict[str, Any]] = []
        pack_tokens = 0
        try:
            for raw in self.data.held_out_samples(ds):
                sample, length = self.data.trained(raw, dtype, ds.manifest, plan.pack_tokens)
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
        return scores.from_tensor(self.group.sum(scores.as_tensor()))

    # -- files

    def _append(self, name: str, row: dict[str, Any]) -> None:
        path = self.root / name
        make_output_dirs(path.parent)
        with open_output_file(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _rewrite(self, name: str, rows: list[dict[str, Any]]) -> None:
        replace_output_file(self.root / name, "".join(json.dumps(r) + "\n" for r in rows))

    def _write_state(self, state: str, error: str | None = None) -> None:
        body = {"state": state, "step": self.state.step, "epoch": self.state.epoch,
                "nodes": self.nodes,
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
        gathered = self.group.gather((asdict(self.state), self._visits))
        self._visits = []
        if not self.group.main:
            return None
        states = [state for state, _ in gathered]
        visits = sorted((v for _, rows in gathered for v in rows),
                        key=lambda v: (v["step"], v["rank"]))
        for visit in visits:  # before the checkpoint: a resume cuts them back to it
            self._append(DRAFT_VISITS, visit)
        self.last_validation = validation
        if validation is not None:
            self._append(DRAFT_VALIDATION, validation)
        tmp = self.draft / ".tmp" / name
        shutil.rmtree(tmp, ignore_errors=True)
        make_output_dirs(tmp)
        model.save_pretrained(str(tmp))
        # Only what read_trainer_state's weights-only loader rebuilds: tensors, numbers,
        # strings, lists, tuples and dicts of them.
        with open_output_file(tmp / TRAINER_STATE, "wb") as fh:
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "state": dict(states[0]), "ranks": states, "world": self.group.world},
                       fh)
        with open_output_file(tmp / CHECKPOINT_METRICS) as fh:
            fh.write(json.dumps({
                "step": self.state.step, "validation": validation,
                "train": asdict(self.last) if self.last else None}, indent=2))
        # transformers picks its files' modes (the umask's, or 0600 for the weights); the
        # staging folder admits only whom the output's mode admits meanwhile, and each
        # file gets that mode before the folder is published.
        mode = output_file_mode()
        for f in tmp.iterdir():
            f.chmod(mode)
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        faults.reached("after_checkpoint_write", str(tmp))
        self._check_quota(tmp)
        make_output_dirs(final.parent)
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

    def _check_quota(self, staged: Path) -> None:
        """Refuse a checkpoint that takes the output past its quota (HSX_QUOTA_BYTES):
        the committed shards, the draft folder (its checkpoints, the one staged
        included) together. The staged one is removed; the newest checkpoint stays."""
        quota = output_quota()
        if quota is None:
            return
        shards = self.output.totals().bytes if self.output.has_manifest() else 0
        draft = folder_bytes(self.root)
        if shards + draft > quota:
            shutil.rmtree(staged, ignore_errors=True)
            raise TrainRefused(
                f"{self.draft}: the checkpoint of step {self.state.step} would take the "
                f"output to {shards + draft:,} bytes ({shards:,} of shards, {draft:,} of "
                f"the draft's folder), over its quota of {quota:,} bytes ({QUOTA_ENV}); "
                "keep fewer checkpoints (keep_checkpoints) or ask for a larger quota")

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
                with src.open("rb") as fsrc, open_output_file(tmp, "xb") as fdst:
                    shutil.copyfileobj(fsrc, fdst)
            os.replace(tmp, self.draft / name)

