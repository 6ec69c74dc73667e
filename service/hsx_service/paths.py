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

Roots are per caller (`Roots`, which users.py gives each caller): the folders and
prefixes their jobs may write, and those they may only read. What a job reads — the
dataset (and each file a folder dataset will be read from, symlinks resolved, so a link
inside an allowed folder cannot reach `/etc/shadow`), the model, the tokenizer, the
folders a job's images may be read from (`images.roots`; the rows' image paths are
resolved under them at ingestion, by default the dataset's own folder) and the vLLM
options that name files to read — must lie in either; what it writes — the output, and
`download_dir` — in the first. A hub id (a model or dataset that names no local path:
`is_model_hub_id`, `hsx.ingest.is_hub_id`) reads nothing below the roots; it is
accepted only where the operator allows the hub (`Settings.hub_allowed`): a hub
dataset's card may name local files of its own.

A refusal names the field and the value as the job gave it, and the roots as the
operator wrote them: never where a path resolves to (a link's target is the server's
business, not the submitter's). A local path inside the roots that cannot be looked at
(a symlink loop, a folder without permission) is refused naming the field and the
reason, not where it leads.

What this cannot do: a path that is swapped for a symlink after the check (a race with
someone who can already write inside an allowed root) is not caught here.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
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
# operator lets jobs set them (hsx's own list of engine options has none). The engine
# writes into `download_dir` (a hub model's files) and reads the others.
ENGINE_PATH_OPTIONS = ("download_dir", "hf_config_path", "quantization_param_path")
ENGINE_WRITE_OPTIONS = frozenset({"download_dir"})


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


def root_as_given(root: str | Path, where: str = "allowed root") -> str | Path:
    """A root as the operator wrote it, in one spelling: a bucket URI normalized
    (`s3://bucket/prefix`), a local folder absolute with `~` expanded (its symlinks are
    resolved at each check, `normalize_root`). ValueError naming `where` otherwise."""
    text = os.fspath(root)
    try:
        location = bucket_location(where, text)
    except JobRefused as err:
        raise ValueError(str(err)) from None
    if location is not None:
        scheme, bucket, segments = location
        return f"{scheme}://{bucket}" + "".join(f"/{seg}" for seg in segments)
    try:
        candidates = local_candidates(where, text)
    except JobRefused as err:
        raise ValueError(str(err)) from None
    if candidates is None:
        raise ValueError(f"{where} {text!r}: use a directory, file:// or s3://bucket/prefix")
    return Path(os.path.abspath(os.path.expanduser(candidates[0])))


def normalize_root(root: str | Path) -> str | Path:
    """A root as checks compare it: a bucket URI normalized, a local path resolved."""
    given = root_as_given(root)
    return given if isinstance(given, str) else resolve(given)


def below_root(root: str | Path, name: str) -> str | Path:
    """The folder or prefix `name` inside `root` (as `root_as_given` spells it)."""
    if isinstance(root, Path):
        return root / name
    return f"{root.rstrip('/')}/{name}"


@dataclass(frozen=True)
class Roots:
    """Where one caller's jobs may read and write: local folders and bucket prefixes as
    the operator wrote them (`root_as_given`), resolved at each check.

    `write` holds what a job may write and read (its output), `read` what it may only
    read besides (models, tokenizers, datasets). `who` names the caller in refusals;
    None for the server's own roots (an admin's, the operator's)."""

    write: tuple[str | Path, ...]
    read: tuple[str | Path, ...] = ()
    who: str | None = None

    @property
    def readable(self) -> tuple[str | Path, ...]:
        return (*self.write, *self.read)

    def check_read(self, field: str, value: str) -> None:
        """Refuse (naming `field`) a path a job would read outside these roots."""
        check_path(field, value, self.readable, self._outside("read"))

    def check_write(self, field: str, value: str) -> None:
        """Refuse (naming `field`) a path a job would write outside these roots."""
        check_path(field, value, self.write, self._outside("write"))

    def _outside(self, verb: str) -> str:
        if self.who is None:
            return "the server's allowed roots"
        return f"the roots {self.who} may {verb}"


def resolve(path: str | Path) -> Path:
    """Where `path` really lands: `~` expanded, symlinks and `..` resolved.

    Relative paths are taken from the server's working directory, as the scheduler
    would take them.
    """
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def within(path: Path, root: Path) -> bool:
    """`path` is `root` or below it, compared by components (both already resolved)."""
    return path == root or path.is_relative_to(root)


def check_path(field: str, value: str, roots: Sequence[str | Path],
               outside: str = "the server's allowed roots") -> None:
    """Raise JobRefused (naming `field`) unless every reading of `value` is inside a root
    and can be looked at. `outside` says whose roots they are, in the refusal."""
    allowed = f"{outside} ({', '.join(str(root_as_given(root)) for root in roots) or 'none'})"
    normalized = [normalize_root(root) for root in roots]
    location = bucket_location(field, value)
    if location is not None:
        for root in normalized:
            inside = bucket_location("allowed root", str(root)) if isinstance(root, str) else None
            if inside is not None and inside[:2] == location[:2] and (
                location[2][: len(inside[2])] == inside[2]
            ):
                return
        raise JobRefused(f"{field}: {value} is outside {allowed}")
    if "://" in value and not value.startswith(FILE_SCHEME):
        raise JobRefused(
            f"{field}: {value}: only local paths, file:// and bucket URIs inside {allowed} "
            "are accepted"
        )
    candidates = local_candidates(field, value) or []
    local_roots = [root for root in normalized if isinstance(root, Path)]
    for candidate in candidates:
        if not any(within(resolve(candidate), root) for root in local_roots):
            # Where it resolves to is not said: a link's target is the server's business.
            raise JobRefused(f"{field}: {value} is outside {allowed}")
    for candidate in candidates:
        _check_readable(field, value, candidate)


def _check_readable(field: str, value: str, candidate: str) -> None:
    """Refuse a path inside the roots that cannot be looked at (a symlink loop, a folder
    without permission), naming the field and the reason; one that does not exist yet
    passes (an output to make; a missing input is the preflight's to name)."""
    try:
        os.stat(os.path.expanduser(candidate))
    except FileNotFoundError:
        return
    except OSError as err:
        raise JobRefused(f"{field}: {value} cannot be read here "
                         f"({err.strerror or type(err).__name__})") from None


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


def check_model_path(field: str, value: str, roots: Roots | None, *,
                     hub_allowed: bool) -> None:
    """A model or tokenizer: a hub id only where the hub is allowed, else a local path
    inside the roots the caller may read (None: anywhere)."""
    if is_model_hub_id(value):
        if not hub_allowed:
            raise _hub_refused(field, value)
        return
    if roots is not None:
        roots.check_read(field, value)


def check_dataset_path(field: str, dataset: str | DatasetSpec, roots: Roots | None, *,
                       hub_allowed: bool = True) -> None:
    """A dataset (a path, or path and split) and every local file it will be read from
    inside the roots the caller may read (None: anywhere); a hub id only where the hub
    is allowed."""
    from hsx.ingest import is_hub_id

    path = dataset.path if isinstance(dataset, DatasetSpec) else dataset
    if is_hub_id(path):
        if not hub_allowed:
            raise _hub_refused(field, path)
        return
    if roots is None:
        return
    roots.check_read(field, path)
    for file in _local_files(field, dataset):
        roots.check_read(field, str(file))


def _local_files(field: str, dataset: str | DatasetSpec) -> list[Path]:
    """The local files a dataset is read from (a folder's, after choosing its split);
    none for a bucket or a dataset that cannot be resolved (the preflight says why).
    JobRefused naming `field` when the folder cannot be listed."""
    from hsx.ingest import DatasetError, resolve_source
    from hsx.ingest.sources import FilesSource

    try:
        source = resolve_source(dataset)
    except (DatasetError, ValueError):
        return []
    except OSError as err:
        path = dataset.path if isinstance(dataset, DatasetSpec) else dataset
        raise JobRefused(f"{field}: {path} cannot be read here "
                         f"({err.strerror or type(err).__name__})") from None
    if not isinstance(source, FilesSource):
        return []
    read = {*source.files, *source.fingerprinted}
    return sorted(file.path for file in read if file.path is not None)


def check_job_paths(spec: JobSpec, roots: Roots | None, *, hub_allowed: bool = True) -> None:
    """Refuse a job that names a path outside the caller's `roots` (None: no
    restriction) or a hub id where the hub is not allowed. Covers what the job reads
    (the dataset and its files, the model, the tokenizer, the folders images may be read
    from: `images.roots`, the vLLM options that name files) and what it writes (the
    output, `download_dir`)."""
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
    roots.check_write("output", spec.output)
    # Image paths in the rows are read only under images.roots (hsx.ingest.images), by
    # default the dataset's own folder, judged with the dataset above.
    for i, root in enumerate(spec.images.roots if spec.images is not None else ()):
        roots.check_read(f"images.roots.{i}", root)
    options = spec.vllm.engine_args()
    for name in ENGINE_PATH_OPTIONS:
        value = options.get(name)
        if not isinstance(value, str):
            continue
        if name in ENGINE_WRITE_OPTIONS:
            roots.check_write(f"vllm.{name}", value)
        else:
            roots.check_read(f"vllm.{name}", value)
