"""A token holder cannot make the coordinator work without end: a job whose chat
template loops for ever (on every row, or in one operation in C) is refused at submit
after HSX_TEMPLATE_SECONDS of a child process's CPU, naming `chat_template_kwargs`, and
the API answers the whole time (hsx.ingest.estimate)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.client import JobRefusedError
from hsx_workers.tiny_models import ChatDataset

from .conftest import SecuredCoordinator

pytestmark = pytest.mark.integration

# The template: 10^10 iterations, hours of a core, rendered at submit.
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                "{% endfor %}")
# One operation in C, folded when the template compiles: no line of Python to stop at.
HUGE_POWER = "{{ 7 ** 1000000000 }}"
REFUSED_WITHIN_S = 90  # the default 10 s of CPU each, two children on CI's 2 cores


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
    assert "the chat template took more than 10 s to render one row" in str(loops)
    assert isinstance(power, JobRefusedError), power
    assert power.field == "spec.chat_template_kwargs"
    assert "the chat template took more than 10 s to render the dataset's" in str(power)
    assert outcomes["loops seconds"] < REFUSED_WITHIN_S
    assert outcomes["power seconds"] < REFUSED_WITHIN_S, outcomes
    # The API answered during the submits, in a moment each time, and right after.
    assert len(answered) >= 10 and max(answered) < 5, answered
    assert {job.id for job in admin.list()} == before
    assert client.ready()
