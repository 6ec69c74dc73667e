"""Rows tokenized in child processes that are killed when a row will not end: no chat
template, whoever wrote it, can stall the process that ingests (a coordinator's job
thread, and its API with it: one long call into C holds the interpreter's lock), a
pool's thread, or a Ray task.

Every ingestion tokenizes through `TokenizingProcess`: a child forked from the fork
server (`pool_context`: transformers imported once), which loads the tokenizer, takes
slices from its parent and sends back their tokenized batches. It beats as each row's
rendering starts (limits.py, `row_started`) and after each batch. The parent kills it
when, since its last beat, it computed for more than HSX_TEMPLATE_SECONDS +
GRACE_SECONDS of CPU time (a row's own CPU limit, limits.py, stops loops in Python
first; this stops one long call into C, such as a huge integer power, that nothing
inside the process can interrupt), or waited without computing for HANG_SECONDS (a
read that never returns), or it dies (MEMORY_BYTES past its imports, a crash). CPU
time, not wall time: the child runs at nice 19, and on a machine busy with engines a
good row may wait minutes for a core; a kill must mean the row, not the load. Where
the child's times cannot be read (no /proc), WALL_FACTOR x that CPU time of wall time
stands for them. The row that stopped
it is then found: the batch's rows again, one at a time, in a new child; the one that
stops that child is a bad row with the reason, and the slice goes on after it.
KILLED_ROWS such rows in one slice end the ingestion (TemplateLimitError): a template
that stops on every row would otherwise cost that long per row.

`tokenize_slice` is what an executor runs for `ingest` (a thread of a pool here, a Ray
task there: hsx_service.ingest_tasks): the calling thread's own child tokenizes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import resource
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hsx import settings as hsx_settings
from hsx.ingest import limits
from hsx.ingest.slices import (
    SliceSettings,
    TokenizedRows,
    slice_batches,
    worker_tokenizer,
)
from hsx.ingest.sources import SourceSlice
from hsx.ingest.tokenizer import TemplateTimeout

SETUP_SECONDS = 60.0  # a new child's start and tokenizer, wall time
# ... and a job's image processor, which imports torch (seconds; a minute and more on a
# loaded machine was seen).
IMAGE_SETUP_SECONDS = 240.0
GRACE_SECONDS = 2.0  # beyond HSX_TEMPLATE_SECONDS: a row's own CPU limit stops it first
WALL_FACTOR = 3.0  # without /proc: wall time without a beat, in those CPU seconds
HANG_SECONDS = 300.0  # asleep (not computing, not waiting for a core) without a beat
MEMORY_BYTES = 8 * 2**30  # what a child may map beyond its imports
KILLED_ROWS = 3  # rows of one slice whose child was stopped that end the ingestion
MEMORY_EXIT = 86  # a child's exit code when it ran out of MEMORY_BYTES
POLL_S = 0.25

log = logging.getLogger(__name__)


def pool_context() -> Any:
    """How tokenizing children (and the estimate's at submit: estimate.py) start:
    forked from multiprocessing's fork server, which imports what they need once
    (pool_preload.py), and is started here, so that it imports while the ingesting
    process loads its own tokenizer. Not forked from the ingesting process itself: a
    coordinator's threads (Ray's, the API's) would be forked in the middle of what
    they hold."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hsx.ingest.pool_preload"])
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return context


def exit_with_parent() -> None:
    """In a child (a tokenizing one, the estimate's): exit when the process that asks is
    gone. A killed driver (SIGKILL, OOM) closes no pipe, and its children would wait on
    theirs forever, each holding a tokenizer."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="hsx-exit-with-parent", daemon=True).start()


def limit_memory(more: int) -> None:
    """From now on this process may map `more` bytes beyond what it maps now (then
    allocations fail: MemoryError)."""
    with contextlib.suppress(OSError, ValueError):  # no /proc: no memory limit
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _lower(resource.RLIMIT_AS, mapped + more)


def limit_cpu(seconds: float) -> None:
    """From now on this process may spend `seconds` more CPU; then the kernel stops it
    (SIGXCPU), without a core file."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _lower(resource.RLIMIT_CORE, 0)
    _lower(resource.RLIMIT_CPU, math.ceil(usage.ru_utime + usage.ru_stime + seconds))


def _lower(which: int, soft: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(which, (soft, hard))


class _Stopped(Exception):
    """The child stopped beating or died; the message is the row's reason."""


def stall_seconds(template_seconds: float) -> float | None:
    """CPU time without a beat after which a child is killed (None: never, when the
    template's time is not limited)."""
    if template_seconds <= 0:
        return None
    return template_seconds + GRACE_SECONDS


def _times(pid: int) -> tuple[float, bool] | None:
    """A process's CPU seconds (user + system) and whether it is asleep (neither running
    nor waiting for a core), from /proc; None where they cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, fields[0] not in ("R",)


class _Watch:
    """Since a child's last beat: the CPU time it computed and the time it slept."""

    def __init__(self) -> None:
        self.beat = -1.0
        self.cpu = 0.0
        self.slept = 0.0
        self.at = time.monotonic()

    def over(self, pid: int, beat: float, stall: float) -> str | None:
        """Why the row must be stopped now, or None."""
        now, times = time.monotonic(), _times(pid)
        if times is None:  # no /proc: wall time stands for CPU time
            if now - beat > WALL_FACTOR * stall:
                return (f"the chat template ran for more than {WALL_FACTOR * stall:g} s "
                        "on the row without ending")
            return None
        cpu, asleep = times
        if beat != self.beat:  # a new row (or batch) began: count from here
            self.beat, self.cpu, self.slept = beat, cpu, 0.0
        elif asleep:
            self.slept += now - self.at
        self.at = now
        if cpu - self.cpu > stall:
            return (f"the chat template computed for more than {stall:g} s of CPU time "
                    "on the row without ending")
        if self.slept > HANG_SECONDS:
            return (f"the row's tokenizing waited {HANG_SECONDS:g} s without computing "
                    "or ending")
        return None


class TokenizingProcess:
    """A child process that tokenizes slices for this one, under the watch described in
    the module docstring. Used by one thread at a time; `close` (or its collection) ends
    the child."""

    def __init__(self, settings: SliceSettings) -> None:
        self.settings = settings
        self._child: Any = None
        self._conn: Connection | None = None
        self._beat: Any = None  # the child's last beat (time.monotonic(), shared)
        self._finalizer: weakref.finalize[Any, TokenizingProcess] | None = None
        self.has_chat_template = False  # the tokenizer's, once `start` loaded it

    def start(self) -> None:
        """Start the child now, if it is not running (it loads the tokenizer)."""
        if self._child is not None and self._child.is_alive():
            return
        self.close()
        context = pool_context()
        self._beat = context.RawValue("d", time.monotonic())
        ours, theirs = context.Pipe(duplex=True)
        child = context.Process(target=_child_main, name="hsx-tokenize", daemon=True,
                                args=(theirs, self._beat, self.settings))
        child.start()
        theirs.close()
        self._child, self._conn = child, ours
        self._finalizer = weakref.finalize(self, _end, child, ours)
        try:
            kind, value = self._answer(SETUP_SECONDS if self.settings.images is None
                                       else IMAGE_SETUP_SECONDS)
        except _Stopped as stopped:
            kind, value = "stopped", stopped
        if kind == "error":
            self.close()
            raise value
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the process that tokenizes with "
                               f"{self.settings.tokenizer_path} did not start: {value}")
        self.has_chat_template = bool(value)

    def batches(self, slc: SourceSlice, skip: int = 0) -> Iterator[TokenizedRows]:
        """The slice's rows from row `skip` on, tokenized, in order; a row that stops its
        child comes as a bad row."""
        delivered, alone_until, killed = skip, 0, 0
        stall = stall_seconds(slc.limits.template_seconds)
        while True:
            self.start()
            conn = self._connection()
            conn.send((slc, delivered, alone_until))
            ended = False
            try:
                while True:
                    kind, value = self._answer(stall)
                    if kind == "end":
                        ended = True
                        return
                    if kind == "error":
                        ended = True
                        raise value
                    if kind != "rows":
                        raise _Stopped(str(value))
                    delivered = value.first + value.rows
                    yield value
            except _Stopped as stopped:
                # Said where the ingestion logs: a good row's rows tokenized again cost
                # the wait that stopped the child, and nothing else would show it.
                log.warning("tokenizing process %s stopped at row %d of a %s slice "
                            "(from %d): %s", self._child.pid if self._child else "?",
                            delivered, slc.kind, slc.start, stopped)
                self.close()
                if delivered >= alone_until:  # one row of the next batch: find it
                    alone_until = delivered + self.settings.batch_rows
                    continue
                killed += 1
                if killed >= KILLED_ROWS:
                    raise TemplateTimeout(
                        f"stopped its tokenizing process on {{row}}: {stopped}",
                        f"{killed} rows of one slice") from None
                yield TokenizedRows.bad_row(delivered, str(stopped),
                                            keep_messages=self.settings.keep_messages,
                                            images=self.settings.images is not None)
                delivered += 1
            finally:
                if not ended:  # left in the middle of a slice (stopped, or closed early)
                    self.close()

    def close(self) -> None:
        """End the child (it is killed: it may be inside a row that never ends)."""
        if self._finalizer is not None:
            self._finalizer()
        self._child = self._conn = self._finalizer = None

    def _connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("the tokenizing process is not running")
        return self._conn

    def _answer(self, stall: float | None) -> tuple[str, Any]:
        """The child's next message; _Stopped (with the row's reason) when it died or did
        not beat for `stall` seconds."""
        conn = self._connection()
        watch = _Watch()
        while True:
            if conn.poll(POLL_S):
                try:
                    message: tuple[str, Any] = conn.recv()
                    return message
                except (EOFError, OSError):
                    raise _Stopped(self._death()) from None
            if not self._child.is_alive():
                raise _Stopped(self._death())
            why = None if stall is None else watch.over(self._child.pid, self._beat.value,
                                                        stall)
            if why is not None:
                raise _Stopped(f"{why} ({limits.TEMPLATE_SECONDS_ENV})")

    def _death(self) -> str:
        self._child.join(5)
        code = self._child.exitcode
        if code == MEMORY_EXIT:
            return (f"the row took more than {MEMORY_BYTES / 2**30:g} GiB of memory to "
                    "tokenize")
        return f"its tokenizing process died (exit code {code}) on the row"


def _end(child: Any, conn: Connection) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.close()
    if child.is_alive():
        child.kill()
    child.join(5)


def _child_main(conn: Connection, beat: Any, settings: SliceSettings) -> None:
    """A tokenizing child: load the tokenizer (and a job's image processor: loading it
    imports torch, seconds that no row's beat would cover), then tokenize the slices
    it is sent."""
    exit_with_parent()
    os.environ[hsx_settings.TOKENIZING_PROCESS.name] = "1"
    limit_memory(MEMORY_BYTES)

    def started() -> None:
        beat.value = time.monotonic()

    limits.row_started = started
    try:
        tokenizer = worker_tokenizer(settings)
        if settings.images is not None:
            settings.images.tokens()
    except MemoryError:
        os._exit(MEMORY_EXIT)
    except BaseException as err:
        conn.send(("error", _sendable(err)))
        return
    conn.send(("ready", bool(getattr(tokenizer, "chat_template", None))))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        slc, skip, alone_until = job
        try:
            for rows in slice_batches(slc, settings, tokenizer, skip, alone_until):
                started()
                conn.send(("rows", rows))
            message: tuple[str, Any] = ("end", None)
        except MemoryError:
            os._exit(MEMORY_EXIT)
        except BaseException as err:  # the parent raises it (a dataset error, a limit)
            message = ("error", _sendable(err))
        started()
        conn.send(message)


def _sendable(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError saying what it was."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


_THREAD = threading.local()


def thread_tokenizer(settings: SliceSettings) -> TokenizingProcess:
    """The calling thread's tokenizing child for `settings` (another settings' ends)."""
    child: TokenizingProcess | None = getattr(_THREAD, "child", None)
    if child is None or child.settings != settings:
        if child is not None:
            child.close()
        child = _THREAD.child = TokenizingProcess(settings)
    return child


def tokenize_slice(slc: SourceSlice, settings: SliceSettings, skip: int = 0
                   ) -> list[TokenizedRows]:
    """A slice's rows tokenized by the calling thread's child: what an executor runs for
    `ingest` (a pool's thread, a Ray task)."""
    return list(thread_tokenizer(settings).batches(slc, skip))


def warm_tokenizer(settings: SliceSettings) -> None:
    """Start the calling thread's child (its tokenizer loads) before its first slice."""
    thread_tokenizer(settings).start()
