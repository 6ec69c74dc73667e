"""Who is calling: the user behind a request, what that user may see and change, and
where their jobs may read and write.

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

No configuration lets callers in by mistake: a tokens file without a token, a token
shorter than `MIN_TOKEN` characters or one that is an example's placeholder
(`token_problem`) stops the start, naming the file or variable.

Each caller carries their `Roots` (paths.py): an admin the server's allowed roots; a
user their own folder in each allowed root (`<root>/<user>`), or the roots the tokens
file gives them (`roots:`, read and write; `read_roots:`, read only). Every caller also
reads the roots of `HSX_READ_ROOTS`. A tokens file entry:

    {token: ..., user: alice, admin: false, roots: [/nvme/alice], read_roots: [/datasets]}
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hsx_service.paths import Roots, below_root, root_as_given

if TYPE_CHECKING:
    from hsx_service.config import Settings

ANONYMOUS = "anonymous"
OPERATOR = "operator"
# A user name is shown on the dashboard and stored in the ledger: plain characters only.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")
MAX_NAME = 128


class Unauthorized(Exception):
    """A call without a valid identity (401; main.py maps it)."""


@dataclass(frozen=True)
class Caller:
    """The user behind a request, and where their jobs may read and write (None:
    anywhere, on a loopback server without users)."""

    user: str
    admin: bool
    roots: Roots | None

    def may_see(self, owner: str | None) -> bool:
        """Whether this caller may read and change a job owned by `owner` (None: a job
        submitted before users existed, which only admins see)."""
        return self.admin or (owner is not None and owner == self.user)


def caller(user: str, admin: bool, settings: Settings, *,
           roots: Sequence[str | Path] | None = None,
           read_roots: Sequence[str | Path] = ()) -> Caller:
    """The caller `user` with their roots: `roots` if the operator gave them, else the
    server's allowed roots for an admin and the user's own folder in each for a user;
    and, to read only, `read_roots` and the server's `HSX_READ_ROOTS`."""
    allowed = settings.effective_roots()
    read = (*read_roots, *(settings.read_roots or ()))
    if roots is not None:
        return Caller(user, admin, Roots(tuple(roots), read, who=user))
    if allowed is None:
        return Caller(user, admin, None)
    if admin:
        return Caller(user, admin, Roots(tuple(allowed), read))
    own = tuple(below_root(root, user) for root in allowed)
    return Caller(user, admin, Roots(own, read, who=user))


def check_name(name: str, where: str) -> str:
    """A user name as given, or ValueError naming `where`. A name is a folder in each
    allowed root (a user's own roots), so `.` and `..` are none."""
    if not name or len(name) > MAX_NAME or not set(name) <= _NAME_CHARS or (
            set(name) == {"."}):
        raise ValueError(f"{where}: {name!r} is not a user name (1 to {MAX_NAME} letters, "
                         "digits, '.', '_', '@' or '-'; not only dots)")
    return name


MIN_TOKEN = 16
# What the examples of hsx and of others put where a token belongs: a token with one of
# these is someone's placeholder, left as it was (deploy/secrets.example.yaml has one).
_PLACEHOLDER = re.compile(r"replace|change.?me|placeholder|your.?token|\.\.\.|<|>",
                          re.IGNORECASE)


def token_problem(token: str) -> str | None:
    """Why `token` is not one a server may accept; None if it is."""
    if len(token) < MIN_TOKEN:
        return f"is shorter than {MIN_TOKEN} characters"
    if _PLACEHOLDER.search(token):
        return "is an example's placeholder, not a token"
    return None


_MAKE_ONE = "make one with `openssl rand -hex 32`"


@dataclass(frozen=True)
class TokenTable:
    """The tokens a server accepts, each with its caller."""

    entries: tuple[tuple[bytes, Caller], ...]

    @classmethod
    def load(cls, settings: Settings) -> TokenTable:
        """The table of the settings' `HSX_API_TOKEN` and `HSX_TOKENS_FILE`; ValueError
        naming the variable, the file and the entry when one is not usable (the server
        then refuses to start)."""
        entries: list[tuple[bytes, Caller]] = []
        if settings.api_token is not None:
            problem = token_problem(settings.api_token)
            if problem:
                raise ValueError(f"HSX_API_TOKEN (or hsx --token) {problem}: {_MAKE_ONE}")
            entries.append((settings.api_token.encode(), caller(OPERATOR, True, settings)))
        if settings.tokens_file is not None:
            entries.extend(_read_tokens_file(settings.tokens_file, settings))
        seen: set[bytes] = set()
        for token, who in entries:
            if token in seen:
                raise ValueError(f"HSX_TOKENS_FILE {settings.tokens_file}: a token is given "
                                 f"twice (user {who.user})")
            seen.add(token)
        return cls(tuple(entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def caller(self, given: str) -> Caller | None:
        """The caller of token `given`, or None. Every entry is compared (in constant
        time), so the answer's timing says nothing of which token was close."""
        found = None
        data = given.encode()
        for token, who in self.entries:
            if hmac.compare_digest(data, token):
                found = who
        return found


_ENTRY_KEYS = ("token", "user", "admin", "roots", "read_roots")


def _read_tokens_file(path: Path, settings: Settings) -> list[tuple[bytes, Caller]]:
    try:
        data: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"HSX_TOKENS_FILE {path}: cannot be read: {err}") from None
    items = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ValueError(f"HSX_TOKENS_FILE {path}: expected `tokens:` with a list of "
                         "{token, user, admin} entries")
    if not items:
        raise ValueError(f"HSX_TOKENS_FILE {path} lists no token, and would let every "
                         "caller in as an admin: give each user an entry {token, user}, "
                         "or unset HSX_TOKENS_FILE to run without users")
    entries = []
    for number, item in enumerate(items, 1):
        where = f"HSX_TOKENS_FILE {path}, entry {number}"
        if not isinstance(item, dict) or set(item) - set(_ENTRY_KEYS):
            raise ValueError(f"{where}: expected the keys {', '.join(_ENTRY_KEYS)}, got "
                             f"{json.dumps(sorted(item)) if isinstance(item, dict) else item!r}")
        token, user = item.get("token"), item.get("user")
        if not isinstance(token, str) or len(token) < MIN_TOKEN:
            raise ValueError(f"{where}: `token` must be a string of at least {MIN_TOKEN} "
                             "characters")
        problem = token_problem(token)
        if problem:
            raise ValueError(f"{where}: `token` {problem}: {_MAKE_ONE}")
        if not isinstance(user, str):
            raise ValueError(f"{where}: `user` must be a string")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: `admin` must be true or false")
        roots = _entry_roots(item, "roots", where)
        read_roots = _entry_roots(item, "read_roots", where) or ()
        entries.append((token.encode(), caller(check_name(user, where), admin, settings,
                                               roots=roots, read_roots=read_roots)))
    return entries


def _entry_roots(item: dict[str, Any], key: str, where: str) -> tuple[str | Path, ...] | None:
    """An entry's `roots` or `read_roots`: absolute folders and bucket prefixes."""
    if key not in item:
        return None
    given = item[key]
    if not isinstance(given, list) or not all(isinstance(root, str) for root in given):
        raise ValueError(f"{where}: `{key}` must be a list of folders and bucket prefixes")
    for root in given:
        if "://" not in root and not root.startswith(("/", "~")):
            raise ValueError(f"{where}: `{key}`: {root!r} is not an absolute folder or a "
                             "bucket prefix")
    return tuple(root_as_given(root, f"{where}: `{key}`") for root in given)
