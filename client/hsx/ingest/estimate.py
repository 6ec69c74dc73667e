"""`estimate_tokens` in a child process of its own, bounded: what a coordinator runs at
submit (hsx_service.prepare), so that a job's chat template and dataset, whoever wrote
them, can hold neither the thread that asks (an API request's) nor the coordinator's
memory.

The child is forked from the fork server that ingestion's pool processes come from
(bounded.py, `pool_context`: transformers is imported there), so it starts in
milliseconds. It may map MEMORY_BYTES beyond what it has then (its RLIMIT_AS: an
allocation past it fails). In it:

1. the dataset is resolved, its rows counted, the sample read (samples.py,
   `read_estimate_sample`) and the tokenizer loaded, within SETUP_SECONDS of wall
   time; longer, there is no estimate (`EstimateUnavailable`), as for a dataset that
   cannot be counted quickly;
2. then the sample is tokenized within `HSX_TEMPLATE_SECONDS` (+ GRACE_SECONDS) of
   CPU, each row's renderings within the same seconds (limits.py). The CPU time is the
   child's RLIMIT_CPU: the kernel stops it past them, even inside one call into C that
   a row's time limit cannot interrupt.

A sample row whose template passes a limit, or a sample that passes the CPU time,
raises `TemplateLimitError`: the job is refused. A child that does not answer within
WALL_FACTOR x its CPU time (a machine too busy to give it the CPU) is killed: no
estimate. Each estimate has a child of its own, so a killed one is replaced by the
next estimate's.
"""

from __future__ import annotations

import contextlib
import signal
from multiprocessing.connection import Connection
from typing import Any

from hsx.ingest.bounded import exit_with_parent, limit_cpu, limit_memory, pool_context
from hsx.ingest.images import ImageSettings
from hsx.ingest.limits import IngestLimits
from hsx.ingest.samples import (
    TokenEstimate,
    estimate_from_sample,
    read_estimate_sample,
)
from hsx.ingest.slices import tokenize_on_one_thread
from hsx.ingest.sources import DatasetLike, resolve_source
from hsx.ingest.tokenizer import TemplateLimitError, load_tokenizer, timed_out

SETUP_SECONDS = 60.0  # wall time to read the sample and load the tokenizer
GRACE_SECONDS = 2.0  # CPU beyond HSX_TEMPLATE_SECONDS for the sample: a row's own limit first
WALL_FACTOR = 3.0  # wall time for the sample, in its CPU seconds
MEMORY_BYTES = 8 * 2**30  # what the child may map beyond its imports


class EstimateUnavailable(Exception):
    """No estimate was made: the dataset took too long to read, the child failed or
    did not answer. The message says why; nothing is refused on it."""


def bounded_estimate(
    dataset: DatasetLike, tokenizer_path: str, max_seq_len: int, *, sample_rows: int = 256,
    chat_template_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False,
    limits: IngestLimits | None = None, images: ImageSettings | None = None,
) -> TokenEstimate:
    """`estimate_tokens` of the same arguments, in a child process (see the module
    docstring): TemplateLimitError when the chat template passes a limit on the
    sample, EstimateUnavailable when no estimate could be made."""
    limits = limits or IngestLimits.from_env()
    context = pool_context()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_estimate_in_child, name="hsx-estimate", daemon=True,
        args=(send, dataset, tokenizer_path, max_seq_len, sample_rows,
              dict(chat_template_kwargs or {}), trust_remote_code, limits, images))
    child.start()
    send.close()
    cpu = limits.template_seconds + GRACE_SECONDS
    try:
        kind, value = _answer(receive, child, SETUP_SECONDS)
        if kind == "sampled":
            sampled = value
            kind, value = _answer(receive, child, WALL_FACTOR * cpu)
            if kind == "ended" and value == -signal.SIGXCPU:
                raise timed_out(limits.template_seconds, f"the dataset's {sampled} sample rows")
        if kind == "estimate":
            return TokenEstimate(*value)
        if kind == "template":
            raise TemplateLimitError(*value)
        if kind == "silent":
            raise EstimateUnavailable(
                f"the estimate's process did not answer within {value:g} s")
        if kind == "ended":
            raise EstimateUnavailable(f"the estimate's process ended (exit code {value})")
        raise EstimateUnavailable(str(value))
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        receive.close()


def _answer(receive: Connection, child: Any, seconds: float) -> tuple[str, Any]:
    """The child's next message; ("ended", exit code) when it ended without one,
    ("silent", seconds) when it sent none in time."""
    if not receive.poll(seconds):
        return "silent", seconds
    try:
        kind, value = receive.recv()
    except EOFError:
        child.join(5)
        return "ended", child.exitcode
    return kind, value


def _estimate_in_child(send: Connection, dataset: DatasetLike, tokenizer_path: str,
                       max_seq_len: int, sample_rows: int, kwargs: dict[str, Any],
                       trust_remote_code: bool, limits: IngestLimits,
                       images: ImageSettings | None = None) -> None:
    exit_with_parent()
    tokenize_on_one_thread()  # one thread: RLIMIT_CPU is then the sample's time
    message: tuple[str, Any]
    try:
        limit_memory(MEMORY_BYTES)  # the sample's rows too: up to 256 of the row limit
        sample = read_estimate_sample(resolve_source(dataset), sample_rows, limits)
        tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
        if images is not None:
            images.tokens()  # the processor, loaded before the sample's time starts
        limit_cpu(limits.template_seconds + GRACE_SECONDS)
        send.send(("sampled", sample.sampled))
        estimate = estimate_from_sample(sample, tokenizer, max_seq_len, kwargs, limits,
                                        images)
        message = ("estimate", tuple(estimate))
    except TemplateLimitError as err:
        message = ("template", (err.problem, err.row))
    except BaseException as err:  # said to the parent, which decides
        message = ("error", f"{type(err).__name__}: {err}")
    with contextlib.suppress(OSError):  # the parent gave up on it
        send.send(message)
