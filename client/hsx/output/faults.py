"""Named fault points in the commit protocol, for crash tests: `HSX_FAULT_POINT`.

`HSX_FAULT_POINT=<point>` (or `<point>:<n>`) makes the process SIGKILL itself the first
(the n-th) time it reaches that step of writing a shard, counting in this process only.
The variable is read once, when `hsx.output` is imported; unset, `reached()` is one
comparison. The job driver hands the variable on to the worker actors it starts
(engine_pool.EnginePool), so `HSX_FAULT_POINT=after_publish hsx extract job.yaml` kills each
worker process at its first publish. The points, in the order a unit's commit takes them
(docs/FORMAT.md, "Commit protocol"):

- `after_shard_write`: the shard's bytes and header are written to its staging file
  (`.tmp/`), not yet fsynced (local disk);
- `after_fsync`: the staging file is fsynced, not yet renamed into `shards/` (local disk);
- `after_publish`: the shard is in `shards/` (renamed and its folder fsynced; on an object
  store, the upload completed), its commit record not yet created;
- `after_commit_record`: the commit record exists, the worker has not yet reported the unit.

The trainer's checkpoints have their own points (workers/hsx_workers/trainer/
draft_trainer.py), in the order a checkpoint takes them; they count every checkpoint, so
`after_checkpoint_write:2` dies while the second checkpoint is written, with the first
one whole behind it:

- `after_checkpoint_write`: the checkpoint's files are written and fsynced in
  `draft/.tmp/step-N/`, not yet renamed into `draft/checkpoints/`;
- `after_checkpoint_rename`: the checkpoint is in `draft/checkpoints/`, not yet
  published into `draft/`;
- `after_checkpoint_publish`: its files are hard-linked into `draft/` (when it is the best
  or the newest), the older checkpoints not yet pruned, train.json not yet rewritten.
"""

from __future__ import annotations

import os
import signal

from hsx import settings
from hsx.output.layout import SHARDS_DIR

ENV = settings.FAULT_POINT.name
COMMIT_POINTS = ("after_shard_write", "after_fsync", "after_publish", "after_commit_record")
CHECKPOINT_POINTS = ("after_checkpoint_write", "after_checkpoint_rename",
                     "after_checkpoint_publish")
POINTS = COMMIT_POINTS + CHECKPOINT_POINTS


def parse(value: str) -> tuple[str, int] | None:
    """(point, n) from the variable's value; None when empty. ValueError names the problem."""
    value = value.strip()
    if not value:
        return None
    point, _, count = value.partition(":")
    if point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: the point must be one of {', '.join(POINTS)}")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: the count after ':' must be a number") from None
    if n < 1:
        raise ValueError(f"{ENV}={value!r}: the count must be >= 1")
    return point, n


_ARMED = parse(settings.FAULT_POINT.get())
_seen = 0


def reached(point: str, key: str) -> None:
    """Step `point` of writing object `key` is done: die here if this is the armed one.

    Of the commit protocol's points only shards count (`key`, the shard's key, is under
    shards/): the inputs table and other objects pass through the same storage writers.
    A checkpoint's points count every checkpoint (`key`: its folder).
    """
    global _seen
    if _ARMED is None or _ARMED[0] != point:
        return
    if point in COMMIT_POINTS and not key.startswith(SHARDS_DIR + "/"):
        return
    _seen += 1
    if _seen == _ARMED[1]:
        os.kill(os.getpid(), signal.SIGKILL)
