"""Every schema that crosses the REST API, in one place.

Compatibility rule: a new field gets a default, so older clients and servers keep
working; a breaking change gets a new path version (`/v2`). The job body is `JobSpec`
itself (hsx.spec), the same schema `hsx extract` reads from a file.

Errors cross the wire as `ErrorBody` (type, message, field); `hsx.Client` re-raises them
as `ApiError` subclasses with the server's message.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field

from hsx.spec import JobSpec, TrainSpec

API_PREFIX = "/v1"


class JobState(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class SubmitRequest(BaseModel):
    """`POST /v1/jobs`: a job, and optionally the id the client wants it to have.

    The same id with the same spec returns the existing job (idempotent retries);
    the same id with a different spec is a 409.
    """

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Job id chosen by the client; the server makes one when absent.",
    )
    spec: JobSpec = Field(..., description="The job.")


class WorkerStatus(BaseModel):
    name: str = Field(..., description="Worker (engine) name within the job.")
    state: str = Field(..., description="starting | idle | busy | dead")
    unit: int | None = Field(None, description="Work unit it is running, if any.")


class WorkerTotals(BaseModel):
    """What one worker (engine) committed for a job, over all of the job's runs."""

    name: str = Field(..., description="Worker (engine) name within the job.")
    units: int = Field(0, description="Units it committed (units another attempt won excluded).")
    samples: int = Field(0, description="Samples in those units.")
    tokens: int = Field(0, description="Tokens in those units.")
    bytes: int = Field(0, description="Bytes of the shards it committed.")
    seconds: float = Field(0.0, description="Time its committed units took, summed.")


class NodePlan(BaseModel):
    """What a job's plan puts on one Ray node."""

    node: str = Field(..., description="The Ray node's id.")
    address: str = Field("", description="Its IP address.")
    engines: list[str] = Field(default_factory=list, description="The job's engines planned "
                               "there (engine-0, ...).")
    trainer_workers: list[int] = Field(
        default_factory=list, description="Ranks of the trainer's workers planned there (0 "
        "is the one that writes the draft).")


class ResourcePlan(BaseModel):
    """Where a job's engines, its trainer and its evaluation run, as the coordinator
    planned them from the cluster's resources and the spec (docs/ARCHITECTURE.md,
    "Placement")."""

    gpus: int = Field(0, description="GPUs of the Ray cluster when planned; 0: a CPU cluster.")
    replicas: int = Field(1, description="Engines (a spec without `replicas` gets as many "
                          "as fit).")
    tensor_parallel_size: int = Field(1, description="GPUs (or CPU ranks) per engine.")
    engine_gpus: int = Field(0, description="GPUs the engines hold together.")
    train_gpus: int = Field(0, description="GPUs of the trainer (0: no training, or on CPU).")
    eval_gpus: int = Field(0, description="GPUs of the evaluation (the target as the job runs "
                           "it, with the draft).")
    training: str = Field(
        "none",
        description=(
            "`beside`: the trainer runs on GPUs of its own while the engines extract; "
            "`after`: the engines yield their GPUs to it when the extraction ends; "
            "`shared`: an online trainer takes `train_share` of a GPU the engines use; `none`."
        ),
    )
    train_share: float = Field(0.0, description="Training `shared`: the part of one GPU (of "
                               "Ray's accounting and of its memory) the trainer takes.")
    engine_memory: float = Field(0.0, description="The fraction of each GPU's memory the "
                                 "engines' vLLM takes (GPU clusters).")
    train_place: str = Field("any", description="`apart`: the trainer's workers run on no "
                             "node of the job's engines (the spec's `train.place`).")
    nodes: list[NodePlan] = Field(
        default_factory=list,
        description=(
            "Per Ray node, the engines and trainer workers planned there, from the "
            "cluster's nodes when planned (Ray places them within the same constraints; "
            "the job's status shows where they run: `JobStatus.nodes`)."
        ),
    )
    summary: str = Field("", description="The plan in words.")


class NodeStatus(BaseModel):
    """What of a running job is on one Ray node now."""

    node: str = Field(..., description="The Ray node's id.")
    engines: list[str] = Field(default_factory=list, description="The job's engines there.")
    trainer_workers: list[int] = Field(
        default_factory=list, description="Ranks of the job's trainer workers there.")
    bytes_in_flight: int = Field(
        0, description="An online job: captured states there that no trainer worker has "
        "trained on yet (in the engine's object store, or being read by a worker).")


class JobStatus(BaseModel):
    id: str = Field(..., description="Job id.")
    name: str | None = Field(None, description="The spec's name.")
    owner: str | None = Field(
        None, description="The user who submitted it (null: submitted before users).")
    state: JobState = Field(..., description="queued, running, succeeded, failed, cancelled.")
    output: str = Field(..., description="Output location.")
    created_at: float = Field(..., description="Unix time of submission.")
    started_at: float | None = Field(None, description="Unix time the job started running.")
    finished_at: float | None = Field(None, description="Unix time the job ended.")
    samples_total: int = Field(0, description="Good samples to extract (after ingestion).")
    samples_done: int = Field(
        0, description="Samples of samples_total processed: committed, or failed in the engine."
    )
    samples_failed: int = Field(0, description="Samples recorded as errors, ingestion included.")
    samples_at_start: int = Field(
        0,
        description=(
            "Samples of samples_done its output already held when this run started, "
            "committed by an earlier run (a rerun resumes after them)."
        ),
    )
    tokens_total: int = Field(0, description="Tokens to extract.")
    tokens_done: int = Field(0, description="Tokens extracted.")
    bytes: int = Field(0, description="Bytes of committed shards.")
    shards: int = Field(0, description="Committed shards.")
    units_total: int = Field(0, description="Work units planned.")
    units_done: int = Field(0, description="Work units committed.")
    units_failed: int = Field(0, description="Work units given up after repeated failures.")
    samples_generated: int = Field(
        0, description="A regenerating job's first stage: samples the target has answered."
    )
    tokens_generated: int = Field(0, description="Tokens the target generated for them.")
    samples_checked: int = Field(
        0, description="Samples the self-check looked at in committed units (spec.checks "
        "says how: on, warn, off; a tripped check under `on` fails the job, last_error "
        "says where).")
    check_problems: int = Field(
        0, description="Problems the self-check found and recorded (`checks: warn`).")
    head_rows_checked: int = Field(
        0, description="Rows of the last layer (id N) the self-check's head check compared "
        "with the engine's own next token: lm_head(norm(h_N)) against its top-1.")
    head_rows_agreed: int = Field(
        0, description="Of those, the rows that agreed (a correct capture: nearly all).")
    rows_tokenized: int = Field(
        0, description="Dataset rows ingested (tokenized, or recorded as bad) so far.")
    rows_total: int = Field(
        0,
        description=(
            "Rows of the dataset: estimated from the share of it read while `ingesting`, "
            "exact once ingestion ends (0: not known yet)."
        ),
    )
    ingesting: bool = Field(
        False, description="The dataset is being tokenized now (units_total grows with it).")
    tokens_per_s: float = Field(0.0, description="Extraction rate of the current run.")
    tokens_per_s_avg: float = Field(
        0.0,
        description=(
            "Average extraction rate over the time the job ran (all its runs); kept once "
            "the job has ended."
        ),
    )
    eta_s: float | None = Field(None, description="Seconds left at the current rate.")
    workers: list[WorkerStatus] = Field(default_factory=list, description="Engines.")
    nodes: list[NodeStatus] = Field(
        default_factory=list, description="While it runs, per Ray node: its engines, its "
        "trainer's workers and (online) the captured bytes in flight there.")
    worker_totals: list[WorkerTotals] = Field(
        default_factory=list, description="Per worker: what it committed (kept after the end)."
    )
    restarts: int = Field(0, description="Worker restarts during this job.")
    last_error: str | None = Field(None, description="The last error seen, if any.")
    plan: ResourcePlan | None = Field(
        None, description="Where its engines, trainer and evaluation run (set when it runs).")
    waiting_for: str | None = Field(
        None,
        description=(
            "What the job waits for and who holds it (`waiting for 1 GPU: held by the "
            "trainer of job X`); None when it waits for nothing."
        ),
    )
    spec: JobSpec | None = Field(
        None, description="The job as submitted, with values that look secret redacted.")
    updated_at: float | None = Field(
        None,
        description=(
            "Server Unix time this status was made. The server makes one at every change "
            "(while a job extracts, at least every second) and serves it to every reader."
        ),
    )

    @computed_field(  # type: ignore[prop-decorator]
        description=(
            "The job found its output complete: every sample was committed by an earlier "
            "run (a rerun of a finished job), and this run extracted nothing."
        )
    )
    @property
    def already_complete(self) -> bool:
        return (self.state == JobState.succeeded and self.samples_total > 0
                and self.samples_at_start >= self.samples_total)


class JobList(BaseModel):
    jobs: list[JobStatus]


class ThroughputPoint(BaseModel):
    at: float = Field(..., description="Server Unix time.")
    tokens_per_s: float = Field(..., description="Tokens/s over the interval ending at `at`.")
    tokens_done: int = Field(..., description="Tokens extracted by then.")


class Throughput(BaseModel):
    """`GET /v1/jobs/{id}/throughput`: the job's tokens/s over time, kept after it ends."""

    job_id: str = Field(..., description="Job id.")
    tokens_per_s_avg: float = Field(0.0, description="Average over the time the job ran.")
    points: list[ThroughputPoint] = Field(
        default_factory=list,
        description="In time order, at most 600 (longer runs are averaged into buckets).",
    )


class ErrorRecord(BaseModel):
    sample_index: int = Field(..., description="Row index in the source dataset.")
    reason: str = Field(..., description="Why the row was skipped.")


class ErrorPage(BaseModel):
    items: list[ErrorRecord]
    total: int = Field(..., description="All error records of the job.")
    offset: int
    limit: int


class ErrorBody(BaseModel):
    """What every non-2xx response carries."""

    type: str = Field(..., description="Error class, e.g. JobRefused, NotFound, Conflict.")
    message: str = Field(..., description="What went wrong, in words.")
    field: str | None = Field(None, description="The job field at fault, when one is.")
    detail: Any = Field(None, description="Extra structured detail (e.g. pydantic errors).")


class TrainState(str, Enum):
    starting = "starting"  # actor starting, or waiting for the first shard
    running = "running"
    evaluating = "evaluating"  # trained; vLLM measures the draft's acceptance
    done = "done"
    failed = "failed"
    stopped = "stopped"  # the coordinator stopped it; it resumes at the next start

    @property
    def finished(self) -> bool:
        return self in (TrainState.done, TrainState.failed)


class TrainPoint(BaseModel):
    """One logged training step (draft/metrics.jsonl)."""

    step: int = Field(..., description="Optimizer step.")
    epoch: int = Field(0, description="Passes over this worker's units completed before it.")
    loss: float = Field(..., description="Training loss of the step.")
    acc: list[float] = Field(
        default_factory=list, description="P(TTT steps 0..k all right), per k.")
    time: float = Field(0.0, description="Unix time of the step.")


class ValidationPoint(BaseModel):
    """One validation on the held-out samples (draft/validation.jsonl), at a checkpoint."""

    step: int = Field(..., description="Step of the checkpoint it scores.")
    loss: float = Field(..., description="Loss on the held-out samples.")
    acc: list[float] = Field(
        default_factory=list, description="P(TTT steps 0..k all right), per k.")
    cond_acc: list[float] = Field(
        default_factory=list,
        description="P(TTT step k right | the steps before it right), per k.")
    expected_acceptance_length: float = Field(
        ..., description="1 + sum over k of the products of cond_acc[0..k]: tokens per "
                         "verification a draft of len(acc) tokens would give.")
    tokens: int = Field(0, description="Held-out tokens scored.")
    time: float = Field(0.0, description="Unix time of the validation.")


class TrainPlan(BaseModel):
    """The schedule a training resolved from its spec, its data and its device."""

    device: str = Field(..., description="cpu or cuda.")
    workers: int = Field(1, description="Training processes (Ray Train workers).")
    steps: int = Field(..., description="Optimizer steps of the schedule.")
    batch_tokens: int = Field(..., description="Tokens per step and worker.")
    pack_tokens: int = Field(..., description="Tokens per packed sequence (forward pass).")
    lr: float = Field(..., description="Peak learning rate.")
    lr_schedule: str = Field("cosine", description="cosine or constant after the warm-up.")
    warmup_steps: int = Field(0, description="Linear warm-up steps.")
    checkpoint_every: int = Field(..., description="Steps between validated checkpoints.")
    train_samples: int = Field(0, description="Samples trained on.")
    train_tokens: int = Field(0, description="Their tokens (shifted: length - 1 each).")
    val_samples: int = Field(0, description="Samples held out for validation.")
    passes: float = Field(0.0, description="Times the schedule goes over the training tokens.")
    warning: str | None = Field(None, description="Why the data is small for the schedule.")
    online: str | None = Field(None, description="An online training: the target tokens "
                               "the engines capture for it, against the bytes offline "
                               "would store.")


class DraftEval(BaseModel):
    """The draft's acceptance in vLLM on held-out prompts (draft/eval.json)."""

    k: int | None = Field(None, description="Draft tokens per step (num_speculative_tokens).")
    prompts: int = Field(0, description="Prompts generated from.")
    prompt_source: str | None = Field(None, description="Where the prompts came from.")
    draft_step: int | None = Field(None, description="Checkpoint step of the draft measured.")
    generated_tokens: int = Field(0, description="Tokens vLLM generated.")
    drafts: int = Field(0, description="Draft proposals vLLM verified.")
    draft_tokens: int = Field(0, description="Draft tokens proposed.")
    accepted_tokens: int = Field(0, description="Draft tokens accepted.")
    accepted_per_position: list[int] = Field(
        default_factory=list, description="Accepted draft tokens at positions 1..k.")
    acceptance_per_position: list[float] = Field(
        default_factory=list, description="accepted_per_position ÷ drafts.")
    mean_acceptance_length: float | None = Field(
        None, description="1 + accepted ÷ drafts: tokens per verification step.")
    confidence_interval: list[float] | None = Field(
        None, description="95% interval of mean_acceptance_length over the prompts (where "
        "vLLM counts each request's drafts; `measurement.interval` says how).")
    stopped_at_eos: int | None = Field(
        None, description="Generations that ended their turn (EOS); the others reached "
        "their limit.")
    measurement: dict[str, Any] | None = Field(
        None, description="How the figure was made: vLLM's speculative_config, sampling, "
        "where generation stops, the prompts and their limits, the interval, vLLM's "
        "version.")
    seconds: float = Field(0.0, description="Generation time.")
    time: float | None = Field(None, description="Unix time of the measurement.")
    error: str | None = Field(None, description="Why the measurement failed, if it did.")


class TrainStatus(BaseModel):
    """A job's draft training: where it is and how it goes."""

    job_id: str = Field(..., description="The job whose output is trained on.")
    state: TrainState = Field(..., description="starting, running, evaluating, done, "
                                               "failed, stopped.")
    draft: str = Field(..., description="The draft's folder (speculators format; vLLM loads it).")
    step: int = Field(0, description="Last logged step.")
    epoch: int = Field(0, description="Epoch of the last logged step.")
    loss: float | None = Field(None, description="Loss at the last logged step.")
    acc: list[float] = Field(
        default_factory=list, description="Draft accuracy per TTT step at the last logged step."
    )
    tokens_per_s: float = Field(0.0, description="Training tokens/s (all workers).")
    wait_fraction: float = Field(
        0.0, description="Time the steps waited for data ÷ their total time."
    )
    checkpoint_step: int | None = Field(None, description="Step of the newest checkpoint.")
    restarts: int = Field(0, description="Trainer actors restarted (each resumes a checkpoint).")
    resumed_from: int | None = Field(None, description="Step the current run resumed from.")
    first_step_at: float | None = Field(None, description="Unix time of the first step.")
    error: str | None = Field(None, description="Why the training failed, if it did.")
    waiting_for: str | None = Field(
        None,
        description=(
            "What the training (or its evaluation) waits for and who holds it; None when "
            "it waits for nothing."
        ),
    )
    spec: TrainSpec = Field(..., description="The training as asked.")
    plan: TrainPlan | None = Field(
        None, description="What the trainer chose for the spec's unset fields.")
    warning: str | None = Field(None, description="The plan's warning, if any.")
    history: list[TrainPoint] = Field(
        default_factory=list, description="The loss curve, at most 500 points."
    )
    validation: list[ValidationPoint] = Field(
        default_factory=list, description="Every validation so far, oldest first.")
    best_step: int | None = Field(
        None, description="Checkpoint in draft/: the best expected acceptance length so far.")
    best_expected_acceptance_length: float | None = Field(
        None, description="Its expected acceptance length on the held-out samples.")
    eval: DraftEval | None = Field(
        None, description="vLLM's measurement of the draft (after training).")
    updated_at: float | None = Field(None, description="Server Unix time of this status.")
