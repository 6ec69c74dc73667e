"""The `hsx` command.

This module is the composition root: server-side commands (`extract`, `demo`, the
fixture makers) import the service and the workers inside their functions; nothing
else in `hsx` does, so `import hsx` stays light.

The commands that talk to a running coordinator (`submit`, `status`, `watch`, `ls`,
`cancel`, `errors`) go through `hsx.Client`; `--url` / `--token` (or HSX_URL /
HSX_API_TOKEN) say which server. Their results (a job id, a table, JSON) go to stdout so
they can be piped; progress and messages go to stderr.

Exit codes: 0 done, 1 the job failed while running (or was cancelled; or the server
answered with another error; or `hsx verify` found bad shards), 2 the job was refused
(bad job file, bad model or layers, unwritable output, a path outside the server's
allowed roots) before anything started.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx import __version__
from hsx.progress import JobProgress, console

if TYPE_CHECKING:
    from hsx.client import Client
    from hsx.wire import JobStatus

EXIT_FAILED = 1
EXIT_REFUSED = 2


def _error(message: str, code: int) -> int:
    console().print(f"[bold red]hsx: error:[/] {message}")
    return code


def _cmd_extract(args: argparse.Namespace) -> int:
    from hsx.spec import SpecError, load_job

    try:
        spec = load_job(args.job)
    except SpecError as err:
        return _error(str(err), EXIT_REFUSED)
    overrides: dict[str, Any] = {}
    if args.replicas is not None:
        overrides["replicas"] = args.replicas
    if args.output is not None:
        overrides["output"] = (args.output if "://" in args.output
                               else str(Path(args.output).resolve()))
    if overrides:
        spec = spec.model_copy(update=overrides)
    return _run_extract(spec, progress=not args.no_progress, as_json=args.json)


def _run_extract(spec: Any, *, progress: bool, as_json: bool = False) -> int:
    from hsx.progress import ProgressBar
    from hsx_service.prepare import JobRefused
    from hsx_service.runner import DispatchHooks, JobFailed, run_job

    try:
        with ProgressBar(spec.name or "extract", enabled=None if progress else False) as bar:
            summary = run_job(spec, hooks=DispatchHooks(on_progress=bar.update))
    except JobRefused as err:
        return _error(str(err), EXIT_REFUSED)
    except JobFailed as err:
        return _error(f"{err} (committed shards are kept; run again to resume)", EXIT_FAILED)
    except KeyboardInterrupt:
        return _error("interrupted (committed shards are kept; run again to resume)", 130)
    if as_json:
        sys.stdout.write(json.dumps(summary.as_dict()) + "\n")
    elif summary.nothing_to_do:
        console().print(f"nothing to do: {summary.output} is complete "
                      f"({summary.samples} samples in {summary.shards} shards)")
    else:
        rate = summary.tokens / summary.seconds if summary.seconds else 0.0
        console().print(
            f"[green]done[/]: {summary.samples} samples, {summary.tokens:,} tokens, "
            f"{summary.shards} shards, {summary.bytes / 2**20:,.1f} MiB, "
            f"{summary.errors} bad rows, {summary.seconds:.1f}s ({rate:,.0f} tok/s overall) "
            f"-> {summary.output}"
        )
    return 0


def _cmd_inspect_model(args: argparse.Namespace) -> int:
    """Model preflight from the config alone; exit 2 when the model cannot be captured."""
    from hsx.modelinfo import ModelConfigError
    from hsx_workers.preflight import format_report, inspect_model

    layers = [int(k) for k in args.layers.split(",")] if args.layers else None
    memory = int(args.gpu_memory_gib * 2**30) if args.gpu_memory_gib else None
    try:
        report = inspect_model(
            args.model, engine=args.engine, layers=layers, tensor_parallel_size=args.tp,
            dataset=args.dataset, max_seq_len=args.max_seq_len,
            trust_remote_code=args.trust_remote_code, gpu_memory_bytes=memory,
        )
    except ModelConfigError as err:
        return _error(str(err), EXIT_REFUSED)
    if args.json:
        sys.stdout.write(json.dumps(report.as_dict(), indent=1) + "\n")
    else:
        _stdout().print(format_report(report), markup=False, highlight=False)
    return 0 if report.capturable else EXIT_REFUSED


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Installed versions and what does not fit together; exit 1 when something is wrong."""
    from hsx_workers.preflight import environment_report

    checks = environment_report()
    if args.json:
        sys.stdout.write(json.dumps([vars(c) for c in checks], indent=1) + "\n")
    else:
        out = _stdout()
        for check in checks:
            mark = "ok " if check.ok else "BAD"
            out.print(f"{mark} {check.message}", markup=False, highlight=False)
    return 0 if all(c.ok for c in checks) else EXIT_FAILED


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from hsx_workers.tiny_models import make_tiny_model

    path = make_tiny_model(Path(args.path), arch=args.arch, seed=args.seed)
    sys.stdout.write(f"{path}\n")
    return 0


def _cmd_make_dataset(args: argparse.Namespace) -> int:
    from hsx_workers.tiny_models import make_chat_dataset

    result = make_chat_dataset(Path(args.path), n=args.n, seed=args.seed, bad_rows=args.bad_rows)
    sys.stdout.write(f"{getattr(result, 'path', result)}\n")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """Write an hsx output in another tool's layout (today: speculators' offline data)."""
    from hsx.export import ExportError, export_speculators

    try:
        summary = export_speculators(
            args.uri, args.dest, force=args.force, allow_incomplete=args.allow_incomplete,
        )
    except ExportError as err:
        return _error(str(err), EXIT_REFUSED)
    except KeyboardInterrupt:
        return _error("interrupted; nothing was written to the destination", 130)
    if args.json:
        sys.stdout.write(json.dumps(summary.as_dict()) + "\n")
        return 0
    ids = " ".join(str(k) for k in summary.target_layer_ids)
    console().print(
        f"[green]exported[/] {summary.samples} samples, {summary.tokens:,} tokens, "
        f"{summary.bytes / 2**20:,.1f} MiB of hidden states in {summary.seconds:.1f}s "
        f"-> {summary.dest}"
    )
    if summary.not_exported:
        console().print(f"{summary.not_exported} samples have no hidden states "
                        "(see `hsx errors` / HiddenStatesDataset.errors()); not exported")
    if not summary.source_complete:
        console().print("[yellow]the source job was not complete: later shards are missing[/]")
    console().print(f"train with: speculators train --data-path {summary.dest} "
                    f"--target-layer-ids {ids} --on-missing raise ...")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Check every committed shard of an output; with --repair withdraw the bad ones."""
    from hsx.output import Output, OutputCorrupt, OutputNotFound, StorageError

    output = Output(args.uri)
    try:
        manifest = output.manifest()
        units = output.committed_units()
        with console().status(f"verifying {len(units)} committed shards of {output}") as st:
            checked = 0

            def tick(unit: int) -> None:
                nonlocal checked
                checked += 1
                st.update(f"verifying shards of {output}: {checked}/{len(units)}")

            bad = output.check_shards(on_checked=tick)
    except (OutputNotFound, OutputCorrupt, StorageError) as err:
        return _error(str(err), EXIT_REFUSED)
    withdrawn = output.withdraw([b.unit for b in bad]) if args.repair and bad else []
    if args.json:
        sys.stdout.write(json.dumps({
            "output": str(output), "units_total": len(manifest.units), "committed": len(units),
            "bad": [{"unit": b.unit, "shard": b.shard, "reason": b.reason} for b in bad],
            "withdrawn": withdrawn,
        }) + "\n")
    else:
        for b in bad:  # one line each, tab-separated: for grep and cut
            sys.stdout.write(f"unit {b.unit}\t{b.shard}\t{b.reason}\n")
        if not bad:
            console().print(f"[green]ok[/]: {len(units)} committed shards of {output} "
                            "match their checksums")
        elif withdrawn:
            console().print(f"[yellow]withdrawn[/] {len(withdrawn)} bad shard(s) (units "
                            f"{withdrawn}); run the job again to extract them")
        else:
            console().print(f"[bold red]{len(bad)} of {len(units)} committed shards are bad[/]; "
                            "`hsx verify --repair` withdraws them so that a rerun of the "
                            "job extracts those units again")
    return EXIT_FAILED if bad else 0


def _train_spec(args: argparse.Namespace) -> Any:
    """TrainSpec from --spec FILE and --set key=value overrides (SpecError when bad)."""
    import yaml

    from hsx.spec import SpecError, parse_train

    fields: dict[str, Any] = {}
    if args.spec:
        try:
            loaded = yaml.safe_load(Path(args.spec).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise SpecError(f"cannot read train spec {args.spec}: {err}") from None
        if not isinstance(loaded, dict):
            raise SpecError(f"{args.spec}: a train spec must be a mapping of fields")
        fields.update(loaded)
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"--set {item!r}: expected key=value")
        fields[key.strip()] = yaml.safe_load(value)
    fields["follow"] = bool(args.follow)
    return parse_train(fields)


def _is_output(target: str) -> bool:
    """A target names an output (a URI or an existing path), else it is a job id."""
    return "://" in target or Path(target).expanduser().exists()


def _train_line(step: int, epoch: int, loss: float | None, acc: list[float], rate: float,
                wait: float) -> str:
    accs = " ".join(f"{a:.2f}" for a in acc)
    loss_text = "-" if loss is None else f"{loss:.4f}"
    return (f"train: step {step} epoch {epoch} loss {loss_text} acc [{accs}] "
            f"{rate:,.0f} tok/s, waiting on data {wait:.1%}")


def _cmd_train(args: argparse.Namespace) -> int:
    """Train an EAGLE-3 draft on an output (here) or on a job's output (on the coordinator)."""
    from hsx.spec import SpecError

    try:
        spec = _train_spec(args)
    except SpecError as err:
        return _error(str(err), EXIT_REFUSED)
    if _is_output(args.target):
        return _train_local(args.target, spec, args.draft_dir)
    return _remote(lambda a: _train_remote(a, spec))(args)


def _plan_line(plan: Any) -> str:
    workers = f" x {plan.workers} workers" if plan.workers > 1 else ""
    return (f"plan: {plan.steps:,} steps of {plan.batch_tokens:,} tokens{workers} "
            f"(packs of {plan.pack_tokens:,}) on {plan.device}, lr {plan.lr:g} "
            f"{plan.lr_schedule}, {plan.passes:.1f} passes over {plan.train_tokens:,} tokens "
            f"of {plan.train_samples:,} samples; {plan.val_samples:,} held out; "
            f"validated checkpoint every {plan.checkpoint_every:,} steps")


def _train_local(target: str, spec: Any, draft_dir: str | None) -> int:
    from hsx.draft import draft_folder
    from hsx.output import Output, StorageError
    from hsx.output.layout import DRAFT_DIR
    from hsx_workers.trainer import TrainRefused

    out = console()
    try:
        output = Output(target)
        if not spec.follow and not output.is_complete():
            return _error(f"{target}: the extraction is not complete; pass --follow to train "
                          "while it runs", EXIT_REFUSED)
        root = draft_folder(output, draft_dir)
    except (StorageError, ValueError) as err:
        return _error(str(err), EXIT_REFUSED)
    try:
        train = _train_here if spec.workers == 1 else _train_workers
        summary = train(output, root, spec, out)
    except TrainRefused as err:
        return _error(str(err), EXIT_REFUSED)
    except StorageError as err:
        return _error(f"{err}; the next `hsx train` resumes from the newest checkpoint",
                      EXIT_FAILED)
    except KeyboardInterrupt:
        return _error("interrupted; the next `hsx train` resumes from the newest checkpoint",
                      130)
    resumed = "" if summary.get("resumed_from") is None else \
        f" (resumed from step {summary['resumed_from']})"
    best = summary.get("best") or {}
    chosen = (f"; draft/ holds step {best['step']}, expected acceptance length "
              f"{best['expected_acceptance_length']:.2f} on held-out samples") if best else ""
    into = f"{output.url(DRAFT_DIR)} (trained in {root / DRAFT_DIR})" \
        if output.local_root is None else str(root / DRAFT_DIR)
    out.print(f"[green]trained[/] {summary['step']} steps, {summary['epoch']} epochs{resumed} "
              f"-> {into}{chosen}")
    again = "" if draft_dir is None else f" --draft-dir {draft_dir}"
    out.print(f"measure with: hsx eval-draft {output}{again}", markup=False, highlight=False)
    out.print(f"serve with: vllm serve {output.manifest().model} --speculative-config "
              f"'{{\"method\": \"eagle3\", \"model\": \"{root / DRAFT_DIR}\", "
              f"\"num_speculative_tokens\": 3}}'", markup=False, highlight=False)
    return 0


def _train_here(output: Any, root: Path, spec: Any, out: Any) -> dict[str, Any]:
    """One process: DraftTrainer, each step printed."""
    from hsx_workers.trainer import DraftTrainer

    def on_plan(plan: Any) -> None:
        out.print(_plan_line(plan), markup=False, highlight=False)
        if plan.warning:
            out.print(f"[yellow]warning:[/] {plan.warning}")

    trainer = DraftTrainer(output, spec, draft_root=root, on_plan=on_plan,
                           on_metrics=lambda m: out.print(
                               _train_line(m.step, m.epoch, m.loss, m.acc, m.tokens_per_s,
                                           m.wait_fraction),
                               markup=False, highlight=False))
    state = trainer.run()
    return {"step": state.step, "epoch": state.epoch, "resumed_from": trainer.resumed_from,
            "best": trainer.best}


def _train_workers(output: Any, root: Path, spec: Any, out: Any) -> dict[str, Any]:
    """`spec.workers` Ray Train workers on a local (or RAY_ADDRESS's) Ray; the main
    worker's step records are printed as they are written."""
    import threading
    import time

    from hsx.draft import read_jsonl, read_train_state
    from hsx.output.layout import DRAFT_METRICS
    from hsx_service.runner import ensure_ray
    from hsx_workers.trainer import train_distributed

    ensure_ray(None, cpus_needed=spec.workers + 1)
    started = time.time()
    done = threading.Event()

    def show() -> None:
        printed, shown_plan = 0, False
        while not done.wait(1.0):
            state = read_train_state(root) or {}
            if not shown_plan and state.get("plan") and float(state.get("time", 0)) >= started:
                shown_plan = True
                plan = argparse.Namespace(**state["plan"])
                out.print(_plan_line(plan), markup=False, highlight=False)
                if plan.warning:
                    out.print(f"[yellow]warning:[/] {plan.warning}")
            rows = [r for r in read_jsonl(root / DRAFT_METRICS) if r.get("time", 0) >= started]
            for m in rows[printed:]:
                out.print(_train_line(m["step"], m["epoch"], m["loss"], m["acc"],
                                      m["tokens_per_s"], m["wait_fraction"]),
                          markup=False, highlight=False)
            printed = len(rows)

    printer = threading.Thread(target=show, name="hsx-train-print", daemon=True)
    printer.start()
    try:
        return train_distributed(output, spec, draft_root=root)
    finally:
        done.set()
        printer.join(timeout=5)
def _train_remote(args: argparse.Namespace, spec: Any) -> int:
    client = _client(args)
    status = client.train(args.target, spec)
    if args.detach:
        sys.stdout.write(f"training {args.target}: {status.state.value} -> {status.draft}\n")
        return 0
    last_step = -1

    def show(s: Any) -> None:
        nonlocal last_step
        if s.step != last_step:
            last_step = s.step
            console().print(_train_line(s.step, s.epoch, s.loss, s.acc, s.tokens_per_s,
                                        s.wait_fraction), markup=False, highlight=False)

    final = client.wait_train(args.target, on_update=show)
    if final.state.value != "done":
        return _error(f"training of {args.target} {final.state.value}: {final.error}",
                      EXIT_FAILED)
    console().print(f"[green]trained[/] {final.step} steps -> {final.draft}")
    if final.best_step is not None and final.best_expected_acceptance_length is not None:
        console().print(f"draft/ holds step {final.best_step}, expected acceptance length "
                        f"{final.best_expected_acceptance_length:.2f} on held-out samples")
    if final.eval is not None:
        console().print(
            f"vLLM: {final.eval.error}" if final.eval.error else
            f"vLLM: mean acceptance length {final.eval.mean_acceptance_length:.2f} at "
            f"k={final.eval.k} on {final.eval.prompts} held-out prompts",
            markup=False, highlight=False)
    return 0


def _cmd_eval_draft(args: argparse.Namespace) -> int:
    """Generate with vLLM and the draft on held-out prompts; report vLLM's acceptance
    counters and record them in draft/eval.json."""
    from hsx.draft import draft_folder
    from hsx.output import Output, StorageError
    from hsx.output.layout import DRAFT_EVAL
    from hsx_workers.acceptance import evaluate_draft

    try:
        output = Output(args.output)
        root = draft_folder(output, args.draft_dir) if args.draft is None else None
        result = evaluate_draft(output, draft_root=args.draft_dir, prompts=args.prompts,
                                max_tokens=args.max_tokens, k=args.k, prefix=args.prefix,
                                draft=args.draft, target=args.target)
    except (StorageError, ValueError, FileNotFoundError) as err:
        return _error(str(err), EXIT_REFUSED)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    rates = " ".join(f"{r:.2f}" for r in result["acceptance_per_position"])
    console().print(
        f"mean acceptance length {result['mean_acceptance_length']:.2f} at k={result['k']} "
        f"on {result['prompts']} {result['prompt_source']} ({result['accepted_tokens']} of "
        f"{result['draft_tokens']} draft tokens accepted in {result['drafts']} drafts; "
        f"acceptance per position [{rates}])", markup=False, highlight=False)
    if root is not None:
        where = output.url(DRAFT_EVAL) if output.local_root is None else root / DRAFT_EVAL
        console().print(f"recorded in {where}", markup=False, highlight=False)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """The whole product on one machine: tiny model + synthetic chats, the coordinator
    with local Ray, a job submitted over REST and followed live, shards at the end."""
    import threading
    import time

    import uvicorn

    from hsx.client import Client
    from hsx.spec import JobSpec
    from hsx_service.config import Settings
    from hsx_service.main import create_app
    from hsx_workers.tiny_models import make_chat_dataset, make_tiny_model

    root = Path(args.dir).resolve()
    model = root / "tiny-llama"
    if not (model / "config.json").exists():
        console().print(f"making a tiny random Llama in {model}")
        make_tiny_model(model, arch="llama")
    dataset = root / "chats.jsonl"
    if not dataset.exists():
        console().print(f"making {args.samples} synthetic conversations in {dataset}")
        make_chat_dataset(dataset, n=args.samples, seed=0, bad_rows=3)
    spec = JobSpec(
        name="demo",
        model=str(model),
        dataset=str(dataset),
        output=str(root / "hidden-states"),
        layers=[1, 2, 3, 4],
        max_seq_len=512,
        unit_tokens=8192,
        engine=args.engine,
    )
    (root / "job.yaml").write_text(_yaml(spec.model_dump(mode="json", exclude_defaults=True)))

    settings = Settings(port=args.port, ledger_path=root / "ledger.sqlite",
                        allowed_roots=[root])
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host,
                                           port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="hsx-demo-server", daemon=True)
    thread.start()
    url = f"http://{settings.host}:{settings.port}"
    try:
        with Client(url) as client:
            deadline = time.monotonic() + 300
            while not client.ready():
                if time.monotonic() > deadline or not thread.is_alive():
                    return _error(f"the coordinator did not start on {url}", EXIT_FAILED)
                time.sleep(0.3)
            job = client.submit(spec)
            console().print(f"coordinator: {url}   dashboard: {url}/#/jobs/{job.id}")
            code = _follow(client, job.id, "demo")
        if code == 0:
            console().print(
                f"\nshards: {spec.output}/shards  (job file: {root / 'job.yaml'})\n"
                "read them:\n"
                f"  python -c \"import hsx; ds = hsx.HiddenStatesDataset('{spec.output}'); "
                "print(len(ds), ds[0]['hidden_states'].shape)\""
            )
        if code == 0 and args.serve:
            console().print(f"dashboard stays up at {url}/#/jobs/{job.id} (Ctrl-C to stop)")
            while thread.is_alive():
                time.sleep(1)
        return code
    except KeyboardInterrupt:
        return 130
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(data, sort_keys=False))


# --- the coordinator -----------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    """Run the coordinator (REST API, dashboard, scheduler) until interrupted."""
    import uvicorn
    from pydantic import ValidationError

    from hsx_service.config import Settings
    from hsx_service.main import create_app

    overrides: dict[str, Any] = {
        key: value
        for key, value in (("host", args.host), ("port", args.port), ("ledger_path", args.ledger))
        if value is not None
    }
    if args.standby:
        overrides["standby"] = True
    try:
        settings = Settings(**overrides)
    except ValidationError as err:
        return _error(f"bad server settings: {err}", EXIT_REFUSED)
    if not settings.standby:  # refused here with a plain message, before uvicorn starts
        from hsx_service.ledger import Ledger, LedgerHeld

        ledger = Ledger(settings.ledger_path)
        holder = ledger.lease()
        ledger.close()
        if holder is not None and not holder.gone():
            return _error(str(LedgerHeld(settings.ledger_path, holder)), EXIT_REFUSED)
    console().print(
        f"hsx coordinator on http://{settings.host}:{settings.port}  (dashboard /, API /docs; "
        f"ledger {settings.ledger_path})"
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info" if args.verbose else "warning",
        # Open event streams (dashboards, `hsx watch`) must not hold up a Ctrl-C.
        timeout_graceful_shutdown=5,
    )
    return 0


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


def _client(args: argparse.Namespace) -> Client:
    from hsx.client import Client

    return Client(args.url, args.token)


def _remote(command: Any) -> Any:
    """Run a command against the server; API errors become a message and an exit code."""

    def run(args: argparse.Namespace) -> int:
        from hsx.client import ApiError, JobRefusedError
        from hsx.spec import SpecError

        try:
            code: int = command(args)
            return code
        except (JobRefusedError, SpecError) as err:
            return _error(str(err), EXIT_REFUSED)
        except ApiError as err:
            return _error(str(err), EXIT_FAILED)
        except KeyboardInterrupt:
            return _error("interrupted", 130)

    return run


def _stdout() -> Any:
    """A console on stdout: tables and JSON are the command's result, not chatter."""
    from rich.console import Console

    return Console(highlight=False)


def _follow(client: Client, job_id: str, title: str) -> int:
    """Show a live progress bar until the job ends; exit 0 only if it succeeded."""
    from hsx.progress import ProgressBar

    try:
        with ProgressBar(title) as bar:
            final = client.wait(job_id, on_update=lambda status: bar.update(job_progress(status)))
    except KeyboardInterrupt:
        return _error(f"stopped watching; job {job_id} goes on (`hsx cancel {job_id}` stops it)",
                      130)
    return _report_final(final)


def _report_final(job: JobStatus) -> int:
    if job.state.value == "succeeded":
        console().print(
            f"[green]done[/]: job {job.id}: {job.samples_done:,} samples, "
            f"{job.tokens_done:,} tokens, {job.shards} shards, {job.bytes / 2**20:,.1f} MiB, "
            f"{job.samples_failed} bad rows -> {job.output}"
        )
        return 0
    reason = f": {job.last_error}" if job.last_error else ""
    return _error(f"job {job.id} {job.state.value}{reason}", EXIT_FAILED)


def _cmd_submit(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.submit(Path(args.job), job_id=args.id)
        sys.stdout.write(f"{job.id}\n")
        sys.stdout.flush()
        if not args.wait:
            return 0
        return _follow(client, job.id, job.name or job.id)


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
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
        ("state", job.state.value),
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
    if job.last_error:
        rows.append(("last error", job.last_error))
    for key, value in rows:
        table.add_row(key, value)
    _stdout().print(table)
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _follow(client, args.job, args.job)


def _cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
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
    _stdout().print(table)
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
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

    with _client(args) as client:
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
    _stdout().print(table)
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


def _add_remote_parsers(sub: Any) -> None:
    # --url/--token work before or after the command (`hsx --url U ls`, `hsx ls --url U`);
    # SUPPRESS keeps a subcommand from overwriting the top-level value with its default.
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--url", default=argparse.SUPPRESS,
                        help="coordinator URL (env HSX_URL; default http://127.0.0.1:8642)")
    remote.add_argument("--token", default=argparse.SUPPRESS,
                        help="API token (env HSX_API_TOKEN)")
    from hsx.wire import JobState

    p = sub.add_parser("serve", help="run the coordinator: REST API, dashboard, scheduler")
    p.add_argument("--host", help="address to bind (env HSX_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (env HSX_PORT; default 8642)")
    p.add_argument("--ledger", help="ledger SQLite file (env HSX_LEDGER_PATH)")
    p.add_argument("--standby", action="store_true", default=None,
                   help="if another coordinator holds the ledger, wait and take over when "
                        "it stops, instead of refusing to start (env HSX_STANDBY)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("submit", parents=[remote], help="submit a job file to the coordinator")
    p.add_argument("job", help="job file (YAML or JSON)")
    p.add_argument("--id", help="job id to use (submitting the same job again is a no-op)")
    p.add_argument("--wait", action="store_true", help="show progress until the job ends")
    p.set_defaults(func=_remote(_cmd_submit))

    p = sub.add_parser("status", parents=[remote], help="one job's state and numbers")
    p.add_argument("job", help="job id")
    p.add_argument("--json", action="store_true", help="the JobStatus as JSON on stdout")
    p.set_defaults(func=_remote(_cmd_status))

    p = sub.add_parser("watch", parents=[remote], help="live progress bar until the job ends")
    p.add_argument("job", help="job id")
    p.set_defaults(func=_remote(_cmd_watch))

    p = sub.add_parser("ls", parents=[remote], help="list jobs")
    p.add_argument("--state", choices=[s.value for s in JobState], help="only jobs in this state")
    p.add_argument("--json", action="store_true", help="the jobs as JSON on stdout")
    p.set_defaults(func=_remote(_cmd_ls))

    p = sub.add_parser("cancel", parents=[remote], help="cancel a job")
    p.add_argument("job", help="job id")
    p.set_defaults(func=_remote(_cmd_cancel))

    p = sub.add_parser("errors", parents=[remote], help="a job's skipped rows and why")
    p.add_argument("job", help="job id")
    p.add_argument("--limit", type=int, default=100, help="most records to show (default 100)")
    p.add_argument("--json", action="store_true", help="the records as JSON on stdout")
    p.set_defaults(func=_remote(_cmd_errors))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx", description="Hidden states of a target LLM as EAGLE-3 training data."
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log for operators")
    parser.add_argument("--url", default=None,
                        help="coordinator URL (env HSX_URL; default http://127.0.0.1:8642)")
    parser.add_argument("--token", default=None, help="API token (env HSX_API_TOKEN)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train", help="train an EAGLE-3 draft on an output (a path) or a job (an id)")
    p.add_argument("target", help="an output path or URI (file://, s3://: trains here), or a "
                                  "job id (the coordinator trains it)")
    p.add_argument("--follow", action="store_true",
                   help="start on the shards committed so far and keep up with the extraction")
    p.add_argument("--spec", help="TrainSpec file (YAML or JSON)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one TrainSpec field, e.g. --set epochs=3 (repeatable)")
    p.add_argument("--detach", action="store_true",
                   help="job id only: start the training and return at once")
    p.add_argument("--draft-dir", help="output only: the local folder to train the draft "
                                       "in (default the output's; for s3:// a folder in "
                                       "$HSX_CACHE, ~/.cache/hsx, uploaded to the bucket)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "eval-draft", help="acceptance of an output's trained draft in vLLM (greedy, eagle3)")
    p.add_argument("output", help="the output the draft was trained on (prompts come from it)")
    p.add_argument("--draft-dir", help="the local folder the draft was trained in (as "
                                       "`hsx train --draft-dir`; default the output's; for "
                                       "s3:// the bucket's draft is downloaded there)")
    p.add_argument("--draft", help="draft folder (default: <draft-dir>/draft; another one is "
                                   "measured but not recorded)")
    p.add_argument("--target", help="target model (default: the output's model)")
    p.add_argument("--k", type=int, default=None,
                   help="num_speculative_tokens (default: the training's ttt_steps, 3)")
    p.add_argument("--prompts", type=int, default=32,
                   help="held-out samples whose prompts vLLM answers (default 32)")
    p.add_argument("--prefix", type=int, default=8,
                   help="prompt length for samples without a question (all loss-masked)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="at most this many tokens per answer (default: each sample's "
                        "answer length, at most 256)")
    p.add_argument("--json", action="store_true", help="the counters as JSON on stdout")
    p.set_defaults(func=_cmd_eval_draft)

    p = sub.add_parser("extract", help="run a job file to completion (local Ray by default)")
    p.add_argument("job", help="job file (YAML or JSON): model, dataset, output, layers, ...")
    p.add_argument("--replicas", type=int, help="override the job's replicas")
    p.add_argument("--output", help="override the job's output")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser(
        "demo", help="tiny model + chats, extracted through a local coordinator over REST"
    )
    p.add_argument("--dir", default="demo-output", help="where the demo's files go")
    p.add_argument("--samples", type=int, default=400, help="synthetic conversations")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--port", type=int, default=8642, help="the coordinator's port")
    p.add_argument("--serve", action="store_true",
                   help="keep the coordinator and dashboard up after the job")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("inspect-model",
                       help="can this model be captured, how, and at what size (no weights)")
    p.add_argument("model", help="model directory or hub id")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--dataset", help="count its tokens and the output bytes they make")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size for the fit check")
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument("--layers", help="comma-separated layer ids to check")
    p.add_argument("--max-seq-len", type=int, default=4096, help="truncation when counting")
    p.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU (default: probe)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(func=_cmd_inspect_model)

    p = sub.add_parser("doctor", help="check that vLLM, torch, transformers, ... fit together")
    p.add_argument("--json", action="store_true", help="the checks as JSON on stdout")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("make-tiny-model", help="build a random-weight model with a tokenizer")
    p.add_argument("path")
    p.add_argument("--arch", default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("make-dataset", help="write a synthetic chat dataset (JSONL)")
    p.add_argument("path")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bad-rows", type=int, default=0)
    p.set_defaults(func=_cmd_make_dataset)

    p = sub.add_parser("export", help="write an output in speculators' offline-data layout")
    p.add_argument("uri", help="the hsx output (directory, file:// or s3:// URI)")
    p.add_argument("dest", help="directory to create (must be absent or empty)")
    p.add_argument("--format", choices=["speculators"], default="speculators",
                   help="target layout (default speculators)")
    p.add_argument("--force", action="store_true", help="replace an earlier hsx export at DEST")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="export what a still-running job has committed so far")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("verify", help="check every committed shard's checksums; "
                       "--repair withdraws the bad ones so a rerun extracts them again")
    p.add_argument("uri", help="the hsx output (directory, file:// or s3:// URI)")
    p.add_argument("--repair", action="store_true",
                   help="withdraw the commits of bad shards and remove them (no job may run "
                   "on the output meanwhile)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=_cmd_verify)

    _add_remote_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
