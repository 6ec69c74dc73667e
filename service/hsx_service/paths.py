"""Where a submitted job may read and write: its dataset and output against allowed roots.

The submit route calls `check_job_paths` before the scheduler sees a job, so a job that
would read `/etc` or write over another user's files is refused with 422 and the field
named. A path is judged by where it really lands: `..` and symlinks are resolved with
`os.path.realpath` (for an output that does not exist yet, its deepest existing parent
is what gets resolved — realpath does exactly that), and containment is decided by path
components, so `/data-evil` is not inside `/data`.

A `file://` URI is checked as the local path it names. Other schemes (`s3://`, ...) are
not local paths; whether they are supported at all is the scheduler's answer.

What this cannot do: a path that is swapped for a symlink after the check (a race with
someone who can already write inside an allowed root) is not caught here.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from hsx.spec import JobSpec
from hsx_service.errors import JobRefused

FILE_SCHEME = "file://"


def local_candidates(field: str, value: str) -> list[str] | None:
    """Every local path `value` may be read as; None when it names no local path.

    A `file://` URI yields both its parsed path and the bare text after the scheme:
    readers in hsx do not all decode URIs the same way, and the check must hold for
    whichever one ends up opening it.
    """
    if "://" not in value:
        return [value]
    if not value.startswith(FILE_SCHEME):
        return None
    parsed = urllib.parse.urlparse(value)
    if parsed.netloc:
        # Not even `localhost`: some readers would take it as the first path component.
        raise JobRefused(
            f"{field}: {value}: file:// URIs must name a local path with no host "
            "(file:///path)"
        )
    return [urllib.parse.unquote(parsed.path), value[len(FILE_SCHEME):]]


def resolve(path: str | Path) -> Path:
    """Where `path` really lands: `~` expanded, symlinks and `..` resolved.

    Relative paths are taken from the server's working directory, as the scheduler
    would take them.
    """
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def within(path: Path, root: Path) -> bool:
    """`path` is `root` or below it, compared by components (both already resolved)."""
    return path == root or path.is_relative_to(root)


def check_path(field: str, value: str, roots: Sequence[Path]) -> None:
    """Raise JobRefused (naming `field`) unless every reading of `value` is inside a root."""
    candidates = local_candidates(field, value)
    if candidates is None:
        return
    resolved_roots = [resolve(root) for root in roots]
    for candidate in candidates:
        real = resolve(candidate)
        if any(within(real, root) for root in resolved_roots):
            continue
        where = f" (resolves to {real})" if str(real) != candidate else ""
        allowed = ", ".join(str(root) for root in resolved_roots) or "none"
        raise JobRefused(
            f"{field}: {value}{where} is outside the server's allowed roots ({allowed})"
        )


def check_job_paths(spec: JobSpec, roots: Sequence[Path] | None) -> None:
    """Refuse a job whose dataset or output lies outside `roots` (None: no restriction)."""
    if roots is None:
        return
    check_path("dataset", spec.dataset, roots)
    check_path("output", spec.output, roots)
