"""`hsx.Client`: the coordinator's REST API from Python.

```python
import hsx
client = hsx.Client()                      # HSX_URL / HSX_API_TOKEN, else http://127.0.0.1:8642
job = client.submit("job.yaml", job_id="llama8b-chats")
final = client.wait(job.id)                # follows the event stream; polls if it breaks
for record in client.iter_errors(job.id):  # rows skipped with a reason
    ...
```

Errors cross the wire as `ErrorBody` (type, message, field) and are re-raised here with
the server's message, as an `ApiError` subclass chosen by the HTTP status:

| status | class |
|---|---|
| 401 | `UnauthorizedError` |
| 404 | `NotFoundError` |
| 409 | `ConflictError` |
| 422 | `JobRefusedError` (`field` names the culprit, e.g. `spec.layers`) |
| 429 | `TooBusyError` (raised once `busy_wait` seconds of tries did not get through) |
| 503 | `NotReadyError` |
| no answer | `ConnectionFailedError` (also a `ConnectionError`), naming the URL |

A job file given as a path is read with `hsx.spec.load_job` (relative paths in it are
taken from the file's folder); an unreadable or invalid file raises `hsx.spec.SpecError`
before anything is sent. A dict is sent as it is, for the server to validate.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from hsx import settings
from hsx.spec import JobSpec, TrainSpec, load_job
from hsx.wire import (
    API_PREFIX,
    ErrorBody,
    ErrorPage,
    ErrorRecord,
    JobList,
    JobState,
    JobStatus,
    TrainState,
    TrainStatus,
)

log = logging.getLogger(__name__)

DEFAULT_URL = settings.URL.default
# Longer than the server's keep-alive interval (15 s), so a quiet stream is not mistaken
# for a dead one, yet a vanished server is noticed within a minute.
EVENTS_READ_TIMEOUT_S = 60.0


class ApiError(Exception):
    """An error answer from the coordinator (or none at all), with the server's message."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        field: str | None = None,
        detail: Any = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.field = field
        self.detail = detail

    def __str__(self) -> str:
        return self.message


class JobRefusedError(ApiError):
    """422: the job cannot run as written; `field` names the culprit when there is one."""


class NotFoundError(ApiError):
    """404: no such job."""


class ConflictError(ApiError):
    """409: the job id is taken by a different job."""


class UnauthorizedError(ApiError):
    """401: the server needs an API token (HSX_API_TOKEN), or another one."""


class NotReadyError(ApiError):
    """503: the coordinator is still starting; try again shortly."""


KEEPALIVE_S = 2.0  # seconds a pooled connection may idle before the client drops it


class TooBusyError(ApiError):
    """429: the coordinator checks as many submits and inspects as it may at once (the
    caller's, or in all); `retry_after` seconds later it may take this one. The client
    waits and tries again for up to `busy_wait` seconds before it raises this."""

    @property
    def retry_after(self) -> float:
        return float(self.detail or 5)


class ConnectionFailedError(ApiError, ConnectionError):
    """No answer from the server: not running, wrong URL, or the connection broke."""


_BY_STATUS: dict[int, type[ApiError]] = {
    401: UnauthorizedError,
    404: NotFoundError,
    409: ConflictError,
    422: JobRefusedError,
    429: TooBusyError,
    503: NotReadyError,
}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = ErrorBody.model_validate(response.json())
    except ValueError:
        # Not ours (a proxy, a crash before the app): keep what it said.
        text = response.text.strip()[:500] or response.reason_phrase
        body = ErrorBody(type=f"HTTP {response.status_code}", message=text)
    cls = _BY_STATUS.get(response.status_code, ApiError)
    detail = body.detail
    if cls is TooBusyError:
        detail = response.headers.get("Retry-After") or detail
    raise cls(response.status_code, body.type, body.message, body.field, detail)


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(event, data) of a server-sent event stream, given its lines; comments skipped."""
    event = "message"
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
    if data:
        yield event, "\n".join(data)


class Client:
    """The coordinator's job API: submit, get, list, cancel, errors, events, wait.

    `base_url` and `token` default to HSX_URL and HSX_API_TOKEN. One client holds one
    connection pool; use it as a context manager (or call `close`) when done.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        transport: httpx.BaseTransport | None = None,
        busy_wait: float = 120.0,
    ) -> None:
        self.base_url = (base_url or settings.URL.raw() or DEFAULT_URL).rstrip("/")
        token = token if token is not None else settings.API_TOKEN.get()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._busy_wait = busy_wait  # seconds of 429s a call waits through before raising
        # An idle connection is dropped well before a server closes it (uvicorn's default
        # after 5 s, `hsx serve`'s after 30): a request sent on a connection the server
        # is closing at that moment fails with a reset, and 429 waits leave connections
        # idle for seconds.
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- the API ----------------------------------------------------------------------

    def submit(
        self, spec: JobSpec | dict[str, Any] | str | Path, job_id: str | None = None
    ) -> JobStatus:
        """Queue a job (a JobSpec, a dict of its fields, or a job file's path).

        With `job_id`, submitting the same job again returns it (safe to retry); the same
        id with a different job raises ConflictError.
        """
        if isinstance(spec, (str, Path)):
            spec = load_job(spec)
        # Only the fields that were set: an older server must not meet a newer field
        # that the user never asked for.
        fields = spec.model_dump(mode="json", exclude_unset=True) if isinstance(
            spec, JobSpec
        ) else dict(spec)
        body: dict[str, Any] = {"spec": fields}
        if job_id is not None:
            body["id"] = job_id
        return JobStatus.model_validate(self._request("POST", _jobs(), json=body).json())

    def ready(self) -> bool:
        """Whether the coordinator answers and has finished starting (`/readyz`)."""
        try:
            return bool(self._http.get("/readyz").status_code == 200)
        except httpx.HTTPError:
            return False

    def get(self, job_id: str) -> JobStatus:
        return JobStatus.model_validate(self._request("GET", _jobs(job_id)).json())

    def list(self, state: JobState | str | None = None) -> list[JobStatus]:
        """Jobs in submission order, optionally only those in `state`."""
        params = {"state": JobState(state).value} if state is not None else None
        return JobList.model_validate(self._request("GET", _jobs(), params=params).json()).jobs

    def cancel(self, job_id: str) -> JobStatus:
        """Ask the job to stop; the returned status may still say running while units end."""
        return JobStatus.model_validate(self._request("DELETE", _jobs(job_id)).json())

    def errors(self, job_id: str, offset: int = 0, limit: int = 100) -> ErrorPage:
        """One page of the job's per-row error records (limit at most 1000)."""
        params = {"offset": offset, "limit": limit}
        response = self._request("GET", _jobs(job_id, "errors"), params=params)
        return ErrorPage.model_validate(response.json())

    def iter_errors(self, job_id: str, page_size: int = 1000) -> Iterator[ErrorRecord]:
        """Every error record of the job, fetched a page at a time."""
        offset = 0
        while True:
            page = self.errors(job_id, offset=offset, limit=page_size)
            yield from page.items
            offset += len(page.items)
            if not page.items or offset >= page.total:
                return

    def events(
        self, job_id: str, read_timeout: float | None = EVENTS_READ_TIMEOUT_S
    ) -> Iterator[JobStatus]:
        """The job's status now, then at every change, until it has finished.

        Raises ConnectionFailedError when the stream cannot be opened or breaks;
        `wait` is the variant that rides over that.
        """
        timeout = httpx.Timeout(self._timeout, read=read_timeout)
        try:
            with self._http.stream("GET", _jobs(job_id, "events"), timeout=timeout) as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                for event, data in sse_events(response.iter_lines()):
                    if event == "status":
                        yield JobStatus.model_validate_json(data)
        except httpx.TransportError as err:
            raise self._unreachable(err, f"the event stream of job {job_id!r}") from err

    def wait(
        self,
        job_id: str,
        timeout: float | None = None,
        *,
        on_update: Callable[[JobStatus], None] | None = None,
        poll_s: float = 2.0,
    ) -> JobStatus:
        """Block until the job has finished and return its final status.

        Follows the event stream, calling `on_update` with each status. When the stream
        breaks (the coordinator restarting, a proxy cutting it), polls `get` every
        `poll_s` seconds and reopens the stream once the server answers again. Raises
        TimeoutError after `timeout` seconds; API errors other than an unreachable or
        starting server (a 404, a 401) are raised at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobStatus | None = None

        def seen(status: JobStatus) -> bool:
            nonlocal last
            last = status
            if on_update is not None:
                on_update(status)
            return status.state.finished

        while True:
            try:
                for status in self.events(job_id, read_timeout=_read_timeout(deadline)):
                    if seen(status):
                        return status
                    _check_deadline(deadline, job_id, timeout, last)
            except (ConnectionFailedError, NotReadyError) as err:
                log.info("job %s: event stream unavailable (%s); polling", job_id, err)
            _check_deadline(deadline, job_id, timeout, last)
            time.sleep(poll_s if deadline is None else min(poll_s, _left(deadline)))
            try:
                polled = self.get(job_id)
                if seen(polled):
                    return polled
            except (ConnectionFailedError, NotReadyError) as err:
                log.info("job %s: server unavailable (%s); retrying", job_id, err)

    def train(self, job_id: str, spec: TrainSpec | dict[str, Any] | None = None) -> TrainStatus:
        """Start training a draft on the job's output: the spec's method, EAGLE-3 when
        spec is None (with the defaults)."""
        fields = spec.model_dump(mode="json", exclude_unset=True) if isinstance(
            spec, TrainSpec) else dict(spec or {})
        response = self._request("POST", _jobs(job_id, "train"), json=fields)
        return TrainStatus.model_validate(response.json())

    def train_status(self, job_id: str) -> TrainStatus:
        return TrainStatus.model_validate(self._request("GET", _jobs(job_id, "train")).json())

    def wait_train(
        self, job_id: str, timeout: float | None = None, *, poll_s: float = 1.0,
        on_update: Callable[[TrainStatus], None] | None = None,
    ) -> TrainStatus:
        """Poll the training until it is done, failed or stopped; TimeoutError after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = self.train_status(job_id)
            if on_update is not None:
                on_update(status)
            if status.state.finished or status.state is TrainState.stopped:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"training of job {job_id} still {status.state.value} after {timeout}s "
                    f"(step {status.step})")
            time.sleep(poll_s)

    # --- plumbing ---------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        deadline = time.monotonic() + self._busy_wait
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as err:
                raise self._unreachable(err, f"{method} {path}") from err
            try:
                _raise_for(response)
                return response
            except TooBusyError as busy:  # nothing was done: the same call again, later
                wait = min(busy.retry_after, _left(deadline))
                if wait <= 0:
                    raise
                time.sleep(wait)

    def _unreachable(self, err: httpx.TransportError, what: str) -> ConnectionFailedError:
        reason = str(err) or type(err).__name__
        return ConnectionFailedError(
            0,
            "ConnectionFailed",
            f"no answer from the hsx server at {self.base_url} ({what}: {reason}); is "
            "`hsx serve` running there? (--url or HSX_URL choose another)",
        )


def _jobs(job_id: str | None = None, tail: str | None = None) -> str:
    path = f"{API_PREFIX}/jobs"
    if job_id is not None:
        path += "/" + urllib.parse.quote(job_id, safe="")
    if tail is not None:
        path += "/" + tail
    return path


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _read_timeout(deadline: float | None) -> float:
    if deadline is None:
        return EVENTS_READ_TIMEOUT_S
    return max(min(EVENTS_READ_TIMEOUT_S, _left(deadline)), 0.05)


def _check_deadline(
    deadline: float | None, job_id: str, timeout: float | None, last: JobStatus | None
) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        state = last.state.value if last is not None else "unknown"
        raise TimeoutError(f"job {job_id} did not finish within {timeout:g} s (last: {state})")
