"""The coordinator's notice board: each job's latest status, encoded once, read by all.

The scheduler posts a job's `JobStatus` whenever it changes (state changes at once,
progress at most a few times a second); the board keeps the latest post per job with
its encodings made once, at posting: the JSON body of `GET /v1/jobs/{id}`, and the SSE
`status` event of `GET /v1/jobs/{id}/events`. A request reads a post (a dict lookup
under a lock): no SQLite, no pydantic, whatever the number of clients.

Event streams wait on one asyncio future per job, resolved by the next post of that job
(posts from other threads wake the event loop with one `call_soon_threadsafe` per post,
not per follower). A follower then sends the latest post's event: a slow one skips to
the newest status instead of queueing old ones, and a post costs the same with one
follower or a thousand.

Who calls what: the scheduler (its own thread, and the routes' threads for submit and
cancel) calls `post`; routes call `get`, `list_json` and, in the event loop, `next`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hsx.wire import JobState, JobStatus


@dataclass(frozen=True)
class Post:
    """One job's status as posted: the object and its two encodings."""

    version: int  # per job, grows with every post
    status: JobStatus
    json: bytes
    event: bytes

    @property
    def finished(self) -> bool:
        return self.status.state.finished


def sse_event(status_json: bytes) -> bytes:
    """One `status` event; JSON has no raw newlines, so it fits one `data:` line."""
    return b"event: status\ndata: " + status_json + b"\n\n"


class StatusBoard:
    """The latest post of every job, in submission order; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posts: dict[str, Post] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[str, asyncio.Future[None]] = {}  # touched in the loop only
        self._following: dict[str, int] = {}  # streams awaiting each job's next post

    def post(self, status: JobStatus) -> Post:
        """Make `status` the job's current one and wake whoever follows the job.

        A status equal to the current one but for `updated_at` replaces it (a GET sees
        the new time) without a new version: it is no news to the event streams.
        """
        body = status.model_dump_json().encode()
        with self._lock:
            previous = self._posts.get(status.id)
            same = previous is not None and previous.status == status.model_copy(
                update={"updated_at": previous.status.updated_at})
            version = (previous.version if same else previous.version + 1) if previous else 1
            post = Post(version, status, body, sse_event(body))
            self._posts[status.id] = post
            loop = self._loop
        if loop is not None and not same:
            with contextlib.suppress(RuntimeError):  # the loop has closed (server stopped)
                loop.call_soon_threadsafe(self._wake, status.id)
        return post

    def get(self, job_id: str) -> Post | None:
        with self._lock:
            return self._posts.get(job_id)

    def list(self, state: JobState | None = None,
             visible: Callable[[str | None], bool] | None = None) -> list[Post]:
        """Posts in submission order (the order jobs were first posted); with `visible`,
        those whose owner it accepts."""
        with self._lock:
            posts = list(self._posts.values())
        return [p for p in posts if (state is None or p.status.state == state)
                and (visible is None or visible(p.status.owner))]

    def list_json(self, state: JobState | None = None,
                  visible: Callable[[str | None], bool] | None = None) -> bytes:
        """The body of `GET /v1/jobs` (a `JobList`), joined from the posts' encodings."""
        return b'{"jobs":[' + b",".join(p.json for p in self.list(state, visible)) + b"]}"

    async def next(self, job_id: str, after: int, timeout: float) -> Post | None:
        """The job's post once its version is above `after`; None after `timeout` s."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is not loop:
                self._loop = loop
                self._waiting = {}
            post = self._posts.get(job_id)
        if post is not None and post.version > after:
            return post
        # No await between the check above and creating the future: a post made since
        # has scheduled its _wake behind this step of the loop, and will resolve it.
        future = self._waiting.get(job_id)
        if future is None or future.done():
            future = loop.create_future()
            self._waiting[job_id] = future
        self._following[job_id] = self._following.get(job_id, 0) + 1
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            return None
        finally:  # also when the stream is cancelled (its client went away)
            self._following[job_id] -= 1
        return self.get(job_id)

    def following(self, job_id: str) -> int:
        """Event streams now waiting for the job's next post."""
        return self._following.get(job_id, 0)

    def _wake(self, job_id: str) -> None:
        future = self._waiting.pop(job_id, None)
        if future is not None and not future.done():
            future.set_result(None)
