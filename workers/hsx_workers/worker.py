"""ExtractionWorker: one engine, fed work units, each unit committed as one shard.

The class is plain Python; the job driver wraps it with `ray.remote` (one actor per
engine, resources for its tensor-parallel ranks). A unit's life:

1. `run_unit` reads its rows (sample_index, input_ids, loss_mask) from the output's
   inputs table (`Output.input_rows`: on an object store only the table's batches that
   hold them) and queues it;
2. one capture loop per worker streams the queued units' requests through the engine
   back to back, so the engine never drains between units: while the tail of one unit
   computes, the next unit's requests are already in flight. Results come back in
   request order, and each goes straight into its unit's `ShardWriter` (nothing of a
   unit is held in memory as a whole);
3. when a unit's last result is in, a committer thread commits it: the shard becomes
   visible only through its commit record, created create-if-absent — if another
   attempt of the same unit won, this one's data is dropped and the unit reports
   `won=False`. `run_unit` returns that report.

A unit of a job with `regenerate:` first has its conversations answered by the same
engine (GenerateRequests in the same stream, so the engine keeps capturing the unit
before it meanwhile), round by round for `turns: each`; the regenerated conversations
are then tokenized as ingestion does and captured like any unit. Their table is stored
whole before the commit record, which names it: a committed unit's answers are never
generated again, and an attempt that loses the commit deletes its own.

The driver keeps up to two units queued on each worker (runner.py) for that overlap.
Per-sample failures are recorded in the commit record's errors and the unit goes on.
`EngineDead` fails every unit the worker holds: the driver restarts the actor and
retries them.

Every sample's states pass the job's self-check (selfcheck.py) on their way to the
writer. Under `checks: on` a tripped check fails its unit at once, and every other unit
of that job this worker holds, with `StatesCheckFailed` (their writers aborted: nothing
more is written, no shard of theirs becomes visible); the driver ends the job, retries
none of them, and has the job's other workers stop theirs the same way (`stop_job`).
The checks run on threads of their own: the committer waits for a unit's before it
commits (the capture goes on meanwhile), and one that trips fails the unit there; the
capture thread stops the job at its next sample. The unit's check numbers go into its
commit record.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from hsx.output import Output, ShardWriter
from hsx.output.memory_storage import MemoryStorage
from hsx.output.shards import DEFAULT_CHECKSUM, background_priority
from hsx.output.tables import IMAGES_COLUMN, MESSAGES_COLUMN, REGENERATIONS_SCHEMA
from hsx.plan import WorkUnit
from hsx.regenerate import (
    Conversation,
    GeneratedTurn,
    Regeneration,
    dumps_messages,
    loads_messages,
    sample_seed,
)
from hsx_workers.engines.base import (
    WAIT,
    CaptureRequest,
    CaptureResult,
    EngineDead,
    GenerateRequest,
    GenerateResult,
    _Wait,
)
from hsx_workers.engines.factory import AnyEngineConfig, create_engine
from hsx_workers.engines.vllm.settings import VllmSettings
from hsx_workers.headcheck import FinalHead
from hsx_workers.selfcheck import StatesCheck, StatesCheckFailed, UnitTally, head_ahead

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 5.0
"""A capture loop with nothing queued or in flight for this long ends (a new unit
starts another), so an idle engine does not poll."""


@dataclass
class UnitReport:
    unit: int
    won: bool
    samples: int
    tokens: int
    bytes: int
    errors: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    worker: str = ""
    # The Ray node the unit ran on ('' outside Ray): where an online unit's bytes lie.
    # Ray may have restarted the worker on another node since the driver last heard of
    # it (its node died while it held no unit), and the driver learns it here.
    node: str = ""
    generated: int = 0  # samples regenerated (a regenerating job)
    generated_tokens: int = 0
    truncated: int = 0  # regenerated samples with a turn that reached max_tokens
    # Where the unit's time went: time.monotonic() on the worker's host when it was
    # queued, its first and last request fed to the engine, its last request computed
    # and taken from the spool (engines that tell), its last sample handed to the
    # writer, all of it written, and committed. Benchmarks read the hand-off from it.
    marks: dict[str, float] = field(default_factory=dict)
    # The self-check's numbers for the unit (CommitRecord.checks).
    checks: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Regen:
    """A unit's regeneration: its conversations, turn by turn."""

    spec: dict[str, Any]  # the job's `regenerate:` section
    tokenizer: Any
    max_seq_len: int
    template_kwargs: dict[str, Any]
    provenance: dict[str, Any]
    conversations: list[Conversation]
    failed: dict[int, str] = field(default_factory=dict)  # sample_index -> reason
    asked: int = 0  # answers awaited in the current round
    generated: int = 0  # conversations fully answered
    tokens: int = 0  # tokens generated

    def table(self) -> pa.Table:
        done = [c for c in self.conversations
                if c.sample_index not in self.failed and c.finished]
        return pa.Table.from_pydict({
            "sample_index": [c.sample_index for c in done],
            "messages": [dumps_messages(c.messages()) for c in done],
            "original": [dumps_messages(c.original) for c in done],
            "seeds": [[t.seed for t in c.done] for c in done],
            "finish_reasons": [[t.finish_reason for t in c.done] for c in done],
            "generated_tokens": [sum(t.tokens for t in c.done) for c in done],
            "truncated": [c.truncated for c in done],
        }, schema=REGENERATIONS_SCHEMA)


@dataclass
class _UnitRun:
    """One unit on its way through this worker."""

    output: Output  # where the shard goes: the job's output, or memory (online)
    storage_dtype: str
    checksum: str
    unit: WorkUnit
    rows: list[tuple[int, list[int], list[int]]]
    # A job that takes images: each sample's images and its tokens once they are
    # expanded (the inputs' `images` and `length`), by sample_index; None: text only.
    images: dict[int, tuple[list[bytes], int]] | None = None
    job: str = ""  # the job's output URI (the job a stop_job names)
    future: Future[UnitReport] = field(default_factory=Future)
    started: float = field(default_factory=time.monotonic)
    writer: ShardWriter | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    fed: int = 0  # requests handed to the engine
    done: int = 0  # results taken
    tokens_done: int = 0
    failure: BaseException | None = None
    regen: _Regen | None = None
    marks: dict[str, float] = field(default_factory=dict)  # see UnitReport.marks
    check: StatesCheck | None = None  # the job's self-check on this worker
    tally: UnitTally | None = None  # the check's numbers of this unit, as they come in
    checks: dict[str, Any] | None = None  # those numbers for the commit record, all in
    fault: str | None = None  # HSX_FAULT_STATES as the driver passed it (tests)
    stop: StatesCheckFailed | None = None  # another unit of the job tripped the check
    fault_memory: dict[str, Any] = field(default_factory=dict)  # what a fault carries over
    shard: str = ""  # the committed shard's key

    def fail(self, err: BaseException) -> None:
        """The unit ends now with `err` (its remaining results are dropped)."""
        if self.failure is None:
            self.failure = err
            if self.writer is not None:
                self.writer.abort()
        if not self.future.done():
            self.future.set_exception(err)

    def mark(self, stage: str, at: float | None = None) -> None:
        self.marks[stage] = time.monotonic() if at is None else at


def _vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", ""))


class ExtractionWorker:
    """Owns one capture engine and turns work units into committed shards."""

    def __init__(self, engine: str, engine_config: AnyEngineConfig, name: str = "worker"):
        self.name = name
        self.config = engine_config
        self._lock = threading.Lock()
        # The output last worked on, which keeps its inputs table open; an engine
        # serves any job whose engine config matches, one output at a time.
        self._output: Output | None = None
        self._queued: deque[_UnitRun] = deque()  # waiting for the capture loop
        self._routing: deque[_UnitRun] = deque()  # fed to the engine, results pending
        self._settling: list[_UnitRun] = []  # every result taken, at the committer
        self._loop: threading.Thread | None = None  # the capture loop taking units
        self._last_loop: threading.Thread | None = None  # a new one waits for it to end
        self._stopping = False
        self._dead: BaseException | None = None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsx-commit",
                                             initializer=background_priority)
        self._tokenizers: dict[str, Any] = {}  # a regenerating job's tokenizer, by path
        self._check: StatesCheck | None = None  # the self-check of the job of _output
        self._check_of_job: tuple[str, str] = ("", "")  # (output uri, mode) it checks
        # The target's head (headcheck.py), read while the engine starts: the default
        # `checks: on` compares id N with it from a job's first unit.
        settings = engine_config.settings
        # vLLM's own arguments may say how the weights load (`load_format: dummy`).
        engine_args = settings.options.engine_args() if isinstance(settings, VllmSettings) else {}
        self._head: Future[FinalHead] | None = head_ahead(
            engine_config.model, engine_args
        ) if engine_config.num_layers in engine_config.layers else None
        self.engine = create_engine(engine, engine_config)

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> str:
        """The Ray node this worker runs on ('' outside Ray): it answers once it can
        take units."""
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            return str(sys.modules["ray"].get_runtime_context().get_node_id())
        return ""

    def progress(self) -> dict[int, tuple[int, int, int, int]]:
        """unit -> (samples, tokens) captured and (samples, tokens) regenerated so far,
        for the units in flight (polled)."""
        with self._lock:
            runs = list(self._routing)
        return {run.unit.unit: (run.done, run.tokens_done,
                                run.regen.generated if run.regen else 0,
                                run.regen.tokens if run.regen else 0) for run in runs}

    def _rows(self, output: Output, unit: WorkUnit
              ) -> tuple[Output, list[tuple[int, list[int], list[int]]], pa.Table]:
        """The worker's Output for `output` (kept between units), the unit's rows and
        their table."""
        with self._lock:
            if self._output is None or self._output.uri != output.uri:
                self._output = output
            output = self._output
            table = output.input_rows(unit.row_start, unit.row_end)
        return output, list(
            zip(
                table.column("sample_index").to_pylist(),
                table.column("input_ids").to_pylist(),
                table.column("loss_mask").to_pylist(),
                strict=True,
            )
        ), table

    def _images_of(self, table: pa.Table) -> dict[int, tuple[list[bytes], int]] | None:
        """The unit's images and expanded lengths, when its job takes images (its engine
        was built to: `EngineConfig.images`, and its inputs keep them)."""
        if self.config.images is None:
            return None
        if IMAGES_COLUMN not in table.column_names:
            raise ValueError("the job takes images but its inputs hold none (an output "
                             "ingested without `images:`)")
        return {int(i): (list(images), int(length)) for i, images, length in zip(
            table.column("sample_index").to_pylist(), table.column(IMAGES_COLUMN).to_pylist(),
            table.column("length").to_pylist(), strict=True)}

    def _check_of(self, output: Output, mode: str) -> StatesCheck:
        """The self-check of `output`'s job: one per job on this worker, so its scale
        reference is what this job's first samples here showed."""
        # Waited for outside the lock: progress() answers meanwhile (done once it is read).
        head = self._head.result() if mode != "off" and self._head else None
        with self._lock:
            if self._check is None or self._check_of_job != (output.uri, mode):
                self._check = StatesCheck(mode, list(self.config.layers),
                                          self.config.num_layers, head)
                self._check_of_job = (output.uri, mode)
            return self._check

    def _regen_of(self, job: Regeneration | None, table: pa.Table) -> _Regen | None:
        """The unit's regeneration, when its job (`job`, from the admitted spec)
        regenerates: ingestion kept the conversations in the inputs."""
        if job is None:
            return None
        if MESSAGES_COLUMN not in table.column_names:
            raise ValueError("the job regenerates but its inputs hold no conversations "
                             "(an output ingested without them)")
        tokenizer = self._tokenizers.get(job.tokenizer)
        if tokenizer is None:
            from hsx.ingest import load_tokenizer

            tokenizer = load_tokenizer(job.tokenizer, trust_remote_code=job.trust_remote_code)
            self._tokenizers = {job.tokenizer: tokenizer}
        conversations = [
            Conversation(int(i), loads_messages(m), job.turns)
            for i, m in zip(table.column("sample_index").to_pylist(),
                            table.column(MESSAGES_COLUMN).to_pylist(), strict=True)
        ]
        provenance = {"model": job.model, "engine": "vllm", **job.settings,
                      "vllm_version": _vllm_version()}
        return _Regen(job.settings, tokenizer, job.max_seq_len,
                      dict(job.chat_template_kwargs), provenance, conversations)

    def run_unit(self, output: Output | str, storage_dtype: str, unit: WorkUnit,
                 checksum: str = DEFAULT_CHECKSUM, rows_of: WorkUnit | None = None,
                 checks: str = "on", fault: str | None = None,
                 regenerate: Regeneration | None = None
                 ) -> UnitReport | tuple[UnitReport, np.ndarray]:
        """Extract one unit into its shard and commit it; blocks until it is committed.

        `output` is the job's Output (it carries the storage settings the driver
        resolved) or its URI. Units queued by concurrent calls run back to back through
        one engine, in the order the calls arrived. An online job's unit (`rows_of`: the
        job's unit whose rows it captures; `unit` is its stream unit, hsx.online) is
        built and committed in this process's memory and returned with its report: the
        shard's bytes, which Ray puts into this node's object store for the trainer
        (hsx_workers.stream). `checks` is the job's self-check mode; `fault` puts wrong
        states in on purpose (state_faults.py: the driver's HSX_FAULT_STATES, for
        tests). `regenerate`: the job's regeneration, made by the driver from the
        admitted spec (nothing in the output decides what runs here).
        """
        out, rows, table = self._rows(Output.of(output), rows_of or unit)
        memory = None
        if rows_of is not None:
            memory = MemoryStorage(f"{out.uri}#{unit.unit}",
                                   expect_bytes=self._shard_bytes(rows, storage_dtype))
        run = _UnitRun(out if memory is None else Output(memory), storage_dtype, checksum,
                       unit, rows, job=out.uri,
                       images=self._images_of(table),
                       regen=self._regen_of(regenerate, table),
                       check=self._check_of(out, checks),
                       fault=fault)
        with self._lock:
            if self._dead is not None:
                raise EngineDead(f"{self.name}: the engine is gone: {self._dead}")
            self._queued.append(run)
            if self._loop is None:
                self._loop = threading.Thread(
                    target=self._capture_loop, args=(self._last_loop,),
                    name=f"hsx-capture-{self.name}", daemon=True)
                self._last_loop = self._loop
                self._loop.start()
        report = run.future.result()
        if memory is None:
            return report
        return report, memory.take(run.shard)

    def _shard_bytes(self, rows: list[tuple[int, list[int], list[int]]],
                     storage_dtype: str) -> int:
        """About the bytes of a shard of `rows` (a unit built in memory is allocated
        once): each token's states at the job's layers, its scales in fp8, its id and
        mask; each sample's offset, index and digest."""
        layers = len(self.config.layers)
        width = 1 if storage_dtype == "fp8" else 2
        per_token = layers * self.config.hidden_size * width + 5 + (
            4 * layers if storage_dtype == "fp8" else 0)
        return sum(len(ids) for _, ids, _ in rows) * per_token + 48 * len(rows) + 4096

    # -- the capture loop (one thread at a time)

    def _capture_loop(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        try:
            for result in self.engine.capture(self._feed()):
                self._take(result)
        except BaseException as err:
            logger.error("%s: capture failed: %s", self.name, err)
            with self._lock:
                self._dead = err
                runs = list(self._routing) + list(self._queued)
                self._routing.clear()
                self._queued.clear()
                self._loop = None
            for run in runs:
                run.fail(err)

    def _feed(self) -> Iterator[CaptureRequest | GenerateRequest | _Wait]:
        """The requests of the queued units, back to back; WAIT while none is queued."""
        run: _UnitRun | None = None
        idle_since = time.monotonic()
        while True:
            if run is None or run.fed == len(run.rows):
                run = self._next_run()
                if run is None:
                    with self._lock:
                        idle = not self._queued and not self._routing
                        if idle and (self._stopping
                                     or time.monotonic() - idle_since > IDLE_EXIT_S):
                            self._loop = None
                            return
                    yield WAIT
                    continue
                if run.regen is not None:
                    yield from self._regenerate(run, run.regen)
                    if not run.rows:  # every answer failed: nothing to capture
                        with self._lock:
                            self._routing.remove(run)
                            self._settling.append(run)
                        self._committer.submit(self._commit, run)
                        run = None
                        continue
            idle_since = time.monotonic()
            index, ids, _mask = run.rows[run.fed]
            if run.fed == 0:
                run.mark("fed")
            run.fed += 1
            if run.fed == len(run.rows):
                run.mark("fed_last")
            predict = run.check is not None and run.check.picks(index)
            images, tokens = run.images.get(index, ([], 0)) if run.images else ([], 0)
            yield CaptureRequest(index, ids, predict=predict, images=images or None,
                                 tokens=tokens)

    def _regenerate(self, run: _UnitRun, regen: _Regen) -> Iterator[GenerateRequest | _Wait]:
        """Answer the unit's conversations round by round (one round per regenerated
        turn), then set its rows to the regenerated conversations' tokens."""
        spec = regen.spec
        from hsx.ingest import generation_prompt, tokenize_conversations

        while True:
            asks = []
            for conv in regen.conversations:
                if conv.sample_index in regen.failed:
                    continue
                prompt_messages = conv.next_prompt()
                if prompt_messages is None:
                    continue
                try:
                    prompt = generation_prompt(regen.tokenizer, prompt_messages,
                                               regen.template_kwargs)
                except ValueError as err:
                    regen.failed[conv.sample_index] = f"regenerate: {err}"
                    continue
                room = regen.max_seq_len - len(prompt)
                if room < 1:
                    regen.failed[conv.sample_index] = (
                        f"regenerate: the conversation before turn {len(conv.done)} takes "
                        f"{len(prompt)} tokens, no room to answer within max_seq_len "
                        f"({regen.max_seq_len})")
                    continue
                seed = sample_seed(int(spec.get("seed", 0)), conv.sample_index, len(conv.done))
                asks.append(GenerateRequest(
                    conv.sample_index, prompt, min(int(spec["max_tokens"]), room),
                    float(spec["temperature"]), float(spec["top_p"]), seed,
                    on_done=self._answer(regen, conv, seed)))
            if not asks:
                break
            regen.asked = len(asks)
            yield from asks
            while regen.asked:
                yield WAIT  # the engine steps; each answer arrives through on_done
        done = [c for c in regen.conversations if c.sample_index not in regen.failed]
        tokenized = tokenize_conversations(regen.tokenizer, [c.messages() for c in done],
                                           regen.max_seq_len, regen.template_kwargs)
        rows = []
        for conv, result in zip(done, tokenized, strict=True):
            if isinstance(result, str):
                regen.failed[conv.sample_index] = f"regenerate: {result}"
            else:
                rows.append((conv.sample_index, result[0].tolist(), result[1].tolist()))
        run.rows = rows
        run.errors.extend({"sample_index": i, "reason": r}
                          for i, r in sorted(regen.failed.items()))

    @staticmethod
    def _answer(regen: _Regen, conv: Conversation, seed: int
                ) -> Callable[[GenerateResult], None]:
        def on_done(result: GenerateResult) -> None:
            regen.asked -= 1
            if result.error is not None:
                regen.failed[conv.sample_index] = f"regenerate: {result.error}"
                return
            conv.answer(GeneratedTurn(result.text, len(result.token_ids),
                                      result.finish_reason, seed))
            regen.tokens += len(result.token_ids)
            regen.generated += conv.finished

        return on_done

    def _next_run(self) -> _UnitRun | None:
        """The next queued unit with its writer open, now awaiting results; None if none."""
        while True:
            with self._lock:
                if not self._queued:
                    return None
                run = self._queued.popleft()
            try:
                if not run.rows:
                    raise ValueError(f"unit {run.unit.unit} has no rows")
                run.writer = run.output.shard_writer(
                    run.unit.unit, layers=self.config.layers,
                    hidden_size=self.config.hidden_size,
                    storage_dtype=run.storage_dtype,  # type: ignore[arg-type]
                    checksum=run.checksum,  # type: ignore[arg-type]
                    modality=run.images is not None,
                )
            except BaseException as err:  # the output cannot take this unit
                run.fail(err)
                continue
            with self._lock:
                self._routing.append(run)
            return run

    def _take(self, result: CaptureResult) -> None:
        """One result into its unit's shard (results come in request order)."""
        run = self._routing[0]
        if result.sample_index != run.rows[run.done][0]:
            raise RuntimeError(f"internal: result for sample {result.sample_index} where "
                               f"sample {run.rows[run.done][0]} of unit {run.unit.unit} was due")
        if run.stop is not None and run.failure is None:
            run.fail(run.stop)
        if run.failure is None and run.writer is not None:
            try:
                masks, unaligned = None, None
                if result.error is None and result.hidden_states is not None:
                    try:
                        masks = self._masks(run, result)
                    except ValueError as err:  # the engine's tokens are not the prompt's
                        unaligned = str(err)
                if result.error is not None or result.hidden_states is None or masks is None:
                    run.errors.append({"sample_index": result.sample_index,
                                       "reason": result.error or unaligned
                                       or "no hidden states"})
                else:
                    states, scales = result.hidden_states, result.scales
                    if run.fault is not None:
                        from hsx_workers import state_faults

                        states, scales = state_faults.apply(
                            run.fault, result.sample_index, states, scales,
                            head=run.check.head if run.check else None,
                            last=run.check.last if run.check else None,
                            memory=run.fault_memory)
                    if run.check is not None:  # a fault's states have norms of their own
                        run.check.check(result.sample_index, states, scales,
                                        result.predicted,
                                        result.norms if run.fault is None else None)
                    loss_mask, modality = masks
                    run.writer.add(result.sample_index, result.input_ids, loss_mask, states,
                                   take=result.owned, scales=scales,
                                   modality_mask=modality)
            except StatesCheckFailed as err:
                self._stop_job(run, err)
            except BaseException as err:
                run.fail(err)
        run.done += 1
        run.tokens_done += len(result.input_ids)
        for stage, at in (("computed", result.computed_at), ("spooled", result.spooled_at)):
            if at > run.marks.get(stage, 0.0):
                run.mark(stage, at)
        if run.done == len(run.rows):
            run.mark("taken")
            if run.check is not None and run.failure is None:
                run.tally = run.check.finish()
            with self._lock:
                self._routing.popleft()
                self._settling.append(run)
            self._committer.submit(self._commit, run)

    def _masks(self, run: _UnitRun, result: CaptureResult) -> tuple[Any, Any]:
        """The loss mask over the tokens the engine computed, and which of them are an
        image's vision tokens (None: a text job). The engine expands each image's
        placeholder (vLLM's ids are the shard's), so a prompt with images has its mask
        carried over to them (hsx.ingest.images.realign): vision tokens are never in
        the loss."""
        _, ids, mask = run.rows[run.done]
        if run.images is None:
            return mask, None
        from hsx.ingest.images import realign

        images = self.config.images
        if images is None:
            raise RuntimeError("a unit with images on a worker built for text prompts")
        return realign(ids, mask, result.input_ids, images.image_token_id)

    def _stop_job(self, run: _UnitRun, err: StatesCheckFailed) -> None:
        """A tripped self-check (`checks: on`): this unit fails now, and so does every
        other unit of its job that this worker holds, queued or computing. Their
        remaining results are dropped as they come (results come in request order)."""
        failed = StatesCheckFailed(f"unit {run.unit.unit}: {err}")
        run.fail(failed)
        self._stop_units(run.job, str(failed), run)

    def stop_job(self, output: Output | str, reason: str) -> int:
        """A unit of the job writing into `output` tripped its self-check on another
        worker (the driver asks, dispatch.py): every unit of it this worker holds fails
        now with `reason`, as a trip here would fail them. Returns how many."""
        return self._stop_units(Output.of(output).uri, reason)

    def _stop_units(self, uri: str, reason: str, tripped: _UnitRun | None = None) -> int:
        with self._lock:
            queued = [r for r in self._queued if r.job == uri]
            for other in queued:
                self._queued.remove(other)
            routing = [r for r in (*self._routing, *self._settling)
                       if r is not tripped and r.job == uri]
            for other in routing:  # failed at their next result, or before their commit
                other.stop = StatesCheckFailed(reason)
        for other in queued:  # the same words: the job's error is the one that tripped
            other.fail(StatesCheckFailed(reason))
        return len(queued) + len(routing)

    def _commit(self, run: _UnitRun) -> None:
        try:
            self._settle_and_commit(run)
        finally:
            with self._lock:
                self._settling.remove(run)

    def _settle_and_commit(self, run: _UnitRun) -> None:
        writer = run.writer
        if run.check is not None and run.tally is not None and run.failure is None:
            try:  # the unit's checks, awaited here: the capture goes on meanwhile
                run.checks = run.check.settle(run.tally)
            except StatesCheckFailed as err:
                self._stop_job(run, err)
            except BaseException as err:  # the check itself failed: the unit with it
                run.fail(err)
        try:
            if run.stop is not None and run.failure is None:
                run.fail(run.stop)  # another unit of the job tripped: nothing of it commits
            if run.failure is not None:
                raise run.failure
            if writer is None:
                raise RuntimeError(f"unit {run.unit.unit} has no writer")
            writer.flush()
            run.mark("written")
            ref = None
            if run.regen is not None:
                ref = run.output.put_regenerations(run.unit.unit, writer.attempt,
                                                   run.regen.table(), run.regen.provenance)
            outcome = writer.commit(errors=run.errors, regenerations=ref, checks=run.checks)
        except BaseException as err:
            run.fail(err)
            return
        run.mark("committed")
        record = outcome.record
        run.shard = record.shard
        run.future.set_result(UnitReport(
            unit=run.unit.unit,
            won=outcome.won,
            samples=record.samples,
            tokens=record.tokens,
            bytes=record.bytes,
            errors=[e.model_dump() for e in record.errors],
            seconds=time.monotonic() - run.started,
            worker=self.name,
            node=self.ready(),
            generated=record.regenerations.rows if record.regenerations else 0,
            generated_tokens=record.regenerations.tokens if record.regenerations else 0,
            truncated=record.regenerations.truncated if record.regenerations else 0,
            marks={"queued": run.started, **run.marks},
            checks=dict(run.checks or {}),
        ))

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            loop = self._loop
        if loop is not None:
            loop.join(timeout=60)
        self._committer.shutdown(wait=True)
        self.engine.close()
