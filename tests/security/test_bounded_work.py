"""A token holder cannot make the coordinator work without end, nor stall its API:

- a job whose chat template loops for ever (on every row, or in one operation in C) is
  refused at submit after HSX_TEMPLATE_SECONDS of a child process's CPU, naming
  `chat_template_kwargs` (hsx.ingest.estimate);
- a template that blows up in C on one row the submit's sample did not hold makes that
  row a bad row: the process tokenizing it is killed (hsx.ingest.bounded), the job
  ends with the others;
- an inspect of a model whose own template blows up answers with the reason;

and `/healthz` answers within 3 s the whole time."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from hsx.client import JobRefusedError
from hsx_workers.tiny_models import CHAT_TEMPLATE, ChatDataset

from .conftest import TEMPLATE_SECONDS, SecuredCoordinator

pytestmark = pytest.mark.integration

# The template: 10^10 iterations, hours of a core, rendered at submit.
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                "{% endfor %}")
# One operation in C, folded when the template compiles: no line of Python to stop at.
HUGE_POWER = "{{ 7 ** 1000000000 }}"
REFUSED_WITHIN_S = 60  # 2 s of CPU each (conftest.py), two children on CI's 2 cores


def _spec(model: Path, dataset: ChatDataset, output: Path, template: str) -> dict[str, Any]:
    return {"model": str(model), "dataset": str(dataset.path), "output": str(output),
            "layers": [1, 2, 3, 4], "max_seq_len": 256, "unit_tokens": 1024,
            "chat_template_kwargs": {"chat_template": template}}


def test_templates_that_never_end_are_refused_while_the_api_answers(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
) -> None:
    admin = coordinator.client(coordinator.users.admin)
    before = {job.id for job in admin.list()}
    outcomes: dict[str, Any] = {}

    def submit(name: str, template: str) -> None:
        started = time.monotonic()
        try:
            coordinator.client().submit(_spec(tiny_llama, chat_dataset,
                                              coordinator.folder("alice", name), template))
            outcomes[name] = "queued"
        except Exception as err:  # the assertions below say what was expected
            outcomes[name] = err
        outcomes[f"{name} seconds"] = time.monotonic() - started

    submits = [threading.Thread(target=submit, args=("loops", NESTED_LOOPS)),
               threading.Thread(target=submit, args=("power", HUGE_POWER))]
    for thread in submits:
        thread.start()
    client = coordinator.client()
    answered: list[float] = []
    begun = time.monotonic()
    while any(thread.is_alive() for thread in submits):
        assert time.monotonic() - begun < REFUSED_WITHIN_S + 30, outcomes
        started = time.monotonic()
        client.list()
        answered.append(time.monotonic() - started)
        time.sleep(0.25)
    for thread in submits:
        thread.join()

    loops, power = outcomes["loops"], outcomes["power"]
    assert isinstance(loops, JobRefusedError), loops
    assert loops.field == "spec.chat_template_kwargs"
    assert f"the chat template took more than {TEMPLATE_SECONDS} s to render one row" in str(
        loops)
    assert isinstance(power, JobRefusedError), power
    assert power.field == "spec.chat_template_kwargs"
    assert (f"the chat template took more than {TEMPLATE_SECONDS} s to render the dataset's"
            in str(power))
    assert outcomes["loops seconds"] < REFUSED_WITHIN_S
    assert outcomes["power seconds"] < REFUSED_WITHIN_S, outcomes
    # The API answered during the submits, in a moment each time, and right after.
    assert len(answered) >= 10 and max(answered) < 5, answered
    assert {job.id for job in admin.list()} == before
    assert client.ready()


# The tiny template, with one operation in C on the rows that say "boom" (it depends on
# the row, so it is not folded when the template compiles): 9 ** 43046721.
POWER_ON_BOOM = CHAT_TEMPLATE.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{% if messages[0]['content'] == 'boom' %}"
    "{{ 9 ** (9 ** (messages[0]['content'] | length + 4)) }}{% endif %}")
HEALTH_WITHIN_S = 3.0


@contextmanager
def health_probed(url: str) -> Iterator[list[float]]:
    """`/healthz` asked every 0.25 s while the block runs: the seconds of each answer
    (a probe that got none within HEALTH_WITHIN_S counts as infinity)."""
    answered: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=HEALTH_WITHIN_S) as http:
            while not done.is_set():
                started = time.monotonic()
                try:
                    ok = http.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                answered.append(time.monotonic() - started if ok else float("inf"))
                done.wait(0.25)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        yield answered
    finally:
        done.set()
        prober.join(10)


def test_a_row_that_blows_up_past_the_sample_is_a_bad_row_while_the_api_answers(
    coordinator: SecuredCoordinator, tiny_llama: Path, tmp_path: Path,
) -> None:
    rows = [{"messages": [{"role": "user", "content": "boom" if i == 280 else f"hi {i}"},
                          {"role": "assistant", "content": f"an answer to {i}"}]}
            for i in range(300)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    client = coordinator.client()
    with health_probed(coordinator.url) as answered:
        # The submit's estimate samples the first 256 rows: the template passes it.
        job = client.submit({"model": str(tiny_llama), "dataset": str(data),
                             "output": str(coordinator.folder("alice", "out")),
                             "layers": [1, 2, 3, 4],
                             "max_seq_len": 256, "unit_tokens": 1 << 20,
                             "chat_template_kwargs": {"chat_template": POWER_ON_BOOM}})
        final = client.wait(job.id, timeout=600)
    assert len(answered) >= 20 and max(answered) < HEALTH_WITHIN_S, answered
    assert final.state.value == "succeeded", final.last_error
    assert (final.samples_done, final.samples_failed) == (299, 1)
    errors = list(client.iter_errors(job.id))
    assert [e.sample_index for e in errors] == [280]
    assert "computed for more than" in errors[0].reason


def test_inspecting_a_model_whose_template_blows_up_answers_while_the_api_answers(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path: Path,
) -> None:
    model = tmp_path / "bomb-model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 9 ** (9 ** 8) }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    with health_probed(coordinator.url) as answered, httpx.Client(
            base_url=coordinator.url, timeout=120,
            headers={"Authorization": f"Bearer {coordinator.token}"}) as http:
        started = time.monotonic()
        report = http.post("/v1/models/inspect", json={
            "model": str(model), "dataset": str(chat_dataset.path), "max_seq_len": 256})
        seconds = time.monotonic() - started
    assert report.status_code == 200, report.text
    reasons = " ".join(report.json()["reasons"])
    assert "The dataset cannot be ingested: the chat template took more than" in reasons
    assert report.json()["dataset_tokens"] is None
    assert seconds < REFUSED_WITHIN_S
    assert len(answered) >= 4 and max(answered) < HEALTH_WITHIN_S, answered
