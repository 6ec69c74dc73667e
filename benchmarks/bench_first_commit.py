"""Time from submit to the first committed shard on a dataset of a million chats.

A chat dataset made with the generator the tests use (`make_chat_dataset`, one bad row
per thousand), the tiny Llama and its tokenizer, the product's defaults (`engine: vllm`
on vLLM's CPU build, one replica, local Ray, one ingestion process, `unit_tokens`) but
`storage_dtype: fp8` (in bf16 the output estimate refuses the job on a 68 GB disk, as it
should) and `max_seq_len: 1024` (the tiny model has 2,048 positions; the default 4,096
is refused at preflight). Two measurements,
each in a fresh process, on the same dataset:

- `streamed`  `run_job` as `hsx extract` runs it: the engines start once the first part
              of the inputs is published and take units while the rest is tokenized.
              Measured: submit → the first unit's commit record (then the job is
              cancelled: extracting a million chats on a CPU is not the point).
- `whole`     what a job waited for before its first unit when the plan needed the whole
              table: `ingest` of the dataset, start to end (the tokenizer's load
              included). With `--whole-rows N` < the dataset's rows, the first N rows
              are ingested and the time scaled to the dataset's rows (ingestion is
              linear in rows: results/2026-12-03-ingest/ingest.json's memory and rate figures).

- `streamed`, again: the same job on the same machine later, vLLM's compile cache warm.
- `served`    the same job submitted to a running coordinator (`hsx serve`, started and
              ready first, as people run it), with a copy of the model in a folder of its
              own: submit → the job's status shows a committed unit. The
              coordinator has its Ray and the preflight's imports already
              (`prepare.warm_preflight`); its engine starts for this job.

Each engine starts as on a machine that never compiled this model (the first `streamed`
and `served`: compile caches of their own, empty, `_compile_caches`) but the second
`streamed`, which finds the cache of the first.

Ratio: streamed ÷ whole (how much of the old wait is left), and the target: the first
commit within 60 s of submit. Progress samples of the streamed run (rows tokenized,
units planned and committed, as the CLI bar and the API show them) are kept.

The streamed run marks each step of the job (prepared, Ray ready, units planned, the
first engine running, the first tokens captured, the first commit).

Run: `python -m benchmarks.bench_first_commit [--rows N] [--whole-rows N]`
(results in `results/<date>-first-commit/first_commit.json`; not part of `run_all.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

FIRST_COMMIT_TARGET_S = 60.0
# The job of every run but the model, the dataset and the output: the product's defaults
# but these two (the module's docstring says why).
JOB: dict[str, Any] = {"max_seq_len": 1024, "storage_dtype": "fp8"}


def child_streamed(data: str, model: str, out: str) -> dict[str, Any]:
    """One job in this (fresh) process, cancelled after its first commit."""
    from hsx.progress import JobProgress
    from hsx.spec import JobSpec
    from hsx_service.dispatch import DispatchHooks
    from hsx_service.errors import JobCancelled
    from hsx_service.runner import run_job

    # fp8: a million chats' states in bf16 (~200 GB) are refused by the output estimate
    # on this machine's disk; the job is cancelled after its first commit anyway.
    spec = JobSpec(model=model, dataset=data, output=out, **JOB)
    marks: dict[str, float] = {}
    seen: list[dict[str, Any]] = []
    start = time.perf_counter()

    def mark(name: str) -> None:
        marks.setdefault(name, time.perf_counter() - start)

    def on_progress(p: JobProgress) -> None:
        if any(state in ("busy", "idle") for state in p.workers.values()):
            mark("first_engine_running_s")
        if p.tokens_done:
            mark("first_tokens_captured_s")
        seen.append({"t": round(time.perf_counter() - start, 2),
                     "rows_tokenized": p.rows_tokenized, "rows_total": p.rows_total,
                     "ingesting": p.ingesting, "units_total": p.units_total,
                     "units_done": p.units_done})

    def on_planned(_job: Any, units: list[Any], _done: bool) -> None:
        if units:
            mark("first_units_planned_s")

    hooks = DispatchHooks(on_progress=on_progress, on_unit_done=lambda _: mark("first_commit_s"),
                          on_planned=on_planned, on_prepared=lambda _: mark("prepared_s"),
                          on_plan=lambda _: mark("ray_ready_s"),
                          cancelled=lambda: "first_commit_s" in marks)
    with contextlib.suppress(JobCancelled):
        run_job(spec, hooks=hooks)
    marks["job_ended_s"] = time.perf_counter() - start
    last = seen[-1] if seen else {}
    return {**{k: round(v, 2) for k, v in marks.items()},
            "rows_tokenized_at_end": last.get("rows_tokenized"),
            "units_planned_at_end": last.get("units_total"),
            "progress": seen[:: max(1, len(seen) // 40)]}


def child_served(data: str, model: str, out: str) -> dict[str, Any]:
    """`hsx serve` started and ready, then the job submitted to it; cancelled after the
    status shows its first committed unit."""
    import shutil
    import signal
    import socket

    from hsx.client import Client

    scratch = Path(out).parent
    served_model = scratch / "model-served"
    shutil.copytree(model, served_model, dirs_exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    token = "bench-first-commit"
    env = {**os.environ, "HSX_API_TOKEN": token, "HSX_ALLOWED_ROOTS": str(scratch)}
    env.pop("RAY_ADDRESS", None)
    log = open(scratch / "serve.log", "ab")  # noqa: SIM115 - the server writes it until stopped
    started = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "serve", "--port", str(port),
         "--ledger", str(scratch / "ledger.sqlite")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    marks: dict[str, float] = {}
    seen: list[dict[str, Any]] = []
    try:
        with Client(f"http://127.0.0.1:{port}", token) as client:
            while not client.ready():
                if server.poll() is not None:
                    raise RuntimeError(f"hsx serve exited {server.returncode}: "
                                       f"{(scratch / 'serve.log').read_text()[-3000:]}")
                time.sleep(0.2)
            marks["serve_ready_s"] = round(time.perf_counter() - started, 2)
            spec = {"model": str(served_model), "dataset": data, "output": out, **JOB}
            submitted = time.perf_counter()
            job = client.submit(spec, job_id="first-commit")
            marks["submit_answered_s"] = time.perf_counter() - submitted
            while "first_commit_s" not in marks:
                status = client.get(job.id)
                at = time.perf_counter() - submitted
                if status.state.finished:
                    raise RuntimeError(f"the job ended {status.state}: {status.last_error}")
                if status.units_total:
                    marks.setdefault("first_units_planned_s", at)
                if status.tokens_done:
                    marks.setdefault("first_tokens_captured_s", at)
                if status.units_done:
                    marks["first_commit_s"] = at
                seen.append({"t": round(at, 2), "rows_tokenized": status.rows_tokenized,
                             "units_total": status.units_total,
                             "units_done": status.units_done,
                             "waiting_for": status.waiting_for})
                time.sleep(0.2)
            client.cancel(job.id)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # the coordinator and its Ray
        server.wait()
        log.close()
    return {**{k: round(v, 2) for k, v in marks.items()},
            "progress": seen[:: max(1, len(seen) // 40)]}


def child_whole(data: str, model: str, out: str, rows: int) -> dict[str, Any]:
    """`ingest` of the dataset's first `rows` rows, start to end."""
    import itertools

    from hsx.ingest import ingest

    source = data
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if rows:
        source = str(Path(out).parent / "head.jsonl")
        with open(data, "rb") as f, open(source, "wb") as g:
            g.writelines(itertools.islice(f, rows))
    start = time.perf_counter()
    result = ingest(source, model, 1024, out)
    return {"rows": result.num_rows, "seconds": round(time.perf_counter() - start, 2)}


def _compile_caches(folder: Path) -> dict[str, str]:
    """The environment that gives a child's vLLM and inductor compile caches of their own
    in `folder`: empty the first time (a machine's first job of this model), warm when a
    child used them before (a later job)."""
    return {"VLLM_CACHE_ROOT": str(folder / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}


def _child(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", __spec__.name, *args], capture_output=True,
                          text=True, check=False, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{proc.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return record


def run(*, rows: int, whole_rows: int, out: Path, workdir: Path | None,
        note: str | None) -> dict[str, Any]:
    from hsx_workers.tiny_models import make_chat_dataset, make_tiny_model

    machine = common.machine_info()
    scratch = Path(tempfile.mkdtemp(dir=workdir, prefix="hsx-bench-first-commit-"))
    try:
        model = make_tiny_model(scratch / "model", "llama")
        data = scratch / "chat.jsonl"
        started = time.perf_counter()
        make_chat_dataset(data, n=rows - rows // 1000, seed=0, bad_rows=rows // 1000)
        print(f"dataset of {rows:,} rows: {data.stat().st_size / 2**20:,.0f} MiB "
              f"({time.perf_counter() - started:.0f} s to make)", flush=True)

        caches = _compile_caches(scratch / "compile-streamed")
        streamed = _child(["--streamed", str(data), str(model), str(scratch / "streamed")],
                          caches)
        print(f"streamed: first commit {streamed['first_commit_s']} s after submit",
              flush=True)
        subprocess.run(["rm", "-rf", str(scratch / "streamed")], check=False)
        # The same job again on the same machine: vLLM's compile cache is warm.
        warm = _child(["--streamed", str(data), str(model), str(scratch / "streamed")],
                      caches)
        print(f"streamed, warm compile cache: first commit {warm['first_commit_s']} s "
              "after submit", flush=True)
        subprocess.run(["rm", "-rf", str(scratch / "streamed")], check=False)
        served = _child(["--served", str(data), str(model), str(scratch / "served")],
                        _compile_caches(scratch / "compile-served"))
        print(f"served: first commit {served['first_commit_s']} s after the submit to a "
              f"ready coordinator", flush=True)
        part = min(whole_rows or rows, rows)
        whole = _child(["--whole", str(data), str(model), str(scratch / "whole" / "out"),
                        str(part if part < rows else 0)], {})
        whole_s = whole["seconds"] * rows / whole["rows"]
        print(f"whole ingestion: {whole['seconds']} s for {whole['rows']:,} rows "
              f"(scaled to {rows:,}: {whole_s:,.0f} s)", flush=True)
        first = streamed["first_commit_s"]
        section = {
            "date": common.now_iso(),
            "note": note,
            "rows": rows,
            "cpu_affinity": len(os.sched_getaffinity(0)),
            "streamed": streamed,
            "streamed_warm_compile_cache": warm,
            "served": served,
            "whole": {**whole, "scaled_to_rows": rows, "scaled_seconds": round(whole_s, 1),
                      "scaled": whole["rows"] < rows},
            "first_commit_s": first,
            "first_commit_over_whole_ingestion": common.ratio(first, whole_s),
            "target_s": FIRST_COMMIT_TARGET_S,
            "verdict": "PASS" if first <= FIRST_COMMIT_TARGET_S else "MISS",
        }
        common.save_section(out, "first_commit", section,
                            {**machine, "load_end": os.getloadavg()})
        print(common.table(
            ["", "seconds"],
            [["submit → first committed shard (streamed, as `hsx extract`)", first],
             ["the same, vLLM's compile cache warm (a later job)", warm["first_commit_s"]],
             ["submit to a ready `hsx serve` → first committed shard",
              served["first_commit_s"]],
             ["ingestion of the whole dataset (the old wait)", round(whole_s, 1)],
             ["ratio", section["first_commit_over_whole_ingestion"]]]))
        return section
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--streamed":
        print(json.dumps(child_streamed(*argv[1:4])))
        return 0
    if argv and argv[0] == "--served":
        print(json.dumps(child_served(*argv[1:4])))
        return 0
    if argv and argv[0] == "--whole":
        print(json.dumps(child_whole(argv[1], argv[2], argv[3], int(argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the dataset")
    p.add_argument("--whole-rows", type=int, default=0,
                   help="rows the whole-ingestion baseline reads (default: all)")
    p.add_argument("--out", type=Path,
                   default=common.campaign_path("first-commit", "first_commit.json"))
    p.add_argument("--workdir", type=Path, help="parent of the scratch dir (default $TMPDIR)")
    p.add_argument("--note", help="free text stored with the results")
    args = p.parse_args(argv)
    run(rows=args.rows, whole_rows=args.whole_rows, out=args.out, workdir=args.workdir,
        note=args.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
