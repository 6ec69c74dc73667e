"""A draft training's files in an output (draft/); see docs/TRAINING.md.

The trainer writes them, the coordinator and `hsx` commands read them here: the step
records (metrics.jsonl), the validations (validation.jsonl), the checkpoints and each
one's metrics, the trainer's state (train.json) and vLLM's evaluation (eval.json).

A draft always lives in a local folder (checkpoints are published by folder renames and
hard links; vLLM loads a draft from a folder): the output's own on local disk, else a
working folder (`draft_folder`). For an object-store output, `BucketDraft` copies that
folder's finished checkpoints and its draft/ into `<output>/draft/`, and back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx import settings
from hsx.output.layout import (
    CHECKPOINT_METRICS,
    DRAFT_CHECKPOINTS,
    DRAFT_DIR,
    DRAFT_EVAL,
    DRAFT_METRICS,
    DRAFT_STATE,
    DRAFT_UPLOADED,
    DRAFT_VALIDATION,
    DRAFT_VISITS,
    checkpoint_name,
)
from hsx.output.local_storage import make_output_dirs, open_output_file, replace_output_file
from hsx.output.storage import ObjectExistsError, Storage, StorageError

if TYPE_CHECKING:
    from hsx.output import Output

logger = logging.getLogger(__name__)

CACHE_ENV = settings.CACHE.name
"""The folder under which drafts of object-store outputs are trained and downloaded
(default ~/.cache/hsx): `<cache>/drafts/<bucket-and-prefix>-<hash>/draft/`."""


def cache_root() -> Path:
    return settings.CACHE.get().expanduser()


def draft_folder(output: Output, draft_root: str | Path | None = None) -> Path:
    """The local folder that holds an output's draft/: `draft_root`, else the output's
    own folder on local disk, else (an object store) a working folder in the cache
    named after the output's URI, the same on every machine and run."""
    if draft_root is not None:
        return Path(draft_root).expanduser()
    root = output.local_root
    if root is not None:
        return root
    return _cache_folder("drafts", output.uri)


def _cache_folder(kind: str, uri: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", uri.partition("://")[2]).strip("-.")[:80]
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    return cache_root() / kind / f"{slug}-{digest}"


def draft_view(output: Output) -> Path:
    """A folder whose draft/ shows the output's draft for reading its files (the
    coordinator's status): the output's own on local disk; for an object store a copy
    of the bucket's draft/ as last uploaded (checkpoints not included), refreshed here
    (one GET when nothing changed). Never the trainer's working folder, which runs ahead."""
    root = output.local_root
    if root is not None:
        return root
    view = _cache_folder("views", output.uri)
    try:
        BucketDraft(output.storage, view).pull_draft(tries=1)
    except (StorageError, OSError) as err:
        logger.debug("%s: draft not refreshed: %s", view, err)
    return view


def newest_checkpoint(root: str | Path) -> int | None:
    """The step of the draft's newest checkpoint: in draft/checkpoints/, else (a view of
    a bucket's draft) as the uploaded.json pulled with it names them."""
    saved = checkpoints(root)
    if saved:
        return checkpoint_step(saved[-1])
    marker = read_json(Path(root) / DRAFT_DIR / DRAFT_UPLOADED) or {}
    steps = [s for s in marker.get("checkpoints") or [] if isinstance(s, int)]
    return max(steps, default=None)


def write_draft_json(output: Output, root: Path, name: str, body: dict[str, Any]) -> None:
    """Write draft/`name` in `root` (`write_json`); for an object-store output into the
    bucket's draft/ too, on top of its current files (pulled first)."""
    mirror = bucket_draft(output, root)
    if mirror is not None:
        mirror.pull_draft()
    write_json(root / DRAFT_DIR / name, body)
    if mirror is not None:
        mirror.push_draft()


def fetch_draft(output: Output, draft_root: str | Path | None = None) -> Path:
    """The local folder whose draft/ is the output's draft, for what needs one on disk
    (vLLM): `draft_folder`, with an object-store output's draft/ downloaded into it
    first where it differs. FileNotFoundError when there is no trained draft."""
    root = draft_folder(output, draft_root)
    mirror = bucket_draft(output, root)
    if mirror is not None:
        mirror.pull_draft()
    if not (root / DRAFT_DIR / "config.json").is_file():
        where = output.url(DRAFT_DIR) if mirror is not None else str(root / DRAFT_DIR)
        raise FileNotFoundError(f"no trained draft at {where}; train one with `hsx train "
                                f"{output}`")
    return root


def bucket_draft(output: Output, root: Path) -> BucketDraft | None:
    """The bucket copy of the draft trained in `root`, for an object-store output;
    None on local disk (the draft is in the output already)."""
    return None if output.local_root is not None else BucketDraft(output.storage, root)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order; a line cut by a crash is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent or not (yet) an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_metrics(root: str | Path) -> list[dict[str, Any]]:
    """Every record of draft/metrics.jsonl (one per logged step), in order."""
    return read_jsonl(Path(root) / DRAFT_METRICS)


def read_validation(root: str | Path) -> list[dict[str, Any]]:
    """Every record of draft/validation.jsonl (one per validation), in order."""
    return read_jsonl(Path(root) / DRAFT_VALIDATION)


def read_visits(root: str | Path) -> list[dict[str, Any]]:
    """Every record of draft/visits.jsonl (one per step of a one-worker training: its
    epoch and the sample indices it trained), in order."""
    return read_jsonl(Path(root) / DRAFT_VISITS)


def read_train_state(root: str | Path) -> dict[str, Any] | None:
    """draft/train.json: state, step, plan, best checkpoint, warning, error."""
    return read_json(Path(root) / DRAFT_STATE)


def read_eval(root: str | Path) -> dict[str, Any] | None:
    """draft/eval.json: the draft's acceptance in vLLM, when it has been measured."""
    return read_json(Path(root) / DRAFT_EVAL)


def checkpoints(root: str | Path) -> list[Path]:
    """The draft's checkpoint folders, oldest first. Each is whole: a checkpoint is
    published by renaming its finished folder into draft/checkpoints/."""
    folder = Path(root) / DRAFT_CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if checkpoint_step(p) is not None)


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint folder named by `hsx.output.layout.checkpoint_name`, else None."""
    prefix, _, step = path.name.partition("-")
    return int(step) if prefix == "step" and step.isdigit() else None


def checkpoint_metrics(path: Path) -> dict[str, Any] | None:
    """A checkpoint's own metrics (its step, validation, last training step)."""
    return read_json(path / CHECKPOINT_METRICS)


def expected_acceptance(validation: dict[str, Any] | None) -> float | None:
    """The expected acceptance length a validation record gives, if it has one."""
    if not validation:
        return None
    value = validation.get("expected_acceptance_length")
    return float(value) if isinstance(value, int | float) else None


def last_record(path: Path, window: int = 1 << 16) -> dict[str, Any] | None:
    """The last whole record of a JSON-lines file, reading only its tail."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - window))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            return row
    return None


def write_json(path: Path, body: dict[str, Any]) -> None:
    """Replace a JSON file atomically (readers see the old or the new content)."""
    replace_output_file(path, json.dumps(body, indent=2))


# ---------------------------------------------------------------------- in a bucket

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_=+@,-][A-Za-z0-9._=+@,-]*")  # no /, not hidden
_CHUNK = 64 * 2**20  # bytes per streamed write or ranged read of a draft file
_PULL_TRIES = 20  # reads of draft/ that found it being replaced, before giving up
_PULL_WAIT_S = 0.5


def _files(folder: Path) -> dict[str, os.stat_result]:
    """The files of a draft folder to copy: regular files, not hidden, not temporary."""
    if not folder.is_dir():
        return {}
    return {p.name: p.stat() for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".tmp")
            and p.name != DRAFT_UPLOADED}


class BucketDraft:
    """The draft of an object-store output: the local folder `root` (whose draft/ the
    trainer writes) copied into `<output>/draft/`, and back.

    - `push()` (the trainer's main worker, after each checkpoint and state change):
      every finished local checkpoint the bucket lacks is uploaded to
      `draft/checkpoints/step-N/`, each file streamed, then its `uploaded.json` (naming
      the files and sizes) is created last; checkpoints the trainer deleted are deleted
      in the bucket, marker first. Then draft/'s own files (the best checkpoint's
      weights, metrics.jsonl, train.json, eval.json...) the same way: `uploaded.json`
      deleted, the changed files uploaded, a new `uploaded.json` created.
    - `pull_checkpoints()` (at resume): where the bucket has a newer checkpoint than the
      local folder, its uploaded checkpoints and draft/'s files.
    - `pull_draft()` (eval-draft, vLLM): draft/'s files as its `uploaded.json` names
      them, read again until that marker is the same before and after.

    A reader takes only what an `uploaded.json` names, so a partial upload is never used.
    One writer per output at a time (the coordinator runs one training per job).
    """

    def __init__(self, storage: Storage, root: Path) -> None:
        self.storage = storage
        self.root = Path(root)
        self.draft = self.root / DRAFT_DIR

    def __repr__(self) -> str:
        return f"BucketDraft({self.storage.url(DRAFT_DIR)!r} <-> {str(self.draft)!r})"

    # -- what the bucket holds

    def complete_checkpoints(self) -> dict[int, dict[str, Any]]:
        """The bucket's uploaded checkpoints: step -> its uploaded.json."""
        out = {}
        for step in sorted(self._remote_steps()):
            key = f"{self._ckpt_key(step)}/{DRAFT_UPLOADED}"
            try:
                out[step] = self._read_marker(key)
            except FileNotFoundError:
                continue
        return out

    def _remote_steps(self) -> set[int]:
        """Steps with any object under draft/checkpoints/ (uploaded or not)."""
        steps = set()
        for info in self.storage.list(DRAFT_CHECKPOINTS):
            name = info.key[len(DRAFT_CHECKPOINTS) + 1:].split("/", 1)[0]
            if (step := checkpoint_step(Path(name))) is not None:
                steps.add(step)
        return steps

    def _read_marker(self, key: str, data: bytes | None = None) -> dict[str, Any]:
        """An uploaded.json (read here unless its bytes are given), checked."""
        if data is None:
            data = self.storage.read(key)
        try:
            marker = json.loads(data)
        except ValueError:
            marker = None
        if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
            raise StorageError(f"{self.storage.url(key)} is not an upload marker")
        # The names become local paths: whoever can write the bucket must not reach
        # outside the draft folder (`../`) or write the hidden files it keeps.
        for name in marker["files"]:
            if not _PLAIN_NAME.fullmatch(name):
                raise StorageError(f"{self.storage.url(key)} names {name!r}, not a file of a "
                                   "draft folder")
        return marker

    @staticmethod
    def _ckpt_key(step: int) -> str:
        return f"{DRAFT_CHECKPOINTS}/{checkpoint_name(step)}"

    # -- upload

    def push(self) -> None:
        """Upload what the local draft folder has and the bucket lacks (see the class)."""
        local = {s: p for p in checkpoints(self.root) if (s := checkpoint_step(p)) is not None}
        remote = self.complete_checkpoints()
        for step in sorted(set(local) - set(remote)):
            self._upload_checkpoint(step, local[step])
        if local:
            newest = max(local)
            for step in sorted(self._remote_steps() - set(local)):
                if step < newest:  # deleted here (pruned), or a partial upload of a crash
                    self._delete_checkpoint(step)
        self.push_draft()

    def _upload_file(self, path: Path, key: str) -> int:
        with self.storage.open_writer(key) as writer, path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                writer.write(chunk)
            return writer.finish().size

    def _upload_checkpoint(self, step: int, folder: Path) -> None:
        base = self._ckpt_key(step)
        files = {name: self._upload_file(folder / name, f"{base}/{name}")
                 for name in _files(folder)}
        body = {"step": step, "files": files, "time": time.time()}
        # Taken already only by another writer of the same checkpoint: its files are whole.
        with contextlib.suppress(ObjectExistsError):
            self.storage.create(f"{base}/{DRAFT_UPLOADED}", json.dumps(body).encode())
        logger.info("%s: uploaded checkpoint step %d (%d files)", self, step, len(files))

    def _delete_checkpoint(self, step: int) -> None:
        base = self._ckpt_key(step)
        self.storage.delete(f"{base}/{DRAFT_UPLOADED}")  # no reader takes it from now on
        for info in self.storage.list(base):
            self.storage.delete(info.key)

    def push_draft(self) -> None:
        """Upload draft/'s own files that changed (not the checkpoints), marker last."""
        local = _files(self.draft)
        wanted = {name: {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
                  for name, st in local.items()}
        steps = sorted(s for p in checkpoints(self.root) if (s := checkpoint_step(p)) is not None)
        marker_key = f"{DRAFT_DIR}/{DRAFT_UPLOADED}"
        try:
            marker = self._read_marker(marker_key)
        except FileNotFoundError:
            marker = {"files": {}}
        old: dict[str, Any] = marker["files"]
        steps = steps or marker.get("checkpoints") or []  # (eval-draft's folder has none)
        if old == wanted and marker.get("checkpoints") == steps:
            return
        self.storage.delete(marker_key)
        for name, sig in wanted.items():
            if old.get(name) != sig:
                self._upload_file(self.draft / name, f"{DRAFT_DIR}/{name}")
        for name in old:
            if name not in wanted:
                self.storage.delete(f"{DRAFT_DIR}/{name}")
        body = {"files": wanted, "checkpoints": steps, "nonce": secrets.token_hex(8),
                "time": time.time()}
        self.storage.create(marker_key, json.dumps(body).encode())

    # -- download

    def _download(self, key: str, dest: Path, size: int, mtime_ns: int | None = None) -> None:
        """`key` into `dest` (replaced atomically), checked against the marker's size."""
        tmp = dest.with_name(f".{dest.name}.tmp")
        make_output_dirs(dest.parent)
        with open_output_file(tmp, "wb") as f:
            done = 0
            while done < size:
                n = min(_CHUNK, size - done)
                f.write(self.storage.read_range(key, done, n))
                done += n
            if self.storage.size(key) != size:
                raise StorageError(f"{self.storage.url(key)} is not the size its "
                                   f"{DRAFT_UPLOADED} names ({size})")
            f.flush()
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, dest)

    def pull_checkpoints(self) -> int | None:
        """Where the bucket has a newer uploaded checkpoint than the local folder, make
        the folder the bucket's: draft/'s files, its uploaded checkpoints (the newest
        `keep_checkpoints` and the best), and none it has not (pruned by the run that
        uploaded them). Returns the newest step, or None when nothing was downloaded."""
        remote = self.complete_checkpoints()
        local = {s: p for p in checkpoints(self.root) if (s := checkpoint_step(p)) is not None}
        if not remote or max(remote) <= max(local, default=-1):
            return None
        self.pull_draft()
        for step, path in local.items():
            if step not in remote:
                shutil.rmtree(path)
        for step in sorted(set(remote) - set(local)):
            self._pull_checkpoint(step, remote[step])
        newest = max(remote)
        logger.info("%s: resuming from the bucket's checkpoint step %d", self, newest)
        return newest

    def _pull_checkpoint(self, step: int, marker: dict[str, Any]) -> None:
        name = checkpoint_name(step)
        tmp = self.draft / ".tmp" / f"{name}.pull"
        shutil.rmtree(tmp, ignore_errors=True)
        make_output_dirs(tmp)
        base = self._ckpt_key(step)
        for file, size in marker["files"].items():
            self._download(f"{base}/{file}", tmp / file, int(size))
        final = self.root / DRAFT_CHECKPOINTS / name
        make_output_dirs(final.parent)
        os.rename(tmp, final)  # whole or not at all, as the trainer publishes its own

    def pull_draft(self, tries: int = _PULL_TRIES) -> bool:
        """Make the local draft/ the bucket's (its files, as its uploaded.json names
        them, which is kept beside them); files already the same are kept. False when
        the bucket has no draft. Read again while the trainer replaces it, `tries` times."""
        marker_key = f"{DRAFT_DIR}/{DRAFT_UPLOADED}"
        for _ in range(tries):
            try:
                before = self.storage.read(marker_key)
            except FileNotFoundError:
                if not any(True for _ in self.storage.list(DRAFT_DIR)):
                    return False
                time.sleep(_PULL_WAIT_S)  # being replaced by the trainer
                continue
            files: dict[str, Any] = self._read_marker(marker_key, before)["files"]
            local = _files(self.draft)
            for name, sig in files.items():
                st = local.get(name)
                if st is None or (st.st_size, st.st_mtime_ns) != (sig["size"], sig["mtime_ns"]):
                    self._download(f"{DRAFT_DIR}/{name}", self.draft / name, int(sig["size"]),
                                   int(sig["mtime_ns"]))
            try:
                after = self.storage.read(marker_key)
            except FileNotFoundError:
                after = b""
            if after == before:
                write_json(self.draft / DRAFT_UPLOADED, json.loads(before))
                return True
            time.sleep(_PULL_WAIT_S)
        raise StorageError(f"{self.storage.url(DRAFT_DIR)} kept changing while it was read "
                           "(a training is uploading it); try again")
