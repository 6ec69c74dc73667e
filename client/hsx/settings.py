"""Every `HSX_*` environment variable hsx reads, outside the coordinator's own settings.

Each is a `Setting` here, with its type, its default and what it does; modules read one
with `settings.QUOTA_BYTES.get()` (typed, the default when unset), never through
`os.environ` (tests/unit/test_settings.py fails if one does). A variable set to the
empty string counts as unset (`HSX_QUOTA_BYTES=` in a shell script means "no quota"). A
value that does not parse is a ValueError naming the variable and the value. Each is read
when asked for, not at import, so a process that sets one (a test, a Ray worker's
runtime env) is heard; `HSX_FAULT_POINT` is the exception (read once, at import).

The coordinator (`hsx serve`) reads its settings through pydantic-settings instead:
`hsx_service.config.Settings`, one `HSX_<FIELD>` variable per field (HSX_HOST, HSX_PORT,
HSX_LEDGER_PATH, HSX_API_TOKEN, HSX_ALLOWED_ROOTS, ...), each field with its description.
Three names are read both ways: HSX_API_TOKEN (the token a client sends, here; the token
the coordinator requires, there), HSX_QUOTA_BYTES and HSX_INGEST_WORKERS (`hsx extract`
and the trainer here; the coordinator's jobs there).

This module imports nothing of hsx, torch, vLLM or Ray: any module may read a setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One `HSX_*` environment variable: its name, type, default and meaning."""

    name: str
    kind: str
    """Its type, as an operator writes it (`bytes`, `octal file mode`, `0 or 1`, ...)."""
    default: T
    doc: str
    parse: Callable[[str], T]
    """The value from the variable's text; ValueError (with the reason) when it is bad."""
    internal: bool = False
    """Set by hsx itself for processes it starts, not by operators."""

    def raw(self) -> str | None:
        """The variable's text, stripped; None when unset or empty."""
        text = os.environ.get(self.name, "").strip()
        return text or None

    def get(self) -> T:
        """The value now in this process's environment, else the default."""
        text = self.raw()
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError as err:
            raise ValueError(f"{self.name}={text!r} {err}") from None


SETTINGS: dict[str, Setting[Any]] = {}
"""Every setting by its variable's name, in the order below."""


def _register(setting: Setting[T]) -> Setting[T]:
    if setting.name in SETTINGS or not setting.name.startswith("HSX_"):
        raise ValueError(f"setting {setting.name!r}: registered twice, or not HSX_*")
    SETTINGS[setting.name] = setting
    return setting


def get(name: str) -> Any:
    """The value of the setting named `name` (an `HSX_*` variable registered here)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not an hsx setting (hsx.settings lists them)")
    return SETTINGS[name].get()


# ------------------------------------------------------------------ parsers


def _text(raw: str) -> str:
    return raw


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not 0 or 1")


def _count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("is not a whole number") from None
    if value < 0:
        raise ValueError("is negative")
    return value


def _bytes_or_none(raw: str) -> int | None:
    try:
        return int(float(raw)) or None
    except ValueError:
        raise ValueError("is not a number of bytes") from None


def _positive(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError("is not a positive number")
    return value


def _file_mode(raw: str) -> int:
    try:
        mode = int(raw, 8)
    except ValueError:
        mode = -1
    # hsx must read and rewrite its own files; nothing it writes is a program.
    if mode < 0 or mode & ~0o666 or mode & 0o600 != 0o600:
        raise ValueError("is not a file mode hsx can use: give octal read/write bits with "
                         "the owner's both set, e.g. 0600 or 0640")
    return mode


def _nice(raw: str) -> int:
    try:
        return min(int(raw), 19)
    except ValueError:
        raise ValueError("is not a nice value (0 to 19)") from None


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


# ------------------------------------------------------------------ the client

URL = _register(Setting(
    "HSX_URL", "url", "http://127.0.0.1:8642",
    "The coordinator the CLI and `hsx.Client` talk to (`--url` overrides it).", _text))
API_TOKEN: Setting[str | None] = _register(Setting(
    "HSX_API_TOKEN", "string", None,
    "The bearer token the CLI and `hsx.Client` send (`--token` overrides it); the "
    "coordinator reads the same variable as the token it requires.", _text))

# ------------------------------------------------------------------ outputs

OUTPUT_MODE = _register(Setting(
    "HSX_OUTPUT_MODE", "octal file mode", 0o600,
    "Mode of the files hsx creates on local disk (folders get x where r is set): "
    "owner-only by default, `0640` shares an output with the owner's group.", _file_mode))
QUOTA_BYTES: Setting[int | None] = _register(Setting(
    "HSX_QUOTA_BYTES", "bytes", None,
    "Most bytes one job's output may hold, its shards and its draft's checkpoints "
    "together (unset or 0: no limit); a job that would exceed it is refused.",
    _bytes_or_none))
DIRECT_IO = _register(Setting(
    "HSX_DIRECT_IO", "0 or 1", False,
    "1: a shard's body is written to local disk with O_DIRECT, bypassing the page cache "
    "(less CPU per byte, but each write waits for the disk); see "
    "hsx.output.local_storage.DIRECT_ALIGN.", _flag))
BACKGROUND_NICE = _register(Setting(
    "HSX_BACKGROUND_NICE", "nice value", 19,
    "CPU priority of the threads that move, hash and write captured states (0: as the "
    "engine's), so that they run on cores the engine leaves idle.", _nice))
FAULT_POINT = _register(Setting(
    "HSX_FAULT_POINT", "point[:n]", "",
    "Crash tests only: the process SIGKILLs itself the n-th time it passes a named step "
    "of the commit or checkpoint protocol (hsx.output.faults lists them); read at "
    "import.", _text))
FAULT_STATES = _register(Setting(
    "HSX_FAULT_STATES", "kind[:args]", "",
    "Self-check tests only: the states of each unit are made wrong on purpose before the "
    "check (zeros, nan:<sample>, copy_layer, scale:<factor>[:<sample>]; "
    "hsx_workers.state_faults); read by the job's driver for each unit, never by a job.",
    _text))

# ------------------------------------------------------------------ ingestion

INGEST_WORKERS: Setting[int | None] = _register(Setting(
    "HSX_INGEST_WORKERS", "count", None,
    "Slices of a dataset tokenized at once (0: one per core; 1: in the driver's own "
    "process); unset: as many as Ray has CPUs for where Ray is connected, else 1.",
    _count))
MAX_ROW_BYTES = _register(Setting(
    "HSX_MAX_ROW_BYTES", "bytes", float(16 * 2**20),
    "Largest dataset row (a JSON line, a Parquet or Arrow row, a rendered chat) read; a "
    "larger one is recorded as a bad row, unread.", _positive))
MAX_JSON_ARRAY_BYTES = _register(Setting(
    "HSX_MAX_JSON_ARRAY_BYTES", "bytes", float(2**30),
    "Largest `.json` file holding one array that is read (an array is read whole); "
    "larger ones are refused: convert them to JSON lines.", _positive))
TEMPLATE_SECONDS = _register(Setting(
    "HSX_TEMPLATE_SECONDS", "seconds", 10.0,
    "CPU seconds a row's chat template may take to render before the row is recorded "
    "as a bad row.", _positive))
TOKENIZING_PROCESS = _register(Setting(
    "HSX_TOKENIZING_PROCESS", "0 or 1", False,
    "1 in a process that tokenizes slices for the one that ingests (a pool's, a Ray "
    "task's): it then yields its core to the engines.", _flag, internal=True))

# ------------------------------------------------------------------ engines, training

RAY_LOG_TO_DRIVER = _register(Setting(
    "HSX_RAY_LOG_TO_DRIVER", "0 or 1", False,
    "1: the Ray workers' logs (engines, trainer) are printed by the driver too.", _flag))
CACHE = _register(Setting(
    "HSX_CACHE", "folder", Path("~/.cache/hsx"),
    "Where drafts of object-store outputs are trained and downloaded "
    "(`<cache>/drafts/<bucket-and-prefix>-<hash>/draft/`).", _path))
