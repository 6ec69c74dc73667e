"""The `hsx` command.

This module is the composition root: server-side commands (`extract`, `demo`, the
fixture makers) import the service and the workers inside their functions; nothing
else in `hsx` does, so `import hsx` stays light.

Exit codes: 0 done, 1 the job failed while running, 2 the job was refused (bad job
file, bad model or layers, unwritable output) before anything started.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hsx import __version__
from hsx.progress import console

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
        overrides["output"] = str(Path(args.output).resolve())
    if overrides:
        spec = spec.model_copy(update=overrides)
    return _run_extract(spec, progress=not args.no_progress, as_json=args.json)


def _run_extract(spec: Any, *, progress: bool, as_json: bool = False) -> int:
    from hsx.progress import ProgressBar
    from hsx_service.prepare import JobRefused
    from hsx_service.runner import JobFailed, run_job

    try:
        with ProgressBar(spec.name or "extract", enabled=None if progress else False) as bar:
            summary = run_job(spec, on_progress=bar.update)
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


def _cmd_demo(args: argparse.Namespace) -> int:
    """Tiny model + synthetic chats -> hidden states, all local."""
    from hsx.spec import JobSpec
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
    code = _run_extract(spec, progress=True)
    if code == 0:
        console().print(
            f"\nshards: {spec.output}/shards  (job file: {root / 'job.yaml'})\n"
            "read them:\n"
            f"  python -c \"import hsx; ds = hsx.HiddenStatesDataset('{spec.output}'); "
            "print(len(ds), ds[0]['hidden_states'].shape)\""
        )
    return code


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(data, sort_keys=False))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx", description="Hidden states of a target LLM as EAGLE-3 training data."
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log for operators")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("extract", help="run a job file to completion (local Ray by default)")
    p.add_argument("job", help="job file (YAML or JSON): model, dataset, output, layers, ...")
    p.add_argument("--replicas", type=int, help="override the job's replicas")
    p.add_argument("--output", help="override the job's output")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser("demo", help="make a tiny model and chats, then extract them locally")
    p.add_argument("--dir", default="demo-output", help="where the demo's files go")
    p.add_argument("--samples", type=int, default=400, help="synthetic conversations")
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.set_defaults(func=_cmd_demo)

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
