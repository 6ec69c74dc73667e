"""What a coordinator keeps on its node besides the outputs, against another user of the
machine: Ray's token (with it, anyone runs code on the cluster) is in an owner-only file,
and an online job's stream (the captured states, in /dev/shm) is never written into a
folder someone else made at its predictable name. Against the real coordinator of
conftest.py."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import psutil
import pytest

from hsx.online import Stream, stream_root
from hsx.output import Output
from hsx.wire import JobState
from hsx_workers.tiny_models import ChatDataset

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


def test_an_online_jobs_stream_is_never_a_folder_someone_else_made(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path: Path,
) -> None:
    """Someone else of the machine makes the folder an online job's stream will have
    (its name comes from the output) a link to a folder of theirs, to read the captured
    states or plant units: the job is refused when it would open it, naming the reason,
    and nothing is written through the link."""
    output = coordinator.folder("alice", "online")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    stream = Stream(Output(output).location)  # where the coordinator will look
    root = stream_root()
    root.mkdir(mode=0o700, exist_ok=True)
    assert root.is_dir() and not root.is_symlink()
    stream.path.symlink_to(theirs, target_is_directory=True)
    try:
        alice = coordinator.client()
        job = alice.submit({
            "model": str(tiny_llama), "dataset": str(chat_dataset.path), "output": str(output),
            "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 1024,
            "train": {"online": True, "steps": 2, "eval_prompts": 0}})
        deadline = time.monotonic() + 600
        status = alice.get(job.id)
        while not status.state.finished and not any(theirs.iterdir()):
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
            status = alice.get(job.id)
        if not status.state.finished:
            alice.cancel(job.id)
        assert not list(theirs.iterdir()), "the job wrote into another user's folder"
        assert status.state == JobState.failed
        assert "train.online: the online stream's folder" in (status.last_error or "")
        assert "is a symlink" in (status.last_error or "")
    finally:
        os.unlink(stream.path)
