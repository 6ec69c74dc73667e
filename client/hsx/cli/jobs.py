"""`hsx serve`'s clients: `submit`, `status`, `watch`, `ls`, `cancel`, `errors`.

They go through `hsx.Client`; `--url` / `--token` (or HSX_URL / HSX_API_TOKEN) say which
server, before or after the command. API errors become a message and an exit code
(`remote`), which `hsx train JOB` uses too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx.cli.report import EXIT_FAILED, EXIT_REFUSED, already_complete, error, result_console
from hsx.progress import JobProgress, console

if TYPE_CHECKING:
    from hsx.client import Client
    from hsx.wire import JobStatus


class _ServerProgress(JobProgress):
    """A JobProgress whose rate and ETA are the server's, not recomputed here."""

    def __init__(self, status: JobStatus) -> None:
        super().__init__(
            samples_total=status.samples_total,
            tokens_total=status.tokens_total,
            samples_done=status.samples_done,
            tokens_done=status.tokens_done,
            samples_failed=status.samples_failed,
            shards=status.shards,
            bytes=status.bytes,
            units_total=status.units_total,
            units_done=status.units_done,
            workers={w.name: w.state for w in status.workers},
            restarts=status.restarts,
            started_at=status.started_at or status.created_at,
            samples_generated=status.samples_generated,
            tokens_generated=status.tokens_generated,
            waiting_for=status.waiting_for,
            rows_tokenized=status.rows_tokenized,
            rows_total=status.rows_total,
            ingesting=status.ingesting,
        )
        self._rate = status.tokens_per_s
        self._eta = status.eta_s

    def tokens_per_s(self) -> float:
        return self._rate

    def eta_s(self) -> float | None:
        return self._eta


def job_progress(status: JobStatus) -> JobProgress:
    """What the terminal progress bar shows, from a job's status on the server."""
    return _ServerProgress(status)


def client_for(args: argparse.Namespace) -> Client:
    from hsx.client import Client

    return Client(args.url, args.token)


def remote(command: Any) -> Any:
    """Run a command against the server; API errors become a message and an exit code."""

    def run(args: argparse.Namespace) -> int:
        from hsx.client import ApiError, JobRefusedError
        from hsx.spec import SpecError

        try:
            code: int = command(args)
            return code
        except (JobRefusedError, SpecError) as err:
            return error(str(err), EXIT_REFUSED)
        except ApiError as err:
            return error(str(err), EXIT_FAILED)
        except KeyboardInterrupt:
            return error("interrupted", 130)

    return run


def follow(client: Client, job_id: str, title: str) -> int:
    """Show a live progress bar until the job ends; exit 0 only if it succeeded."""
    from hsx.progress import ProgressBar

    try:
        with ProgressBar(title) as bar:
            final = client.wait(job_id, on_update=lambda status: bar.update(job_progress(status)))
    except KeyboardInterrupt:
        return error(f"stopped watching; job {job_id} goes on (`hsx cancel {job_id}` stops it)",
                      130)
    return _report_final(final)


def _report_final(job: JobStatus) -> int:
    if job.already_complete:
        console().print(f"[green]done[/]: job {job.id}: {already_complete(job.samples_done)} "
                        f"-> {job.output}")
        return 0
    if job.state.value == "succeeded":
        console().print(
            f"[green]done[/]: job {job.id}: {job.samples_done:,} samples, "
            f"{job.tokens_done:,} tokens, {job.shards} shards, {job.bytes / 2**20:,.1f} MiB, "
            f"{job.samples_failed} bad rows -> {job.output}"
        )
        return 0
    reason = f": {job.last_error}" if job.last_error else ""
    return error(f"job {job.id} {job.state.value}{reason}", EXIT_FAILED)


def _cmd_submit(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.submit(Path(args.job), job_id=args.id)
        sys.stdout.write(f"{job.id}\n")
        sys.stdout.flush()
        if not args.wait:
            return 0
        return follow(client, job.id, job.name or job.id)


def _cmd_status(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.get(args.job)
    if args.json:
        sys.stdout.write(job.model_dump_json(indent=2) + "\n")
        return 0
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    rows: list[tuple[str, str]] = [
        ("job", f"{job.id}" + (f" ({job.name})" if job.name else "")),
        ("state", job.state.value + (f" ({already_complete(job.samples_done)})"
                                     if job.already_complete else "")),
        ("samples", f"{job.samples_done:,} / {job.samples_total:,} ({job.samples_failed:,} bad)"),
        ("tokens", f"{job.tokens_done:,} / {job.tokens_total:,}"),
        ("rate", f"{job.tokens_per_s:,.0f} tok/s, ETA {_duration(job.eta_s)}"),
        ("units", f"{job.units_done} / {job.units_total} ({job.units_failed} failed)"),
        *([("regenerated", f"{job.samples_generated:,} samples, "
                           f"{job.tokens_generated:,} tokens")]
          if job.spec is not None and job.spec.regenerate is not None else []),
        ("shards", f"{job.shards} ({job.bytes / 2**20:,.1f} MiB)"),
        ("workers", ", ".join(f"{w.name}: {w.state}" for w in job.workers) or "-"),
        ("restarts", str(job.restarts)),
        ("created", _when(job.created_at)),
        ("started", _when(job.started_at)),
        ("finished", _when(job.finished_at)),
        ("output", job.output),
    ]
    if job.plan is not None:
        rows.append(("plan", job.plan.summary))
    for node in job.nodes:  # where it runs now: engines, trainer workers, bytes in flight
        parts = [*node.engines, *(f"trainer worker {r}" for r in node.trainer_workers)]
        if node.bytes_in_flight:
            parts.append(f"{node.bytes_in_flight / 2**20:,.1f} MiB in flight")
        rows.append((f"node {node.node[:8]}", ", ".join(parts) or "-"))
    if job.waiting_for:
        rows.append(("waiting", job.waiting_for))
    if job.last_error:
        rows.append(("last error", job.last_error))
    for key, value in rows:
        table.add_row(key, value)
    result_console().print(table)
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        return follow(client, args.job, args.job)


def _cmd_ls(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        jobs = client.list(args.state)
    if args.json:
        sys.stdout.write(json.dumps([j.model_dump(mode="json") for j in jobs]) + "\n")
        return 0
    from rich.table import Table

    table = Table()
    # Ids and states are what people copy and grep: never wrapped; the output path folds.
    table.add_column("job", no_wrap=True)
    table.add_column("name")
    table.add_column("state", no_wrap=True)
    for name in ("samples", "bad", "tok/s"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("ETA", no_wrap=True)
    table.add_column("created", no_wrap=True)
    table.add_column("output", overflow="fold")
    for job in jobs:
        table.add_row(
            job.id, job.name or "", job.state.value, f"{job.samples_done:,}/{job.samples_total:,}",
            f"{job.samples_failed:,}", f"{job.tokens_per_s:,.0f}", _duration(job.eta_s),
            _when(job.created_at, "%m-%d %H:%M"), job.output,
        )
    result_console().print(table)
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.cancel(args.job)
    if job.state.value == "cancelled":
        console().print(f"job {job.id}: cancelled")
    elif job.state.finished:
        console().print(f"job {job.id} had already {job.state.value}; nothing to cancel")
    else:
        # Running units end cleanly first; `hsx watch` shows when it has stopped.
        console().print(f"job {job.id}: cancel requested (now {job.state.value})")
    return 0


def _cmd_errors(args: argparse.Namespace) -> int:
    from itertools import islice

    with client_for(args) as client:
        total = client.errors(args.job, limit=1).total
        records = list(islice(client.iter_errors(args.job), args.limit))
    if args.json:
        sys.stdout.write(json.dumps([r.model_dump(mode="json") for r in records]) + "\n")
        return 0
    from rich.table import Table

    table = Table()
    table.add_column("sample", justify="right")
    table.add_column("reason")
    for record in records:
        table.add_row(str(record.sample_index), record.reason)
    result_console().print(table)
    console().print(f"{len(records)} of {total} error records of job {args.job}")
    return 0


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _when(timestamp: float | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    import time

    return "-" if timestamp is None else time.strftime(fmt, time.localtime(timestamp))


def add_parsers(sub: Any) -> None:
    # --url/--token work before or after the command (`hsx --url U ls`, `hsx ls --url U`);
    # SUPPRESS keeps a subcommand from overwriting the top-level value with its default.
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--url", default=argparse.SUPPRESS,
                        help="coordinator URL (env HSX_URL; default http://127.0.0.1:8642)")
    server.add_argument("--token", default=argparse.SUPPRESS,
                        help="API token (env HSX_API_TOKEN)")
    from hsx.wire import JobState

    p = sub.add_parser("submit", parents=[server], help="submit a job file to the coordinator")
    p.add_argument("job", help="job file (YAML or JSON)")
    p.add_argument("--id", help="job id to use (submitting the same job again is a no-op)")
    p.add_argument("--wait", action="store_true", help="show progress until the job ends")
    p.set_defaults(func=remote(_cmd_submit))

    p = sub.add_parser("status", parents=[server], help="one job's state and numbers")
    p.add_argument("job", help="job id")
    p.add_argument("--json", action="store_true", help="the JobStatus as JSON on stdout")
    p.set_defaults(func=remote(_cmd_status))

    p = sub.add_parser("watch", parents=[server], help="live progress bar until the job ends")
    p.add_argument("job", help="job id")
    p.set_defaults(func=remote(_cmd_watch))

    p = sub.add_parser("ls", parents=[server], help="list jobs")
    p.add_argument("--state", choices=[s.value for s in JobState], help="only jobs in this state")
    p.add_argument("--json", action="store_true", help="the jobs as JSON on stdout")
    p.set_defaults(func=remote(_cmd_ls))

    p = sub.add_parser("cancel", parents=[server], help="cancel a job")
    p.add_argument("job", help="job id")
    p.set_defaults(func=remote(_cmd_cancel))

    p = sub.add_parser("errors", parents=[server], help="a job's skipped rows and why")
    p.add_argument("job", help="job id")
    p.add_argument("--limit", type=int, default=100, help="most records to show (default 100)")
    p.add_argument("--json", action="store_true", help="the records as JSON on stdout")
    p.set_defaults(func=remote(_cmd_errors))
