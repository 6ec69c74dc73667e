"""A job's own measurement of its draft agrees with vLLM serving the draft.

The target: the learnable language whose answers end their turn (`TaskLanguage(ends=
True)`: greedy answers of 1 to 10 tokens, then EOS), 3,000 samples. `hsx extract
job.yaml` with `train:` extracts, trains an EAGLE-3 draft and measures it in vLLM as its
last step (draft/eval.json, the held-out prompts). Then vLLM serves the draft in a
process of its own (tests/integration/serving.py), as a client would use it: new prompts
of the language, greedy, stopping at EOS, up to 64 tokens each. The job's figure must be
within 5% of the server's.

The same engine measures the draft as hsx did before it generated as a server does (the
held-out prompts, `ignore_eos`, at least 8 tokens each): that figure is more than 5% off,
so this target tells the two apart (docs/TRAINING.md, "Measuring the draft in vLLM").
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from hsx.output import Output
from hsx.output.layout import DRAFT_EVAL
from hsx.spec import TrainSpec
from hsx_workers.acceptance import held_out_prompts
from hsx_workers.learnable import (
    SEP_ID,
    TaskLanguage,
    make_learnable_model,
    write_language_dataset,
)

from .serving import measure_serving

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]

SAMPLES = 3000
# 300 steps: the draft accepts ~3.5 tokens a step here (at 150 steps only 2.1). 450
# held-out prompts: on 200 the job's figure was 2% from the server's by the choice of
# prompts alone (a 95% interval of +-3%), too near the 5% this test allows.
TRAIN = {"steps": 300, "val_fraction": 0.15, "val_max_samples": 512, "eval_prompts": 512,
         "seed": 0}
HELD_OUT = 450
SERVED_PROMPTS = 400
SERVED_MAX_TOKENS = 64  # past every greedy answer of the language (at most 10 tokens)
AGREE = 0.05
OLD_MIN_TOKENS = 8  # the former measurement's floor on each prompt's tokens


@dataclass
class Served:
    job_eval: dict[str, Any]
    runs: dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """The short-answer target, a job with `train:` on it, and vLLM serving its draft."""
    work = tmp_path_factory.mktemp("short-answers")
    language = TaskLanguage(seed=0, ends=True)
    # 500 steps, as the learnable fixture: greedy accuracy 0.996 (300 reached 0.92).
    target = make_learnable_model(work / "target", language=language, steps=500)
    dataset = write_language_dataset(work / "tasks.jsonl", SAMPLES, language=language)
    output = work / "out"
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": str(target), "dataset": str(dataset), "output": str(output),
        "max_seq_len": 256, "unit_tokens": 8192, "ray_address": "local", "train": TRAIN}))
    done = subprocess.run([sys.executable, "-m", "hsx.cli", "extract", str(job),
                           "--no-progress"], capture_output=True, text=True, timeout=1800,
                          check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    job_eval = json.loads((output / DRAFT_EVAL).read_text())

    rng = random.Random(7)  # prompts the job never saw (its rows are seeded 1)
    new = [ids[: ids.index(SEP_ID) + 1] for ids, _ in
           (language.sample(rng) for _ in range(SERVED_PROMPTS))]
    held, _ = held_out_prompts(Output(output), TrainSpec.model_validate(TRAIN), HELD_OUT)
    runs = measure_serving(target, job_eval["measurement"]["speculative_config"], {
        "served": {"prompts": new, "max_tokens": [SERVED_MAX_TOKENS] * len(new),
                   "ignore_eos": False},
        "former": {"prompts": [p.token_ids for p in held],
                   "max_tokens": [max(p.max_tokens, OLD_MIN_TOKENS) for p in held],
                   "ignore_eos": True},
    })["runs"]
    return Served(job_eval, runs)


def test_a_jobs_evaluation_agrees_with_vllm_serving_its_draft(served: Served) -> None:
    job, server = served.job_eval, served.runs["served"]
    assert job["error"] is None and job["k"] == 3
    assert job["prompts"] == HELD_OUT and job["prompt_source"] == "held-out samples"
    # As a server: most answers end their turn before their limit.
    assert job["stopped_at_eos"] >= 0.8 * job["prompts"], job
    assert server["stopped_at_eos"] == server["prompts"] == SERVED_PROMPTS, server
    low, high = job["confidence_interval"]
    assert low < job["mean_acceptance_length"] < high and high - low < 0.3, job
    how = job["measurement"]
    assert how["sampling"] == "greedy" and "EOS" in how["stop"], how
    assert how["vllm"] and "delta method" in how["interval"], how
    assert "answer's length" in how["prompts"], how
    assert job["mean_acceptance_length"] >= 2.5, job
    gap = abs(job["mean_acceptance_length"] / server["mean_acceptance_length"] - 1)
    assert gap <= AGREE, (job["mean_acceptance_length"], server)


def test_the_former_measurement_misses_what_serving_accepts(served: Served) -> None:
    """Past each answer's end the target says what it never says to a user, and the
    draft cannot predict it: the former figure falls below the server's."""
    former, server = served.runs["former"], served.runs["served"]
    assert former["stopped_at_eos"] == 0
    gap = 1 - former["mean_acceptance_length"] / server["mean_acceptance_length"]
    assert gap > AGREE, (former, server)
