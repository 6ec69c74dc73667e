"""`/v1/models/inspect`: the model preflight over REST (what `hsx inspect-model` prints).

Answers from the model's config alone (hsx_workers.preflight): no weights, no GPU. The
first call in a process imports vLLM (seconds); it is a plain `def` route, so that runs
in FastAPI's thread pool. The server's path policy applies to the model and dataset as
it does to jobs (the caller's roots); a refusal is a JobRefused, turned into 422 in main.py.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from hsx.modelinfo import ModelConfigError
from hsx.spec import DatasetSpec
from hsx.wire import API_PREFIX, ErrorBody
from hsx_service.deps import CallerDep, ChecksDep, SettingsDep, authenticate
from hsx_service.errors import JobRefused
from hsx_service.paths import check_dataset_path, check_model_path
from hsx_service.routes.jobs import BODY_ERRORS, TOO_BUSY

router = APIRouter(
    prefix=f"{API_PREFIX}/models",
    tags=["models"],
    dependencies=[Depends(authenticate)],
    responses={401: {"model": ErrorBody, "description": "Missing or wrong API token."}},
)


class InspectRequest(BaseModel):
    """What to preflight; the fields mirror the job's (model, engine, layers, ...)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, description="Model directory or hub id.")
    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="Engine to judge the model for; auto picks the best path.")
    layers: list[int] | None = Field(None, description="Layer ids to check (default: EAGLE-3's).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine, for the fit check.")
    dataset: str | DatasetSpec | None = Field(
        None, description="Dataset to count tokens and output bytes of (as a job's `dataset`).")
    max_seq_len: int = Field(4096, ge=1, description="Truncation length used when counting.")
    trust_remote_code: bool = Field(False, description="Allow the model's own config code.")
    gpu_memory_bytes: int | None = Field(
        None, ge=1, description="Memory of one GPU; unknown (null) by default on the coordinator.")


@router.post("/inspect", responses={**BODY_ERRORS, 429: TOO_BUSY})
def inspect_model_route(body: InspectRequest, settings: SettingsDep, caller: CallerDep,
                        checks: ChecksDep) -> dict[str, Any]:
    """The preflight report: capture path, layers, bytes per token, reasons (plain
    words); the dataset's size estimated from sample rows in a bounded child process;
    429 while too many submits and inspects are being checked (throttle.py)."""
    if body.trust_remote_code and not settings.allow_trust_remote_code:
        raise JobRefused(
            "trust_remote_code: this server does not run models' own code "
            "(its operator can allow it with HSX_ALLOW_TRUST_REMOTE_CODE=1)"
        )
    roots, hub = caller.roots, settings.hub_allowed
    check_model_path("model", body.model, roots, hub_allowed=hub)
    if body.dataset is not None:
        check_dataset_path("dataset", body.dataset, roots, hub_allowed=hub)
    from hsx_workers.preflight import inspect_model

    try:
        with checks.slot(caller.user, "inspect"):
            report = inspect_model(
                body.model, engine=body.engine, layers=body.layers,
                tensor_parallel_size=body.tensor_parallel_size, dataset=body.dataset,
                max_seq_len=body.max_seq_len, trust_remote_code=body.trust_remote_code,
                gpu_memory_bytes=body.gpu_memory_bytes,
            )
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    return report.as_dict()
