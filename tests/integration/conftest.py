"""Integration fixtures: one local Ray and one pool of warm engines for the whole session.

Each vLLM CPU engine costs ~20-40 s to start, so jobs with the same engine config share
the pool's actors (the pool is the same one `hsx extract` uses, kept across jobs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.spec import JobSpec
from hsx_workers.tiny_models import ChatDataset

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

LAYERS = [1, 2, 3, 4]  # every id of the 4-layer tiny model but the embeddings, N included


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    import ray

    from hsx_service.runner import ensure_ray

    ensure_ray(None, cpus_needed=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def engine_pool(ray_local: None) -> Iterator[Any]:
    from hsx_service.runner import EnginePool

    pool = EnginePool()
    yield pool
    pool.shutdown()


@pytest.fixture(scope="session")
def make_job(tiny_llama: Path, chat_dataset: ChatDataset) -> Any:
    def make(output: Path, **overrides: Any) -> JobSpec:
        fields: dict[str, Any] = {
            "model": str(tiny_llama),
            "dataset": str(chat_dataset.path),
            "output": str(output),
            "layers": LAYERS,
            "max_seq_len": 256,
            "unit_tokens": 4096,
            **overrides,
        }
        return JobSpec(**fields)

    return make
