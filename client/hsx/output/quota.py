"""The byte quota of one job's output (`HSX_QUOTA_BYTES`): its shards and its draft's
checkpoints together, for `hsx extract`, the coordinator and the trainer alike.

Read from the environment each time it is asked (a coordinator sets it once; a trainer
actor inherits it from the process that started Ray)."""

from __future__ import annotations

from pathlib import Path

from hsx import settings

QUOTA_ENV = settings.QUOTA_BYTES.name


def output_quota(quota_bytes: int | None = None) -> int | None:
    """The byte quota for one job's output: the argument, else $HSX_QUOTA_BYTES; None
    (or 0) for no limit. ValueError naming the variable when it is not a number."""
    if quota_bytes is not None:
        return quota_bytes or None
    return settings.QUOTA_BYTES.get()


def folder_bytes(folder: Path) -> int:
    """Bytes of the files below `folder` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
