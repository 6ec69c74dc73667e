"""A job names data and tunes an engine; it never runs code, reads outside its
submitter's roots, nor runs on another Ray cluster than the coordinator's. Each attack
is a submit to the real coordinator of conftest.py, refused with 422 naming the field
and the reason (never where a path resolves to), before any engine starts and with
nothing run or read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx.client import JobRefusedError
from hsx_workers.tiny_models import ChatDataset

from .conftest import SecuredCoordinator

pytestmark = pytest.mark.integration


def _spec(model: Path, dataset: ChatDataset, output: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "dataset": str(dataset.path), "output": str(output),
            "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 1024, **extra}


def _refused(coordinator: SecuredCoordinator, spec: dict[str, Any]) -> JobRefusedError:
    before = {job.id for job in coordinator.client(coordinator.users.admin).list()}
    with pytest.raises(JobRefusedError) as refused:
        coordinator.client().submit(spec)
    assert {job.id for job in coordinator.client(coordinator.users.admin).list()} == before
    return refused.value


def test_engine_options_that_load_code_are_refused(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    # vLLM hands this file to logging.config.dictConfig in the engine: a handler built by
    # calling os.system would run the command.
    log_config = tmp_path / "logging.json"
    log_config.write_text(json.dumps({
        "version": 1,
        "handlers": {"h": {"()": "os.system", "command": f"touch {marker}"}},
        "root": {"handlers": ["h"]},
    }))
    base = _spec(tiny_llama, chat_dataset, coordinator.folder("alice", "out"))
    attacks = {
        "log_config_file": str(log_config),
        "model_class_overrides": {"LlamaForCausalLM": "os.system"},
        "compilation_config": {"backend": "os.system"},
        "ec_transfer_config": {"ec_connector": "os.system"},
        "worker_cls": "os.system",
        "logits_processors": ["builtins.exec"],
        "distributed_executor_backend": "os.system",
    }
    for name, value in attacks.items():
        error = _refused(coordinator, {**base, "vllm": {name: value}})
        assert error.field == "spec.vllm", name
        assert f"{name} is not among the engine options a job may set" in error.message
        assert "max_num_seqs" in error.message and "HSX_ENGINE_OPTIONS" in error.message
    # Listed options take one plain value, and weights are read as data only.
    error = _refused(coordinator, {**base, "vllm": {"max_num_seqs": {"()": "os.system"}}})
    assert "max_num_seqs takes one plain value" in error.message
    error = _refused(coordinator, {**base, "vllm": {"load_format": "tensorizer"}})
    assert "load_format 'tensorizer'" in error.message
    # Models' own code stays the operator's decision.
    error = _refused(coordinator, {**base, "trust_remote_code": True})
    assert "HSX_ALLOW_TRUST_REMOTE_CODE" in error.message
    assert not marker.exists()


def test_paths_outside_the_roots_and_hub_ids_are_refused(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path: Path,
) -> None:
    output = coordinator.folder("alice", "out")
    base = _spec(tiny_llama, chat_dataset, output)
    # A folder dataset inside the roots whose file is a link to a file outside them.
    folder = tmp_path / "linked"
    folder.mkdir()
    (folder / "train.jsonl").symlink_to("/etc/passwd")
    (tmp_path / "passwd.jsonl").symlink_to("/etc/passwd")
    (output.parent / "elsewhere").symlink_to("/var/tmp", target_is_directory=True)
    outside_model = Path("/usr/share")  # exists, outside the roots
    read, write = "is outside the roots alice may read", "is outside the roots alice may write"
    attacks = [
        ("dataset", {"dataset": str(folder)}, read),
        ("dataset", {"dataset": str(tmp_path / "passwd.jsonl")}, read),
        ("dataset", {"dataset": f"file://{tmp_path}/%2e%2e/%2e%2e/%2e%2e/etc/passwd"}, read),
        ("output", {"output": str(output.parent / "elsewhere" / "out")}, write),
        ("model", {"model": str(outside_model)}, read),
        ("tokenizer", {"tokenizer": "/etc"}, read),
        ("model", {"model": "meta-llama/Llama-3.1-8B-Instruct"}, "HSX_ALLOW_HUB"),
        ("tokenizer", {"tokenizer": "org/tokenizer"}, "HSX_ALLOW_HUB"),
        ("dataset", {"dataset": "HuggingFaceH4/ultrachat_200k"}, "HSX_ALLOW_HUB"),
        ("output", {"output": "s3://AKIA:secret@bucket/x"}, "not a bucket name"),
        ("output", {"output": "s3://Bad_Bucket/x"}, "not a bucket name"),
    ]
    for field, change, reason in attacks:
        error = _refused(coordinator, {**base, **change})
        assert error.field == f"spec.{field}", change
        assert reason in error.message, (change, error.message)
        # Where a link leads, and the server's resolved paths, are not the caller's.
        assert "/etc/passwd" not in error.message.replace(change.get("dataset", ""), "")
        assert "/var/tmp" not in error.message and "resolves" not in error.message
    headers = {"Authorization": f"Bearer {coordinator.token}"}
    for body in ({"model": str(output.parent / "elsewhere")}, {"model": "org/name"},
                 {"model": str(tiny_llama), "dataset": str(folder)}):
        inspect = httpx.post(f"{coordinator.url}/v1/models/inspect", headers=headers,
                             json=body, timeout=60)
        assert inspect.status_code == 422, body
    inspect = httpx.post(f"{coordinator.url}/v1/models/inspect", headers=headers,
                         json={"model": str(tiny_llama), "trust_remote_code": True}, timeout=60)
    assert inspect.status_code == 422 and "trust_remote_code" in inspect.json()["message"]


def test_hostile_requests_are_refused(coordinator: SecuredCoordinator, tiny_llama: Path,
                                      chat_dataset: ChatDataset, tmp_path: Path) -> None:
    base = _spec(tiny_llama, chat_dataset, coordinator.folder("alice", "hostile"))
    headers = {"Authorization": f"Bearer {coordinator.token}"}
    # Oversized bodies, declared or streamed without a length: 413 before any parsing.
    huge = {"spec": {**base, "name": "x" * (2 << 20)}}
    too_big = httpx.post(f"{coordinator.url}/v1/jobs", headers=headers, json=huge, timeout=30)
    assert too_big.status_code == 413 and too_big.json()["type"] == "PayloadTooLarge"

    def chunks() -> Iterator[bytes]:
        yield b'{"spec": {"name": "'
        for _ in range(64):
            yield b"y" * 65536
        yield b'"}}'

    streamed = httpx.post(f"{coordinator.url}/v1/jobs", headers=headers, content=chunks(),
                          timeout=30)
    assert streamed.status_code == 413
    # A token that is wrong, of another length, or not ASCII: 401, never a 500.
    for wrong in ("x", coordinator.token + "x", coordinator.token[:-1], "\u00e9" * 12):
        answer = httpx.get(f"{coordinator.url}/v1/jobs", timeout=10,
                           headers={"Authorization": f"Bearer {wrong}".encode()})
        assert answer.status_code == 401, wrong
    # A web page whose DNS name points at this loopback server (DNS rebinding): the
    # browser sends the page's name as the Host, which this server does not answer.
    rebound = httpx.get(f"{coordinator.url}/v1/jobs", timeout=10,
                        headers={**headers, "Host": "attacker.example:8642"})
    assert rebound.status_code == 421 and "attacker.example" in rebound.json()["message"]
    assert coordinator.client().ready()


def test_a_job_cannot_send_the_coordinator_to_another_ray(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
) -> None:
    """`ray_address` names a Ray cluster for `hsx extract`; a coordinator runs every job on
    its own, so a submitted job that names one is refused, not run somewhere else."""
    for address in ("ray://attacker.example:10001", "local", "auto"):
        spec = _spec(tiny_llama, chat_dataset, coordinator.folder("alice", "out"),
                     ray_address=address)
        error = _refused(coordinator, spec)
        assert error.field == "spec.ray_address", address
        assert "this coordinator runs every job on its own Ray" in error.message


def test_a_path_that_cannot_be_read_is_a_422_naming_the_field(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
) -> None:
    """A symlink loop inside alice's own root, as each field: refused naming the field and
    the reason, never an internal error."""
    output = coordinator.folder("alice", "out")
    loop = output.parent / "loop"
    loop.symlink_to(loop)
    for field, change in (("dataset", {"dataset": str(loop)}),
                          ("model", {"model": str(loop)}),
                          ("tokenizer", {"tokenizer": str(loop)}),
                          ("output", {"output": str(loop / "out")})):
        error = _refused(coordinator, {**_spec(tiny_llama, chat_dataset, output), **change})
        assert error.field == f"spec.{field}", change
        assert "cannot be read here (Too many levels of symbolic links)" in error.message
