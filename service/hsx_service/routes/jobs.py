"""`/v1/jobs`: submit, list, inspect, cancel, follow and page through errors.

Routes only validate and enqueue: the request body is parsed by pydantic (`SubmitRequest`,
`extra="forbid"`), the server's policy (policy.py: engine options, the caller's roots,
hub access, trust_remote_code) is checked here, and everything else — preflight, planning,
running — is the scheduler's. Each route that names a job answers only the job's owner
(or an admin): another user's job is a 404 (users.py). Plain `def` routes run in
FastAPI's thread pool, so a scheduler call that touches SQLite never stalls the event
loop that serves the other clients.

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

from hsx.spec import TrainSpec
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
from hsx_service.board import Post, StatusBoard
from hsx_service.deps import (
    CallerDep,
    ChecksDep,
    SchedulerAPI,
    SchedulerDep,
    SettingsDep,
    authenticate,
)
from hsx_service.errors import JobConflict, JobNotFound
from hsx_service.policy import vet_spec
from hsx_service.users import Caller

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
    429: {"model": ErrorBody, "description": "Too many submits and inspects are being "
                                             "checked (the caller's, or in all); try "
                                             "again after Retry-After seconds."},
    503: {"model": ErrorBody,
          "description": "The coordinator is still starting, or is a standby (the message "
                         "names the coordinator that holds the ledger)."},
}
TOO_BUSY = _ERRORS[429]  # what a route that runs checks (throttle.py) may answer
# What a route that takes a body may also answer.
BODY_ERRORS: dict[int | str, dict[str, Any]] = {k: _ERRORS[k] for k in (400, 413, 422)}

router = APIRouter(
    prefix=f"{API_PREFIX}/jobs",
    tags=["jobs"],
    dependencies=[Depends(authenticate)],
    responses={k: _ERRORS[k] for k in (401, 503)},
)


@router.post(
    "",
    response_model=JobStatus,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobStatus, "description": "This id already holds this same job."},
        409: {"model": ErrorBody, "description": "This id already holds a different job."},
        429: TOO_BUSY,
        **BODY_ERRORS,
    },
)
def submit_job(
    body: SubmitRequest, response: Response, settings: SettingsDep, scheduler: SchedulerDep,
    caller: CallerDep, checks: ChecksDep,
) -> JobStatus:
    """Queue a job; 201 with its status, or 200 when the same id already holds it; 429
    while too many submits and inspects are being checked (throttle.py)."""
    vet_spec(body.spec, settings, caller)
    post = scheduler.board.get(body.id) if body.id else None
    if post is not None and not caller.may_see(post.status.owner):
        raise JobConflict(f"job id {body.id} is taken; choose another")
    with checks.slot(caller.user, "submit"):
        job, created = scheduler.submit(body.spec, body.id, caller.user)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    response.headers["Location"] = f"{API_PREFIX}/jobs/{job.id}"
    if created:
        log.info("job %s queued (%s)", job.id, job.output)
    return job


@router.get("", response_model=JobList, responses={422: _ERRORS[422]})
async def list_jobs(
    scheduler: SchedulerDep,
    caller: CallerDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
) -> Response:
    """Jobs in submission order: the caller's own (an admin's: every job)."""
    return Response(scheduler.board.list_json(state, caller.may_see), media_type=JSON)


def owned(scheduler: SchedulerAPI, job_id: str, caller: Caller) -> Post:
    """The job's post if the caller may see the job; else 404, as for a job that does
    not exist (another user's job ids are not confirmed)."""
    post = scheduler.board.get(job_id)
    if post is None or not caller.may_see(post.status.owner):
        raise JobNotFound(job_id)
    return post


@router.get("/{job_id}", response_model=JobStatus, responses={404: _ERRORS[404]})
async def get_job(job_id: str, scheduler: SchedulerDep, caller: CallerDep) -> Response:
    return Response(owned(scheduler, job_id, caller).json, media_type=JSON)


@router.delete("/{job_id}", response_model=JobStatus, responses={404: _ERRORS[404]})
def cancel_job(job_id: str, scheduler: SchedulerDep, caller: CallerDep) -> JobStatus:
    """Cancel: dispatch stops, running units end cleanly; a finished job stays as it is."""
    owned(scheduler, job_id, caller)
    job = scheduler.cancel(job_id)
    log.info("job %s: cancel requested (now %s)", job_id, job.state.value)
    return job


@router.get(
    "/{job_id}/errors", response_model=ErrorPage, responses={404: _ERRORS[404], 422: _ERRORS[422]}
)
def job_errors(
    job_id: str,
    scheduler: SchedulerDep,
    caller: CallerDep,
    offset: Annotated[int, Query(ge=0, description="First record to return.")] = 0,
    limit: Annotated[
        int, Query(ge=1, le=MAX_ERRORS_PAGE, description="Most records to return.")
    ] = 100,
) -> ErrorPage:
    """The job's per-row error records (rows skipped with a reason), a page at a time."""
    owned(scheduler, job_id, caller)
    return scheduler.errors(job_id, offset, limit)


@router.get("/{job_id}/throughput", response_model=Throughput, responses={404: _ERRORS[404]})
def job_throughput(job_id: str, scheduler: SchedulerDep, caller: CallerDep) -> Throughput:
    """The job's tokens/s over time and its average, kept after the job has ended."""
    owned(scheduler, job_id, caller)
    return scheduler.throughput(job_id)


@router.post(
    "/{job_id}/train",
    response_model=TrainStatus,
    status_code=status.HTTP_202_ACCEPTED,
    responses={404: _ERRORS[404], 409: {"model": ErrorBody, "description": "Already training."},
               **BODY_ERRORS},
)
def start_training(job_id: str, spec: TrainSpec, scheduler: SchedulerDep,
                   caller: CallerDep) -> TrainStatus:
    """Train a draft (the spec's method) on the job's output (while it runs, or after); a
    second call after the first ended resumes from its newest checkpoint."""
    owned(scheduler, job_id, caller)
    started = scheduler.train(job_id, spec)
    log.info("job %s: training started", job_id)
    return started


@router.get("/{job_id}/train", response_model=TrainStatus, responses={404: _ERRORS[404]})
def training_status(job_id: str, scheduler: SchedulerDep, caller: CallerDep) -> TrainStatus:
    """State, step, loss, per-step accuracy, tokens/s and the loss curve of the training."""
    owned(scheduler, job_id, caller)
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
async def job_events(job_id: str, scheduler: SchedulerDep,
                     caller: CallerDep) -> StreamingResponse:
    """Server-sent events: the current status first, then one per change, until finished."""
    owned(scheduler, job_id, caller)  # before any byte is sent: a 404
    return StreamingResponse(
        _status_stream(scheduler.board, job_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
