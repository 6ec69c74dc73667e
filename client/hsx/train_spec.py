"""A job's `train:` section, and `hsx train --spec`: the draft to train on an output.

`TrainSpec` is part of the job file (hsx.spec re-exports it); it lives apart because the
trainer, the CLI and the coordinator all read it, and each method's defaults come from
its method (hsx.methods).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hsx.methods import DEFAULT_METHOD, DraftMethod, method, method_names

_LABEL_NAME = r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"({_LABEL_NAME}(\.{_LABEL_NAME})*/)?{_LABEL_NAME}")
_LABEL_SELECTOR = re.compile(
    rf"!?(in)?\({_LABEL_NAME}(, ?{_LABEL_NAME})*\)|!?{_LABEL_NAME}")

TrainDevice = Literal["auto", "cpu", "cuda"]
TrainLoss = Literal["kl_div", "ce", "rkl", "jsd", "tv"]


class TrainSpec(BaseModel):
    """How to train a draft on a job's output (speculators' model of its `method`).

    The draft's shape comes from the target's (text) config and the output's layer ids:
    the last id must be N (the final layer before the norm: the draft's training target);
    the ids before it are the auxiliary states the draft reads (its method's own, when
    the output holds several methods' ids: hsx.methods).

    Fields left unset (None) are chosen when training starts, from the data and the
    device (docs/TRAINING.md, "Defaults"): the number of steps from the training tokens,
    the learning rate and the tokens per step from CPU or GPU. The trainer records what
    it chose in `draft/train.json` (`plan`).
    """

    model_config = ConfigDict(extra="forbid")

    draft_vocab_size: int = Field(
        32000,
        gt=0,
        le=2**20,
        description=(
            "Tokens the draft predicts: the most frequent loss-masked tokens of the inputs. "
            "At or above the target's vocabulary size the draft uses the whole vocabulary. "
            "At most 1,048,576 (four times the largest vocabularies, 262,144)."
        ),
    )
    method: str = Field(DEFAULT_METHOD, description=(
        f"Draft method, one of {', '.join(method_names())} (hsx.methods; "
        "docs/TRAINING.md, \"Draft methods\"): `eagle3` (autoregressive, `ttt_steps` "
        "tokens a step), `dflash` (a block of `block_size` - 1 tokens in one forward "
        "pass), `dspark` (DFlash's blocks with a Markov and a confidence head) or "
        "`peagle` (EAGLE-3's layers, `block_size` tokens drafted at once)."))
    num_layers: int | None = Field(None, ge=1, le=32, description=(
        "Decoder layers of the draft, each of the target's layer size. None: the "
        "method's (speculators' recipes; docs/TRAINING.md). At most 32 (32 of a large "
        "target's layers take hundreds of GB)."))
    block_size: int = Field(8, ge=2, le=64, description=(
        "DFlash, DSpark: tokens of a block, from the anchor (the target's own token). "
        "P-EAGLE: tokens drafted at once."))
    max_anchors: int | None = Field(None, ge=1, le=2**16, description=(
        "DFlash, DSpark: blocks trained per packed sequence, at positions drawn at random "
        "(None: one per `block_size` tokens of a pack, at most 512). P-EAGLE: positions "
        "its parallel groups start from (None: every answer token)."))
    ttt_steps: int = Field(
        3, ge=1, le=32, description=(
            "Training-time-test steps: draft tokens trained per position. At most 32 "
            "(EAGLE-3 trains 3 to 8; each step holds its own activations).")
    )
    ttt_step_loss_decay: float = Field(
        1.0, gt=0, description="Weight of step k's loss is decay**k."
    )
    loss: TrainLoss | None = Field(None, description=(
        "Loss against the target's distribution. None: the method's in speculators: "
        "`kl_div`, `ce` for DFlash (with per-position D-PACE weights)."))
    loss_implementation: Literal["auto", "fused", "eager"] = Field(
        "auto",
        description=(
            "speculators' loss kernels: `fused` (Triton; the GPU default under auto) or "
            "`eager` (plain torch; the CPU default, and the fallback where the fused "
            "kernels do not compile with the installed torch)."
        ),
    )
    lr: float | None = Field(
        None, gt=0, description=(
            "Peak AdamW learning rate; None: the method's where it has one (DFlash and "
            "DSpark: 5e-3 on CPU, 3e-4 on GPU), else 1e-3 on CPU, 1e-4 on GPU."))
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine",
        description="After the warm-up: cosine decay to 0 over the schedule, or constant.",
    )
    warmup_steps: int | None = Field(
        None, ge=0, description="Linear warm-up steps; None: 5% of the schedule, at most 500."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    steps: int | None = Field(
        None,
        gt=0,
        description=(
            "Optimizer steps of the schedule (the learning rate decays over them). None: "
            "from `epochs` if set, else sized from the data: 3 passes over the training "
            "tokens, at least 500 steps on CPU and 2000 on GPU."
        ),
    )
    epochs: float | None = Field(
        None,
        gt=0,
        description="Passes over the training samples, instead of `steps` (not both).",
    )
    max_steps: int | None = Field(
        None,
        gt=0,
        description="Stop at this step (a checkpoint is written); the schedule is unchanged.",
    )
    batch_tokens: int | None = Field(
        None,
        gt=1,
        le=2**24,
        description=(
            "Tokens per optimizer step and worker: whole samples, packed into sequences of "
            "`pack_tokens`. None: 1024 on CPU, 8192 on GPU. At most 16,777,216 (a step's "
            "samples are read at once)."
        ),
    )
    pack_tokens: int | None = Field(
        None,
        gt=1,
        le=2**20,
        description=(
            "Tokens per forward pass (one packed sequence; a longer sample is cut to it). "
            "The draft's attention over a packed sequence costs its length squared on CPU, "
            "so steps of `batch_tokens` are split into packs and their gradients summed. "
            "None: 512 on CPU, 8192 on GPU (block-sparse flex attention). At most "
            "1,048,576, the longest max_seq_len."
        ),
    )
    checkpoint_every: int | None = Field(
        None,
        gt=0,
        description=(
            "Steps between checkpoints, each validated first (a final one is always "
            "written). None: a tenth of the schedule, at most 2000."
        ),
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Newest checkpoints kept in draft/checkpoints/ (plus the best)."
    )
    log_every: int = Field(1, ge=1, description="Steps between metrics records.")
    val_fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description=(
            "Fraction of the samples held out for validation, chosen by sample index (the "
            "same ones on every run and resume); 0 disables validation, and the newest "
            "checkpoint is then the draft."
        ),
    )
    val_max_samples: int = Field(
        256, ge=1, le=2**20, description=(
            "At most this many samples are held out (validated at each checkpoint); at "
            "most 1,048,576.")
    )
    workers: int = Field(
        1,
        ge=1,
        description=(
            "Training processes (Ray Train, DDP): each reads its own units of the output "
            "(online: of each epoch's capture). 1 trains in the calling process (or the "
            "coordinator's trainer actor)."
        ),
    )
    place: Literal["any", "apart"] = Field(
        "any",
        description=(
            "Where the trainer's workers run against the job's engines: `any`, where Ray "
            "finds room; `apart`, never on a Ray node that runs one of the job's engines "
            "(the engines are placed first). A plan that cannot keep them apart is refused "
            "at submit, naming what is missing."
        ),
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Ray node labels each trainer worker's node must have (Ray's label selector: "
            "`value`, `!value`, `in(a,b)`, `!in(a,b)`), e.g. {hsx-role: trainer} for the "
            "nodes of a KubeRay worker group started with `labels: hsx-role=trainer`."
        ),
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Custom Ray resources each trainer worker takes besides its CPU and GPU, e.g. "
            "{trainer: 1} where only the trainer's nodes have `trainer` (`ray start "
            "--resources`)."
        ),
    )
    eval_prompts: int = Field(
        256,
        ge=0,
        le=65536,
        description=(
            "After a job's training: held-out prompts that vLLM answers with the draft, as "
            "a server does (greedy, stopping at the end of the turn), to measure its "
            "acceptance (draft/eval.json); as many as are held out when fewer; 0: no "
            "evaluation. At most 65,536."
        ),
    )
    eval_max_tokens: int = Field(
        256, ge=1, le=2**17, description=(
            "At most this many tokens generated per evaluation prompt (each prompt's own "
            "limit is its answer's length in the dataset); at most 131,072 (a "
            "long-context model's window).")
    )
    seed: int = Field(0, description="Seed of the initial weights and the sample order.")
    device: TrainDevice = Field("auto", description="`cuda` when a GPU is present under auto.")
    follow: bool = Field(
        True,
        description=(
            "Start on the first committed shards and keep up while extraction runs; "
            "False waits for the extraction to finish."
        ),
    )
    norm_before_residual: bool = Field(
        True, description="Normalize the hidden input before the residual (speculators default)."
    )
    online: bool = Field(
        False,
        description=(
            "A job's training fed by its engines directly: the captured states go to the "
            "trainer's workers through the job's stream (Ray's object store, across nodes) "
            "and are never stored as shards; the engines capture the data again for each "
            "epoch. Only in a job's `train:` section (`hsx extract`, the coordinator)."
        ),
    )
    buffer_bytes: int | None = Field(
        None,
        gt=0,
        le=2**40,
        description=(
            "Online: captured states the trainer has not taken yet, at most (the engines "
            "wait beyond it). None: 1 GiB, or three of the job's largest units when more. "
            "At most 1 TiB."
        ),
    )
    gpu_share: float = Field(
        0.3,
        gt=0,
        le=0.8,
        description=(
            "Online, when the cluster has no GPU to spare for the trainer (one GPU, or the "
            "engines take them all): the part of an engine's GPU the trainer takes, in "
            "Ray's accounting and in memory (torch caps it there); the engines' vLLM then "
            "takes at most 0.95 less this of the GPU's memory."
        ),
    )

    @field_validator("node_labels")
    @classmethod
    def _label_syntax(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not _LABEL_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not a Ray label key (letters, digits, '-', "
                                 "'_', '.', an optional prefix/)")
            if not _LABEL_SELECTOR.fullmatch(value):
                raise ValueError(f"{key}: {value!r} is not a Ray label selector (value, "
                                 "!value, in(a,b), !in(a,b))")
        return labels

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name}: a worker's CPU and GPU are hsx's to set; name "
                                 "custom resources only")
            if amount <= 0:
                raise ValueError(f"{name}: must be > 0, got {amount}")
        return resources

    @field_validator("method")
    @classmethod
    def _known_method(cls, name: str) -> str:
        method(name)  # ValueError naming the known ones
        return name

    @property
    def draft(self) -> DraftMethod:
        """The draft method (hsx.methods)."""
        return method(self.method)

    @property
    def loss_fn(self) -> str:
        """`loss`, or the method's own when unset."""
        return self.loss or self.draft.loss

    @property
    def proposed_tokens(self) -> int:
        """Tokens the draft proposes per verification step (vLLM's num_speculative_tokens)."""
        return self.draft.proposed_tokens(self)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainSpec:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("set steps or epochs, not both")
        if self.online and not self.follow:
            raise ValueError("online training follows the engines: follow must be true")
        return self
