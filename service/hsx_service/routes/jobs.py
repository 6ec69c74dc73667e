"""`/v1/jobs`: submit, list, inspect, cancel, follow and page through errors.

Routes only validate and enqueue: the request body is parsed by pydantic (`SubmitRequest`,
`extra="forbid"`), the server's policy (allowed roots, trust_remote_code) is checked
here, and everything else — preflight, planning, running — is the scheduler's. Plain
`def` routes run in FastAPI's thread pool, so a scheduler call that touches SQLite never
stalls the event loop that serves the other clients.

Errors are raised as the coordinator's exceptions and turned into HTTP in main.py.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Depends, Query, Request, Response, status
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
    TrainStatus,
)
from hsx_service.config import Settings
from hsx_service.deps import SchedulerAPI, SchedulerDep, SettingsDep, require_token
from hsx_service.errors import JobRefused
from hsx_service.paths import check_job_paths

log = logging.getLogger(__name__)

MAX_ERRORS_PAGE = 1000
# A comment line this often keeps proxies from closing an idle stream, and makes a
# vanished client show up as a failed write.
KEEPALIVE_S = 15.0
# How long one blocking read of the update queue waits before checking the client.
POLL_S = 1.0
# Event streams park a thread each on their queue; they get their own limiter so that
# many open dashboards cannot starve the thread pool the other routes run in.
_stream_threads = anyio.CapacityLimiter(1000)

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong API token."},
    404: {"model": ErrorBody, "description": "No such job."},
    422: {"model": ErrorBody, "description": "Refused; `field` names the culprit."},
    503: {"model": ErrorBody, "description": "The coordinator is still starting."},
}

router = APIRouter(
    prefix=f"{API_PREFIX}/jobs",
    tags=["jobs"],
    dependencies=[Depends(require_token)],
    responses={k: _ERRORS[k] for k in (401, 503)},
)


def vet_spec(spec: JobSpec, settings: Settings) -> None:
    """The server's policy on a job, checked before the scheduler sees it."""
    if spec.trust_remote_code and not settings.allow_trust_remote_code:
        raise JobRefused(
            "trust_remote_code: this server does not run models' own code "
            "(its operator can allow it with HSX_ALLOW_TRUST_REMOTE_CODE=1)"
        )
    check_job_paths(spec, settings.effective_roots())


@router.post(
    "",
    response_model=JobStatus,
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {"model": JobStatus, "description": "This id already holds this same job."},
        409: {"model": ErrorBody, "description": "This id already holds a different job."},
        422: _ERRORS[422],
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
def list_jobs(
    scheduler: SchedulerDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
) -> JobList:
    """Jobs in submission order."""
    return JobList(jobs=scheduler.list(state))


@router.get("/{job_id}", response_model=JobStatus, responses={404: _ERRORS[404]})
def get_job(job_id: str, scheduler: SchedulerDep) -> JobStatus:
    return scheduler.get(job_id)


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


@router.post(
    "/{job_id}/train",
    response_model=TrainStatus,
    status_code=status.HTTP_202_ACCEPTED,
    responses={404: _ERRORS[404], 409: {"model": ErrorBody, "description": "Already training."},
               422: _ERRORS[422]},
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


def sse_event(job: JobStatus) -> str:
    """One `status` event; JSON has no raw newlines, so it fits one `data:` line."""
    return f"event: status\ndata: {job.model_dump_json()}\n\n"


def _next_update(q: queue.Queue[JobStatus | None], timeout: float) -> JobStatus | str | None:
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return "timeout"


async def _status_stream(
    request: Request,
    scheduler: SchedulerAPI,
    job_id: str,
    q: queue.Queue[JobStatus | None],
) -> AsyncIterator[str]:
    try:
        # The scheduler greets a new subscriber with the current status; take that one
        # (a separate get() could be newer than what is queued after it, and the stream
        # would go back in time). Subscribed first, so no update falls in between.
        try:
            first = q.get_nowait()
        except queue.Empty:
            first = await anyio.to_thread.run_sync(scheduler.get, job_id)
        if first is None:
            return
        current = first
        yield sse_event(current)
        if current.state.finished:
            return
        last_sent = time.monotonic()
        while True:
            update = await anyio.to_thread.run_sync(
                _next_update, q, POLL_S, limiter=_stream_threads
            )
            if update is None:  # the scheduler's end-of-job marker
                return
            # An unchanged status is not an event (the scheduler may republish one), and
            # must not hold off the keep-alive either.
            if isinstance(update, JobStatus) and update != current:
                current = update
                yield sse_event(update)
                last_sent = time.monotonic()
                if update.state.finished:
                    return
                continue
            if await request.is_disconnected():
                return
            if time.monotonic() - last_sent >= KEEPALIVE_S:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
    finally:
        scheduler.unsubscribe(job_id, q)


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
def job_events(job_id: str, request: Request, scheduler: SchedulerDep) -> StreamingResponse:
    """Server-sent events: the current status first, then one per change, until finished."""
    q = scheduler.subscribe(job_id)  # raises JobNotFound before any byte is sent: a 404
    return StreamingResponse(
        _status_stream(request, scheduler, job_id, q),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
