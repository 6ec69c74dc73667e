"""Whether a user's new job may join the ledger: the checks of `Scheduler.submit` that
weigh it against the jobs already there (policy.py judges the job alone).

- A user has at most `max_active_jobs` jobs queued or running.
- An output is a job's own: not inside or around another job's output, not at the
  output of a job still running, nor at the output of another user's job (a rerun of
  one's own job at its output resumes it), nor at an output holding a job that none of
  the user's jobs here made (`hsx extract`'s, another coordinator's, or planted by
  whoever can write the folder), unless the job says `resume_foreign: true`.
- A user's jobs hold at most `user_quota_bytes` together: the bytes their jobs have
  committed plus the new job's estimate (`prepare.check_estimated_output`, which is given
  what is left as the job's quota).

Refusals are JobRefused (422) or JobConflict (409), naming the setting that limits.
"""

from __future__ import annotations

from typing import Any

from hsx.progress import human_bytes
from hsx.spec import JobSpec
from hsx_service.board import StatusBoard
from hsx_service.errors import JobConflict, JobRefused
from hsx_service.ledger import Ledger
from hsx_service.prepare import open_output


def nested(inner: str, outer: str) -> bool:
    """Whether location `inner` lies strictly below location `outer` (both as
    `Output.location` gives them: a resolved path, or a bucket URI)."""
    return inner.startswith(outer.rstrip("/") + "/")


class Admission:
    """The checks of one submit by `owner`; see the module docstring."""

    def __init__(self, settings: Any, board: StatusBoard, ledger: Ledger,
                 owner: str | None) -> None:
        self.owner = owner
        self.ledger = ledger
        self.max_active = int(getattr(settings, "max_active_jobs", 0) or 0)
        self.per_job = getattr(settings, "quota_bytes", None) or None
        self.per_user = getattr(settings, "user_quota_bytes", None) or None
        mine = [post.status for post in board.list() if post.status.owner == owner]
        self.active = sum(1 for status in mine if not status.state.finished)
        self.held = sum(status.bytes for status in mine)

    def check_active_jobs(self) -> None:
        """Refuse a job past its user's limit of queued and running jobs."""
        if self.max_active and self.active >= self.max_active:
            raise JobRefused(
                f"{self.owner or 'this user'} has {self.active} jobs queued or running, "
                "the most one user may have here (HSX_MAX_ACTIVE_JOBS); wait for one to "
                "end or cancel one")

    def check_output_place(self, spec: JobSpec) -> None:
        """Refuse an output inside or around another job's, at the output of a job still
        running, at another user's job's, or holding a job that none of this user's jobs
        here made (unless the job asks `resume_foreign`)."""
        output = open_output(spec.output)
        location = output.location
        ours = False
        for other in self.ledger.jobs():
            theirs = open_output(other.output).location
            if theirs == location:
                if not other.state.finished:
                    raise JobConflict(f"output {spec.output} is in use by job {other.id}")
                if other.owner != self.owner:
                    raise JobConflict(f"output {spec.output} holds the output of another "
                                      "user's job; choose another location")
                ours = True
            elif nested(location, theirs) or nested(theirs, location):
                raise JobConflict(f"output {spec.output} would lie inside or around the "
                                  f"output of job {other.id} ({other.output}); choose a "
                                  "location of its own")
        if not ours and not spec.resume_foreign and output.holds_job():
            raise JobConflict(
                f"output {spec.output} holds a job that no job of yours on this coordinator "
                "made; choose another location, or set `resume_foreign: true` to adopt it "
                "(its manifest must then equal this job field by field)")

    def job_quota(self) -> int | None:
        """The quota of the new job's output: the tighter of the per-job quota and what
        is left of the user's; None for no limit."""
        if self.per_user is None:
            return self.per_job
        left = max(self.per_user - self.held, 1)
        return left if self.per_job is None else min(self.per_job, left)

    def check_quota(self, estimate: int | None) -> None:
        """Refuse a job whose user's jobs hold their quota already, or would with the
        job's `estimate` (bytes; None before it is made)."""
        if self.per_user is None:
            return
        if self.held >= self.per_user or self.held + (estimate or 0) > self.per_user:
            raise JobRefused(
                f"output: {self.owner or 'this user'}'s jobs hold {human_bytes(self.held)} "
                f"and this one would write about {human_bytes(estimate or 0)}, more than "
                f"the {human_bytes(self.per_user)} one user may hold here "
                "(HSX_USER_QUOTA_BYTES)")
