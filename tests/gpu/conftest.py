"""GPU tests: real vLLM (GPU build) on the machine's GPUs, real Ray, real files.

Every test here is marked `gpu` and skipped where torch sees no CUDA device (CI, the
CPU development machine); `@pytest.mark.gpus(2)` asks for two. They run on the lent
H200 machines through the recipe in benchmarks/gpu/README.md. Measured numbers go to
`$HSX_GPU_RESULTS` (default: a temporary folder) as JSON, one file per test, so a run's
results can be committed as a campaign folder, benchmarks/results/YYYY-MM-DD-<what>/.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = _gpu_count()
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.gpu)
        wanted = item.get_closest_marker("gpus")
        need = int(wanted.args[0]) if wanted is not None else 1
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA device(s), this machine has {have}"))


@pytest.fixture(scope="session")
def gpu_results() -> Path:
    """Where tests write what they measured."""
    path = Path(os.environ.get("HSX_GPU_RESULTS") or "/tmp/hsx-gpu-results")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def record(gpu_results: Path) -> Any:
    """record(name, **numbers): one JSON file of results per name."""

    def write(name: str, **values: Any) -> None:
        (gpu_results / f"{name}.json").write_text(json.dumps(values, indent=1, default=str))

    return write


@pytest.fixture(scope="session")
def ray_gpus() -> Iterator[None]:
    import ray

    from hsx_service.engine_pool import ensure_ray

    ensure_ray(None, cpus_needed=4)
    yield
    ray.shutdown()
