"""Fixture makers for tests and the demo: `make-tiny-model` (random weights and a
tokenizer) and `make-dataset` (synthetic chats as JSONL)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


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


def add_parsers(sub: Any) -> None:
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
