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
Any other scheme is refused while roots are set. Bucket names are checked for their
form (lowercase letters, digits, `.` and `-`, 3 to 63 characters) whatever the roots.

Every path a job names is judged: the dataset (and each file a folder dataset will be
read from, symlinks resolved, so a link inside an allowed folder cannot reach
`/etc/shadow`), the output, the model, the tokenizer, the folders a job's images may be
read from (`images.roots`; the rows' image paths are resolved under them at ingestion,
by default the dataset's own folder), and the vLLM options that name paths
(`ENGINE_PATH_OPTIONS`, when the operator allows them). A hub id (a model or
dataset that names no local path: `is_model_hub_id`, `hsx.ingest.is_hub_id`) reads
nothing below the roots; it is accepted only where the operator allows the hub
(`Settings.hub_allowed`): a hub dataset's card may name local files of its own.

What this cannot do: a path that is swapped for a symlink after the check (a race with
someone who can already write inside an allowed root) is not caught here.
"""

from __future__ import annotations

import os
import re
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
# S3's rule for bucket names (GCS and Azure containers are stricter or the same): what
# a key or an endpoint could be confused with (`..`, `/`, upper case, `@`) never passes.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# vLLM engine options that name local paths: checked against the roots when the
# operator lets jobs set them (hsx's own list of engine options has none).
ENGINE_PATH_OPTIONS = ("download_dir", "hf_config_path", "quantization_param_path")


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
    if not _BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise JobRefused(
            f"{field}: {value}: {bucket!r} is not a bucket name (3 to 63 lowercase "
            "letters, digits, '.' and '-', starting and ending with a letter or digit)"
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


def is_model_hub_id(value: str) -> bool:
    """Whether a job's model (or tokenizer) names a hub repository rather than a local
    path: no URI, not spelt as a path, and nothing of that name here."""
    if "://" in value or value.startswith(("/", ".", "~")):
        return False
    return not Path(value).expanduser().exists()


def _hub_refused(field: str, value: str) -> JobRefused:
    return JobRefused(
        f"{field}: {value} names a hub repository, and this server reads only from its "
        "allowed roots (its operator can allow the hub with HSX_ALLOW_HUB=1)")


def check_model_path(field: str, value: str, roots: Sequence[str | Path] | None, *,
                     hub_allowed: bool) -> None:
    """A model or tokenizer: a hub id only where the hub is allowed, else a local path
    inside the roots."""
    if is_model_hub_id(value):
        if not hub_allowed:
            raise _hub_refused(field, value)
        return
    if roots is not None:
        check_path(field, value, roots)


def check_dataset_path(field: str, dataset: str | DatasetSpec,
                       roots: Sequence[str | Path] | None, *, hub_allowed: bool = True) -> None:
    """`check_path` for a dataset (a path, or path and split) and for every local file
    it will be read from; a hub id only where the hub is allowed."""
    from hsx.ingest import is_hub_id

    path = dataset.path if isinstance(dataset, DatasetSpec) else dataset
    if is_hub_id(path):
        if not hub_allowed:
            raise _hub_refused(field, path)
        return
    if roots is None:
        return
    check_path(field, path, roots)
    for file in _local_files(dataset):
        check_path(field, str(file), roots)


def _local_files(dataset: str | DatasetSpec) -> list[Path]:
    """The local files a dataset is read from (a folder's, after choosing its split);
    none for a bucket or a dataset that cannot be resolved (the preflight says why)."""
    from hsx.ingest import DatasetError, resolve_source
    from hsx.ingest.sources import FilesSource

    try:
        source = resolve_source(dataset)
    except (DatasetError, OSError, ValueError):
        return []
    if not isinstance(source, FilesSource):
        return []
    read = {*source.files, *source.fingerprinted}
    return sorted(file.path for file in read if file.path is not None)


def check_job_paths(spec: JobSpec, roots: Sequence[str | Path] | None, *,
                    hub_allowed: bool = True) -> None:
    """Refuse a job that names a path outside `roots` (None: no restriction) or a hub id
    where the hub is not allowed. Covers the model, the tokenizer, the dataset and its
    files, the output, the folders images may be read from (`images.roots`) and the
    vLLM options that name paths."""
    bucket_location("dataset", spec.dataset_spec.path)  # a bucket's name, whatever the roots
    bucket_location("output", spec.output)
    if roots is None and hub_allowed:
        return
    check_dataset_path("dataset", spec.dataset, roots, hub_allowed=hub_allowed)
    check_model_path("model", spec.model, roots, hub_allowed=hub_allowed)
    if spec.tokenizer:
        check_model_path("tokenizer", spec.tokenizer, roots, hub_allowed=hub_allowed)
    if roots is None:
        return
    check_path("output", spec.output, roots)
    # Image paths in the rows are read only under images.roots (hsx.ingest.images), by
    # default the dataset's own folder, judged with the dataset above.
    for i, root in enumerate(spec.images.roots if spec.images is not None else ()):
        check_path(f"images.roots.{i}", root, roots)
    options = spec.vllm.engine_args()
    for name in ENGINE_PATH_OPTIONS:
        value = options.get(name)
        if isinstance(value, str):
            check_path(f"vllm.{name}", value, roots)
