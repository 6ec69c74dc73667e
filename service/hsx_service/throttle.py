"""How many checks the API runs at once.

A submit's checks (the preflight, the estimate's child process: hsx.ingest.estimate) and
an inspect (`/v1/models/inspect`, its dataset's estimate in a child too) each hold a
request thread, a process allowed several GiB and a core for seconds, up to a minute
for a chat template at its limit or a dataset slow to read. Unbounded, a few users'
requests would take every thread the API has and every core of its node. So at most
`max_user_checks` of one user's and `max_checks` in all run at once (HSX_MAX_USER_CHECKS,
HSX_MAX_CHECKS); one more is answered 429 with `Retry-After` (main.py), before it
does any work. `hsx.Client` waits and tries again.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

RETRY_AFTER_S = 5


class TooBusy(RuntimeError):
    """Too many checks run at once (429); `retry_after` says when to try again."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Checks:
    """The checks running now, by user; `slot` takes one or refuses."""

    def __init__(self, max_checks: int, max_user_checks: int) -> None:
        self.max_checks = max_checks
        self.max_user_checks = max_user_checks
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    @contextmanager
    def slot(self, user: str, what: str) -> Iterator[None]:
        """Hold one of `user`'s check slots while `what` (a submit, an inspect) runs;
        TooBusy when none is free."""
        with self._lock:
            if self._running[user] >= self.max_user_checks:
                raise TooBusy(
                    f"{what}: {user} has {self._running[user]} submits or inspects being "
                    f"checked, the most one user may have at once here "
                    f"(HSX_MAX_USER_CHECKS); try again in {RETRY_AFTER_S} s")
            if self._running.total() >= self.max_checks:
                raise TooBusy(
                    f"{what}: {self._running.total()} submits or inspects are being "
                    f"checked, the most this coordinator runs at once (HSX_MAX_CHECKS); "
                    f"try again in {RETRY_AFTER_S} s")
            self._running[user] += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[user] -= 1
                if not self._running[user]:
                    del self._running[user]
