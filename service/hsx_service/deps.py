"""Route dependencies: the settings, the scheduler, and the caller (users.py).

`create_app` puts the settings and the scheduler on `app.state`; routes reach them only
through `get_settings` and `get_scheduler`, so a test can hand the app its own (or use
`app.dependency_overrides`).

`SchedulerAPI` is the whole surface the routes use. `hsx_service.scheduler.Scheduler`
provides it; unit tests provide a fake. Statuses are read from its `board` (memory, in
the event loop); the other methods are expected to be fast (memory or a little SQLite)
and are called from FastAPI's thread pool.

The dependencies here are `async def`: they only read memory, and FastAPI runs a plain
`def` dependency in its thread pool — a thread hop per dependency per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Protocol

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client.core import Metric

from hsx.spec import JobSpec, TrainSpec
from hsx.wire import ErrorPage, JobStatus, Throughput, TrainStatus
from hsx_service.board import StatusBoard
from hsx_service.config import Settings
from hsx_service.errors import NotReady
from hsx_service.throttle import Checks
from hsx_service.users import ANONYMOUS, Caller, TokenTable, Unauthorized, caller, check_name


class SchedulerAPI(Protocol):
    """What the routes call. Raises JobRefused, JobNotFound, JobConflict, NotReady."""

    board: StatusBoard  # every job's latest status: GET /v1/jobs..., the event streams

    @property
    def ready(self) -> bool: ...

    def not_ready(self) -> NotReady:
        """What to answer (503) while not `ready`: starting, or a standby naming the
        coordinator that holds the ledger."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, spec: JobSpec, job_id: str | None,
               owner: str | None = None) -> tuple[JobStatus, bool]: ...

    def cancel(self, job_id: str) -> JobStatus: ...

    def errors(self, job_id: str, offset: int, limit: int) -> ErrorPage: ...

    def throughput(self, job_id: str) -> Throughput: ...

    def train(self, job_id: str, spec: TrainSpec) -> TrainStatus: ...

    def train_status(self, job_id: str) -> TrainStatus: ...

    def collect_metrics(self) -> Iterable[Metric]: ...


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_scheduler(request: Request) -> SchedulerAPI:
    scheduler: SchedulerAPI | None = getattr(request.app.state, "scheduler", None)
    if scheduler is None:
        # Only between create_app and the lifespan's start; say so rather than crash.
        raise NotReady("the coordinator is starting")
    return scheduler


# auto_error=False: a missing header is our 401 with an ErrorBody, not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="An API token of the server's.")


async def authenticate(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    """The caller of a /v1 request (users.py), or Unauthorized.

    GET calls may pass the token as `?access_token=`: the dashboard's EventSource cannot
    set headers. Other methods must use the header, so a token never rides in the URL
    of a call that changes something.
    """
    if settings.user_header is not None:
        name = request.headers.get(settings.user_header)
        if not name:
            raise Unauthorized(f"this server needs the {settings.user_header} header, set by "
                               "its authenticating proxy")
        try:
            user = check_name(name, settings.user_header)
        except ValueError as err:
            raise Unauthorized(str(err)) from None
        return caller(user, user in settings.admins, settings)
    tokens: TokenTable = request.app.state.tokens
    if not tokens:
        return caller(ANONYMOUS, True, settings)
    given: str | None = credentials.credentials if credentials is not None else None
    if given is None and request.method == "GET":
        given = request.query_params.get("access_token")
    if given is None:
        raise Unauthorized("this server needs an API token: send Authorization: Bearer <token>")
    found = tokens.caller(given)
    if found is None:
        raise Unauthorized("wrong API token")
    return found


async def get_checks(request: Request) -> Checks:
    """The coordinator's check slots (throttle.py): submits and inspects take one."""
    checks: Checks = request.app.state.checks
    return checks


SettingsDep = Annotated[Settings, Depends(get_settings)]
ChecksDep = Annotated[Checks, Depends(get_checks)]
SchedulerDep = Annotated[SchedulerAPI, Depends(get_scheduler)]
CallerDep = Annotated[Caller, Depends(authenticate)]
