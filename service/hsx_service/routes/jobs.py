"""`/v1/jobs`: submit, list, inspect, cancel, follow and page through errors.

Routes only validate and enqueue: the request body is parsed by pydantic (`SubmitRequest`,
`extra="forbid"`), the server's policy (allowed roots, trust_remote_code) is checked
here, and everything else — preflight, planning, running — is the scheduler's. Plain
`def` routes run in FastAPI's thread pool, so a scheduler call that touches SQLite never
stalls the event loop that serves the other clients.

Statuses are the exception, as the routes clients poll: `GET /v1/jobs`, `GET
/v1/jobs/{id}` and the event streams are `async` and answer from the scheduler's board
(board.py) the bytes it encoded when the status changed — no thread hop, no SQLite, no
serialization per request. An event stream is one task waiting on the board; no thread
is parked per follower.

Errors are raised as the coordinator's exceptions and turned into HTTP in main.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response, status
from fastapi.responses import StreamingResponse

from hsx.spec import JobSpec, TrainSpec
from hsx.wire import (
    API_PREFIX,
    ErrorBody,
    ErrorPage,
    JobList,
    JobState,
    JobStatus,
    SubmitRequest,
    Throughput,
    TrainStatus,
)
from hsx_service.board import StatusBoard
from hsx_service.config import Settings
from hsx_service.deps import SchedulerDep, SettingsDep, require_token
from hsx_service.errors import JobNotFound, JobRefused
from hsx_service.paths import check_job_paths

log = logging.getLogger(__name__)

MAX_ERRORS_PAGE = 1000
# A comment line this often keeps proxies from closing an idle stream.
KEEPALIVE_S = 15.0
JSON = "application/json"

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "The body cannot be read as JSON."},
    401: {"model": ErrorBody, "description": "Missing or wrong API token."},
    404: {"model": ErrorBody, "description": "No such job."},
    422: {"model": ErrorBody, "description": "Refused; `field` names the culprit."},
    413: {"model": ErrorBody, "description": "The body is over the server's size limit."},
    503: {"model": ErrorBody,
          "description": "The coordinator is still starting, or is a standby (the message "
                         "names the coordinator that holds the ledger)."},
}
# What a route that takes a body may also answer.
BODY_ERRORS: dict[int | str, dict[str, Any]] = {k: _ERRORS[k] for k in (400, 413, 422)}

router = APIRouter(
    prefix=f"{API_PREFIX}/jobs",
    tags=["jobs"],
    dependencies=[Depends(require_token)],
    responses={k: _ERRORS[k] for k in (401, 503)},
)


# vLLM engine arguments that name Python code for vLLM to import and run (a class or
# function by qualified name, a plugin file): what trust_remote_code guards, by another door.
CODE_LOADING_ENGINE_ARGS = frozenset({
    "worker_cls", "scheduler_cls", "logits_processors", "reasoning_parser_plugin",
    "io_processor_plugin",
})


def vet_spec(spec: JobSpec, settings: Settings) -> None:
    """The server's policy on a job, checked before the scheduler sees it."""
    if not settings.allow_trust_remote_code:
        if spec.trust_remote_code:
            raise JobRefused(
                "trust_remote_code: this server does not run models' own code "
                "(its operator can allow it with HSX_ALLOW_TRUST_REMOTE_CODE=1)"
            )
        args = spec.vllm.engine_args()
        loading = sorted(CODE_LOADING_ENGINE_ARGS & set(args))
        backend = args.get("distributed_executor_backend")
        if isinstance(backend, str) and "." in backend:  # a class by qualified name
            loading.append("distributed_executor_backend")
        if loading:
            raise JobRefused(
                f"vllm: {', '.join(loading)} name Python code for vLLM to load; this server "
                "runs only its own code (its operator can allow it with "
                "HSX_ALLOW_TRUST_REMOTE_CODE=1)"
            )
    check_job_paths(spec, settings.effective_roots())


@router.post(
    "",
    response_model=JobStatus,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobStatus, "description": "This id already holds this same job."},
        409: {"model": ErrorBody, "description": "This id already holds a different job."},
        **BODY_ERRORS,
    },
)
def submit_job(
    body: SubmitRequest, response: Response, settings: SettingsDep, scheduler: SchedulerDep
) -> JobStatus:
    """Queue a job; 201 with its status, or 200 when the same id already holds it."""
    vet_spec(body.spec, settings)
    job, created = scheduler.submit(body.spec, body.id)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    response.headers["Location"] = f"{API_PREFIX}/jobs/{job.id}"
    if created:
        log.info("job %s queued (%s)", job.id, job.output)
    return job


@router.get("", response_model=JobList, responses={422: _ERRORS[422]})
async def list_jobs(
    scheduler: SchedulerDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
) -> Response:
    """Jobs in submission order."""
    return Response(scheduler.board.list_json(state), media_type=JSON)


@router.get("/{job_id}", response_model=JobStatus, responses={404: _ERRORS[404]})
async def get_job(job_id: str, scheduler: SchedulerDep) -> Response:
    post = scheduler.board.get(job_id)
    if post is None:
        raise JobNotFound(job_id)
    return Response(post.json, media_type=JSON)


@router.delete("/{job_id}", response_model=JobStatus, responses={404: _ERRORS[404]})
def cancel_job(job_id: str, scheduler: SchedulerDep) -> JobStatus:
    """Cancel: dispatch stops, running units end cleanly; a finished job stays as it is."""
    job = scheduler.cancel(job_id)
    log.info("job %s: cancel requested (now %s)", job_id, job.state.value)
    return job


@router.get(
    "/{job_id}/errors", response_model=ErrorPage, responses={404: _ERRORS[404], 422: _ERRORS[422]}
)
def job_errors(
    job_id: str,
    scheduler: SchedulerDep,
    offset: Annotated[int, Query(ge=0, description="First record to return.")] = 0,
    limit: Annotated[
        int, Query(ge=1, le=MAX_ERRORS_PAGE, description="Most records to return.")
    ] = 100,
) -> ErrorPage:
    """The job's per-row error records (rows skipped with a reason), a page at a time."""
    return scheduler.errors(job_id, offset, limit)


@router.get("/{job_id}/throughput", response_model=Throughput, responses={404: _ERRORS[404]})
def job_throughput(job_id: str, scheduler: SchedulerDep) -> Throughput:
    """The job's tokens/s over time and its average, kept after the job has ended."""
    return scheduler.throughput(job_id)


@router.post(
    "/{job_id}/train",
    response_model=TrainStatus,
    status_code=status.HTTP_202_ACCEPTED,
    responses={404: _ERRORS[404], 409: {"model": ErrorBody, "description": "Already training."},
               **BODY_ERRORS},
)
def start_training(job_id: str, spec: TrainSpec, scheduler: SchedulerDep) -> TrainStatus:
    """Train an EAGLE-3 draft on the job's output (while it runs, or after); a second
    call after the first ended resumes from its newest checkpoint."""
    started = scheduler.train(job_id, spec)
    log.info("job %s: training started", job_id)
    return started


@router.get("/{job_id}/train", response_model=TrainStatus, responses={404: _ERRORS[404]})
def training_status(job_id: str, scheduler: SchedulerDep) -> TrainStatus:
    """State, step, loss, per-step accuracy, tokens/s and the loss curve of the training."""
    return scheduler.train_status(job_id)


async def _status_stream(board: StatusBoard, job_id: str) -> AsyncIterator[bytes]:
    """The job's current status, then each newer one, until the job ends. A follower
    that falls behind gets the newest status, not every one in between."""
    post = board.get(job_id)
    if post is None:
        return
    yield post.event
    version = post.version
    while not post.finished:
        newer = await board.next(job_id, version, KEEPALIVE_S)
        if newer is None:
            yield b": keep-alive\n\n"
            continue
        yield newer.event
        post, version = newer, newer.version


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "`event: status` with a JobStatus as `data`, until the job ends.",
        },
        404: _ERRORS[404],
    },
)
async def job_events(job_id: str, scheduler: SchedulerDep) -> StreamingResponse:
    """Server-sent events: the current status first, then one per change, until finished."""
    if scheduler.board.get(job_id) is None:
        raise JobNotFound(job_id)  # before any byte is sent: a 404
    return StreamingResponse(
        _status_stream(scheduler.board, job_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
