"""Two users with their own tokens cannot see, cancel, retrain or overwrite each other's
jobs, nor read or write each other's files; an admin sees both; secrets in a spec are
shown to nobody; a user's queued jobs and bytes are limited. Against the real
coordinator of conftest.py, with a real job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx.client import ConflictError, JobRefusedError, NotFoundError, UnauthorizedError
from hsx.wire import JobState
from hsx_workers.tiny_models import ChatDataset, make_chat_dataset

from .conftest import MAX_ACTIVE_JOBS, SecuredCoordinator

pytestmark = pytest.mark.integration

SECRET = "sk-live-0123456789abcdef"


def _spec(model: Path, dataset: Path, output: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "dataset": str(dataset), "output": str(output),
            "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 1024, **extra}


@pytest.fixture(scope="module")
def small_chats(tmp_path_factory: pytest.TempPathFactory) -> ChatDataset:
    return make_chat_dataset(tmp_path_factory.mktemp("small") / "chats.jsonl", n=12, seed=1)


@pytest.fixture(scope="module")
def alices_job(coordinator: SecuredCoordinator, tiny_llama: Path, small_chats: ChatDataset,
               tmp_path_factory: pytest.TempPathFactory) -> str:
    """Alice's job, run to its end, with a secret among its template's arguments."""
    output = coordinator.folder("alice", "out")
    alice = coordinator.client()
    job = alice.submit(_spec(tiny_llama, small_chats.path, output,
                             chat_template_kwargs={"api_key": SECRET}), job_id="alices")
    final = list(alice.events(job.id))[-1]
    assert final.state == JobState.succeeded, final.last_error
    return job.id


def test_another_users_job_is_not_there_for_bob(
    coordinator: SecuredCoordinator, alices_job: str, tiny_llama: Path,
    small_chats: ChatDataset,
) -> None:
    bob = coordinator.client(coordinator.users.bob)
    alice_sees = coordinator.client().get(alices_job)
    assert alice_sees.owner == "alice"
    assert alices_job not in {job.id for job in bob.list()}
    for attempt in (lambda: bob.get(alices_job), lambda: bob.cancel(alices_job),
                    lambda: bob.errors(alices_job), lambda: bob.train(alices_job),
                    lambda: list(bob.events(alices_job))):
        with pytest.raises(NotFoundError, match=f"no job '{alices_job}'"):
            attempt()
    http = httpx.Client(base_url=coordinator.url, timeout=30,
                        headers={"Authorization": f"Bearer {coordinator.users.bob}"})
    for path in (f"/v1/jobs/{alices_job}/throughput", f"/v1/jobs/{alices_job}/train"):
        assert http.get(path).status_code == 404, path
    # Her id is not his to take; nor her output, a folder in it or around it: all lie
    # in her own root, which he may not write.
    with pytest.raises(ConflictError):
        bob.submit(_spec(tiny_llama, small_chats.path, coordinator.folder("bob", "out")),
                   job_id=alices_job)
    output = Path(alice_sees.output)
    for place in (output, output / "inside", output.parent):
        with pytest.raises(JobRefusedError, match="is outside the roots bob may write") as no:
            bob.submit(_spec(tiny_llama, small_chats.path, place))
        assert no.value.field == "spec.output"
    # Nothing of hers changed: still hers, still succeeded, no training started.
    again = coordinator.client().get(alices_job)
    assert again.state == JobState.succeeded and again.owner == "alice"
    assert http.get(f"/v1/jobs/{alices_job}/train", headers={
        "Authorization": f"Bearer {coordinator.users.alice}"}).status_code == 404


def test_an_admin_sees_every_job_and_metrics(coordinator: SecuredCoordinator,
                                             alices_job: str) -> None:
    admin = coordinator.client(coordinator.users.admin)
    assert alices_job in {job.id for job in admin.list()}
    assert admin.get(alices_job).owner == "alice"
    metrics = httpx.get(f"{coordinator.url}/metrics", timeout=30)
    assert metrics.status_code == 401
    as_alice = httpx.get(f"{coordinator.url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {coordinator.users.alice}"})
    assert as_alice.status_code == 401 and "admin" in as_alice.json()["message"]
    as_admin = httpx.get(f"{coordinator.url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {coordinator.users.admin}"})
    assert as_admin.status_code == 200 and alices_job in as_admin.text
    assert SECRET not in as_admin.text


def test_secrets_in_a_spec_are_shown_to_nobody(coordinator: SecuredCoordinator,
                                               alices_job: str) -> None:
    for token in (coordinator.users.alice, coordinator.users.admin):
        answer = httpx.get(f"{coordinator.url}/v1/jobs/{alices_job}", timeout=30,
                           headers={"Authorization": f"Bearer {token}"})
        assert SECRET not in answer.text
        assert answer.json()["spec"]["chat_template_kwargs"] == {"api_key": "***"}
    listed = httpx.get(f"{coordinator.url}/v1/jobs", timeout=30,
                       headers={"Authorization": f"Bearer {coordinator.users.admin}"})
    assert SECRET not in listed.text
    log = coordinator.log.read_text()
    assert SECRET not in log
    assert all(token not in log for token in (coordinator.users.alice, coordinator.users.bob,
                                              coordinator.users.admin))


def test_who_am_i(coordinator: SecuredCoordinator) -> None:
    for token, user, admin in ((coordinator.users.bob, "bob", False),
                               (coordinator.users.admin, "root", True)):
        answer = httpx.get(f"{coordinator.url}/v1/whoami", timeout=30,
                           headers={"Authorization": f"Bearer {token}"}).json()
        assert answer == {"user": user, "admin": admin, "open": False}
    with pytest.raises(UnauthorizedError):
        coordinator.client("not-a-token-of-this-server").list()


def test_a_users_queue_and_bytes_are_limited(
    coordinator: SecuredCoordinator, alices_job: str, tiny_llama: Path,
    small_chats: ChatDataset, tmp_path: Path,
) -> None:
    bob = coordinator.client(coordinator.users.bob)
    # More than the user quota (conftest.USER_QUOTA_BYTES) by the submit's estimate.
    big = make_chat_dataset(tmp_path / "big.jsonl", n=20000, seed=2)
    with pytest.raises(JobRefusedError, match="quota") as refused:
        bob.submit(_spec(tiny_llama, big.path, coordinator.folder("bob", "big-out")))
    assert refused.value.field == "spec.output"
    # Queued and running jobs: bob's first MAX_ACTIVE_JOBS are taken, the next refused
    # (each runs for seconds: the first is still running when the last is submitted).
    medium = make_chat_dataset(tmp_path / "medium.jsonl", n=300, seed=3)
    jobs = [bob.submit(_spec(tiny_llama, medium.path, coordinator.folder("bob", f"q{i}")))
            for i in range(MAX_ACTIVE_JOBS)]
    with pytest.raises(JobRefusedError, match="HSX_MAX_ACTIVE_JOBS"):
        bob.submit(_spec(tiny_llama, small_chats.path,
                         coordinator.folder("bob", "one-too-many")))
    # Alice is not held up by bob's queue.
    assert coordinator.client().get(alices_job).owner == "alice"
    for job in jobs:
        bob.cancel(job.id)


def test_alice_cannot_read_or_write_bobs_files(
    coordinator: SecuredCoordinator, tiny_llama: Path, small_chats: ChatDataset,
) -> None:
    """Bob's folder is his: alice's job can neither read his dataset (named, through a
    file:// URI, or through a link in her own folder) nor write its output there. Each
    is refused naming the field, without saying where her link leads; nothing is
    queued, and nothing appears in his folder."""
    bobs = coordinator.homes / "bob"
    bobs.mkdir(exist_ok=True)
    private = bobs / "private.jsonl"
    private.write_text(small_chats.path.read_text())
    link = coordinator.folder("alice", "link.jsonl")
    link.symlink_to(private)
    before = sorted(p.name for p in bobs.iterdir())
    admin = coordinator.client(coordinator.users.admin)
    jobs = {job.id for job in admin.list()}
    alice = coordinator.client()
    mine = coordinator.folder("alice", "out")
    for change, field, says in (
            ({"dataset": str(private)}, "dataset", "is outside the roots alice may read"),
            ({"dataset": f"file://{private}"}, "dataset", "is outside the roots alice may read"),
            ({"dataset": str(link)}, "dataset", "is outside the roots alice may read"),
            ({"output": str(bobs / "alice-out")}, "output",
             "is outside the roots alice may write"),
            # Reading is not writing: the shared root is read-only.
            ({"output": str(coordinator.shared / "alice-out")}, "output",
             "is outside the roots alice may write")):
        with pytest.raises(JobRefusedError) as refused:
            alice.submit({**_spec(tiny_llama, small_chats.path, mine), **change})
        assert refused.value.field == f"spec.{field}", change
        assert says in refused.value.message, (change, refused.value.message)
        assert f"({coordinator.homes / 'alice'}" in refused.value.message  # her own roots
    with pytest.raises(JobRefusedError) as linked:
        alice.submit({**_spec(tiny_llama, small_chats.path, mine), "dataset": str(link)})
    assert str(private) not in linked.value.message  # where her link leads is not said
    inspect = httpx.post(f"{coordinator.url}/v1/models/inspect", timeout=60,
                         headers={"Authorization": f"Bearer {coordinator.users.alice}"},
                         json={"model": str(tiny_llama), "dataset": str(private)})
    assert inspect.status_code == 422 and inspect.json()["field"] == "spec.dataset"
    assert {job.id for job in admin.list()} == jobs
    assert sorted(p.name for p in bobs.iterdir()) == before
