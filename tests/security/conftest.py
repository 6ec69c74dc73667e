"""One real coordinator for the hostile suite: `hsx serve` (uvicorn, local Ray, vLLM CPU
engines) with a tokens file of three users, and the session's tmp as its allowed root.

The modules of tests/security run on one pytest-xdist worker (tests/conftest.py,
ONE_WORKER) and share this coordinator: each attack is a request against it, answered
with a refusal that names the reason, and nothing is run, read or lost.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hsx.client import Client
from tests.integration.test_service import Coordinator, start_coordinator

# Small enough for the tiny model's jobs, too small for a job over the big dataset.
USER_QUOTA_BYTES = 400 << 20
MAX_ACTIVE_JOBS = 2
TEMPLATE_SECONDS = 2


@dataclass
class Users:
    """The coordinator's tokens: two users and an admin."""

    alice: str = field(default_factory=lambda: secrets.token_hex(16))
    bob: str = field(default_factory=lambda: secrets.token_hex(16))
    admin: str = field(default_factory=lambda: secrets.token_hex(16))

    def tokens_file(self, path: Path) -> Path:
        path.write_text(
            "tokens:\n"
            f"  - {{token: {self.alice}, user: alice}}\n"
            f"  - {{token: {self.bob}, user: bob}}\n"
            f"  - {{token: {self.admin}, user: root, admin: true}}\n")
        path.chmod(0o600)
        return path


@dataclass
class SecuredCoordinator:
    server: Coordinator
    users: Users
    roots: list[Path]

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def token(self) -> str:
        return self.users.alice

    @property
    def log(self) -> Path:
        return self.server.log

    def client(self, token: str | None = None) -> Client:
        """A client with `token` (default: alice's)."""
        return Client(self.url, token=token or self.users.alice, timeout=60)


@pytest.fixture(scope="session")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCoordinator]:
    home = tmp_path_factory.mktemp("secured")
    users = Users()
    roots = [tmp_path_factory.getbasetemp()]
    env = {
        "HSX_API_TOKEN": "",
        "HSX_TOKENS_FILE": str(users.tokens_file(home / "tokens.yaml")),
        "HSX_USER_QUOTA_BYTES": str(USER_QUOTA_BYTES),
        "HSX_MAX_ACTIVE_JOBS": str(MAX_ACTIVE_JOBS),
        # A chat template's seconds (its CPU per row; a row's process killed after 3 x
        # (this + 2) s without a row): short, so the template attacks end soon.
        "HSX_TEMPLATE_SECONDS": str(TEMPLATE_SECONDS),
    }
    server = start_coordinator(home / "ledger.sqlite", roots, home / "serve.log", env=env)
    yield SecuredCoordinator(server, users, roots)
    server.kill()
