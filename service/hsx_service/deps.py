"""Route dependencies: the settings, the scheduler, and the API token check.

`create_app` puts the settings and the scheduler on `app.state`; routes reach them only
through `get_settings` and `get_scheduler`, so a test can hand the app its own (or use
`app.dependency_overrides`).

`SchedulerAPI` is the whole surface the routes use. `hsx_service.scheduler.Scheduler`
provides it; unit tests provide a fake. Sync methods are expected to be fast (memory or
one SQLite read); routes call them from FastAPI's thread pool.
"""

from __future__ import annotations

import hmac
import queue
from typing import Annotated, Protocol

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from hsx.spec import JobSpec, TrainSpec
from hsx.wire import ErrorPage, JobState, JobStatus, TrainStatus
from hsx_service.config import Settings
from hsx_service.errors import NotReady


class SchedulerAPI(Protocol):
    """What the routes call. Raises JobRefused, JobNotFound, JobConflict, NotReady."""

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, spec: JobSpec, job_id: str | None) -> tuple[JobStatus, bool]: ...

    def get(self, job_id: str) -> JobStatus: ...

    def list(self, state: JobState | None) -> list[JobStatus]: ...

    def cancel(self, job_id: str) -> JobStatus: ...

    def errors(self, job_id: str, offset: int, limit: int) -> ErrorPage: ...

    def train(self, job_id: str, spec: TrainSpec) -> TrainStatus: ...

    def train_status(self, job_id: str) -> TrainStatus: ...

    def subscribe(self, job_id: str) -> queue.Queue[JobStatus | None]: ...

    def unsubscribe(self, job_id: str, q: queue.Queue[JobStatus | None]) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class Unauthorized(Exception):
    """A /v1 call without the right API token (401; main.py maps it)."""


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_scheduler(request: Request) -> SchedulerAPI:
    scheduler: SchedulerAPI | None = getattr(request.app.state, "scheduler", None)
    if scheduler is None:
        # Only between create_app and the lifespan's start; say so rather than crash.
        raise NotReady("the coordinator is starting")
    return scheduler


# auto_error=False: a missing header is our 401 with an ErrorBody, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="The server's HSX_API_TOKEN.")


def _same(given: str, expected: str) -> bool:
    # Bytes, so a non-ASCII token compares in constant time instead of raising.
    return hmac.compare_digest(given.encode(), expected.encode())


def require_token(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Let the call through when no token is configured or it carries the right one.

    GET calls may pass the token as `?access_token=`: the dashboard's EventSource cannot
    set headers. Other methods must use the header, so a token never rides in the URL
    of a call that changes something.
    """
    expected = settings.api_token
    if expected is None:
        return
    given: str | None = credentials.credentials if credentials is not None else None
    if given is None and request.method == "GET":
        given = request.query_params.get("access_token")
    if given is None:
        raise Unauthorized("this server needs an API token: send Authorization: Bearer <token>")
    if not _same(given, expected):
        raise Unauthorized("wrong API token")


SettingsDep = Annotated[Settings, Depends(get_settings)]
SchedulerDep = Annotated[SchedulerAPI, Depends(get_scheduler)]
