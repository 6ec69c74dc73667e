"""One real coordinator for the hostile suite: `hsx serve` (uvicorn, local Ray, vLLM CPU
engines) with a tokens file of three users, each user's own roots, and a shared root
every user reads.

- `HSX_ALLOWED_ROOTS` is a folder of homes (`homes/alice`, `homes/bob`: each user reads
  and writes only their own; the admin, `root`, all of them). It lies outside the
  session's tmp on purpose: that one is `HSX_READ_ROOTS`, where the tests' models and
  datasets are, which every user reads and nobody writes.
- The coordinator has a home of its own (`HOME`): Ray's token file is made there.

The modules of tests/security run on one pytest-xdist worker (tests/conftest.py,
ONE_WORKER) and share this coordinator: each attack is a request against it, answered
with a refusal that names the reason, and nothing is run, read or lost.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
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
    homes: Path  # HSX_ALLOWED_ROOTS: a folder per user
    shared: Path  # HSX_READ_ROOTS: the session's tmp (models, datasets)
    home: Path  # the coordinator's HOME

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

    def folder(self, user: str, name: str) -> Path:
        """A new folder's path inside `user`'s own root, where their outputs go."""
        own = self.homes / user
        own.mkdir(exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=own)) / name


@pytest.fixture(scope="session")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredCoordinator]:
    state = tmp_path_factory.mktemp("secured")
    home = state / "home"
    home.mkdir()
    users = Users()
    shared = tmp_path_factory.getbasetemp()
    homes = Path(tempfile.mkdtemp(prefix="hsx-homes-"))
    env = {
        "HSX_API_TOKEN": "",
        "HSX_TOKENS_FILE": str(users.tokens_file(state / "tokens.yaml")),
        "HSX_READ_ROOTS": str(shared),
        "HSX_USER_QUOTA_BYTES": str(USER_QUOTA_BYTES),
        "HSX_MAX_ACTIVE_JOBS": str(MAX_ACTIVE_JOBS),
        # A chat template's seconds (its CPU per row; a row's process killed after 3 x
        # (this + 2) s without a row): short, so the template attacks end soon.
        "HSX_TEMPLATE_SECONDS": str(TEMPLATE_SECONDS),
        "HOME": str(home),
    }
    server = start_coordinator(state / "ledger.sqlite", [homes], state / "serve.log",
                               env=env)
    try:
        yield SecuredCoordinator(server, users, homes, shared, home)
    finally:
        server.kill()
        shutil.rmtree(homes, ignore_errors=True)
