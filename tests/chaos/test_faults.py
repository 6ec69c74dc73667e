"""The fault matrix: real Ray, real vLLM CPU engines, faults injected, then the audit.

- SIGKILL at each named step of the commit protocol (`HSX_FAULT_POINT`): the job's
  worker dies there; a rerun completes and the output passes the audit.
- Corruption: a byte flipped in a committed shard is named (shard and sample) by the
  reader and by `hsx verify`; `--repair` and a rerun re-extract exactly that unit.
- Disk full: the output on a small tmpfs; the job fails naming ENOSPC with nothing
  partial visible, and completes once space is freed.

Every case uses one small dataset of 16 rows (2 bad) planned as 2 units, so a killed
worker holds both units at once and each killed run costs one engine start. Reruns use
the session's warm engine pool. Each case prints its figures (`pytest -s`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output, ShardCorrupt
from hsx.output import faults as fault_points
from hsx.output.layout import COMMITS_DIR, SHARDS_DIR, TMP_DIR, inputs_part_path
from hsx.plan import first_unit_tokens, plan_units
from hsx_workers.tiny_models import ChatDataset, make_chat_dataset
from tests.unit.outputs import flip_sample_byte

from .audit import audit, units_named

pytestmark = pytest.mark.integration

UNIT_TOKENS = 1200  # 16 rows of seed 3: two units of ~1.1k tokens (~2.2 MB shards)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> ChatDataset:
    return make_chat_dataset(tmp_path_factory.mktemp("chaos") / "chat.jsonl", n=16, seed=3,
                             bad_rows=2)


@pytest.fixture
def job(make_job: Any, small_dataset: ChatDataset, tmp_path: Path) -> Any:
    def make(output: Path | None = None) -> Any:
        return make_job(output or tmp_path / "out", dataset=str(small_dataset.path),
                        unit_tokens=UNIT_TOKENS)
    return make


def report(case: str, figures: dict[str, Any]) -> None:
    print(f"\nchaos {case}: {json.dumps(figures)}")


@pytest.mark.parametrize("point", fault_points.COMMIT_POINTS)
def test_sigkill_at_a_commit_step_then_a_rerun_completes(
    point: str, job: Any, engine_pool: Any, small_dataset: ChatDataset, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hsx_service.engine_pool import EnginePool
    from hsx_service.errors import JobFailed
    from hsx_service.runner import run_job

    spec = job()
    output = Path(spec.output)
    # The pool hands the variable to the actors it starts: the worker dies at `point`
    # of its first unit, holding both units; with one attempt each, the job fails.
    monkeypatch.setenv(fault_points.ENV, point)
    killed_pool = EnginePool()
    try:
        with pytest.raises(JobFailed) as failed:
            run_job(spec, pool=killed_pool, max_attempts=1)
    finally:
        killed_pool.shutdown()
        monkeypatch.delenv(fault_points.ENV)
    out = Output(output)
    assert len(out.manifest().units) == 2
    committed = out.committed_units()
    given_up = units_named(str(failed.value))
    # The job's error list is true: a unit it gave up has no commit, and one that
    # committed before its worker died is not listed as given up.
    assert given_up and not committed.intersection(given_up), (failed.value, committed)
    assert committed.union(given_up) == {0, 1}
    # The worker holds both units: whichever reaches its commit record first is kept.
    assert len(committed) == (1 if point == "after_commit_record" else 0), committed
    # What a crash there leaves: nothing a reader sees but whole, committed shards.
    shards = {p.name for p in (output / SHARDS_DIR).glob("*")}
    staged = list((output / TMP_DIR).glob("shards--*"))
    if point in ("after_shard_write", "after_fsync"):
        assert staged and not shards  # the staging file only
    elif point == "after_publish":
        assert len(shards) == 1 and not list((output / COMMITS_DIR).glob("*.json"))
    assert out.check_shards() == []
    assert len(HiddenStatesDataset(output)) == sum(r.samples for r in out.commits())

    done: list[int] = []
    from hsx_service.dispatch import DispatchHooks

    summary = run_job(spec, pool=engine_pool,
                      hooks=DispatchHooks(on_unit_done=lambda r: done.append(r.unit)))
    assert sorted(done) == sorted({0, 1} - committed)  # only what was not committed
    assert summary.restarts == 0
    report(f"sigkill {point}", {"faults": 1, **audit(output, small_dataset)})


def test_a_corrupt_shard_is_named_verified_repaired_and_extracted_again(
    job: Any, engine_pool: Any, small_dataset: ChatDataset, capsys: pytest.CaptureFixture[str],
) -> None:
    from hsx.cli import main
    from hsx_service.dispatch import DispatchHooks
    from hsx_service.runner import run_job

    spec = job()
    output = Path(spec.output)
    run_job(spec, pool=engine_pool)
    audit(output, small_dataset)
    out = Output(output)
    record = out.read_commit(1)
    index = flip_sample_byte(output / record.shard, 1)

    ds = HiddenStatesDataset(output, backend="numpy")
    position = ds._index.starts[1] + 1  # unit 1's second sample
    with pytest.raises(ShardCorrupt, match=rf"{Path(record.shard).name} \(unit 1\): sample 1 "
                                           rf"\(sample_index {index}\)"):
        ds[position]

    capsys.readouterr()
    assert main(["verify", str(output)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unit 1\t"), lines
    assert Path(record.shard).name in lines[0] and f"sample_index {index}" in lines[0]
    assert main(["verify", str(output), "--repair", "--json"]) == 1
    assert json.loads(capsys.readouterr().out.strip())["withdrawn"] == [1]

    done: list[int] = []
    run_job(spec, pool=engine_pool, hooks=DispatchHooks(on_unit_done=lambda r: done.append(r.unit)))
    assert done == [1]  # exactly the withdrawn unit
    assert main(["verify", str(output)]) == 0
    report("corruption", {"faults": 1, "bad_shards_listed": len(lines), "re_extracted": done,
                          **audit(output, small_dataset)})


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {detail.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_fails_the_job_naming_enospc_and_a_rerun_completes(
    job: Any, engine_pool: Any, small_dataset: ChatDataset, tmp_path: Path,
) -> None:
    from hsx_service.dispatch import DispatchHooks
    from hsx_service.errors import JobFailed
    from hsx_service.runner import run_job

    with small_tmpfs(tmp_path / "disk", "8m") as disk:
        filler = disk / "filler"

        def fill(_job: Any) -> None:
            # Once the job is prepared (its preflight saw room for it), something else
            # fills the disk: room is left for no shard (~2.2 MB each).
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            filler.write_bytes(b"\0" * (free - 256 * 1024))

        spec = job(disk / "out")
        output = Path(spec.output)
        with pytest.raises(JobFailed) as failed:
            run_job(spec, pool=engine_pool, hooks=DispatchHooks(on_prepared=fill))
        message = str(failed.value)
        assert "no space left on device (ENOSPC)" in message and str(output) in message
        assert "Traceback" not in message and len(message.splitlines()) == 1
        out = Output(output)
        assert out.committed_units() == set() and not out.is_complete()
        assert not list((output / SHARDS_DIR).glob("*"))  # no partial shard visible
        assert not (output / TMP_DIR).exists() or not any((output / TMP_DIR).iterdir())

        filler.unlink()
        summary = run_job(spec, pool=engine_pool)
        assert summary.shards == 2
        figures = audit(output, small_dataset)
        shutil.rmtree(output)  # before the tmpfs goes
    report("disk full", {"faults": 1, "message": message, **figures})


_KILLED_DURING_INGESTION = """
import json, multiprocessing, os, signal, sys
import hsx.ingest.pipeline as pipeline
from hsx.spec import JobSpec
from hsx_service.dispatch import DispatchHooks
from hsx_service.runner import run_job

pipeline.PARALLEL_SLICE_BYTES = 512  # the small dataset in several slices
pipeline.ROWS_PER_PART = 4  # and in parts of 4 samples
spec = JobSpec.model_validate_json(sys.argv[1])

def killed(progress):
    # A part is published, other slices are in the pool's processes: the driver dies.
    if not os.path.exists(os.path.join(spec.output, "inputs", "part-00000.json")):
        return
    children = [p.pid for p in multiprocessing.active_children()]
    with open(sys.argv[2], "w") as f:
        json.dump({"children": children, "rows": progress.rows}, f)
    os.kill(os.getpid(), signal.SIGKILL)

run_job(spec, hooks=DispatchHooks(on_ingest=killed))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing" in f.read()  # not a new process on a reused pid
    except FileNotFoundError:
        return False


def test_a_driver_killed_during_ingestion_keeps_its_parts_and_a_rerun_completes(
    job: Any, engine_pool: Any, small_dataset: ChatDataset, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL of the driver (`hsx extract`, a coordinator) while 2 processes tokenize,
    after it published a part of the inputs: its pool's processes exit too, no manifest
    is published and no half part is visible, and a rerun goes on after the published
    parts (not tokenized again: their files are the same files), plans the same units
    and completes with every row once (in a shard or in the errors table)."""
    import sys
    import time

    from hsx.ingest import pipeline
    from hsx_service.runner import run_job

    spec = job()
    output = Path(spec.output)
    seen = tmp_path / "killed.json"
    env = {**os.environ, "HSX_INGEST_WORKERS": "2"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_DURING_INGESTION,
                           spec.model_dump_json(), str(seen)], env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    killed = json.loads(seen.read_text())
    assert len(killed["children"]) >= 2 and 0 < killed["rows"] < small_dataset.num_rows
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in killed["children"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in killed["children"]), "the pool outlived its driver"
    out = Output(output)
    kept = {p: os.stat(output / inputs_part_path(p)).st_ino for p in out.part_numbers()}
    assert not out.has_manifest() and kept and not out.part_records()[-1].last

    monkeypatch.setenv("HSX_INGEST_WORKERS", "2")
    monkeypatch.setattr(pipeline, "PARALLEL_SLICE_BYTES", 512)
    summary = run_job(spec, pool=engine_pool)
    assert summary.shards == 2
    assert {p: os.stat(output / inputs_part_path(p)).st_ino for p in kept} == kept
    figures = audit(output, small_dataset)
    errors = Output(output).ingest_errors()["sample_index"].to_pylist()
    assert errors == sorted(small_dataset.bad)
    report("killed during ingestion", {"faults": 1, "rows_before_kill": killed["rows"],
                                       "parts_kept": len(kept),
                                       **figures})


_KILLED_AFTER_A_COMMIT_DURING_INGESTION = """
import os, signal, sys, threading
import hsx.ingest.pipeline as pipeline
import hsx.plan
from hsx.output import Output
from hsx.spec import JobSpec
from hsx_service.dispatch import DispatchHooks
from hsx_service.runner import run_job

pipeline.ROWS_PER_PART = 4  # the small dataset in parts of 4 samples
hsx.plan.FIRST_UNIT_TOKENS = 100  # units of 100, 200, then 300 tokens (the rerun: none)
spec = JobSpec.model_validate_json(sys.argv[1])
committed = threading.Event()
publish = Output.publish_part

def publish_then_hold(self, record):
    publish(self, record)
    if record.part == 1:  # the rest of the dataset waits for a unit to commit
        committed.wait(600)

Output.publish_part = publish_then_hold

def killed(report):
    os.kill(os.getpid(), signal.SIGKILL)  # a unit committed, ingestion midway: die

run_job(spec, hooks=DispatchHooks(on_unit_done=killed))
"""


def test_a_driver_killed_after_a_commit_during_ingestion_resumes_without_gap_or_double(
    make_job: Any, engine_pool: Any, small_dataset: ChatDataset, tmp_path: Path,
) -> None:
    """The streaming plan's own case: units run while the dataset is tokenized, and the
    driver is SIGKILLed once one has committed, with 2 of its parts published and the
    rest not. The rerun goes on after those parts, plans the same units (so the
    committed one is recognised and not extracted again) and completes with every row
    once, in a shard or in the errors table. The killed driver's plan ramped up from
    100 tokens; the rerun's own rule would not (as a newer driver's may differ from an
    older one's): it plans by the rule ingest.json recorded."""
    import signal
    import sys

    from hsx_service.runner import run_job

    spec = make_job(tmp_path / "out", dataset=str(small_dataset.path), unit_tokens=300)
    output = Path(spec.output)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_AFTER_A_COMMIT_DURING_INGESTION,
                             spec.model_dump_json()], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its Ray and engine processes
    assert proc.returncode == -9, stderr[-2000:]
    out = Output(output)
    records = {r.unit: r.shard for r in out.commits()}
    parts = out.part_records()
    assert not out.has_manifest() and records
    assert len(parts) == 2 and not parts[-1].last  # the rest was never tokenized

    record = out.read_ingest_record()
    assert record is not None and record.first_unit_tokens == 100
    assert first_unit_tokens(spec.unit_tokens) == 0  # this driver would not ramp

    summary = run_job(spec, pool=engine_pool)
    assert {r.unit: r.shard for r in Output(output).commits() if r.unit in records} == records
    assert summary.shards == len(Output(output).manifest().units) > len(records)
    lengths = Output(output).inputs().column("length").to_pylist()
    assert Output(output).manifest().work_units == plan_units(lengths, 300, 100)
    figures = audit(output, small_dataset)
    report("killed after a commit during ingestion",
           {"faults": 1, "parts_before_kill": len(parts), "units_committed_before_kill":
            len(records), **figures})
