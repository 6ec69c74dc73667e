"""The coordinator's Prometheus metrics, through `prometheus_client`.

`JobMetrics` is owned by the scheduler: its hooks record what happens as units run (unit
latency into a histogram, failed attempts, the time of the last commit, committed
totals), and at a scrape `families()` turns that, the statuses on the board and the
trainings into metric families. The app owns the registry (`main.create_app`): a
`CollectorRegistry` of its own with one collector that asks the scheduler, so tests and
several apps in one process never share (or collide in) the global default registry.

Per-job series carry a `job` label and are exported for jobs that are queued or running,
and for an hour after a job ends (so its final values get scraped), not for every job
the ledger has ever held. Counters count what is committed (shards whose commit record
exists), so they never go down while a unit is retried.

`METRICS` lists every name with its type and help: the Grafana board in deploy/ is built
on exactly these names, and a test holds the two together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hsx.wire import JobState, JobStatus, TrainState, TrainStatus

RECENT_S = 3600.0
UNIT_SECONDS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)

# name (as exposed) -> (type, help). Counters are exposed with their `_total` suffix,
# the histogram as `_bucket`/`_sum`/`_count`.
METRICS: dict[str, tuple[str, str]] = {
    "hsx_ready": ("gauge", "1 once the coordinator has reconciled its ledger and takes jobs."),
    "hsx_jobs": ("gauge", "Jobs in the ledger by state."),
    "hsx_queue_depth": ("gauge", "Jobs waiting for the scheduler (queued)."),
    "hsx_job_state": ("gauge", "1 for the job's current state (label state)."),
    "hsx_job_tokens_per_second": ("gauge", "Extraction rate of the job's current run."),
    "hsx_job_tokens_per_second_avg": ("gauge", "Average extraction rate over the job's runs."),
    "hsx_job_progress_ratio": ("gauge", "Samples done / samples to do."),
    "hsx_job_units_pending": ("gauge", "Work units of the job without a commit record yet."),
    "hsx_job_seconds_since_last_commit": (
        "gauge", "Seconds since the running job last committed a unit (or since it started "
        "dispatching): a stuck job's signal."),
    "hsx_job_engines": ("gauge", "Engines of the running job by state."),
    "hsx_job_tokens_total": ("counter", "Tokens in committed shards."),
    "hsx_job_samples_total": ("counter", "Samples processed: in committed shards, or recorded "
                              "as errors by a worker."),
    "hsx_job_samples_failed_total": ("counter", "Samples recorded as errors and skipped."),
    "hsx_job_bytes_total": ("counter", "Bytes of committed shards."),
    "hsx_job_shards_total": ("counter", "Committed shards."),
    "hsx_job_restarts_total": ("counter", "Worker (engine) restarts during the job."),
    "hsx_job_unit_failures_total": ("counter", "Failed attempts of work units."),
    "hsx_job_samples_checked_total": ("counter", "Samples the self-check looked at in "
                                      "committed units."),
    "hsx_job_check_problems_total": ("counter", "Problems the self-check recorded "
                                     "(`checks: warn`; under `on` the first fails the job)."),
    "hsx_job_head_rows_checked_total": ("counter", "Rows of id N the head check compared "
                                        "with the engine's own next token."),
    "hsx_job_head_rows_agreed_total": ("counter", "Of those, rows where lm_head(norm(h_N)) "
                                       "agreed with the engine."),
    "hsx_unit_seconds": ("histogram", "Seconds from dispatching a work unit to its commit."),
    "hsx_train_step": ("gauge", "Optimizer step of the job's draft training."),
    "hsx_train_loss": ("gauge", "Loss at the training's last logged step."),
    "hsx_train_tokens_per_second": ("gauge", "Training throughput."),
    "hsx_train_restarts_total": ("counter", "Trainer restarts (each resumes a checkpoint)."),
    "hsx_train_state": ("gauge", "1 for the training's current state (label state)."),
    "hsx_job_waiting": ("gauge", "1 while the job waits for resources, or (online) its "
                        "engines wait for its trainer to take what they captured (its "
                        "status's waiting_for says for what and who holds it)."),
    "hsx_train_waiting": ("gauge", "1 while the training or its evaluation waits (for GPUs, "
                          "for the extraction its plan trains after, or for data: shards "
                          "or, online, units the engines have not captured yet)."),
    "hsx_gpus_held": ("gauge", "GPUs held in the coordinator's books, by job and role "
                      "(engine-N, trainer, evaluation)."),
    "hsx_gpus_waited": ("gauge", "GPUs asked for and not granted yet, by job and role."),
}

ENGINE_STATES = ("starting", "idle", "busy", "dead")


def exposed_names() -> set[str]:
    """Every sample name the metrics above produce (what a PromQL query can name)."""
    names = set()
    for name, (kind, _) in METRICS.items():
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


@dataclass
class _Committed:
    tokens: int = 0
    samples: int = 0
    bytes: int = 0
    shards: int = 0


@dataclass
class JobMetrics:
    """What the scheduler records for /metrics; see the module docstring."""

    unit_seconds: Histogram = field(default_factory=lambda: Histogram(
        "hsx_unit_seconds", METRICS["hsx_unit_seconds"][1], ["job"],
        buckets=UNIT_SECONDS_BUCKETS, registry=None))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _committed: dict[str, _Committed] = field(default_factory=dict)
    _unit_failures: dict[str, int] = field(default_factory=dict)
    _last_commit: dict[str, float] = field(default_factory=dict)
    _observed: set[str] = field(default_factory=set)  # jobs with histogram series

    def run_started(self, job_id: str, tokens: int, samples: int, nbytes: int,
                    shards: int) -> None:
        """A run of the job begins; what its output already holds counts as committed."""
        with self._lock:
            self._committed[job_id] = _Committed(tokens, samples, nbytes, shards)
            self._last_commit[job_id] = time.time()

    def unit_done(self, job_id: str, report: Any) -> None:
        """A unit's attempt ended with a commit record (a UnitReport)."""
        self.unit_seconds.labels(job_id).observe(report.seconds)
        with self._lock:
            self._observed.add(job_id)
            self._last_commit[job_id] = time.time()
            if report.won:
                c = self._committed.setdefault(job_id, _Committed())
                c.tokens += report.tokens
                c.samples += report.samples + len(report.errors)
                c.bytes += report.bytes
                c.shards += 1

    def unit_failed(self, job_id: str) -> None:
        with self._lock:
            self._unit_failures[job_id] = self._unit_failures.get(job_id, 0) + 1

    def families(self, statuses: Iterable[JobStatus], trainings: Iterable[TrainStatus],
                 ready: bool, now: float | None = None,
                 gpus: tuple[Iterable[Any], Iterable[Any]] = ((), ())) -> Iterator[Metric]:
        """The metric families of one scrape; `gpus`: the arbiter's holders and waiters
        (placement.Holder: job, role, gpus)."""
        now = time.time() if now is None else now
        statuses = list(statuses)
        fam: dict[str, Any] = {}
        for name, (kind, text) in METRICS.items():
            if kind == "histogram":
                continue
            labels = ["job"] if name.startswith(("hsx_job_", "hsx_train_")) else []
            if name.startswith("hsx_gpus_"):
                labels = ["job", "role"]
            if name in ("hsx_job_state", "hsx_job_engines", "hsx_train_state", "hsx_jobs"):
                labels = [*labels, "state"]
            if kind == "counter":
                fam[name] = CounterMetricFamily(name.removesuffix("_total"), text, labels=labels)
            else:
                fam[name] = GaugeMetricFamily(name, text, labels=labels)

        fam["hsx_ready"].add_metric([], 1.0 if ready else 0.0)
        by_state = {state: 0 for state in JobState}
        for s in statuses:
            by_state[s.state] += 1
        for state, n in by_state.items():
            fam["hsx_jobs"].add_metric([state.value], n)
        fam["hsx_queue_depth"].add_metric([], by_state[JobState.queued])

        exported = [s for s in statuses if is_recent(s, now)]
        with self._lock:
            committed = dict(self._committed)
            failures = dict(self._unit_failures)
            last_commit = dict(self._last_commit)
        for s in exported:
            job = [s.id]
            for state in JobState:
                fam["hsx_job_state"].add_metric([s.id, state.value], 1.0 if s.state == state else 0)
            fam["hsx_job_tokens_per_second"].add_metric(job, s.tokens_per_s)
            fam["hsx_job_tokens_per_second_avg"].add_metric(job, s.tokens_per_s_avg)
            fam["hsx_job_progress_ratio"].add_metric(
                job, s.samples_done / s.samples_total if s.samples_total else 0.0)
            fam["hsx_job_units_pending"].add_metric(
                job, max(s.units_total - s.units_done - s.units_failed, 0))
            # Not run by this coordinator yet: the status's numbers are the committed ones.
            c = committed.get(s.id) or _Committed(s.tokens_done, s.samples_done, s.bytes, s.shards)
            fam["hsx_job_tokens_total"].add_metric(job, c.tokens)
            fam["hsx_job_samples_total"].add_metric(job, c.samples)
            fam["hsx_job_bytes_total"].add_metric(job, c.bytes)
            fam["hsx_job_shards_total"].add_metric(job, c.shards)
            fam["hsx_job_samples_failed_total"].add_metric(job, s.samples_failed)
            fam["hsx_job_restarts_total"].add_metric(job, s.restarts)
            fam["hsx_job_unit_failures_total"].add_metric(job, failures.get(s.id, 0))
            fam["hsx_job_samples_checked_total"].add_metric(job, s.samples_checked)
            fam["hsx_job_check_problems_total"].add_metric(job, s.check_problems)
            fam["hsx_job_head_rows_checked_total"].add_metric(job, s.head_rows_checked)
            fam["hsx_job_head_rows_agreed_total"].add_metric(job, s.head_rows_agreed)
            fam["hsx_job_waiting"].add_metric(job, 1.0 if s.waiting_for else 0.0)
            if s.state == JobState.running:
                since = last_commit.get(s.id, s.started_at or now)
                fam["hsx_job_seconds_since_last_commit"].add_metric(job, max(now - since, 0.0))
                engines = dict.fromkeys(ENGINE_STATES, 0)
                for w in s.workers:
                    engines[w.state] = engines.get(w.state, 0) + 1
                for engine_state, n in engines.items():
                    fam["hsx_job_engines"].add_metric([s.id, engine_state], n)

        for t in trainings:
            job = [t.job_id]
            fam["hsx_train_step"].add_metric(job, t.step)
            if t.loss is not None:
                fam["hsx_train_loss"].add_metric(job, t.loss)
            fam["hsx_train_tokens_per_second"].add_metric(
                job, t.tokens_per_s if t.state == TrainState.running else 0.0)
            fam["hsx_train_restarts_total"].add_metric(job, t.restarts)
            fam["hsx_train_waiting"].add_metric(job, 1.0 if t.waiting_for else 0.0)
            for train_state in TrainState:
                fam["hsx_train_state"].add_metric([t.job_id, train_state.value],
                                                  1.0 if t.state == train_state else 0)

        held, waited = gpus
        for name, holders in (("hsx_gpus_held", held), ("hsx_gpus_waited", waited)):
            for h in holders:
                fam[name].add_metric([h.job, h.role], h.gpus)

        self._forget([s.id for s in statuses if not is_recent(s, now)])
        yield from fam.values()
        yield from self.unit_seconds.collect()

    def _forget(self, job_ids: list[str]) -> None:
        """Drop what is kept for jobs that ended more than RECENT_S ago."""
        with self._lock:
            for job_id in job_ids:
                self._committed.pop(job_id, None)
                self._unit_failures.pop(job_id, None)
                self._last_commit.pop(job_id, None)
            observed = [j for j in job_ids if j in self._observed]
            self._observed.difference_update(observed)
        for job_id in observed:
            self.unit_seconds.remove(job_id)


def is_recent(status: JobStatus, now: float) -> bool:
    """Queued, running, or ended within RECENT_S."""
    return not status.state.finished or (
        status.finished_at is not None and now - status.finished_at < RECENT_S)

