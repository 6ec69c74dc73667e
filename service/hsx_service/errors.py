"""The service's error classes: how a job that ran ends, and the coordinator's errors
(mapped to HTTP in one place, main.py).

A job that ran ends with a summary, `JobFailed` or `JobCancelled` (raised by the driver,
runner.py, the engine pool and the dispatcher); the scheduler makes the outcome the
job's state: succeeded, failed, cancelled.

| class | HTTP |
|---|---|
| `JobRefused`: a job that cannot run, refused before anything starts | 422 |
| `JobNotFound` | 404 |
| `JobConflict`: an id reused with a different spec | 409 |
| `NotReady`: the coordinator is still starting (reconciling the ledger) | 503 |
"""

from __future__ import annotations


class JobRefused(ValueError):
    """The job cannot run; nothing was started. The message says why."""


class JobFailed(RuntimeError):
    """The job stopped; committed units stay valid and a rerun resumes the rest."""


class JobCancelled(RuntimeError):
    """The job was cancelled: dispatch stopped, the units handed out committed."""


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
