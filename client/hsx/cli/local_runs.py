"""Commands that run hsx's server side in this process: `extract` (a job to completion on
a local Ray), `demo` (the whole product on one machine), `serve` (the coordinator).

They import the service and the workers inside the command functions (the CLI is the
composition root), so `import hsx` stays light.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hsx.cli.jobs import follow
from hsx.cli.report import EXIT_FAILED, EXIT_REFUSED, already_complete, error
from hsx.progress import console


def _cmd_extract(args: argparse.Namespace) -> int:
    from hsx.spec import SpecError, load_job

    try:
        spec = load_job(args.job, args.set or [])
    except SpecError as err:
        return error(str(err), EXIT_REFUSED)
    overrides: dict[str, Any] = {}
    if args.replicas is not None:
        overrides["replicas"] = args.replicas
    if args.output is not None:
        overrides["output"] = (args.output if "://" in args.output
                               else str(Path(args.output).resolve()))
    if overrides:
        spec = spec.model_copy(update=overrides)
    from hsx_service.engine_config import fit_to_model

    spec = fit_to_model(spec)
    return _run_extract(spec, progress=not args.no_progress, as_json=args.json)


def _run_extract(spec: Any, *, progress: bool, as_json: bool = False) -> int:
    """The job to its end, its `train:` section with it (trained as the coordinator
    trains it: hsx.cli.training.JobTraining)."""
    from hsx.cli.training import JobTraining
    from hsx.progress import JobProgress, ProgressBar
    from hsx_service.dispatch import DispatchHooks
    from hsx_service.engine_pool import EnginePool, connect_ray
    from hsx_service.errors import JobFailed, JobRefused
    from hsx_service.placement import plan_for_cluster
    from hsx_service.runner import run_job
    from hsx_service.scheduler import check_draft_layers

    pool = EnginePool()
    training = None
    if spec.train is not None:
        try:
            check_draft_layers(spec)  # before any engine starts
        except JobRefused as err:
            return error(str(err), EXIT_REFUSED)
        training = JobTraining(spec, pool.arbiter)

    def on_plan(plan: Any) -> None:
        bar.note(f"plan: {plan.summary}")
        if training is not None:
            training.planned(plan=plan)

    def planned(job: Any, units: Any, ingested: bool) -> None:
        if training is not None and ingested:
            training.planned(whole=True)

    def prepared(job: Any) -> None:
        if training is not None:  # the training starts before the engines, as it may
            connect_ray(spec)
            training.planned(plan=plan_for_cluster(spec))
        planned(job, job.units, job.ingestion is None)

    extracted = False
    try:
        with ProgressBar(spec.name or "extract", enabled=None if progress else False) as bar:
            summary = run_job(spec, pool=pool, connect=True, hooks=DispatchHooks(
                on_plan=on_plan, on_prepared=prepared, on_planned=planned,
                on_engines=training.engines.placed if training is not None else None,
                on_progress=bar.update, on_waiting=bar.waiting,
                on_ingest=lambda p: bar.update(JobProgress.of_ingestion(
                    p.rows, p.rows_expected))))
        extracted = True
    except JobRefused as err:
        return error(str(err), EXIT_REFUSED)
    except JobFailed as err:
        kept = ("the inputs and the draft's checkpoints are kept; run again to resume the "
                "training" if spec.trains_online else
                "committed shards are kept; run again to resume")
        return error(f"{err} ({kept})", EXIT_FAILED)
    except KeyboardInterrupt:
        return error("interrupted (committed shards are kept; run again to resume)", 130)
    finally:
        pool.shutdown()  # the engines' GPUs go to the training and its measurement
        if training is not None and not extracted:
            training.finish(extracted=False)
    if as_json:
        sys.stdout.write(json.dumps(summary.as_dict()) + "\n")
    elif summary.nothing_to_do:
        console().print(f"nothing to do: {already_complete(summary.samples)} "
                        f"({summary.shards} shards in {summary.output})")
    else:
        rate = summary.tokens / summary.seconds if summary.seconds else 0.0
        console().print(
            f"[green]done[/]: {summary.samples} samples, {summary.tokens:,} tokens, "
            f"{summary.shards} shards, {summary.bytes / 2**20:,.1f} MiB, "
            f"{summary.errors} bad rows, {summary.seconds:.1f}s ({rate:,.0f} tok/s overall) "
            f"-> {summary.output}"
        )
    return training.finish(extracted=True) if training is not None else 0


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
                    return error(f"the coordinator did not start on {url}", EXIT_FAILED)
                time.sleep(0.3)
            job = client.submit(spec)
            console().print(f"coordinator: {url}   dashboard: {url}/#/jobs/{job.id}")
            code = follow(client, job.id, "demo")
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


def _cmd_serve(args: argparse.Namespace) -> int:
    """Run the coordinator (REST API, dashboard, scheduler) until interrupted."""
    import uvicorn
    from pydantic import ValidationError

    from hsx_service.config import Settings
    from hsx_service.main import create_app

    overrides: dict[str, Any] = {
        key: value
        for key, value in (("host", args.host), ("port", args.port), ("ledger_path", args.ledger),
                           ("api_token", args.token), ("tokens_file", args.tokens_file))
        if value is not None
    }
    if args.standby:
        overrides["standby"] = True
    if args.allow_open:
        overrides["allow_open"] = True
    try:
        settings = Settings(**overrides)
    except ValidationError as err:
        return error(f"bad server settings: {err}", EXIT_REFUSED)
    refusal = settings.refusal_to_start()
    if refusal is not None:
        return error(refusal, EXIT_REFUSED)
    try:
        app = create_app(settings)
    except ValueError as err:  # a token or tokens file that cannot be used
        return error(str(err), EXIT_REFUSED)
    if not settings.standby:  # refused here with a plain message, before uvicorn starts
        from hsx_service.ledger import Ledger, LedgerHeld

        ledger = Ledger(settings.ledger_path)
        holder = ledger.lease()
        ledger.close()
        if holder is not None and not holder.gone():
            return error(str(LedgerHeld(settings.ledger_path, holder)), EXIT_REFUSED)
    console().print(
        f"hsx coordinator on http://{settings.host}:{settings.port}  (dashboard /, API /docs; "
        f"ledger {settings.ledger_path})"
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info" if args.verbose else "warning",
        # Open event streams (dashboards, `hsx watch`) must not hold up a Ctrl-C.
        timeout_graceful_shutdown=5,
        # Longer than clients keep an idle connection (hsx.client: 2 s), so a client
        # never sends on a connection the server is closing.
        timeout_keep_alive=30,
    )
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("extract", help="run a job file to completion (local Ray by default); "
                                          "with `train:`, then train and measure its draft here")
    p.add_argument("job", help="job file (YAML or JSON): model, dataset, output, layers, ...")
    p.add_argument("--replicas", type=int, help="override the job's replicas")
    p.add_argument("--output", help="override the job's output")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one field of the job file, a section's with a dotted key "
                        "(e.g. --set train.workers=2 --set train.place=apart; the value is "
                        "read as YAML; repeatable)")
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

    p = sub.add_parser("serve", help="run the coordinator: REST API, dashboard, scheduler")
    p.add_argument("--host", help="address to bind (env HSX_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (env HSX_PORT; default 8642)")
    p.add_argument("--ledger", help="ledger SQLite file (env HSX_LEDGER_PATH)")
    p.add_argument("--standby", action="store_true", default=None,
                   help="if another coordinator holds the ledger, wait and take over when "
                        "it stops, instead of refusing to start (env HSX_STANDBY)")
    p.add_argument("--tokens-file",
                   help="YAML file of users' API tokens (env HSX_TOKENS_FILE; "
                        "docs/SECURITY.md); `hsx --token T serve` sets one token")
    p.add_argument("--allow-open", action="store_true",
                   help="serve a non-loopback address with no token: anyone who reaches it "
                        "may submit jobs (env HSX_ALLOW_OPEN)")
    p.set_defaults(func=_cmd_serve)
