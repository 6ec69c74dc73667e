"""A dataset's slices tokenized as Ray tasks (hsx_service.ingest_tasks) on the session's
local Ray: the tables are byte for byte those of one process, bad rows included; a local
dataset's tasks are pinned to this node and a bucket's may run anywhere; a slice that
fails raises its own error; the tasks tokenize on one core at the lowest priority."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.ingest import DatasetFormatError, ingest
from hsx.ingest import pipeline as pipeline_module
from hsx.output import Output, Storage
from hsx.spec import DatasetSpec
from hsx_service.ingest_tasks import RayTasks, tokenizing_cpus, tokenizing_tasks
from hsx_workers.tiny_models import ChatDataset, make_chat_dataset, write_rows
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.integration

PER: dict[str, Any] = {"rows_per_part": 64}  # 6 parts, cut inside batches and between bad rows


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory: pytest.TempPathFactory) -> ChatDataset:
    """Every row format and every kind of bad row, 400 rows."""
    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    return make_chat_dataset(path, n=380, seed=3, bad_rows=20, formats="mixed")


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 400 rows in ~25 slices of JSON lines (cut in the driver)."""
    monkeypatch.setattr(pipeline_module, "PARALLEL_SLICE_BYTES", 4096)


@pytest.fixture
def tasks(ray_local: None) -> Iterator[list[RayTasks]]:
    """The executors a test makes, shut down after it."""
    made: list[RayTasks] = []
    yield made
    for executor in made:
        executor.shutdown(cancel_futures=True)


def _tables(out: Path) -> list[tuple[str, bytes]]:
    return [(str(p.relative_to(out)), p.read_bytes())
            for p in sorted([*out.glob("inputs/*.arrow"), *out.glob("errors/*.arrow")])]


def _same_result(a: Any, b: Any) -> bool:
    paths = {"inputs_path": "", "errors_path": ""}
    return bool(a.to_dict() | paths == b.to_dict() | paths)


def test_ray_tasks_write_the_bytes_of_one_process(
        tiny_tokenizer: Path, mixed_dataset: ChatDataset, tmp_path: Path,
        small_slices: None, tasks: list[RayTasks]) -> None:
    import ray

    data = str(mixed_dataset.path)
    one = ingest(data, str(tiny_tokenizer), 128, tmp_path / "one", **PER)
    here = ray.get_runtime_context().get_node_id()
    # A local file: its tasks run where it is, as many at once as this node's cores
    # (the session's Ray counts more CPUs than the machine has), less one per GPU that
    # Ray sees there (an earlier test of this process may have connected a cluster that
    # declares GPUs); fewer than 2: the local path.
    cpus = tokenizing_cpus(here)
    assert cpus <= len(os.sched_getaffinity(0))
    default = tokenizing_tasks(DatasetSpec(path=data), None)
    if cpus < 2:
        assert default is None
    else:
        assert default is not None and default.max_workers == cpus
        tasks.append(default)
    executor = default or tokenizing_tasks(DatasetSpec(path=data), 2)
    assert executor is not None
    tasks.append(executor)
    assert executor.node == here
    ray_result = ingest(data, str(tiny_tokenizer), 128, tmp_path / "ray",
                        workers=executor.max_workers, executor=executor, batch_rows=50, **PER)
    assert _tables(tmp_path / "ray") == _tables(tmp_path / "one")
    assert _same_result(ray_result, one)
    assert one.num_rows == 400 and one.num_errors == 20
    assert len(Output(tmp_path / "ray").part_records()) == 6

    # The tasks' processes never load the tokenizer: each hands its slices to a child of
    # its own (hsx.ingest.bounded), which tokenizes on one core, behind the engines (Ray
    # starts those at nice 15).
    def probe() -> tuple[bool, int | None]:
        import psutil

        from hsx.ingest import bounded, slices

        child = getattr(bounded._THREAD, "child", None)
        pid = None if child is None or child._child is None else child._child.pid
        alive = pid is not None and psutil.pid_exists(pid)
        return (bool(slices._WORKER_TOKENIZER),
                psutil.Process(pid).nice() if alive else None)

    seen = {f.result() for f in [executor.submit(probe) for _ in range(8)]}
    assert seen and all(not loaded for loaded, _ in seen), seen
    assert {nice for _, nice in seen if nice is not None} == {19}, seen


def test_one_at_a_time_or_no_ray_is_the_local_path(ray_local: None, tmp_path: Path) -> None:
    spec = DatasetSpec(path=str(tmp_path / "d.jsonl"))
    import ray

    assert tokenizing_tasks(spec, 1) is None  # HSX_INGEST_WORKERS=1: in the driver
    explicit = tokenizing_tasks(spec, 3)
    assert explicit is not None and explicit.max_workers == 3
    explicit.shutdown()
    # Beside a streamed job's engines on a cluster without GPUs (vLLM's CPU build, on
    # every core): one task at a time, unless HSX_INGEST_WORKERS says how many.
    # (An earlier test of this process may have connected a cluster that declares GPUs.)
    if not ray.cluster_resources().get("GPU"):
        behind = tokenizing_tasks(spec, None, beside_engines=True)
        assert behind is not None and behind.max_workers == 1
        behind.shutdown()
    asked = tokenizing_tasks(spec, 3, beside_engines=True)
    assert asked is not None and asked.max_workers == 3
    asked.shutdown()


def test_a_slice_that_fails_raises_its_own_error(tiny_tokenizer: Path, tmp_path: Path,
                                                 tasks: list[RayTasks]) -> None:
    import ray

    folder = tmp_path / "parts"
    folder.mkdir()
    write_rows([{"text": f"row {i}"} for i in range(20)], folder / "a.parquet", "parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    executor = RayTasks(2, node=ray.get_runtime_context().get_node_id())
    tasks.append(executor)
    with pytest.raises(DatasetFormatError, match=r"b\.parquet") as raised:
        ingest(str(folder), str(tiny_tokenizer), 128, tmp_path / "out", executor=executor)
    assert "Traceback" not in str(raised.value)  # the remote one is its __cause__
    assert Output(tmp_path / "out").part_numbers() == []


@pytest.mark.s3
def test_a_bucket_dataset_is_tokenized_anywhere(
        tiny_tokenizer: Path, mixed_dataset: ChatDataset, tmp_path: Path, s3_uri: str,
        s3_server: SeaweedS3, small_slices: None, tasks: list[RayTasks],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The slices carry the credentials resolved in the driver: the tasks' processes,
    started without them, read the bucket."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    Storage.for_uri(s3_uri).put("mixed.jsonl", mixed_dataset.path.read_bytes())
    data = f"{s3_uri}/mixed.jsonl"
    executor = tokenizing_tasks(DatasetSpec(path=data), 2)
    assert executor is not None and executor.node is None
    tasks.append(executor)
    ingest(str(mixed_dataset.path), str(tiny_tokenizer), 128, tmp_path / "one", **PER)
    from_bucket = ingest(data, str(tiny_tokenizer), 128, tmp_path / "ray",
                         workers=executor.max_workers, executor=executor, **PER)
    assert _tables(tmp_path / "ray") == _tables(tmp_path / "one")
    assert from_bucket.num_rows == 400 and from_bucket.num_errors == 20
