"""Whether a job may resume the output it names: the manifest found there must hold this
very job, field by field (`manifest_expected`), over an unchanged dataset.

A fingerprint of some fields is not enough: whoever can write the output can copy the
fingerprint of a harmless job beside a spec of their own, and the manifest's spec is
what an earlier hsx ran from (docs/SECURITY.md, "What a job is checked for at submit").
The coordinator asks at submit (scheduler.py), the driver again before it resumes the
output (prepare.py), and the coordinator before it trains on it.
"""

from __future__ import annotations

from typing import Any

from hsx.modelinfo import ModelInfo
from hsx.output import JobMismatch, Manifest, Output
from hsx.spec import JobSpec
from hsx_service.errors import JobRefused

# The job fields a manifest records that a job must equal, field by field, to resume its
# output: what decides the content, and what runs (the tokenizer and whether its own code
# may run, the chat template's arguments, the regeneration).
RESUMED_SPEC_FIELDS = ("model", "tokenizer", "trust_remote_code", "dataset", "layers",
                       "engine", "max_seq_len", "storage_dtype", "unit_tokens",
                       "chat_template_kwargs", "regenerate", "images")


def manifest_expected(spec: JobSpec, info: ModelInfo, layers: list[int]) -> dict[str, Any]:
    """What the manifest of `spec`'s job holds (`Manifest.differences` names): the one
    definition of "the same job" that a found manifest is held to."""
    written = spec.model_dump(mode="json")
    return {
        "job_fingerprint": spec.data_fingerprint(),
        "model": spec.model,
        "architecture": info.architecture,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "layers": list(layers),
        "storage_dtype": spec.storage_dtype,
        "engine": spec.engine,
        "max_seq_len": spec.max_seq_len,
        **{f"spec.{name}": written.get(name) for name in RESUMED_SPEC_FIELDS},
    }


def check_same_job(manifest: Manifest | None, spec: JobSpec, info: ModelInfo,
                   layers: list[int], output: Output) -> None:
    """JobRefused naming the fields, unless `manifest` (found in the job's output; None:
    none is there) holds this very job (`manifest_expected`) over an unchanged dataset.
    The coordinator asks at submit, the driver again before it resumes the output."""
    if manifest is None:
        return
    from hsx.ingest import DatasetError, dataset_fingerprint

    try:
        data_fp = dataset_fingerprint(spec.dataset_spec)
    except DatasetError as err:
        raise JobRefused(f"dataset: {err}") from err
    try:
        manifest.check_same_job(manifest_expected(spec, info, layers), data_fp,
                                output=str(output), dataset=str(spec.dataset_spec))
    except JobMismatch as err:
        raise JobRefused(str(err)) from None
