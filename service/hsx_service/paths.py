"""Where a submitted job may read and write: its dataset and output against allowed roots.

The submit route calls `check_job_paths` before the scheduler sees a job, so a job that
would read `/etc` or write over another user's files is refused with 422 and the field
named. A path is judged by where it really lands: `..` and symlinks are resolved with
`os.path.realpath` (for an output that does not exist yet, its deepest existing parent
is what gets resolved — realpath does exactly that), and containment is decided by path
components, so `/data-evil` is not inside `/data`.

A `file://` URI is checked as the local path it names. A bucket URI (`s3://`, `gs://`,
`az://`) is checked against the bucket roots (`s3://bucket/prefix`): same scheme and
bucket, and the prefix's segments first in the URI's key, so `s3://b/data-evil` is not
inside `s3://b/data`; `.`, `..` and empty segments are refused (storage keys have none).
Any other scheme is refused while roots are set. A dataset is judged the same way, by
its path (a bucket dataset as a bucket output); a hub id (a dataset path that names no
local file, read with `datasets.load_dataset`: `hsx.ingest.is_hub_id`) reads nothing
below the roots and is not checked, as a model's hub id is not.

What this cannot do: a path that is swapped for a symlink after the check (a race with
someone who can already write inside an allowed root) is not caught here.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from hsx.spec import DatasetSpec, JobSpec
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


OBJECT_SCHEMES = ("s3", "gs", "az")


def bucket_location(field: str, value: str) -> tuple[str, str, tuple[str, ...]] | None:
    """(scheme, bucket, key segments) of a bucket URI; None when `value` is not one."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in OBJECT_SCHEMES:
        return None
    bucket, _, key = rest.partition("/")
    segments = tuple(key.rstrip("/").split("/")) if key.rstrip("/") else ()
    if not bucket or any(seg in ("", ".", "..") for seg in segments):
        raise JobRefused(
            f"{field}: {value}: a bucket URI is s3://bucket/prefix with no empty, '.' or "
            "'..' segments"
        )
    return scheme.lower(), bucket, segments


def normalize_root(root: str | Path) -> str | Path:
    """A root as checks compare it: a bucket URI normalized, a local path resolved."""
    text = os.fspath(root)
    try:
        location = bucket_location("allowed root", text)
    except JobRefused as err:
        raise ValueError(str(err)) from None
    if location is not None:
        scheme, bucket, segments = location
        return f"{scheme}://{bucket}" + "".join(f"/{seg}" for seg in segments)
    candidates = local_candidates("allowed root", text)
    if candidates is None:
        raise ValueError(f"allowed root {text!r}: use a directory, file:// or s3://bucket/prefix")
    return resolve(candidates[0])


def resolve(path: str | Path) -> Path:
    """Where `path` really lands: `~` expanded, symlinks and `..` resolved.

    Relative paths are taken from the server's working directory, as the scheduler
    would take them.
    """
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def within(path: Path, root: Path) -> bool:
    """`path` is `root` or below it, compared by components (both already resolved)."""
    return path == root or path.is_relative_to(root)


def check_path(field: str, value: str, roots: Sequence[str | Path]) -> None:
    """Raise JobRefused (naming `field`) unless every reading of `value` is inside a root."""
    normalized = [normalize_root(root) for root in roots]
    allowed = ", ".join(str(root) for root in normalized) or "none"
    location = bucket_location(field, value)
    if location is not None:
        for root in normalized:
            inside = bucket_location("allowed root", str(root)) if isinstance(root, str) else None
            if inside is not None and inside[:2] == location[:2] and (
                location[2][: len(inside[2])] == inside[2]
            ):
                return
        raise JobRefused(f"{field}: {value} is outside the server's allowed roots ({allowed})")
    if "://" in value and not value.startswith(FILE_SCHEME):
        raise JobRefused(
            f"{field}: {value}: only local paths, file:// and bucket URIs inside the "
            f"server's allowed roots ({allowed}) are accepted"
        )
    candidates = local_candidates(field, value) or []
    local_roots = [root for root in normalized if isinstance(root, Path)]
    for candidate in candidates:
        real = resolve(candidate)
        if any(within(real, root) for root in local_roots):
            continue
        where = f" (resolves to {real})" if str(real) != candidate else ""
        raise JobRefused(
            f"{field}: {value}{where} is outside the server's allowed roots ({allowed})"
        )


def check_dataset_path(field: str, dataset: str | DatasetSpec,
                       roots: Sequence[str | Path]) -> None:
    """`check_path` for a dataset (a path, or path and split), unless it is a hub id."""
    from hsx.ingest import is_hub_id

    path = dataset.path if isinstance(dataset, DatasetSpec) else dataset
    if not is_hub_id(path):
        check_path(field, path, roots)


def check_job_paths(spec: JobSpec, roots: Sequence[str | Path] | None) -> None:
    """Refuse a job whose dataset or output lies outside `roots` (None: no restriction)."""
    if roots is None:
        return
    check_dataset_path("dataset", spec.dataset, roots)
    check_path("output", spec.output, roots)
