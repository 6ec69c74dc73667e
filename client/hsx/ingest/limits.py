"""What one row may cost the process that ingests it, and the time limit on rendering
its chat template.

A job's dataset and chat template (the tokenizer's, or `chat_template_kwargs`'
`chat_template`) come from whoever submits it. These limits bound what one row can
make a process do: the coordinator's job thread, its Ray tasks, a pool's processes,
and the child process that estimates a job at submit (estimate.py). They are read
from the environment of the process that ingests (`IngestLimits.from_env`) and travel
with the slices and settings it hands to others, so the coordinator's hold wherever
the rows are tokenized:

- `HSX_MAX_ROW_BYTES` (16 MiB): a JSON line, a Parquet or Arrow row, an element of a
  JSON array, or a chat's rendered text larger than this is a bad row, recorded with
  its size and skipped; a line is read in bounded chunks to its end, never whole
  (readers.py). 16 MiB of text is about 4M tokens, four times the longest
  `max_seq_len` a job may ask (1,048,576), and 60% above the 10 MB messages that are
  ingested (truncated) today.
- `HSX_MAX_JSON_ARRAY_BYTES` (1 GiB): a `.json` file holding one array cannot be
  streamed and is read whole (about 5x its size in memory once parsed); a larger one
  is refused, with the command that converts it to JSON lines. ShareGPT's 642 MB file
  fits.
- `HSX_TEMPLATE_SECONDS` (10): CPU seconds a row's chat template may take to render
  (the chat, and its prefixes at each assistant turn); past them the rendering is
  interrupted and the row is a bad row. A template renders a real chat in
  milliseconds. TIMED_OUT_ROWS such rows in one batch end the ingestion: a template
  slow on every row would otherwise take that long per row, for hours, and a cancel
  is seen between batches only. At submit, the job's sample rows must all render and
  tokenize within the seconds too (estimate.py), or the job is refused.

The time limit is CPU time of the rendering thread, not wall time: a tokenizing
thread runs at the lowest priority beside the engines, and a slow wall clock there is
no sign of a template that loops. It interrupts Python code (Jinja compiles a template
to Python: its loops, macros and recursion), not one long call into C: a single
operation such as a huge integer power or string repetition runs to its end. So rows
are tokenized in child processes that are killed instead (bounded.py: each rendering
starts with `row_started`, the heartbeat its parent watches; at submit, the estimate's
child: estimate.py).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from hsx import settings
from hsx.progress import human_bytes

MAX_ROW_BYTES_ENV = settings.MAX_ROW_BYTES.name
MAX_JSON_ARRAY_BYTES_ENV = settings.MAX_JSON_ARRAY_BYTES.name
TEMPLATE_SECONDS_ENV = settings.TEMPLATE_SECONDS.name

MAX_ROW_BYTES = int(settings.MAX_ROW_BYTES.default)
MAX_JSON_ARRAY_BYTES = int(settings.MAX_JSON_ARRAY_BYTES.default)
TEMPLATE_SECONDS = settings.TEMPLATE_SECONDS.default
TIMED_OUT_ROWS = 3  # rows of one batch past HSX_TEMPLATE_SECONDS that end an ingestion


@dataclass(frozen=True)
class IngestLimits:
    """The limits of this module, as one process read them (see the module docstring)."""

    row_bytes: int = MAX_ROW_BYTES
    json_array_bytes: int = MAX_JSON_ARRAY_BYTES
    template_seconds: float = TEMPLATE_SECONDS

    @classmethod
    def from_env(cls) -> IngestLimits:
        """The limits set in this process's environment; ValueError naming a bad one."""
        return cls(row_bytes=int(settings.MAX_ROW_BYTES.get()),
                   json_array_bytes=int(settings.MAX_JSON_ARRAY_BYTES.get()),
                   template_seconds=settings.TEMPLATE_SECONDS.get())

    def row_too_large(self, size: int) -> str:
        """The reason a row of `size` bytes is skipped."""
        return (f"the row is {human_bytes(size)}, over the {human_bytes(self.row_bytes)} "
                f"limit ({MAX_ROW_BYTES_ENV})")


def text_bytes(text: str, limit: int) -> int:
    """The UTF-8 size of `text`, exactly when it may be over `limit` (a character is at
    most 4 bytes: a shorter text is not encoded, its characters are counted)."""
    if 4 * len(text) <= limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


# ---------------------------------------------------------------- the time limit


class RenderTimeout(BaseException):
    """Raised in a thread whose `time_limit` ran out, at its next line of Python.

    A BaseException, so that the template's own `except Exception` (Jinja's, the
    caller's fallbacks) does not swallow it: only the `time_limit` caller catches it.
    """


@dataclass
class _Armed:
    clock: int | None  # the thread's CPU clock (None: wall time, where there is none)
    start: float
    seconds: float


_lock = threading.Lock()
_wake = threading.Condition(_lock)
_armed: dict[int, _Armed] = {}
_watcher_pid = 0  # the process whose watcher runs (a forked child starts its own)
_watching_until: float | None = None  # when the watcher looks next (None: when told)


def _now(clock: int | None) -> float:
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def _thread_clock() -> int | None:
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # not on this platform
        return None


# Called as each row's rendering starts (`time_limit`): the heartbeat of a process that
# tokenizes for another (bounded.py sets it in its children), None elsewhere.
row_started: Callable[[], None] | None = None


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise RenderTimeout in this thread once it spent `seconds` of CPU inside the
    block (0 or less: no limit). The exception comes at the next line of Python the
    thread runs: a call into C that never returns is not interrupted. Not nested."""
    if row_started is not None:
        row_started()
    if seconds <= 0:
        yield
        return
    ident = threading.get_ident()
    clock = _thread_clock()
    with _wake:
        _start_watcher()
        _armed[ident] = _Armed(clock, _now(clock), seconds)
        # Woken only when it would look too late: not for each row of a batch.
        if _watching_until is None or time.monotonic() + seconds < _watching_until:
            _wake.notify()
    try:
        yield
    finally:
        with _wake:
            fired = _armed.pop(ident, None) is None
        if fired:  # its exception is raised, or pending yet: it must not come later
            _set_async_exc(ident, None)


def _start_watcher() -> None:
    global _watcher_pid
    if _watcher_pid != os.getpid():
        _watcher_pid = os.getpid()
        threading.Thread(target=_watch, name="hsx-template-time", daemon=True).start()


def _watch() -> None:
    global _watching_until
    with _wake:
        while True:
            wait: float | None = None
            for ident, armed in list(_armed.items()):
                try:
                    left = armed.seconds - (_now(armed.clock) - armed.start)
                except OSError:  # the thread ended without disarming
                    del _armed[ident]
                    continue
                if left <= 0:
                    del _armed[ident]
                    _set_async_exc(ident, RenderTimeout)
                else:
                    # A thread's CPU clock runs at most as fast as the wall clock.
                    wait = left if wait is None else min(wait, left)
            wait = None if wait is None else max(wait, 0.01)
            _watching_until = None if wait is None else time.monotonic() + wait
            _wake.wait(wait)


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `ident` at its next line of Python (None: clear one not
    raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None)


def _forked() -> None:
    """In a forked child: the lock may have been held by the parent's watcher, which
    is not in the child, and the armed threads are the parent's."""
    global _lock, _wake, _armed, _watching_until
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _armed = {}
    _watching_until = None


os.register_at_fork(after_in_child=_forked)
