"""Operator endpoints: `/healthz`, `/readyz` (open without a token), `/metrics` (with the
server's token, unless `HSX_PUBLIC_METRICS`), and `/v1/whoami` (who the caller is and
whether the server is open, for the dashboard).

`/healthz` answers as long as the process serves HTTP (liveness); `/readyz` only once the
scheduler has reconciled the ledger and accepts work (readiness, 503 before);
`/metrics` is `prometheus_client`'s exposition of the app's own registry
(`app.state.registry`, made by `create_app`): Prometheus text format, or OpenMetrics
when the scraper asks for it. The names are listed in `hsx_service.metrics.METRICS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from hsx.wire import API_PREFIX, ErrorBody
from hsx_service.deps import CallerDep, SchedulerDep, SettingsDep, authenticate, bearer
from hsx_service.metrics import METRICS
from hsx_service.users import Unauthorized

router = APIRouter(tags=["ops"])
UNAUTHORIZED = {"model": ErrorBody, "description": "Missing or wrong API token."}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorBody, "description": "Still starting."}})
def readyz(scheduler: SchedulerDep) -> dict[str, str]:
    """Readiness: the ledger is reconciled and jobs are accepted."""
    if not scheduler.ready:
        raise scheduler.not_ready()
    return {"status": "ready"}


async def metrics_caller(request: Request, settings: SettingsDep) -> None:
    """/metrics needs an admin (its families cover every user's jobs), unless the
    operator made it public."""
    if settings.public_metrics:
        return
    caller = await authenticate(request, settings, await bearer(request))
    if not caller.admin:
        raise Unauthorized(f"{caller.user} may not read /metrics: it needs an admin's token")


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text."},
               401: UNAUTHORIZED},
)
def metrics(request: Request, _: None = Depends(metrics_caller)) -> Response:
    """Prometheus metrics (text format; OpenMetrics when the Accept header asks for it).
    Needs the server's token unless HSX_PUBLIC_METRICS is set."""
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(request.app.state.registry), media_type=content_type)


@router.get(f"{API_PREFIX}/whoami", dependencies=[Depends(authenticate)],
            responses={401: UNAUTHORIZED})
def whoami(caller: CallerDep, settings: SettingsDep) -> dict[str, Any]:
    """The caller's user name, whether they are an admin, and whether this server lets
    anyone in (`open`: a non-loopback server run with HSX_ALLOW_OPEN)."""
    return {"user": caller.user, "admin": caller.admin, "open": settings.open_to_all}


class SchedulerCollector:
    """A registry collector that asks whatever scheduler the app has at scrape time."""

    def __init__(self, scheduler: Callable[[], Any]) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler()
        if scheduler is None:  # between create_app and the lifespan's start
            yield GaugeMetricFamily("hsx_ready", METRICS["hsx_ready"][1], value=0)
            return
        yield from scheduler.collect_metrics()
