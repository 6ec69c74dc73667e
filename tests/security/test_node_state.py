"""What a coordinator keeps on its node besides the outputs, against another user of the
machine: Ray's token (with it, anyone runs code on the cluster) is in an owner-only file.
(An online job's stream is held in Ray's object store, behind that token: no folder of
the machine holds it.) Against the real coordinator of conftest.py."""

from __future__ import annotations

import stat

import psutil
import pytest

from .conftest import SecuredCoordinator

pytestmark = pytest.mark.integration


def test_rays_token_is_the_coordinators_own(coordinator: SecuredCoordinator) -> None:
    """Ray 2.60 writes ~/.ray/auth_token with the umask's mode (0644): readable by every
    user of the machine, who could then run code on the cluster."""
    token = coordinator.home / ".ray" / "auth_token"
    assert token.is_file(), "the coordinator's local Ray runs without a token file"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    # Its Ray asks for the token: the GCS it started runs in token mode.
    family = psutil.Process(coordinator.server.proc.pid).children(recursive=True)
    gcs = [p for p in family if p.name().startswith("gcs_server")]
    assert gcs and all(p.environ().get("RAY_AUTH_MODE") == "token" for p in gcs)
