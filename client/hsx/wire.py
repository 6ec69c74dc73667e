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

from pydantic import BaseModel, ConfigDict, Field

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


class JobStatus(BaseModel):
    id: str = Field(..., description="Job id.")
    name: str | None = Field(None, description="The spec's name.")
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
    tokens_total: int = Field(0, description="Tokens to extract.")
    tokens_done: int = Field(0, description="Tokens extracted.")
    bytes: int = Field(0, description="Bytes of committed shards.")
    shards: int = Field(0, description="Committed shards.")
    units_total: int = Field(0, description="Work units planned.")
    units_done: int = Field(0, description="Work units committed.")
    units_failed: int = Field(0, description="Work units given up after repeated failures.")
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
    worker_totals: list[WorkerTotals] = Field(
        default_factory=list, description="Per worker: what it committed (kept after the end)."
    )
    restarts: int = Field(0, description="Worker restarts during this job.")
    last_error: str | None = Field(None, description="The last error seen, if any.")
    spec: JobSpec | None = Field(None, description="The job as submitted.")
    updated_at: float | None = Field(
        None,
        description=(
            "Server Unix time this status was made. The server makes one at every change "
            "(while a job extracts, at least every second) and serves it to every reader."
        ),
    )


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
    done = "done"
    failed = "failed"
    stopped = "stopped"  # the coordinator stopped it; it resumes at the next start

    @property
    def finished(self) -> bool:
        return self in (TrainState.done, TrainState.failed)


class TrainPoint(BaseModel):
    step: int
    epoch: int = 0
    loss: float
    acc: list[float] = Field(default_factory=list, description="Accuracy per TTT step.")
    time: float = 0.0


class TrainStatus(BaseModel):
    """A job's draft training: where it is and how it goes."""

    job_id: str
    state: TrainState
    draft: str = Field(..., description="The draft's folder (speculators format; vLLM loads it).")
    step: int = 0
    epoch: int = 0
    loss: float | None = None
    acc: list[float] = Field(
        default_factory=list, description="Draft accuracy per TTT step at the last logged step."
    )
    tokens_per_s: float = 0.0
    wait_fraction: float = Field(
        0.0, description="Time the steps waited for data ÷ their total time."
    )
    checkpoint_step: int | None = Field(None, description="Step of the newest checkpoint.")
    restarts: int = Field(0, description="Trainer actors restarted (each resumes a checkpoint).")
    resumed_from: int | None = Field(None, description="Step the current run resumed from.")
    first_step_at: float | None = Field(None, description="Unix time of the first step.")
    error: str | None = None
    spec: TrainSpec
    history: list[TrainPoint] = Field(
        default_factory=list, description="The loss curve, at most 500 points."
    )
    updated_at: float | None = None
