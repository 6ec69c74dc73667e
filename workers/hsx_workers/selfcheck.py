"""The self-check: every captured sample's states looked at before its shard takes them.

A capture that is silently wrong (all zeros after a vLLM change, NaN from one request, the
layer ids shifted so two ids hold the same state, a scale off by orders of magnitude)
trains a draft that validates and then accepts nothing when served. `StatesCheck` looks
at each sample as the worker hands it to the shard writer (worker.py `_take`), per layer:

- `nonfinite`: a row holds NaN or inf;
- `zero`: a row is all zeros (for id 0, the embeddings, only a whole layer: a padding
  token's embedding may be zero);
- `identical`: two layers hold the same state;
- `scale`: the layer's median row RMS is beyond `ABSOLUTE_RMS`, or `SCALE_FACTOR` times
  above or below what the job's first samples on this worker showed (the reference: the
  per-layer median over the first `REFERENCE_SAMPLES`, which are checked against it once
  it is known; a fault in one of them cannot move a median of several).

Cost: the checks work on the [T, L] row norms, which the vllm engine's connector computes
on the device beside the states it copies (hostcopy.row_norms_of: one reduction, no pass
over the states on the host); for the other engines, one pass over the states here
(`torch.linalg.vector_norm` over H), on the array already in hand, without a copy. Two
layers are compared element by element only when their row norms are equal on every
token, which distinct layers never are. All of it runs on a thread of its own.

Where id N is captured and the target's head can be read (headcheck.py), a sample of
requests is also checked against the engine's own next-token choice (`agreement`) and
for a last state that is already normalized (`prenorm`). The worker asks `picks()` for
each request it feeds (the engine then reports its top-1 per position); those samples'
id-N rows are copied out and compared on a thread of their own, so the capture never
waits for a head's product; the samples queued there go through the head in one product.
A unit commits only once its samples' verdicts are in.

Who calls what: the worker builds one `StatesCheck` per job it serves (`mode` from the
job's `checks:`), calls `picks()` for each request, `check(sample_index, states, scales,
predicted)` for each sample and `finish()` before a unit commits; `take_report()` gives
the unit's numbers for its commit record. Under `checks: on` a problem raises
`StatesCheckFailed`, which the dispatcher treats as the job's end (no retry: the same
states would trip again).
"""

from __future__ import annotations

import math
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsx.spec import CHECK_MODES
from hsx_workers.headcheck import (
    BF16_ROUNDOFF,
    FP8_ROUNDOFF,
    HEAD_EVERY,
    HEAD_FIRST,
    HEAD_FIRST_ROWS,
    HEAD_ROWS,
    FinalHead,
    HeadSample,
    HeadVerdict,
    check_samples,
    pooled_problem,
)

CHECKS_DONE = ("nonfinite", "zero", "identical", "scale", "prenorm", "agreement")
REFERENCE_SAMPLES = 8
SCALE_FACTOR = 1e3
"""A sample's layer this many times above or below the reference trips `scale`. Within a
real model's layer the median row RMS of two samples differs by a few times at most (a
one-token sample is its attention sink, ~100x); a scale bug is orders of magnitude."""
ABSOLUTE_RMS = (1e-6, 1e5)
"""Median row RMS outside these bounds trips `scale` whatever the reference: no trained
or randomly initialized model's residual stream is there (massive activations reach
~1e4 in a few channels, an RMS of ~1e2-1e3)."""
MAX_RECORDED = 20  # problems kept word for word per unit under `checks: warn`

# The spool's arrays map read-only pages; torch warns that writing through its view
# would be undefined. The check only reads them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class StatesCheckFailed(RuntimeError):
    """A captured state is wrong (`checks: on`): the job stops, its units not retried."""


def is_check_failure(err: BaseException) -> bool:
    """Whether `err` (or the cause Ray wrapped) is a tripped self-check."""
    return isinstance(err, StatesCheckFailed) or isinstance(
        getattr(err, "cause", None), StatesCheckFailed)


@dataclass
class UnitTally:
    """One unit's numbers (its commit record's `checks`), the head check's verdicts of its
    samples included, which may come in after the unit's last sample."""

    samples: int = 0  # checked
    problems: list[str] = field(default_factory=list)  # word for word, the first ones
    problem_count: int = 0
    head_samples: int = 0
    head_rows: int = 0
    head_agreed: int = 0
    checks: list[Future[None]] = field(default_factory=list)  # on the checking thread


@dataclass
class StatesCheck:
    """One job's self-check on one worker; see the module docstring."""

    mode: str
    layers: list[int]
    num_layers: int | None = None  # N: the head check looks at id N when it is captured
    head: FinalHead | None = None  # the target's final norm and head (headcheck.py)
    tally: UnitTally = field(default_factory=UnitTally)  # the unit being checked
    _reference: list[float] | None = None  # per layer: median row RMS of the first samples
    _pending: list[tuple[int, list[float]]] = field(default_factory=list)  # (sample, RMS)
    # The head check: requests fed, samples picked and not yet checked, verdicts awaited
    # (with the unit they count for); rows compared and agreed since the job started on
    # this engine. A unit's verdicts are taken when it is settled (the committer's thread).
    _fed: int = 0
    _picked: dict[int, int] = field(default_factory=dict)  # sample -> its rows to compare
    _verdicts: list[tuple[int, Future[HeadVerdict], UnitTally]] = field(default_factory=list)
    _head_queue: list[tuple[HeadSample, Future[HeadVerdict]]] = field(
        default_factory=list)  # id-N rows copied out, for the head's thread
    _job_rows: int = 0
    _job_agreed: int = 0
    _pooled_tripped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tripped: StatesCheckFailed | None = None  # found on the checking thread, under `on`

    def __post_init__(self) -> None:
        if self.mode not in CHECK_MODES:
            raise ValueError(f"checks must be one of {CHECK_MODES}, got {self.mode!r}")

    @property
    def last(self) -> int | None:
        """Where id N is among the stored layers (None: not captured)."""
        n = self.num_layers
        return self.layers.index(n) if n is not None and n in self.layers else None

    @property
    def head_missing(self) -> str:
        """Why the head check does not run ("" when it does)."""
        if self.mode == "off":
            return "checks: off"
        if self.num_layers is not None and self.last is None:
            return f"id N ({self.num_layers}) is not captured"
        if self.head is None:
            return "no head loaded"
        return self.head.missing

    def picks(self, sample_index: int) -> bool:
        """Whether the request of `sample_index`, now fed, is one the head check takes
        (the job's first HEAD_FIRST on this engine, HEAD_FIRST_ROWS rows of each, then one
        in HEAD_EVERY, HEAD_ROWS of it): its engine should report its own top-1 per
        position."""
        if self.head_missing:
            return False
        self._fed += 1
        first = self._fed <= HEAD_FIRST
        picked = first or self._fed % HEAD_EVERY == 0
        if picked:
            self._picked[sample_index] = HEAD_FIRST_ROWS if first else HEAD_ROWS
        return picked

    def check(self, sample_index: int, states: Any, scales: Any = None,
              predicted: list[int] | None = None, norms: Any = None) -> None:
        """Look at one sample's [T, L, H] states (torch, or numpy as the spool maps them;
        float8 with its [T, L] `scales`, neither written to by anyone while the check
        runs); `predicted`: the engine's top-1 per position, for a sample `picks` took;
        `norms`: the [T, L] row norms where the engine computed them (hostcopy.py, on the
        device), else they are computed here.

        The looking is done on the checking thread (one per process, in the order the
        samples come): on a GPU host the capture thread is what bounds the job, and the
        pass over an 8B model's states (5 ms a sample of 1,280 tokens x 4 layers) on it
        cost 11% of the throughput (4% on a thread of its own: hence the device's norms).
        Raises StatesCheckFailed under `on` for a problem found in an earlier sample;
        `settle` raises it for the unit's own."""
        shape = tuple(states.shape)
        if self.mode == "off" or len(shape) != 3 or shape[1] != len(self.layers) or not shape[0]:
            return  # not [T, L, H]: the shard writer refuses it with its own words
        if self._tripped is not None:
            raise self._tripped
        head_rows = self._picked.pop(sample_index, 0)
        tally = self.tally
        tally.checks.append(_check_pool().submit(
            self._check_one, sample_index, states, scales, predicted if head_rows else None,
            head_rows, tally, norms))

    def _check_one(self, sample_index: int, states: Any, scales: Any,
                   predicted: list[int] | None, head_rows: int, tally: UnitTally,
                   norms: Any = None) -> None:
        """One sample, on the checking thread (`head_rows` of it for the head check)."""
        import torch

        # On one thread: on a CPU host the engine keeps every core busy, and torch's
        # OpenMP team waiting on its threads made the check 3-8x slower (0.4-1.0 ms a
        # tiny sample against 0.12 on one thread, with the 2-core machine loaded).
        threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)
        try:
            self._check(sample_index, states, scales, tally, norms)
            if head_rows:
                self._head_check(sample_index, states, scales, predicted, head_rows, tally)
        except StatesCheckFailed as err:
            self._tripped = self._tripped or err
            raise
        finally:
            if threads != 1:
                torch.set_num_threads(threads)

    def _head_check(self, sample_index: int, states: Any, scales: Any,
                    predicted: list[int] | None, rows: int, tally: UnitTally) -> None:
        """Copy the sample's id-N rows out and compare `rows` of them on the head's
        thread."""
        head, li = self.head, self.last
        if head is None or li is None:
            return
        last = as_torch(states)[:, li]
        last = last.float() if last.dtype.itemsize == 1 else last.clone()
        roundoff = BF16_ROUNDOFF
        if scales is not None:
            import torch

            last = last.float() * torch.as_tensor(np.asarray(scales)[:, li])[:, None]
            roundoff = FP8_ROUNDOFF
        future: Future[HeadVerdict] = Future()
        with self._lock:
            self._verdicts.append((sample_index, future, tally))
            self._head_queue.append(
                (HeadSample(last, predicted, self.layers[li], roundoff, rows), future))
        _head_pool().submit(self._run_heads)

    def _run_heads(self) -> None:
        """On the head's thread: every sample queued by now, through the head at once (the
        job's first samples come together, and one product streams the head once)."""
        with self._lock:
            queued, self._head_queue = self._head_queue, []
        if not queued:
            return  # an earlier call took them
        assert self.head is not None
        try:
            verdicts = check_samples(self.head, [sample for sample, _ in queued])
        except BaseException as err:  # each sample's verdict carries it to its unit
            for _, future in queued:
                future.set_exception(err)
            return
        for (_, future), verdict in zip(queued, verdicts, strict=True):
            future.set_result(verdict)

    def _drain(self, unit: UnitTally, block: bool) -> None:
        """Take the head check's verdicts of `unit` that are in (all of them, waiting, when
        `block`). Each unit's are taken on the thread that settles it: a verdict that
        trips fails that unit."""
        while True:
            with self._lock:
                ready = [v for v in self._verdicts if v[2] is unit and (block or v[1].done())]
                if not ready:
                    return
                for v in ready:
                    self._verdicts.remove(v)
            for sample_index, future, tally in ready:
                self._take_verdict(sample_index, future.result(), tally)

    def _take_verdict(self, sample_index: int, verdict: HeadVerdict, tally: UnitTally) -> None:
        with self._lock:
            tally.head_samples += 1
            tally.head_rows += verdict.rows
            tally.head_agreed += verdict.agreed
            self._job_rows += verdict.rows
            self._job_agreed += verdict.agreed
            found = list(verdict.problems)
            pooled = pooled_problem(self._job_rows, self._job_agreed, int(self.num_layers or 0))
            if pooled and not self._pooled_tripped:
                self._pooled_tripped = True
                found.append(pooled)
        if found:
            self._problem(sample_index, found, tally)

    def _check(self, sample_index: int, states: Any, scales: Any, tally: UnitTally,
               given: Any = None) -> None:
        # [T, L] float32: the engine's, or one pass over the states here. What follows
        # works on it in numpy: a few small operations, which hold the GIL (that the
        # capture thread needs) far less than torch's dispatch of the same.
        norms = (row_norms(states, scales).cpu().numpy() if given is None
                 else np.asarray(given, dtype=np.float32))
        t = norms.shape[0]
        finite = np.isfinite(norms)
        zero = norms == 0
        bad_rows, zero_rows = (~finite).sum(axis=0), zero.sum(axis=0)
        found: list[str] = []
        for li, layer in enumerate(self.layers):
            if bad_rows[li]:
                first = int(np.argmax(~finite[:, li]))
                found.append(f"layer {layer}: {int(bad_rows[li])} of {t} rows hold NaN or "
                             f"inf (the first at token {first})")
            elif zero_rows[li] == t or (zero_rows[li] and layer != 0):
                first = int(np.argmax(zero[:, li]))
                found.append(f"layer {layer}: {int(zero_rows[li])} of {t} rows are all "
                             f"zeros (the first at token {first})")
        if not found:
            found += self._identical(states, scales, norms)
        rms: list[float] = []
        if not found:
            root_h = math.sqrt(int(states.shape[-1]))
            rms = (np.median(norms, axis=0) / root_h).tolist()
            low, high = ABSOLUTE_RMS
            for layer, value in zip(self.layers, rms, strict=True):
                if not low <= value <= high:
                    found.append(f"layer {layer}: its median row RMS is {value:.3g}, "
                                 f"outside [{low:g}, {high:g}] (states scaled wrong?)")
        tally.samples += 1
        if found:
            self._problem(sample_index, found, tally)
        elif self._reference is None:
            self._pending.append((sample_index, rms))
            if len(self._pending) >= REFERENCE_SAMPLES:
                self._learn(tally)
        else:
            self._against_reference(sample_index, rms, tally)

    def finish(self) -> UnitTally:
        """At a unit's last sample (on the capture thread): a reference from fewer samples
        than REFERENCE_SAMPLES (a small first unit) is learned from what there is, and
        they are checked. Returns the unit's tally (for `settle`); the next unit's starts."""
        tally, self.tally = self.tally, UnitTally()
        if self.mode != "off":
            tally.checks.append(_check_pool().submit(self._finish_unit, tally))
        return tally

    def _finish_unit(self, tally: UnitTally) -> None:
        if self._reference is None and len(self._pending) >= 3:
            try:
                self._learn(tally)
            except StatesCheckFailed as err:
                self._tripped = self._tripped or err
                raise

    def settle(self, tally: UnitTally) -> dict[str, Any]:
        """Before the unit commits (on the committer's thread, so the capture goes on):
        waits for its head verdicts; returns its numbers for the commit record. Raises
        StatesCheckFailed under `on` for a problem in the unit."""
        for done in tally.checks:
            done.result()
        self._drain(tally, block=True)
        return {"mode": self.mode, "samples": tally.samples,
                "problems": tally.problem_count, "found": list(tally.problems),
                "head_samples": tally.head_samples, "head_rows": tally.head_rows,
                "head_agreed": tally.head_agreed, "head_missing": self.head_missing}

    def take_report(self) -> dict[str, Any]:
        """`finish` and `settle` at once (one thread: a check without a capture)."""
        return self.settle(self.finish())

    def _identical(self, states: Any, scales: Any, norms: Any) -> list[str]:
        import torch

        # Layers whose row norms are equal on every token (one comparison of all pairs);
        # only those are compared element by element.
        same_norms = np.triu((norms[:, :, None] == norms[:, None, :]).all(axis=0), k=1)
        found = []
        for a, b in np.argwhere(same_norms).tolist():
            x = as_torch(states)
            if x.dtype == torch.float8_e4m3fn:  # compared bitwise
                x = x.view(torch.uint8)
            same = torch.equal(x[:, a], x[:, b]) and (
                scales is None or np.array_equal(np.asarray(scales)[:, a],
                                                 np.asarray(scales)[:, b]))
            if same:
                found.append(f"layers {self.layers[a]} and {self.layers[b]} hold "
                             "identical states (layer ids shifted or copied?)")
        return found

    def _learn(self, tally: UnitTally) -> None:
        pending, self._pending = self._pending, []
        self._reference = [float(np.median(column)) for column in zip(*(m for _, m in pending),
                                                                       strict=True)]
        for sample_index, rms in pending:
            self._against_reference(sample_index, rms, tally)

    def _against_reference(self, sample_index: int, rms: list[float], tally: UnitTally
                           ) -> None:
        found = []
        for layer, ref, value in zip(self.layers, self._reference or rms, rms, strict=True):
            if ref > 0 and not ref / SCALE_FACTOR <= value <= ref * SCALE_FACTOR:
                found.append(f"layer {layer}: its median row RMS is {value:.3g}, "
                             f"{value / ref:.3g} times the job's first samples' "
                             f"({ref:.3g}; states scaled wrong?)")
        if found:
            self._problem(sample_index, found, tally)

    def _problem(self, sample_index: int, found: list[str], tally: UnitTally) -> None:
        tally.problem_count += len(found)
        words = [f"sample {sample_index} (dataset row {sample_index}), {f}" for f in found]
        if self.mode == "on":
            more = f"; and {len(words) - 3} more" if len(words) > 3 else ""
            raise StatesCheckFailed(
                "self-check failed: " + "; ".join(words[:3]) + more + " — the job stops before "
                "writing more (`checks: warn` records such states and goes on)")
        room = MAX_RECORDED - len(tally.problems)
        tally.problems.extend(words[:max(room, 0)])


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(name: str) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        return _POOLS[name]


def _check_pool() -> ThreadPoolExecutor:
    """The one thread of this process that checks samples, in the order they come."""
    return _pool("hsx-check")


def _head_pool() -> ThreadPoolExecutor:
    """The one thread of this process that runs head checks."""
    return _pool("hsx-head")


def head_ahead(model_path: str, engine_args: dict[str, Any]) -> Future[FinalHead]:
    """The target's head read (and a float16 one's float32 copy made) on the head's
    thread from now on: a worker asks while its engine starts (20-90 s on a GPU), so that
    a job's first head check does not wait for it (an 8B model's head: 1.2 GB)."""
    import torch  # noqa: F401  here first: torch imported by two threads at once can fail

    def read() -> FinalHead:
        head = FinalHead.of_engine(model_path, engine_args)
        if not head.missing:
            head.product_weight()
        return head

    return _head_pool().submit(read)


def as_torch(states: Any) -> Any:
    """`states` as a torch tensor sharing its memory (numpy bf16/fp8 viewed bitwise)."""
    import torch

    if isinstance(states, torch.Tensor):
        return states
    kind = str(states.dtype)
    if kind == "bfloat16":
        return torch.from_numpy(states.view(np.uint16)).view(torch.bfloat16)
    if kind == "float8_e4m3fn":
        return torch.from_numpy(states.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(states)


def row_norms(states: Any, scales: Any = None) -> Any:
    """[T, L] float32 L2 norm of every row of [T, L, H] states (dequantized by `scales`)."""
    import torch

    x = as_torch(states)
    if x.dtype == torch.float8_e4m3fn:  # torch has no fp8 reductions on every device
        norms = torch.linalg.vector_norm(x.float(), dim=-1)
    else:
        norms = torch.linalg.vector_norm(x, dim=-1).float()
    if scales is not None:
        scale = scales if isinstance(scales, torch.Tensor) else torch.from_numpy(
            np.asarray(scales, dtype=np.float32))
        norms = norms * scale.to(norms.device)
    return norms
