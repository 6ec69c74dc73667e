"""The coordinator's error classes, mapped to HTTP in one place (main.py).

| class | HTTP |
|---|---|
| `JobRefused` (prepare.py): a job that cannot run, refused before anything starts | 422 |
| `JobNotFound` | 404 |
| `JobConflict`: an id reused with a different spec | 409 |
| `NotReady`: the coordinator is still starting (reconciling the ledger) | 503 |
"""

from __future__ import annotations

from hsx_service.prepare import JobRefused


class JobNotFound(KeyError):
    def __str__(self) -> str:
        return f"no job {self.args[0]!r}"


class JobConflict(ValueError):
    """The id exists with a different spec."""


class NotReady(RuntimeError):
    """The coordinator has not finished starting."""


def refused_field(err: JobRefused) -> str | None:
    """The job field a refusal names (its messages start with `field: ...`)."""
    head = str(err).split(":", 1)[0].strip()
    return head if head.replace(".", "").replace("_", "").isalnum() and " " not in head else None
