"""The stream of an online job: captured states handed from the engines to the trainer
without ever becoming the output's shards.

An online job (`train: {online: true}`) writes its output's tables (inputs, errors,
manifest, complete.json) and its draft, but no shard. Its engines capture each unit
again for every epoch the trainer needs and commit it into the job's **stream**: a
folder in the output's layout (shards/, commits/, a copy of the manifest) under
`stream_root()` — `/dev/shm` by default, so in memory, not on disk. The trainer follows
the stream's commits, trains on each unit once per epoch and deletes it after the step
that finished it. The stream is bounded (`buffer_bytes`): the driver hands out no unit
while the captured states the trainer has not taken reach it, and says so.

Units of the stream are numbered `epoch * EPOCH_STRIDE + unit` (`stream_unit`), so the
same unit captured for two epochs is two commit records, and the driver's bookkeeping
(attempts, retries, create-if-absent commits) works on them as on any unit.

Exactly once per epoch: the trainer's checkpoint keeps the units (and the samples of
units begun) it trained in the current epoch. Each run of the trainer writes `resume.json`
(a run id, the epoch and units of the checkpoint it resumed from) before it reads
anything; the driver then captures again what that checkpoint had not consumed and what
is no longer in the stream. The trainer drops (deletes unread) what it does not need: a
unit of an epoch before its own, or one its checkpoint already holds.

One node: the engines, the trainer and the driver share the stream's folder. This module
is the one owner of the stream's layout; the driver (hsx_service.online) and the trainer
(hsx_workers.trainer.data) use it.

The stream is private to the user who runs the job: its folder is found again from the
output (a restarted coordinator resumes into it), so its name is predictable, and it
lies in a folder only that user may write (`stream_root`: `/dev/shm/hsx-stream-<uid>`).
Whoever writes the stream (`Stream.open`, and each file the driver or trainer writes)
makes the folders as they must be or refuses to use them (`StreamFolderError`): a root
or stream folder that is a symlink, another user's, or writable by others (the stream
folder: open to others at all) is never written into, so no one else of the machine
reads the captured states or plants units for the trainer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx import settings
from hsx.output.layout import COMMITS_DIR, SHARDS_DIR, commit_path, unit_of_key
from hsx.output.local_storage import replace_output_file

EPOCH_STRIDE = 1_000_000_000  # stream unit = epoch * EPOCH_STRIDE + the job's unit
RESUME = "resume.json"  # the trainer's run: where it resumed
TRAINER = "trainer.json"  # the trainer's state as the driver reads it: running, done, ...
STREAM_DIR_ENV = settings.STREAM_DIR.name
DEFAULT_BUFFER_BYTES = 1 << 30


def stream_unit(epoch: int, unit: int) -> int:
    return epoch * EPOCH_STRIDE + unit


def split_unit(stream: int) -> tuple[int, int]:
    """(epoch, the job's unit) of a stream unit."""
    return divmod(stream, EPOCH_STRIDE)


def stream_root() -> Path:
    """Where this user's streams live: $HSX_STREAM_DIR, else a folder of theirs in
    /dev/shm (memory), else in the temporary folder (`hsx-stream-<uid>`)."""
    named = settings.STREAM_DIR.get()
    if named is not None:
        return named
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"hsx-stream-{os.geteuid()}"


class StreamFolderError(RuntimeError):
    """A stream's folder (or the folder of streams) that others could read or write."""


def _own_folder(path: Path, *, others_may_read: bool) -> None:
    """Make `path` a folder of this user's (0700), or check the one there: a real
    folder, not a link, this user's, not writable by others (nor open to them at all
    unless `others_may_read`). StreamFolderError otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is a symlink or not a folder"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to another user (uid {info.st_uid})"
    elif info.st_mode & (0o022 if others_may_read else 0o077):
        problem = f"is open to other users (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem is not None:
        raise StreamFolderError(
            f"the online stream's folder {path} {problem}: hsx writes captured states "
            f"only into a folder of its user's own. Remove it, or point {STREAM_DIR_ENV} "
            "at a folder of yours")


@dataclass
class Resume:
    """One run of the trainer: where it started (its checkpoint's epoch and units)."""

    run: str
    epoch: int = 0
    units_done: list[int] = field(default_factory=list)


class Stream:
    """The stream of the output at `location` (its `Output.location`)."""

    def __init__(self, location: str, root: Path | None = None) -> None:
        digest = hashlib.sha256(location.encode()).hexdigest()[:16]
        self.root = root or stream_root()
        self.path = self.root / digest
        self.location = location

    def __repr__(self) -> str:
        return f"Stream({self.path})"

    def output(self) -> Any:
        """The stream as an Output (what the engines commit into)."""
        from hsx.output import Output

        self._private()
        return Output(self.path)

    def open(self, manifest_json: str) -> None:
        """Create the folder (this user's only) with a copy of the output's manifest
        (readers check shards against it); the folder of a resumed job is taken again
        if it is this user's own. StreamFolderError otherwise."""
        from hsx.output.layout import MANIFEST

        self._private()
        replace_output_file(self.path / MANIFEST, manifest_json)

    def _private(self) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        _own_folder(self.root, others_may_read=True)
        _own_folder(self.path, others_may_read=False)

    def committed(self) -> set[int]:
        """Stream units committed and not yet taken by the trainer."""
        from hsx.output.output import unit_of_commit_key

        folder = self.path / COMMITS_DIR
        if not folder.is_dir():
            return set()
        return {u for name in os.listdir(folder)
                if (u := unit_of_commit_key(f"{COMMITS_DIR}/{name}")) is not None}

    def buffered(self) -> tuple[int, int]:
        """(shards, bytes) captured and not yet taken by the trainer."""
        folder = self.path / SHARDS_DIR
        shards = size = 0
        if folder.is_dir():
            for entry in os.scandir(folder):
                with_unit = unit_of_key(f"{SHARDS_DIR}/{entry.name}")
                if with_unit is None:
                    continue
                try:
                    size += entry.stat().st_size
                except FileNotFoundError:  # taken meanwhile
                    continue
                shards += 1
        return shards, size

    def take(self, unit: int) -> None:
        """The trainer is done with a stream unit: its record, then its shards, go."""
        (self.path / commit_path(unit)).unlink(missing_ok=True)
        folder = self.path / SHARDS_DIR
        if folder.is_dir():
            for entry in os.scandir(folder):
                if unit_of_key(f"{SHARDS_DIR}/{entry.name}") == unit:
                    Path(entry.path).unlink(missing_ok=True)

    def start_run(self, epoch: int, units_done: list[int]) -> Resume:
        """A trainer run begins from a checkpoint at (`epoch`, `units_done`)."""
        resume = Resume(uuid.uuid4().hex[:12], epoch, sorted(units_done))
        self.set_trainer("running", run=resume.run)
        self._write(RESUME, resume.__dict__)
        return resume

    def resume(self) -> Resume | None:
        body = self._read(RESUME)
        return None if body is None else Resume(**body)

    def set_trainer(self, state: str, **extra: Any) -> None:
        """The trainer's state for the driver: `running`, `waiting` (for units), `done`,
        `stopped`, `failed`."""
        self._write(TRAINER, {"state": state, **extra})

    def trainer(self) -> dict[str, Any] | None:
        return self._read(TRAINER)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def _write(self, name: str, body: dict[str, Any]) -> None:
        self._private()
        replace_output_file(self.path / name, json.dumps(body))

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / name).read_text())
        except FileNotFoundError:
            return None
