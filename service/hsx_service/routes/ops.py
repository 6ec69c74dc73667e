"""Operator endpoints: `/healthz`, `/readyz`, `/metrics`. Open without a token.

`/healthz` answers as long as the process serves HTTP (liveness); `/readyz` only once the
scheduler has reconciled the ledger and accepts work (readiness, 503 before);
`/metrics` is Prometheus text exposition format 0.0.4.

The scheduler's `metrics()` returns a flat dict; the names are the Prometheus sample
names. Known ones are rendered with their type and help (a missing one as 0):

- counters: hsx_tokens_total, hsx_samples_total, hsx_samples_failed_total,
  hsx_bytes_total, hsx_shards_total, hsx_worker_restarts_total
- summary `hsx_unit_seconds`: keys hsx_unit_seconds_sum and hsx_unit_seconds_count
- gauge hsx_queue_depth
- gauge `hsx_jobs`: one key per JobState, written `hsx_jobs{state="queued"}`

Any other key that is a valid sample name is rendered as `untyped`, so the scheduler can
grow a metric without a change here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from fastapi import APIRouter, Response

from hsx.wire import ErrorBody, JobState
from hsx_service.deps import SchedulerDep
from hsx_service.errors import NotReady

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name, type, help
KNOWN_METRICS: tuple[tuple[str, str, str], ...] = (
    ("hsx_tokens_total", "counter", "Tokens extracted into committed shards."),
    ("hsx_samples_total", "counter", "Samples committed."),
    ("hsx_samples_failed_total", "counter", "Samples recorded as errors and skipped."),
    ("hsx_bytes_total", "counter", "Bytes of committed shards."),
    ("hsx_shards_total", "counter", "Shards committed."),
    ("hsx_unit_seconds", "summary", "Seconds from dispatching a work unit to its commit."),
    ("hsx_queue_depth", "gauge", "Work units waiting for a worker."),
    ("hsx_worker_restarts_total", "counter", "Worker actors restarted after dying."),
    ("hsx_jobs", "gauge", "Jobs by state."),
)
_SAMPLE_NAME = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?$")

router = APIRouter(tags=["ops"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorBody, "description": "Still starting."}})
def readyz(scheduler: SchedulerDep) -> dict[str, str]:
    """Readiness: the ledger is reconciled and jobs are accepted."""
    if not scheduler.ready:
        raise NotReady("the coordinator is starting (reconciling the ledger)")
    return {"status": "ready"}


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text."}},
)
def metrics(scheduler: SchedulerDep) -> Response:
    return Response(render_metrics(scheduler.metrics()), media_type=PROMETHEUS_CONTENT_TYPE)


def _number(value: float) -> str:
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def render_metrics(values: Mapping[str, float]) -> str:
    """Prometheus text format for the scheduler's metrics (missing known ones are 0).

    Labelled samples of a known metric (`hsx_tokens_total{job="a"}`) go under its one
    TYPE line, as the format requires.
    """
    by_base: dict[str, list[str]] = {}
    for key in values:
        match = _SAMPLE_NAME.match(key)
        if match is not None:
            by_base.setdefault(match.group(1), []).append(key)

    lines: list[str] = []
    for name, kind, help_text in KNOWN_METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        if kind == "summary":
            bases = [f"{name}_sum", f"{name}_count"]
            keys = list(bases)
        elif name == "hsx_jobs":
            bases = [name]
            keys = [f'{name}{{state="{state.value}"}}' for state in JobState]
        else:
            bases = [name]
            keys = [name]
        for base in bases:
            keys += sorted(k for k in by_base.pop(base, []) if k not in keys)
        lines += [f"{key} {_number(values.get(key, 0))}" for key in keys]

    for base in sorted(by_base):
        lines.append(f"# TYPE {base} untyped")
        lines += [f"{key} {_number(values[key])}" for key in sorted(by_base[base])]
    return "\n".join(lines) + "\n"
