"""The coordinator's FastAPI app: routes, the one place errors become HTTP, the lifespan.

`create_app(settings, scheduler)` builds it; `hsx serve` runs it under uvicorn. Tests
pass a fake scheduler; without one, the lifespan builds the real
`hsx_service.scheduler.Scheduler(settings)` (imported there, so building an app for its
OpenAPI schema needs no Ray) and calls `start()` / `stop()` around serving.

Every non-2xx response carries an `ErrorBody` (hsx.wire):

| raised | HTTP | type |
|---|---|---|
| request body fails validation (`SubmitRequest`, `JobSpec`) | 422 | JobRefused |
| `JobRefused` (policy here, preflight in the scheduler) | 422 | JobRefused |
| a query or path parameter fails validation | 422 | InvalidRequest |
| a body that cannot be read as JSON | 400 | InvalidRequest |
| `Unauthorized` (deps.authenticate) | 401 | Unauthorized |
| a Host header the server does not answer (`Settings.host_allowed`) | 421 | MisdirectedRequest |
| `JobNotFound` / an unknown route | 404 | NotFound |
| `JobConflict` | 409 | Conflict |
| `NotReady`, `LeaseLost` (a standby, or a coordinator fenced off its ledger) | 503 | NotReady |
| a body over `max_body_bytes` (`BodyTooLarge`) | 413 | PayloadTooLarge |
| anything else | 500 | InternalError (its text only in the log, under the answer's `error id`) |

`field` is the dotted location of the culprit as the client sent it (`spec.layers`).

Each app owns its Prometheus registry (`app.state.registry`), with one collector that
asks the app's scheduler at every scrape (routes/ops.py): two apps in one process (tests,
the demo) never share metrics, and nothing lands in prometheus_client's global registry.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from hsx import __version__
from hsx.wire import ErrorBody
from hsx_service.config import Settings
from hsx_service.errors import JobConflict, JobNotFound, JobRefused, NotReady, refused_field
from hsx_service.ledger import LeaseLost
from hsx_service.routes import jobs, models, ops
from hsx_service.routes.ops import SchedulerCollector
from hsx_service.throttle import Checks, TooBusy
from hsx_service.users import TokenTable, Unauthorized

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
NOT_READY_RETRY_S = 2
_PARAM_SOURCES = ("body", "query", "path", "header", "cookie")

_FALLBACK_INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hsx</title></head>
<body><h1>hsx coordinator</h1>
<p>The dashboard is not installed here. The API is described at <a href="/docs">/docs</a>.</p>
</body></html>
"""


def create_app(settings: Settings | None = None, scheduler: Any | None = None) -> FastAPI:
    """The app for `settings` (default: from the environment), driving `scheduler`.

    ValueError when a token or the tokens file cannot be used."""
    settings = settings if settings is not None else Settings()
    tokens = TokenTable.load(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        refusal = settings.refusal_to_start()
        if refusal is not None:
            raise RuntimeError(refusal)
        _log_exposure(settings)
        if app.state.scheduler is None:
            app.state.scheduler = await anyio.to_thread.run_sync(_build_scheduler, settings)
        # start() is expected to return soon; reconciling the ledger may go on in the
        # scheduler's own thread while `ready` is False (/readyz says 503 meanwhile).
        await anyio.to_thread.run_sync(app.state.scheduler.start)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(app.state.scheduler.stop)

    app = FastAPI(
        title="hsx coordinator",
        version=__version__,
        description=(
            "Hidden-state extraction jobs: the training data of speculative-decoding "
            "drafts (EAGLE-3, DFlash, DSpark), and the drafts' training. When the server has "
            "an API token, /v1 calls need `Authorization: Bearer <token>`."
        ),
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.tokens = tokens
    app.state.scheduler = scheduler
    app.state.checks = Checks(settings.max_checks, settings.max_user_checks)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(HostCheck, settings=settings)
    app.state.registry = CollectorRegistry(auto_describe=False)
    app.state.registry.register(SchedulerCollector(lambda: app.state.scheduler))
    _redact_access_logs()
    _add_error_handlers(app)
    app.include_router(jobs.router)
    app.include_router(ops.router)
    app.include_router(models.router)
    # check_dir=False: the dashboard's assets may be absent from a slim install; then
    # /static answers 404 and / the fallback page.
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        page = STATIC_DIR / "index.html"
        if page.is_file():
            return FileResponse(page, media_type="text/html")
        return HTMLResponse(_FALLBACK_INDEX)

    return app


class BodyTooLarge(Exception):
    """A request body over the server's `max_body_bytes` (413; no route reads it whole)."""


class BodyLimit:
    """Refuse request bodies over `limit` bytes before anything parses them.

    A declared Content-Length over the limit is answered 413 at once; a body sent
    without one (chunked) is counted as it arrives and refused when it passes the limit.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = _error(413, "PayloadTooLarge", self._message(int(declared)))
            await response(scope, receive, send)
            return
        received = 0
        over: list[int] = []

        async def counted() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    over.append(received)
                    raise BodyTooLarge(self._message(received))
            return message

        async def answer(message: Any) -> None:
            # FastAPI turns any error while it reads a body into its own 400; a body
            # refused for its size is answered 413 whatever the app then sends.
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await _error(413, "PayloadTooLarge", self._message(over[0]))(
                    scope, receive, send)

        await self.app(scope, counted, answer)

    def _message(self, size: int) -> str:
        return (f"the request body ({size} bytes or more) is over this server's limit of "
                f"{self.limit} bytes (HSX_MAX_BODY_BYTES)")


class HostCheck:
    """Answer only requests whose Host header this server serves (Settings.host_allowed):
    a loopback server is otherwise reachable from any web page whose DNS name points at
    127.0.0.1 (DNS rebinding), the browser sending that page's name as the Host."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = dict(scope["headers"]).get(b"host")
            name = host.decode("latin-1") if host is not None else None
            if not self.settings.host_allowed(name):
                response = _error(421, "MisdirectedRequest", (
                    f"this server does not answer for host {name!r}; its operator can "
                    "add the name to HSX_ALLOWED_HOSTS"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RedactAccessToken(logging.Filter):
    """Blanks `access_token=` and `token=` in uvicorn's access log (the dashboard is
    opened at `/?token=`, and its EventSource puts the token in the URL; a log file is
    no place for it)."""

    _TOKEN = re.compile(r"([?&](?:access_)?token=)[^&\s]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                self._TOKEN.sub(r"\1***", arg) if isinstance(arg, str) else arg
                for arg in record.args
            )
        return True


def _redact_access_logs() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _RedactAccessToken) for f in access.filters):
        access.addFilter(_RedactAccessToken())


def _build_scheduler(settings: Settings) -> Any:
    from hsx_service.scheduler import Scheduler

    return Scheduler(settings)


def _log_exposure(settings: Settings) -> None:
    roots = settings.effective_roots()
    if roots is None:
        log.info("datasets and outputs may be anywhere (loopback server without a token)")
    else:
        log.info("datasets and outputs must lie in: %s%s", ", ".join(map(str, roots)),
                 " (a user's: their own folder in each, unless the tokens file gives them "
                 "roots)" if settings.authenticates else "")
    if settings.read_roots:
        log.info("every caller may read: %s", ", ".join(map(str, settings.read_roots)))
    if settings.open_to_all:
        log.warning(
            "listening on %s without an API token (HSX_ALLOW_OPEN): anyone who reaches it "
            "can submit jobs",
            settings.host,
        )


def _error(
    status: int,
    type_: str,
    message: str,
    field: str | None = None,
    detail: Any = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = ErrorBody(type=type_, message=message, field=field, detail=detail)
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def _dotted(loc: Sequence[Any]) -> tuple[str, str | None]:
    """(where, field): `body.spec.layers.1` is written `spec.layers.1`, field `spec.layers`."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in _PARAM_SOURCES:
        parts = parts[1:]
    where = ".".join(parts)
    # The field is the named key; list positions say which item, not which field.
    named = [str(p) for p in loc[len(loc) - len(parts):] if not isinstance(p, int)]
    return where, ".".join(named) or None


def _describe(error: dict[str, Any]) -> str:
    if error.get("type") == "extra_forbidden":
        return "unknown field"
    msg = str(error.get("msg", "invalid"))
    return msg.removeprefix("Value error, ")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        lines = []
        for error in errors:
            where, _ = _dotted(error.get("loc", ()))
            lines.append(f"{where or 'request body'}: {_describe(error)}")
        first_loc: Sequence[Any] = errors[0].get("loc", ()) if errors else ()
        _, field = _dotted(first_loc)
        in_body = len(first_loc) > 0 and first_loc[0] == "body"
        detail = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": _describe(e), "type": e.get("type")}
            for e in errors
        ]
        return _error(
            422,
            "JobRefused" if in_body else "InvalidRequest",
            "; ".join(lines) or "invalid request",
            field=field,
            detail=detail,
        )

    @app.exception_handler(JobRefused)
    async def refused(request: Request, exc: JobRefused) -> JSONResponse:
        name = refused_field(exc)
        return _error(422, "JobRefused", str(exc), field=f"spec.{name}" if name else None)

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return _error(401, "Unauthorized", str(exc), headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(JobNotFound)
    async def not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return _error(404, "NotFound", str(exc))

    @app.exception_handler(JobConflict)
    async def conflict(request: Request, exc: JobConflict) -> JSONResponse:
        return _error(409, "Conflict", str(exc))

    @app.exception_handler(NotReady)
    @app.exception_handler(LeaseLost)
    async def not_ready(request: Request, exc: Exception) -> JSONResponse:
        return _error(
            503, "NotReady", str(exc), headers={"Retry-After": str(NOT_READY_RETRY_S)}
        )

    @app.exception_handler(TooBusy)
    async def too_busy(request: Request, exc: TooBusy) -> JSONResponse:
        return _error(429, "TooBusy", str(exc), headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return _error(413, "PayloadTooLarge", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 400: a body that is not JSON at all (FastAPI's own check, before validation).
        type_ = {404: "NotFound", 400: "InvalidRequest"}.get(exc.status_code, "HTTPError")
        return _error(exc.status_code, type_, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # The error's text may name paths, hosts or a job's data: it goes to the log,
        # and the answer names only where to find it there.
        error_id = uuid.uuid4().hex[:12]
        log.exception("%s %s failed (error id %s)", request.method, request.url.path,
                      error_id)
        return _error(500, "InternalError",
                      f"internal error (error id {error_id}; the coordinator's log has it)")
