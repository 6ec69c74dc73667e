"""Everything a job does before any engine starts: check it, ingest it, plan it.

A job is refused here (`JobRefused`, with a message that names the problem) when its
model has no usable config, cannot be captured with the chosen engine (the model
preflight, hsx_workers.preflight, says why), a layer id is out of range or not
capturable for that model, the dataset cannot be read (a missing file, object or prefix,
no permission, a hub that cannot be reached, several splits and none named), its
images cannot be taken (images.py), the output cannot be written, the
estimated output exceeds the free space or quota of the output location, or the output
already holds a different job. Only then does anything heavy start. The output location
is the truth: a manifest found there is reused, committed units are skipped, so running
the same job twice does nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import hsx.output.quota
from hsx import __version__, settings
from hsx.modelinfo import ModelConfigError, ModelInfo, read_model_info
from hsx.output import (
    IngestRecord,
    JobMismatch,
    Manifest,
    Output,
    OutputCorrupt,
    OutputTotals,
    PartRecord,
    StorageError,
    UnitPlan,
)
from hsx.output.layout import LAYER_CONVENTION
from hsx.plan import UnitPlanner, WorkUnit, first_unit_tokens
from hsx.progress import human_bytes
from hsx.spec import JobSpec
from hsx_service.errors import JobCancelled, JobRefused
from hsx_service.images import IMAGE_SAMPLE_ROWS, check_images, image_settings
from hsx_service.resume import check_same_job, manifest_expected

if TYPE_CHECKING:
    from hsx.ingest import IngestProgress, IngestResult
    from hsx_service.ingest_tasks import RayTasks

logger = logging.getLogger(__name__)

INGEST_WORKERS_ENV = settings.INGEST_WORKERS.name


@dataclass
class PreparedJob:
    """A job whose output holds its manifest: the plan, and what is left to do."""

    spec: JobSpec
    model: ModelInfo
    output: Output
    manifest: Manifest
    units: list[WorkUnit]
    pending: list[WorkUnit]
    complete: bool
    committed: set[int] = field(default_factory=set)  # units with a commit record
    # A new job's dataset being tokenized while it runs: more units come from it, and
    # `manifest` is its plan so far until the ingestion publishes the manifest.
    ingestion: Ingestion | None = None

    @classmethod
    def of(cls, spec: JobSpec, model: ModelInfo, output: Output) -> PreparedJob:
        """The job as its output says: planned units, those without a commit record.
        Its manifest holds this very job (`check_same_job`): its layers are the spec's."""
        manifest = output.manifest()
        units = manifest.work_units
        done = output.committed_units()
        return cls(spec=spec, model=model, output=output, manifest=manifest, units=units,
                   pending=[u for u in units if u.unit not in done],
                   complete=output.is_complete(), committed=done)

    def totals(self) -> OutputTotals:
        """The output's numbers against the plan so far."""
        return self.output.totals(manifest=self.manifest)

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def samples_total(self) -> int:
        return self.manifest.num_samples

    @property
    def tokens_total(self) -> int:
        return self.manifest.tokens_total


def open_output(output: str) -> Output:
    """The Output of a job's `output` field; JobRefused naming it when the URI is bad."""
    try:
        return Output(output)
    except (ValueError, StorageError) as err:
        raise JobRefused(f"output: {err}") from None


def check_writable(output: Output) -> None:
    """JobRefused, naming the location (a bucket: its name) and why, unless it is writable."""
    try:
        output.check_writable()
    except StorageError as err:
        raise JobRefused(f"output: {err}") from None


def preflight(spec: JobSpec) -> tuple[ModelInfo, list[int], Output]:
    """The checks that need no engine; raise JobRefused on the first problem."""
    try:
        info = read_model_info(spec.model)
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    layers = info.job_layers(spec.layers, spec.engine, spec.layers_method)
    try:
        info.check_layers(layers, spec.engine)
    except ModelConfigError as err:
        raise JobRefused(str(err)) from None
    check_capturable(spec, info, layers)
    check_images(spec, info)  # images.py
    check_engine_args(spec, info)
    check_dataset(spec)
    if spec.engine == "hf" and spec.tensor_parallel_size > 1:
        raise JobRefused(
            "tensor_parallel_size: the hf engine runs on one device; use engine: vllm for "
            "tensor parallelism"
        )
    output = open_output(spec.output)
    check_writable(output)
    return info, layers, output


def check_dataset(spec: JobSpec) -> None:
    """JobRefused, naming the dataset (file, object, prefix or hub id) and what to do,
    unless its rows can be read from here: resolved as ingestion will read them (the
    split too), and its first file's first byte read (on a bucket: a ranged GET, so a
    missing permission shows now); a hub dataset: the hub answers and has the split."""
    from hsx.ingest import DatasetError
    from hsx.ingest import check_dataset as check

    try:
        check(spec.dataset_spec)
    except DatasetError as err:
        raise JobRefused(f"dataset: {err}") from None


# The estimate refuses only a job it finds clearly too big: its rows are a sample, from
# 16 places of a JSON lines dataset (hsx.ingest.estimate_tokens), or its first rows,
# which may not be like the rest. Jobs below the margin are checked as their plan grows
# (`Ingestion`) and exactly after ingestion.
ESTIMATE_MARGIN = 1.25
HEAD_ESTIMATE_MARGIN = 2.0


def check_estimated_output(spec: JobSpec, info: ModelInfo, layers: list[int], output: Output,
                           quota_bytes: int | None = None, *, in_child: bool = True
                           ) -> int | None:
    """Refuse, before ingestion, a new job whose chat template passes a limit on its
    dataset's sample rows (hsx.ingest.limits: the CPU time of a row's rendering, the size
    of what it renders), or whose output is estimated (from those rows and its row count)
    at more than ESTIMATE_MARGIN x the quota or the free space; the estimate in bytes, or
    None when none was made (a rerun, an online job, a dataset too slow to count).

    For the coordinator's submit, so that such a job gets a 422 instead of failing after
    ingestion; `prepare` checks the exact size once the dataset is tokenized. Takes what
    `preflight` returned. An object store has no free space to check, only the quota.
    The sample is tokenized in a child process bounded in CPU time and memory
    (hsx.ingest.bounded_estimate), never on the calling thread: a template that loops
    for ever is refused after `HSX_TEMPLATE_SECONDS`, and the API answers meanwhile.
    `in_child=False` tokenizes it here, each row's rendering within the same CPU time
    (`prepare`: a coordinator's submit checked the job apart already, and `hsx extract`
    runs its user's own job, with no child process to start).
    """
    if output.has_manifest():
        # A rerun: ingested already, its template with it; prepare checks the exact size.
        return None
    from hsx.ingest import TemplateLimitError, bounded_estimate, estimate_tokens, resolve_source

    try:
        source = resolve_source(spec.dataset_spec)
        if not source.counts_quickly:  # a hub dataset, a bucket's JSON lines
            logger.info("no output estimate for %s: counting its rows means reading it "
                        "whole; the exact check follows ingestion", source)
            return None
        images = image_settings(spec, info)
        tokens, rows, sampled, spread = (bounded_estimate if in_child else estimate_tokens)(
            source, spec.tokenizer or spec.model, spec.max_seq_len,
            chat_template_kwargs=spec.chat_template_kwargs,
            trust_remote_code=spec.trust_remote_code, images=images,
            sample_rows=IMAGE_SAMPLE_ROWS if images is not None else 256)
    except TemplateLimitError as err:
        raise JobRefused(f"{_template_field(spec)}: {err}") from None
    except Exception as err:  # EstimateUnavailable, a dataset that cannot be read
        logger.info("no output estimate for %s: %s", spec.dataset, err)
        return None
    if spec.trains_online:
        # No shard is stored (its stream's room is checked before its engines start:
        # runner.py); the sample checked its template.
        return None
    per_token = info.bytes_per_token(len(layers))[spec.storage_dtype]
    need = tokens * per_token
    limit_what = _size_limit(output, output_quota(quota_bytes))
    if limit_what is None:
        return int(need)
    limit, what = limit_what
    if need > (ESTIMATE_MARGIN if spread else HEAD_ESTIMATE_MARGIN) * limit:
        raise JobRefused(
            f"output: the job would write about {human_bytes(need)} (estimated from {sampled} "
            f"of its {rows} rows{' spread over it' if spread else ''}: {tokens:,.0f} tokens "
            f"x {per_token} bytes of {len(layers)} layers in {spec.storage_dtype}), more than "
            f"{what} ({human_bytes(limit)}); use fewer layers, storage_dtype fp8, or a smaller "
            "dataset"
        )
    return int(need)


def _template_field(spec: JobSpec) -> str:
    """The job field a refusal for its chat template names: `chat_template_kwargs` when
    the job passes any (its own `chat_template`, or what the template loops on), else
    where the tokenizer, and so the template, comes from."""
    if spec.chat_template_kwargs:
        return "chat_template_kwargs"
    return "tokenizer" if spec.tokenizer else "model"


def warm_preflight() -> None:
    """Import what a submit's preflight imports (vLLM's model registry, transformers'
    tokenizers), so the first submit answers as fast as the next ones instead of paying
    tens of seconds of imports inside its request. The coordinator calls it before it
    says it is ready. The fork server that the estimate's child processes come from
    (hsx.ingest.bounded_estimate) starts now too: it imports transformers meanwhile."""
    from hsx.ingest.bounded import pool_context

    pool_context()
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
    if spec.images is not None and spec.engine == "hf":
        return  # an image-text-to-text model, not a causal LM: check_images
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
    """Refuse what the job's engine cannot run as asked: `vllm:` engine arguments on
    another engine, and for the vllm engine whatever its rules refuse (the model's
    length, keys the installed vLLM does not take or that hsx sets itself, settings under
    which it is known to capture wrong states: hsx_workers/engines/vllm/rules.py)."""
    if spec.engine != "vllm":
        passed = spec.vllm.engine_args()
        if passed:
            raise JobRefused(f"vllm: {', '.join(sorted(passed))} are vLLM engine arguments, "
                             f"but the job's engine is {spec.engine}")
        return
    from hsx_workers.engines.vllm.rules import job_problem

    problem = job_problem(spec, info)
    if problem:
        raise JobRefused(problem)


def output_quota(quota_bytes: int | None = None) -> int | None:
    """The byte quota for one job's output: the argument, else $HSX_QUOTA_BYTES
    (hsx.output.quota); a bad setting refuses the job."""
    try:
        return hsx.output.quota.output_quota(quota_bytes)
    except ValueError as err:
        raise JobRefused(str(err)) from None


def _size_limit(output: Output, quota: int | None) -> tuple[int, str] | None:
    """(bytes, what they are) of the tighter of the quota and the free space, if any."""
    root = output.local_root
    free = shutil.disk_usage(root).free if root is not None else None  # preflight made it
    if quota is not None and (free is None or quota < free):
        return quota, "the quota"
    return None if free is None else (free, f"the free space of {root}")


def check_output_size(job: PreparedJob, quota_bytes: int | None = None) -> int:
    """Refuse a job whose pending output exceeds the quota or the output's free space.

    Runs after ingestion (the token count is exact then) and before any engine starts.
    Returns the estimated bytes still to write.
    """
    if job.spec.trains_online:
        return 0  # no shard is stored (the stream's room: runner.online_feed)
    per_token = job.model.bytes_per_token(len(job.layers))[job.spec.storage_dtype]
    pending_tokens = sum(u.tokens for u in job.pending)
    need = pending_tokens * per_token
    quota = output_quota(quota_bytes)
    if quota is not None and need > quota:
        raise JobRefused(
            f"output: the job would write about {human_bytes(need)} ({pending_tokens} tokens x "
            f"{per_token} bytes of {len(job.layers)} layers in {job.spec.storage_dtype}), "
            f"more than the quota of {human_bytes(quota)}; use fewer layers, storage_dtype fp8, "
            "or a smaller dataset"
        )
    root = job.output.local_root  # an object store has no free space to check
    free = shutil.disk_usage(root).free if root is not None else None
    if free is not None and need > free:
        raise JobRefused(
            f"output: the job would write about {human_bytes(need)} but {job.output} has only "
            f"{human_bytes(free)} free; free space, choose another output, or use fewer layers "
            "or storage_dtype fp8"
        )
    return need


def ingest_workers(workers: int | None = None) -> int | None:
    """Slices of a dataset tokenized at once: the argument, else $HSX_INGEST_WORKERS (0:
    one per core; 1: one after the other, in the driver's own process), else None: as
    many as Ray has CPUs for where Ray is connected, else 1 (`Ingestion` decides:
    hsx_service.ingest_tasks)."""
    if workers is None:
        try:
            workers = settings.INGEST_WORKERS.get()
        except ValueError as err:
            raise JobRefused(str(err)) from None
        if workers is None:
            return None
    if workers < 0:
        raise JobRefused(f"{INGEST_WORKERS_ENV}={workers} is negative")
    return workers or os.cpu_count() or 1


def prepare(spec: JobSpec, *, on_ingest: Callable[[IngestProgress], None] | None = None,
            cancelled: Callable[[], bool] | None = None, stream: bool = True,
            while_first_part: Callable[[], None] | None = None) -> PreparedJob:
    """Preflight, then find the output's manifest and plan, or start making them.

    A job whose output has a manifest is prepared from it. A new one (or one whose
    ingestion a killed driver left in parts) starts its `Ingestion` on a thread and is
    returned once the first part of its inputs is published (what the first rows show
    refuses it before any engine starts): its units come as the parts are published,
    while its engines start. A dataset whole by then is prepared as any other. A
    regenerating job is ingested whole first, and so is any with `stream=False`.
    `on_ingest` hears how far the ingestion is (rows tokenized); `cancelled` stops it.
    `while_first_part` is called here while a streamed ingestion tokenizes its first
    part (after the preflight, and after the ingestion chose where it tokenizes):
    `run_job` starts Ray then."""
    info, layers, output = preflight(spec)
    workers = ingest_workers()
    manifest = output.read_manifest()
    if manifest is None:
        check_estimated_output(spec, info, layers, output, in_child=False)
        streamed = stream and spec.regenerate is None
        ingestion = Ingestion(spec, info, layers, output, workers, on_ingest, cancelled,
                              streamed=streamed)
        ingestion.start()
        if streamed:
            try:
                if while_first_part is not None:
                    while_first_part()
                ingestion.wait_first_part()
            except BaseException:
                ingestion.stop()
                raise
        else:
            ingestion.join()
        if ingestion.done:  # a dataset small enough to be whole by now: as any other
            ingestion.raise_error()
            manifest = output.manifest()
        else:
            return PreparedJob(spec=spec, model=info, output=output,
                               manifest=ingestion.manifest, units=[], pending=[],
                               complete=False, committed=output.committed_units(),
                               ingestion=ingestion)
    check_same_job(manifest, spec, info, layers, output)
    job = PreparedJob.of(spec, info, output)
    check_output_size(job)
    return job


def _end_tasks(tasks: Executor) -> None:
    """No task of an ingestion runs once it ended: what a failed or cancelled one left
    waiting or running is cancelled (and waited for)."""
    try:
        tasks.shutdown(cancel_futures=True)
    except Exception as err:  # Ray lost: its tasks went with it
        logger.warning("the ingestion's tasks could not be cancelled: %s", err)


class Ingestion:
    """A new job's dataset tokenized on a thread (in parts: hsx.ingest.ingest) while its
    engines start and run. Each part published plans the units its rows close (the same
    plan `plan_units` makes of the whole table); `take` hands them to the dispatcher.
    When the last part is published, the manifest is (create-if-absent, checked against
    this job), and the exact size of the output is checked. A failure (the dataset, the
    output, a cancel) is kept in `error` for the driver: the dispatcher stops handing
    out units, the units out end, the job fails with it.

    The plan ramps up (hsx.plan: the first unit small, so the first commit comes soon
    after an engine starts). The rows are tokenized in child processes (hsx.ingest.
    bounded: this process's own, a pool's or Ray tasks'), which run behind the engines
    at the lowest priority and are killed when a row will not end; this thread only
    writes their tables, at its own priority (at the lowest it held the GIL while the
    engines took its core, which kept a coordinator's API waiting: benchmarks/
    bench_api.py measures its latency).

    A driver killed while ingesting left the parts it published; this one goes on after
    the last (ingest.json says it is the same job), tokenizing nothing twice, and plans
    the same units again by the rule ingest.json records, so the units committed before
    the kill are recognised."""

    def __init__(self, spec: JobSpec, info: ModelInfo, layers: list[int], output: Output,
                 workers: int | None, on_ingest: Callable[[IngestProgress], None] | None,
                 cancelled: Callable[[], bool] | None, *, streamed: bool = True) -> None:
        self.spec, self.info, self.layers, self.output = spec, info, layers, output
        self.workers = workers
        self.streamed = streamed  # the engines start after the first part
        self.on_ingest = on_ingest
        self.cancelled = cancelled
        self.dispatching = False  # the dispatcher shows the progress from now on
        self.progress: IngestProgress | None = None
        self.units: list[WorkUnit] = []
        self.parts = 0  # parts published (an earlier driver's too)
        self._last_part = False  # the last of them is
        self.error: BaseException | None = None
        self.done = False
        self.manifest = self._manifest(units=[])  # the plan so far (not published)
        self._planner = UnitPlanner(spec.unit_tokens)  # `_start` sets ingest.json's rule
        self._new: list[WorkUnit] = []
        self._room: tuple[int, str] | None = None  # `_measure_room`
        self._committed: set[int] = set()
        self._planned_tokens = 0  # in planned units not committed
        self._stop = False
        self._tasks: RayTasks | None = None  # where it tokenizes, chosen by `start`
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hsx-ingest", daemon=True)

    def start(self) -> None:
        from hsx_service.ingest_tasks import tokenizing_tasks

        # Chosen before the thread starts: Ray connected later (`prepare`'s
        # `while_first_part`) does not move an ingestion that began without it.
        self._tasks = tokenizing_tasks(self.spec.dataset_spec, self.workers,
                                       beside_engines=self.streamed)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        """Stop at the next batch (what is published stays) and wait for the thread."""
        self._stop = True
        self.join()

    def take(self) -> list[WorkUnit]:
        """The units planned since the last call."""
        with self._cv:
            new, self._new = self._new, []
            return new

    def wait_first_part(self) -> None:
        """Until the first part is published or the ingestion ended: what the first
        rows show (a file that cannot be read, another job's output, a dataset small
        enough to be whole by then and too big for the disk) refuses the job before
        any engine starts."""
        with self._cv:
            # After the last part, the manifest and the size check are moments away.
            while not self.done and (not self.parts or self._last_part):
                self._cv.wait()

    def wait(self, timeout: float) -> None:
        """Until a unit is planned, the ingestion ends, or `timeout` seconds."""
        with self._cv:
            if not self._new and not self.done:
                self._cv.wait(timeout)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        from hsx.ingest import DatasetError, TemplateLimitError, ingest
        from hsx.ingest.pipeline import nothing_to_capture

        spec = self.spec
        tasks = self._tasks
        try:
            self._measure_room()
            result = ingest(
                spec.dataset_spec, spec.tokenizer or spec.model, spec.max_seq_len,
                self.output, chat_template_kwargs=spec.chat_template_kwargs,
                trust_remote_code=spec.trust_remote_code,
                keep_messages=spec.regenerate is not None, progress=self._progress,
                workers=tasks.max_workers if tasks is not None else self.workers or 1,
                executor=tasks, job_fingerprint=spec.data_fingerprint(),
                first_unit_tokens=first_unit_tokens(spec.unit_tokens),
                on_start=self._start, on_part=self._part,
                images=image_settings(spec, self.info))
            if not result.num_samples:  # before the manifest: a rerun finds none again
                raise JobRefused("dataset: " + nothing_to_capture(
                    result, self.output.ingest_errors(), str(self.output)))
            # Another driver may have prepared the same output at the same moment: the
            # manifest published first is the one, and it must be this same job.
            manifest = self.output.publish_manifest(self._manifest(self.units, result))
            manifest.check_same_job(manifest_expected(spec, self.info, self.layers),
                                    result.dataset_fingerprint, output=str(self.output),
                                    dataset=str(spec.dataset_spec))
            self.manifest = manifest
            self._check_size()
        except DatasetError as err:  # found while reading it
            self.error = JobRefused(f"dataset: {err}")
        except TemplateLimitError as err:  # on row after row (hsx.ingest.limits)
            self.error = JobRefused(f"{_template_field(spec)}: {err}; the ingestion stopped")
        except JobMismatch as err:
            self.error = JobRefused(str(err))
        except (StorageError, OutputCorrupt) as err:
            self.error = JobRefused(f"output: {err}")
        except BaseException as err:  # a cancel, a bug: the driver raises it
            self.error = err
        finally:
            if tasks is not None:
                _end_tasks(tasks)
            with self._cv:
                self.done = True
                self._cv.notify_all()

    def _progress(self, progress: IngestProgress) -> None:
        if self._stop:
            raise JobCancelled("the job stopped while its dataset was being tokenized")
        if self.cancelled is not None and self.cancelled():
            raise JobCancelled("cancelled while the dataset was being tokenized")
        self.progress = progress
        if not self.dispatching and self.on_ingest is not None:
            self.on_ingest(progress)

    def _start(self, record: IngestRecord) -> None:
        """Plan by the rule of the ingestion the parts come from: a driver killed while
        ingesting may have planned by another (an older driver: none), and the units
        committed since must be recognised."""
        self._planner = UnitPlanner(self.spec.unit_tokens, record.first_unit_tokens)

    def _part(self, record: PartRecord, lengths: Any) -> None:
        units = self._planner.add(lengths.tolist())
        if record.last:
            units += self._planner.finish()
        self._check_room(units, record.rows_end)
        with self._cv:
            m = self.manifest
            self.manifest = m.model_copy(update={
                "num_samples": m.num_samples + record.samples,
                "num_errors": m.num_errors + record.errors,
                "num_tokens": m.num_tokens + record.tokens,
                "units": [*m.units, *(UnitPlan.of(u) for u in units)]})
            self.units.extend(units)
            self._new.extend(units)
            self.parts += 1
            self._last_part = record.last
            self._cv.notify_all()

    def _measure_room(self) -> None:
        """What the plan may take, as the ingestion starts: the quota or the output's
        free space, less nothing for the units committed by then (a rerun's)."""
        if self.spec.trains_online:
            return  # no shard is stored
        self._room = _size_limit(self.output, output_quota())
        if self._room is not None:
            self._committed = self.output.committed_units()

    def _check_room(self, units: list[WorkUnit], rows: int) -> None:
        """Refuse the job as soon as its plan outgrows the room, not after its last row
        (the estimate at submit lets through what it is not sure of): its engines stop
        before they fill the disk."""
        if self._room is None:
            return
        self._planned_tokens += sum(u.tokens for u in units if u.unit not in self._committed)
        dtype = self.spec.storage_dtype
        per_token = self.info.bytes_per_token(len(self.layers))[dtype]
        need, (limit, what) = self._planned_tokens * per_token, self._room
        if need > limit:
            raise JobRefused(
                f"output: the job would write about {human_bytes(need)} for the first {rows:,} "
                f"rows of its dataset alone ({self._planned_tokens:,} tokens x {per_token} "
                f"bytes of {len(self.layers)} layers in {dtype}), more than {what} "
                f"({human_bytes(limit)}) as its ingestion started; free space, choose another "
                "output, or use fewer layers, storage_dtype fp8 or a smaller dataset")

    def _manifest(self, units: list[WorkUnit], result: IngestResult | None = None
                  ) -> Manifest:
        from hsx_service import provenance

        spec, info = self.spec, self.info
        return Manifest(
            hsx_version=__version__,
            job_fingerprint=spec.data_fingerprint(),
            dataset_fingerprint=result.dataset_fingerprint if result else "",
            model=spec.model,
            architecture=info.architecture,
            num_layers=info.num_layers,
            hidden_size=info.hidden_size,
            layers=self.layers,
            layer_convention=LAYER_CONVENTION,
            storage_dtype=spec.storage_dtype,
            engine=spec.engine,
            tokenizer_fingerprint=result.tokenizer_fingerprint if result else "",
            max_seq_len=spec.max_seq_len,
            num_samples=result.num_samples if result else 0,
            num_errors=result.num_errors if result else 0,
            num_tokens=result.num_tokens if result else 0,
            units=[UnitPlan.of(u) for u in units],
            created_at=time.time(),
            spec=spec.model_dump(mode="json"),
            checks=provenance.checks(spec),
            provenance=provenance.provenance(spec, info, self.layers),
        )

    def _check_size(self) -> None:
        """The exact size, now that the dataset is tokenized: the units not committed
        must fit (JobRefused, kept in `error`, stops the job)."""
        committed = self.output.committed_units()
        job = PreparedJob(spec=self.spec, model=self.info, output=self.output,
                          manifest=self.manifest, units=self.units,
                          pending=[u for u in self.units if u.unit not in committed],
                          complete=False)
        check_output_size(job)
