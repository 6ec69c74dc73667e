"""Train a draft (speculators' model of the spec's method: hsx.methods) on an hsx output.

`DraftTrainer(output, spec).run()` (draft_trainer.py) is the whole loop in one process;
`train_distributed` (distributed.py) runs it on N Ray Train workers (DDP); the Ray actor
in trainer_actor.py and `hsx train` call one or the other. The plan is plan.py's, the
data data.py's, the draft model draft_model.py's, the scores scores.py's, the
collectives among workers group.py's.

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
  the target's hidden state), shifted where the method says (EAGLE-3's speculators'
  `shift_batch`) and packed, whole
  samples only, by its `CollateFn` into sequences of `pack_tokens`; a step is packs
  worth `batch_tokens`, their gradients summed. A producer thread builds steps ahead.
- Why packs: on CPU the draft's attention over one packed sequence is dense (eager
  attention and a [T, T] mask, growing to [T, 4T] over the TTT steps), so its cost grows
  with the square of the packed length although samples only attend to themselves;
  packs of 512 tokens keep a step's cost linear in `batch_tokens`.
- Model: the method builds it (`DraftMethod.build`) with `num_layers` decoder layers
  of the target's sizes; embeddings and lm_head come from the target (speculators'
  `load_verifier_weights`); d2t/t2d from the frequencies of loss-masked tokens of the
  training samples (speculators' `build_vocab_mappings_from_distribution`).
- Validation: at every checkpoint, the held-out samples give loss, accuracy per draft
  position and the expected acceptance length, as the method counts them (scores.py).
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

from hsx_workers.trainer.data import EpochEnd, StepBatch, TrainingData, to_speculators_sample
from hsx_workers.trainer.distributed import WorkerDied, train_distributed
from hsx_workers.trainer.draft_model import (
    build_draft_model,
    draft_layout,
    token_frequencies,
    vocab_mappings,
)
from hsx_workers.trainer.draft_trainer import (
    PUBLISHED_FILES,
    TRAINER_STATE,
    DraftTrainer,
    ShareTooSmall,
    StepMetrics,
    TrainState,
    resolve_device,
)
from hsx_workers.trainer.plan import Plan, TrainRefused, held_out, plan_schedule
from hsx_workers.trainer.scores import Scores

__all__ = [
    "PUBLISHED_FILES",
    "TRAINER_STATE",
    "DraftTrainer",
    "EpochEnd",
    "Plan",
    "Scores",
    "ShareTooSmall",
    "StepBatch",
    "StepMetrics",
    "TrainRefused",
    "TrainState",
    "TrainingData",
    "WorkerDied",
    "build_draft_model",
    "draft_layout",
    "held_out",
    "plan_schedule",
    "resolve_device",
    "to_speculators_sample",
    "token_frequencies",
    "train_distributed",
    "vocab_mappings",
]
