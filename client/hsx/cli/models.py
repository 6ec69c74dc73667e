"""Commands about the model and the installation: `inspect-model` (can this model be
captured, how, at what size; from its config alone) and `doctor` (do vLLM, torch,
transformers... fit together)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hsx.cli.report import EXIT_FAILED, EXIT_REFUSED, error, result_console


def _cmd_inspect_model(args: argparse.Namespace) -> int:
    """Model preflight from the config alone; exit 2 when the model cannot be captured."""
    from hsx.modelinfo import ModelConfigError
    from hsx.spec import DatasetSpec
    from hsx_workers.preflight import format_report, inspect_model

    layers = [int(k) for k in args.layers.split(",")] if args.layers else None
    memory = int(args.gpu_memory_gib * 2**30) if args.gpu_memory_gib else None
    if args.split and not args.dataset:
        return error("--split names a split of --dataset, which is not given", EXIT_REFUSED)
    dataset = (DatasetSpec(path=args.dataset, split=args.split) if args.split
               else args.dataset)
    try:
        report = inspect_model(
            args.model, engine=args.engine, layers=layers, tensor_parallel_size=args.tp,
            dataset=dataset, max_seq_len=args.max_seq_len,
            trust_remote_code=args.trust_remote_code, gpu_memory_bytes=memory,
        )
    except ModelConfigError as err:
        return error(str(err), EXIT_REFUSED)
    if args.json:
        sys.stdout.write(json.dumps(report.as_dict(), indent=1) + "\n")
    else:
        result_console().print(format_report(report), markup=False, highlight=False)
    return 0 if report.capturable else EXIT_REFUSED


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Installed versions and what does not fit together; exit 1 when something is wrong."""
    from hsx_workers.preflight import environment_report

    checks = environment_report()
    if args.json:
        sys.stdout.write(json.dumps([vars(c) for c in checks], indent=1) + "\n")
    else:
        out = result_console()
        for check in checks:
            mark = "ok " if check.ok else "BAD"
            out.print(f"{mark} {check.message}", markup=False, highlight=False)
    return 0 if all(c.ok for c in checks) else EXIT_FAILED


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("inspect-model",
                       help="can this model be captured, how, and at what size (no weights)")
    p.add_argument("model", help="model directory or hub id")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--dataset", help="count its tokens and the output bytes they make")
    p.add_argument("--split", help="the split of --dataset to count (one with several)")
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
