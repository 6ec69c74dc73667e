"""`python -m hsx_workers.tiny_models`: build a tiny model or a chat dataset."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from hsx_workers.tiny_models.chat_datasets import ROW_FORMATS, make_chat_dataset
from hsx_workers.tiny_models.models import ARCHS, make_tiny_model

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsx_workers.tiny_models",
                                description="Build tiny random-weight models and datasets.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write a tiny random-weight model directory")
    m.add_argument("dir")
    m.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    m.add_argument("--layers", type=int, default=4, dest="num_layers")
    m.add_argument("--hidden-size", type=int, default=256)
    m.add_argument("--heads", type=int, default=4, dest="num_heads")
    m.add_argument("--kv-heads", type=int, default=2, dest="num_kv_heads")
    m.add_argument("--intermediate-size", type=int, default=512)
    m.add_argument("--vocab-size", type=int, default=512)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bfloat16")
    d = sub.add_parser("dataset", help="write a synthetic JSONL chat dataset")
    d.add_argument("file")
    d.add_argument("--n", type=int, default=200)
    d.add_argument("--bad-rows", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--formats", default="messages", choices=ROW_FORMATS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m hsx_workers.tiny_models` (and `hsx make-tiny-model`)."""
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "model":
        make_tiny_model(
            args.dir, args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
            intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
            seed=args.seed, dtype=args.dtype,
        )
    else:
        ds = make_chat_dataset(args.file, args.n, seed=args.seed, bad_rows=args.bad_rows,
                               formats=args.formats)
        for index, kind in sorted(ds.bad.items()):
            logger.info("bad row %d: %s", index, kind)
    return 0
