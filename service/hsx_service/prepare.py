"""Everything a job does before any engine starts: check it, ingest it, plan it.

A job is refused here (`JobRefused`, with a message that names the problem) when its
model has no usable config, cannot be captured with the chosen engine (the model
preflight, hsx_workers.preflight, says why), a layer id is out of range or not
capturable for that model, the dataset is missing, the output cannot be written, the
estimated output exceeds the free space or quota of the output location, or the output
already holds a different job. Only then does anything heavy start. The output location
is the truth: a manifest found there is reused, committed units are skipped, so running
the same job twice does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx import __version__
from hsx.layout import (
    COMPLETE,
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYER_CONVENTION,
    MANIFEST,
    TMP_DIR,
)
from hsx.modelinfo import ModelConfigError, ModelInfo, read_model_info
from hsx.plan import WorkUnit, plan_units
from hsx.shards import committed_units
from hsx.spec import JobSpec

logger = logging.getLogger(__name__)

# A byte quota for one job's output, when the operator sets one (0 or unset: none).
QUOTA_ENV = "HSX_QUOTA_BYTES"


class JobRefused(ValueError):
    """The job cannot run; nothing was started. The message says why."""


@dataclass
class PreparedJob:
    spec: JobSpec
    model: ModelInfo
    layers: list[int]
    output: Path
    manifest: dict[str, Any]
    units: list[WorkUnit]
    pending: list[WorkUnit]
    complete: bool

    @property
    def samples_total(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def tokens_total(self) -> int:
        return sum(u.tokens for u in self.units)


def output_path(output: str) -> Path:
    """Local path of an output URI; other schemes are refused with the reason."""
    from hsx.dataset import resolve_output

    try:
        return resolve_output(output)
    except ValueError as err:
        raise JobRefused(f"output: {err}") from None


def _check_writable(root: Path) -> None:
    try:
        (root / TMP_DIR).mkdir(parents=True, exist_ok=True)
        probe = root / TMP_DIR / f"probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"hsx")
        probe.unlink()
    except OSError as err:
        raise JobRefused(f"output: {root} is not writable: {err.strerror or err}") from None


def preflight(spec: JobSpec) -> tuple[ModelInfo, list[int], Path]:
    """The checks that need no engine; raise JobRefused on the first problem."""
    try:
        info = read_model_info(spec.model)
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    layers = spec.layers if spec.layers is not None else info.default_layers(spec.engine)
    try:
        info.check_layers(layers, spec.engine)
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    check_capturable(spec, info, layers)
    check_engine_args(spec, info)
    if not Path(spec.dataset).exists():
        raise JobRefused(f"dataset: {spec.dataset} does not exist")
    if spec.engine == "hf" and spec.tensor_parallel_size > 1:
        raise JobRefused(
            "tensor_parallel_size: the hf engine runs on one device; use engine: vllm for "
            "tensor parallelism"
        )
    root = output_path(spec.output)
    _check_writable(root)
    return info, layers, root


# The estimate refuses only a job it finds clearly too big: a dataset's first rows are
# not a random sample. Jobs below this margin get the exact check after ingestion.
ESTIMATE_MARGIN = 2.0


def check_estimated_output(spec: JobSpec, info: ModelInfo, layers: list[int], root: Path,
                           quota_bytes: int | None = None) -> None:
    """Refuse, before ingestion, a new job whose output is estimated (from its first rows
    and its row count) at more than ESTIMATE_MARGIN x the quota or the free space.

    For the coordinator's submit, so that such a job gets a 422 instead of failing after
    ingestion; `prepare` checks the exact size once the dataset is tokenized. Takes what
    `preflight` returned.
    """
    if (root / MANIFEST).exists():
        return  # a rerun: ingested already, prepare checks the exact size
    quota = output_quota(quota_bytes)
    free = shutil.disk_usage(root).free  # preflight has made it
    limit, what = (quota, "the quota") if quota is not None and quota < free else (
        free, f"the free space of {root}")
    from hsx.ingest import estimate_tokens

    try:
        tokens, rows, sampled = estimate_tokens(
            spec.dataset, spec.tokenizer or spec.model, spec.max_seq_len,
            chat_template_kwargs=spec.chat_template_kwargs,
            trust_remote_code=spec.trust_remote_code)
    except Exception as err:
        logger.info("no output estimate for %s: %s", spec.dataset, err)
        return
    per_token = info.bytes_per_token(len(layers))[spec.storage_dtype]
    need = tokens * per_token
    if need > ESTIMATE_MARGIN * limit:
        raise JobRefused(
            f"output: the job would write about {_human(need)} (estimated from the first "
            f"{sampled} of {rows} rows: {tokens:,.0f} tokens x {per_token} bytes of "
            f"{len(layers)} layers in {spec.storage_dtype}), more than {what} "
            f"({_human(limit)}); use fewer layers, storage_dtype fp8, or a smaller dataset"
        )


def warm_preflight() -> None:
    """Import what a submit's preflight imports (vLLM's model registry, transformers'
    tokenizers), so the first submit answers as fast as the next ones instead of paying
    tens of seconds of imports inside its request. The coordinator calls it before it
    says it is ready."""
    try:
        from hsx_workers.preflight import warm_imports
    except ImportError:  # the workers' package is not installed here
        return
    warm_imports()


def check_capturable(spec: JobSpec, info: ModelInfo, layers: list[int]) -> None:
    """Refuse a model the chosen engine cannot capture, with the model preflight's reasons.

    The preflight imports vLLM (seconds, once per process); where vLLM is not installed
    (a coordinator without workers' packages) its answer is partial and nothing is
    refused on it — the engine's own start then says what fails.
    """
    try:
        from hsx_workers.preflight import inspect_model_cached
    except ImportError:  # the workers' package is not installed here
        return
    try:
        report = inspect_model_cached(spec.model, spec.engine, tuple(layers),
                                      spec.trust_remote_code)
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    if spec.engine == "vllm" and not report.vllm_available:
        logger.warning("vLLM cannot be imported here; %s is not checked for capture", spec.model)
        return
    usable = ("extract_hidden_states", "hooks") if spec.engine == "vllm" else ("hf",)
    if report.capture not in usable:
        raise JobRefused(
            f"model: {info.architecture} cannot be captured with engine {spec.engine}: "
            + " ".join(report.reasons)
        )


def check_engine_args(spec: JobSpec, info: ModelInfo) -> None:
    """Refuse `vllm:` keys that the installed vLLM does not take, or that hsx sets itself,
    and settings under which the installed vLLM is known to capture wrong states."""
    passed = spec.vllm.engine_args()
    if spec.engine != "vllm":
        if passed:
            raise JobRefused(f"vllm: {', '.join(sorted(passed))} are vLLM engine arguments, "
                             f"but the job's engine is {spec.engine}")
        return
    try:
        from hsx_workers import vllm_compat
    except ImportError:  # the workers' package is not installed here
        return
    problem = vllm_compat.capture_problem(uses_mla=info.uses_mla,
                                          enforce_eager=spec.vllm.enforce_eager)
    if problem:
        raise JobRefused(f"vllm.enforce_eager: {problem}")
    if not passed:
        return
    try:
        known: frozenset[str] | None = vllm_compat.engine_arg_names()
    except ImportError:  # no vLLM here: the engine's own start says what it refuses
        known = None
    problem = vllm_compat.engine_args_problem(passed, known)
    if problem:
        raise JobRefused(f"vllm: {problem}")


def output_quota(quota_bytes: int | None = None) -> int | None:
    """The byte quota for one job's output: the argument, else $HSX_QUOTA_BYTES."""
    if quota_bytes is not None:
        return quota_bytes or None
    raw = os.environ.get(QUOTA_ENV, "").strip()
    if not raw:
        return None
    try:
        return int(float(raw)) or None
    except ValueError:
        raise JobRefused(f"{QUOTA_ENV}={raw!r} is not a number of bytes") from None


def check_output_size(job: PreparedJob, quota_bytes: int | None = None) -> int:
    """Refuse a job whose pending output exceeds the quota or the output's free space.

    Runs after ingestion (the token count is exact then) and before any engine starts.
    Returns the estimated bytes still to write.
    """
    per_token = job.model.bytes_per_token(len(job.layers))[job.spec.storage_dtype]
    pending_tokens = sum(u.tokens for u in job.pending)
    need = pending_tokens * per_token
    quota = output_quota(quota_bytes)
    if quota is not None and need > quota:
        raise JobRefused(
            f"output: the job would write about {_human(need)} ({pending_tokens} tokens x "
            f"{per_token} bytes of {len(job.layers)} layers in {job.spec.storage_dtype}), "
            f"more than the quota of {_human(quota)}; use fewer layers, storage_dtype fp8, "
            "or a smaller dataset"
        )
    free = shutil.disk_usage(job.output).free
    if need > free:
        raise JobRefused(
            f"output: the job would write about {_human(need)} but {job.output} has only "
            f"{_human(free)} free; free space, choose another output, or use fewer layers "
            "or storage_dtype fp8"
        )
    return need


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _publish_once(path: Path, payload: dict[str, Any]) -> bool:
    """Write JSON to `path` only if absent (atomic). False when it already existed."""
    tmp = path.parent / TMP_DIR / f"{path.name}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def prepare(spec: JobSpec) -> PreparedJob:
    """Preflight, then make (or find) the output's manifest, inputs and plan."""
    info, layers, root = preflight(spec)
    manifest_file = root / MANIFEST
    from hsx.ingest import dataset_fingerprint, ingest

    if manifest_file.exists():
        manifest = json.loads(manifest_file.read_text())
        _check_same_job(manifest, spec, root, dataset_fingerprint(spec.dataset))
    else:
        result = ingest(
            spec.dataset,
            spec.tokenizer or spec.model,
            spec.max_seq_len,
            root,
            chat_template_kwargs=spec.chat_template_kwargs,
            trust_remote_code=spec.trust_remote_code,
        )
        from hsx.ingest import read_inputs

        lengths = read_inputs(root).column("length").to_numpy()
        units = plan_units(lengths.tolist(), spec.unit_tokens)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "hsx_version": __version__,
            "job_fingerprint": spec.data_fingerprint(),
            "dataset_fingerprint": result.dataset_fingerprint,
            "model": spec.model,
            "architecture": info.architecture,
            "num_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "layers": layers,
            "layer_convention": LAYER_CONVENTION,
            "storage_dtype": spec.storage_dtype,
            "engine": spec.engine,
            "tokenizer_fingerprint": result.tokenizer_fingerprint,
            "max_seq_len": spec.max_seq_len,
            "num_samples": result.num_samples,
            "num_errors": result.num_errors,
            "num_tokens": result.num_tokens,
            "units": [u.to_json() for u in units],
            "created_at": time.time(),
            "spec": spec.model_dump(mode="json"),
        }
        if not _publish_once(manifest_file, manifest):
            # Another driver prepared the same output at the same moment.
            manifest = json.loads(manifest_file.read_text())
            _check_same_job(manifest, spec, root, result.dataset_fingerprint)

    units = [WorkUnit.from_json(u) for u in manifest["units"]]
    done = committed_units(root)
    job = PreparedJob(
        spec=spec,
        model=info,
        layers=list(manifest["layers"]),
        output=root,
        manifest=manifest,
        units=units,
        pending=[u for u in units if u.unit not in done],
        complete=(root / COMPLETE).exists(),
    )
    check_output_size(job)
    return job


def _check_same_job(manifest: dict[str, Any], spec: JobSpec, root: Path, data_fp: str) -> None:
    if manifest.get("job_fingerprint") != spec.data_fingerprint():
        raise JobRefused(
            f"output: {root} already holds a different job (model, dataset, layers, "
            "engine, max_seq_len, storage_dtype or unit_tokens differ); choose another "
            "output or remove that one"
        )
    if manifest.get("dataset_fingerprint") != data_fp:
        raise JobRefused(
            f"dataset: {spec.dataset} changed since {root} was started (size or time "
            "differ); choose another output to extract the new version"
        )


def mark_complete(job: PreparedJob, summary: dict[str, Any]) -> None:
    _publish_once(job.output / COMPLETE, summary)
