"""An output folder is data: nothing found in one decides what a job runs.

Whoever can write a folder under an allowed root can plant an output there: a
manifest whose spec names a tokenizer with its own Python code (outside the roots, with
`trust_remote_code: true`) and a `regenerate:` section, given the fingerprint of a
harmless job, beside real inputs (with their conversations). Submitting that harmless
job must not run the tokenizer's code: the coordinator refuses an output that none of
the user's jobs made, and with `resume_foreign: true` the manifest is compared with
the job field by field. The trainer and the evaluation take the target and its code
from the job, not from the manifest.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.client import ConflictError, JobRefusedError
from hsx.output import Manifest, Output, UnitPlan
from hsx.output.layout import LAYER_CONVENTION
from hsx.spec import JobSpec, TargetModel
from hsx_workers.tiny_models import ChatDataset

from .conftest import SecuredCoordinator

pytestmark = pytest.mark.integration


@pytest.fixture
def hostile_tokenizer(tiny_llama: Path) -> Iterator[tuple[Path, Path]]:
    """(a tokenizer folder outside every allowed root whose own code, once imported,
    writes the marker file; the marker's path)."""
    folder = Path(tempfile.mkdtemp(prefix="hsx-hostile-"))
    marker = folder / "code-ran"
    tokenizer = folder / "tokenizer"
    shutil.copytree(tiny_llama, tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["hostile.HostileTokenizer", None]}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    (tokenizer / "hostile.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class HostileTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    try:
        yield tokenizer, marker
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _harmless(model: Path, dataset: ChatDataset, output: Path, **extra: Any) -> JobSpec:
    return JobSpec(model=str(model), dataset=str(dataset.path), output=str(output),
                   engine="hf", layers=[1, 2, 3, 4], max_seq_len=256, unit_tokens=1 << 20,
                   **extra)


def plant_output(job: JobSpec, tokenizer: Path) -> None:
    """What an attacker writes at `job.output`: the job's real inputs (conversations
    kept, as a regenerating job's are), and a manifest with the harmless job's
    fingerprints whose spec names the hostile tokenizer, its code allowed, and a
    regeneration."""
    from hsx.ingest import ingest
    from hsx.modelinfo import read_model_info

    result = ingest(job.dataset_spec, job.model, job.max_seq_len, job.output,
                    keep_messages=True, job_fingerprint=job.data_fingerprint())
    info = read_model_info(job.model)
    spec = {**job.model_dump(mode="json"), "tokenizer": str(tokenizer),
            "trust_remote_code": True, "regenerate": {"max_tokens": 8}}
    manifest = Manifest(
        hsx_version="0", job_fingerprint=job.data_fingerprint(),
        dataset_fingerprint=result.dataset_fingerprint, model=job.model,
        architecture=info.architecture, num_layers=info.num_layers,
        hidden_size=info.hidden_size, layers=[1, 2, 3, 4],
        layer_convention=LAYER_CONVENTION, storage_dtype="bf16", engine="hf",
        tokenizer_fingerprint=result.tokenizer_fingerprint, max_seq_len=job.max_seq_len,
        num_samples=result.num_samples, num_errors=result.num_errors,
        num_tokens=result.num_tokens,
        units=[UnitPlan(unit=0, rows=(0, result.num_samples), tokens=result.num_tokens)],
        created_at=0.0, spec=spec)
    Output(job.output).publish_manifest(manifest)


def test_a_planted_output_is_refused_and_runs_no_code(
    coordinator: SecuredCoordinator, tiny_llama: Path, chat_dataset: ChatDataset,
    tmp_path: Path, hostile_tokenizer: tuple[Path, Path],
) -> None:
    tokenizer, marker = hostile_tokenizer
    # In alice's own root: whoever can write there (a shell on the node) plants it.
    job = _harmless(tiny_llama, chat_dataset, coordinator.folder("alice", "planted"))
    plant_output(job, tokenizer)
    client = coordinator.client()
    wire = job.model_dump(mode="json", exclude_defaults=True)
    # An output no job of this user made here: refused, whatever its manifest says.
    with pytest.raises(ConflictError, match=r"no job of yours on this coordinator made.*"
                                            r"resume_foreign"):
        client.submit(wire)
    # Adopted on purpose: its manifest is held to the job field by field, and the
    # fields the attacker changed are named.
    with pytest.raises(JobRefusedError) as refused:
        client.submit({**wire, "resume_foreign": True})
    said = str(refused.value)
    for field in ("spec.tokenizer", "spec.trust_remote_code", "spec.regenerate"):
        assert field in said, said
    assert not marker.exists(), "the planted manifest's tokenizer code ran"


def test_the_trainer_takes_the_target_from_the_job_not_the_manifest(
    tmp_path: Path, tiny_llama: Path, hostile_tokenizer: tuple[Path, Path],
) -> None:
    """A manifest rewritten after the extraction names a model with its own code and
    `trust_remote_code: true`: the trainer trains against the job's model, and even
    without a job it never runs a model's code on the manifest's word."""
    pytest.importorskip("speculators.models.eagle3")
    from hsx_workers.trainer import DraftTrainer
    from tests.unit.test_trainer import make_output, spec

    hostile, marker = hostile_tokenizer
    config = json.loads((tiny_llama / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "hostile.HostileConfig"}
    (hostile / "config.json").write_text(json.dumps(config))
    (hostile / "hostile.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig\n"
        "class HostileConfig(LlamaConfig):\n    pass\n")
    root = make_output(tmp_path / "out", tiny_llama)
    manifest_file = root / "manifest.json"
    planted = json.loads(manifest_file.read_text())
    planted["model"] = str(hostile)
    planted["spec"] = {**planted["spec"], "model": str(hostile), "trust_remote_code": True}
    manifest_file.write_text(json.dumps(planted))

    state = DraftTrainer(root, spec(max_steps=1), target=TargetModel(str(tiny_llama))).run()
    assert state.step == 1
    assert not marker.exists(), "the manifest's model code ran"
    # No job (`hsx train OUTPUT`): the manifest's model, read as data, its code not run.
    assert DraftTrainer(root, spec(max_steps=2)).run().step == 2
    assert not marker.exists(), "the manifest's model code ran"
