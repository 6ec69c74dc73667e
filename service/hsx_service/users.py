"""Who is calling: the user behind a request, and what that user may see and change.

A coordinator tells its callers apart in one of these ways (config.py, docs/SECURITY.md):

| configured | the caller |
|---|---|
| nothing (a loopback server, or one run open on purpose) | `anonymous`, an admin |
| `HSX_API_TOKEN` | `operator`, an admin, when the request carries that token |
| `HSX_TOKENS_FILE` | the user of the token the request carries |
| `HSX_USER_HEADER` | the user the authenticating proxy names in that header |

A token and a tokens file may be used together. Jobs belong to the user who submitted
them; a user lists, reads, follows, cancels and trains only their own, an admin every
job. Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ANONYMOUS = "anonymous"
OPERATOR = "operator"
# A user name is shown on the dashboard and stored in the ledger: plain characters only.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")
MAX_NAME = 128


class Unauthorized(Exception):
    """A call without a valid identity (401; main.py maps it)."""


@dataclass(frozen=True)
class Caller:
    """The user behind a request."""

    user: str
    admin: bool = False

    def may_see(self, owner: str | None) -> bool:
        """Whether this caller may read and change a job owned by `owner` (None: a job
        submitted before users existed, which only admins see)."""
        return self.admin or (owner is not None and owner == self.user)


EVERYONE = Caller(ANONYMOUS, admin=True)


def check_name(name: str, where: str) -> str:
    """A user name as given, or ValueError naming `where`."""
    if not name or len(name) > MAX_NAME or not set(name) <= _NAME_CHARS:
        raise ValueError(f"{where}: {name!r} is not a user name (1 to {MAX_NAME} letters, "
                         "digits, '.', '_', '@' or '-')")
    return name


@dataclass(frozen=True)
class TokenTable:
    """The tokens a server accepts, each with its caller."""

    entries: tuple[tuple[bytes, Caller], ...]

    @classmethod
    def load(cls, api_token: str | None, tokens_file: Path | None) -> TokenTable:
        """The table of `HSX_API_TOKEN` and `HSX_TOKENS_FILE`; ValueError naming the file
        and the entry when the file is not usable (the server then refuses to start)."""
        entries: list[tuple[bytes, Caller]] = []
        if api_token is not None:
            entries.append((api_token.encode(), Caller(OPERATOR, admin=True)))
        if tokens_file is not None:
            entries.extend(_read_tokens_file(tokens_file))
        seen: set[bytes] = set()
        for token, caller in entries:
            if token in seen:
                raise ValueError(f"{tokens_file}: a token is given twice (user {caller.user})")
            seen.add(token)
        return cls(tuple(entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def caller(self, given: str) -> Caller | None:
        """The caller of token `given`, or None. Every entry is compared (in constant
        time), so the answer's timing says nothing of which token was close."""
        found = None
        data = given.encode()
        for token, caller in self.entries:
            if hmac.compare_digest(data, token):
                found = caller
        return found


MIN_TOKEN = 16


def _read_tokens_file(path: Path) -> list[tuple[bytes, Caller]]:
    try:
        data: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"HSX_TOKENS_FILE {path}: cannot be read: {err}") from None
    items = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ValueError(f"HSX_TOKENS_FILE {path}: expected `tokens:` with a list of "
                         "{token, user, admin} entries")
    entries = []
    for number, item in enumerate(items, 1):
        where = f"HSX_TOKENS_FILE {path}, entry {number}"
        if not isinstance(item, dict) or set(item) - {"token", "user", "admin"}:
            raise ValueError(f"{where}: expected the keys token, user and admin, got "
                             f"{json.dumps(sorted(item)) if isinstance(item, dict) else item!r}")
        token, user = item.get("token"), item.get("user")
        if not isinstance(token, str) or len(token) < MIN_TOKEN:
            raise ValueError(f"{where}: `token` must be a string of at least {MIN_TOKEN} "
                             "characters")
        if not isinstance(user, str):
            raise ValueError(f"{where}: `user` must be a string")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: `admin` must be true or false")
        entries.append((token.encode(), Caller(check_name(user, where), admin=admin)))
    return entries
