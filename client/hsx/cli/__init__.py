"""The `hsx` command: one module per group of commands, each defining its own arguments.

- jobs.py: a coordinator's jobs over REST (`submit`, `status`, `watch`, `ls`, `cancel`,
  `errors`);
- local_runs.py: the server side in this process (`extract`, `demo`, `serve`);
- outputs.py: an output's shards (`export`, `verify`);
- training.py: drafts (`train`, `eval-draft`);
- models.py: the model and the installation (`inspect-model`, `doctor`);
- fixtures.py: a tiny model and a chat dataset for tests and the demo;
- report.py: exit codes, errors on stderr, results on stdout.

This package is the composition root: server-side commands import the service and the
workers inside their functions; nothing else in `hsx` does, so `import hsx` stays
light.

Exit codes: 0 done, 1 the job failed while running (or was cancelled; or the server
answered with another error; or `hsx verify` found bad shards), 2 the job was refused
(bad job file, bad model or layers, unwritable output, a path outside the server's
allowed roots) before anything started.
"""

from __future__ import annotations

import argparse
import logging

from hsx import __version__
from hsx.cli import fixtures, jobs, local_runs, models, outputs, training


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx", description="Training data for speculative-decoding drafts "
        f"({training.method_titles()}): a target LLM's hidden states captured by vLLM; the "
        "draft trained on them and measured in vLLM."
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log for operators")
    parser.add_argument("--url", default=None,
                        help="coordinator URL (env HSX_URL; default http://127.0.0.1:8642)")
    parser.add_argument("--token", default=None, help="API token (env HSX_API_TOKEN)")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (training, local_runs, models, fixtures, outputs, jobs):
        group.add_parsers(sub)
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
