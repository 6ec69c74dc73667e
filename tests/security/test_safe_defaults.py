"""A coordinator never starts open by accident: `hsx serve` on a non-loopback address
without a token refuses to start (nothing listens), `hsx --token T serve` needs T, a
tokens file that cannot be used stops the start — one with no token at all, on any
address — as do a token shorter than 16 characters and the example Secret's placeholder;
an internal error's text stays in the log."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.helpers import kill_tree
from tests.integration.test_service import _free_port, serve_env

pytestmark = pytest.mark.integration


def _serve(tmp_path: Path, *extra: str, token: str | None = None,
           port: int | None = None) -> list[str]:
    """`hsx [--token T] serve ...` on a ledger of its own."""
    return [sys.executable, "-m", "hsx.cli", *(["--token", token] if token else []),
            "serve", "--port", str(port or _free_port()), "--ledger",
            str(tmp_path / "ledger.sqlite"), *extra]


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    env = {**serve_env([tmp_path]), "HSX_API_TOKEN": "", **more}
    env.pop("HSX_HOST", None)
    return env


def test_a_non_loopback_server_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    port = _free_port()
    refused = subprocess.run(_serve(tmp_path, "--host", "0.0.0.0", port=port),
                             env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "refusing to serve 0.0.0.0 without an API token" in refused.stderr
    assert "HSX_ALLOW_OPEN" in refused.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    # A tokens file that cannot be used stops the start too, naming what is wrong.
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n  - {token: short, user: alice}\n")
    bad = subprocess.run(_serve(tmp_path, "--tokens-file", str(tokens)),
                         env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "at least 16 characters" in bad.stderr, bad.stderr


def _refuses_to_start(command: list[str], env: dict[str, str], port: int) -> str:
    """Run `hsx serve` and return what it said on stderr, having checked that it exited
    with the refusal's code and never listened. A server that starts instead (the
    attack worked) is killed, with everything it started, and the test fails."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/v1/whoami", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.3)
                continue
            raise AssertionError(f"the server started and answered whoami: {answer.text}")
        if proc.poll() is None:
            raise AssertionError("the server neither started nor refused in 120 s")
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 2, stderr
    return stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_a_tokens_file_without_a_token_refuses_to_start(tmp_path: Path, host: str) -> None:
    """An empty tokens file once let everyone in as an admin: whoami answered anonymous,
    admin, and /metrics answered."""
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens: []\n")
    port = _free_port()
    stderr = _refuses_to_start(_serve(tmp_path, "--host", host, port=port),
                               _env(tmp_path, HSX_TOKENS_FILE=str(tokens)), port)
    assert f"HSX_TOKENS_FILE {tokens} lists no token" in stderr
    assert "every caller in as an admin" in stderr


def test_a_short_or_placeholder_token_refuses_to_start(tmp_path: Path) -> None:
    """A token under 16 characters, or the one deploy/secrets.example.yaml ships with (as
    HSX_API_TOKEN, the flag, or a tokens file's entry), is refused naming it."""
    example = Path(__file__).resolve().parents[2] / "deploy" / "secrets.example.yaml"
    (secret, *_) = [doc for doc in yaml.safe_load_all(example.read_text())
                    if doc["metadata"]["name"] == "hsx-api-token"]
    placeholder = secret["stringData"]["HSX_API_TOKEN"]
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  - {{token: {placeholder}, user: alice}}\n")
    for token, extra, env, says in (
            ("short-token", (), {}, "HSX_API_TOKEN (or hsx --token) is shorter than 16"),
            (None, ("--host", "0.0.0.0"), {"HSX_API_TOKEN": "s3cret"},
             "HSX_API_TOKEN (or hsx --token) is shorter than 16"),
            (None, ("--host", "0.0.0.0"), {"HSX_API_TOKEN": placeholder},
             "HSX_API_TOKEN (or hsx --token) is an example's placeholder"),
            (None, ("--host", "0.0.0.0", "--tokens-file", str(tokens)), {},
             "entry 1: `token` is an example's placeholder")):
        port = _free_port()
        stderr = _refuses_to_start(_serve(tmp_path, *extra, token=token, port=port),
                                   _env(tmp_path, **env), port)
        assert says in stderr and "openssl rand -hex 32" in stderr, stderr


def test_the_token_flag_protects_the_server(tmp_path: Path) -> None:
    token = "flag-token-0123456789"
    port = _free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(_serve(tmp_path, token=token, port=port),
                            env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp_path / "serve.log").read_text()[-3000:])
            try:
                httpx.get(f"{url}/healthz", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert httpx.get(f"{url}/v1/jobs", timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/jobs?access_token={token}", timeout=10).status_code != 401
        assert httpx.get(f"{url}/v1/jobs", timeout=10, headers={
            "Authorization": f"Bearer {token}"}).status_code != 401
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
        log.close()
    assert token not in (tmp_path / "serve.log").read_text()
