"""The head check: the captured last state against the engine's own next-token choice.

The format promises that id N is the target's last state before its final norm, so
`lm_head(norm(h_N))` at token t is the model's prediction of token t+1: the token the
engine itself picks there. A capture taken at the wrong point (after the norm, a layer
early, another request's rows: vLLM #50815, speculators #279) drifts from it. On a
sample of requests (`HEAD_FIRST` first, then one in `HEAD_EVERY`) the engine is asked
for its top-1 at every prompt position (vLLM's prompt logprobs, greedy on the last), and
this module compares, on up to `HEAD_ROWS` rows of each such sample (`HEAD_FIRST_ROWS` of
each of the first):

- `agreement`: the share of rows where the engine's top-1 is the argmax of
  `lm_head(norm(h_N))`, or within `TIE_ULPS` bf16 steps of it (the engine's logits are
  bf16: on the tests' tiny model, with 512 tokens and logits near 0.3, an exact argmax
  agreed on 0.986 of rows, every miss a near-tie). A correct capture agrees on nearly
  every row; the check trips when the rows checked so
  far on this engine agree on less than `AGREEMENT_MIN` (judged once `AGREEMENT_ROWS`
  are in), or one sample on less than `SAMPLE_AGREEMENT_MIN` (another request's states);
- `prenorm`: id N is not already normalized: every row of `h_N / w` having an RMS of 1
  (within `PRENORM_TOLERANCE`) is what the final norm's output looks like, never its input.

`FinalHead.load` reads the final norm (hsx.finalnorm, for the model types whose norm it
knows) and the head's weights from the model's safetensors (the head tied to the
embeddings where the checkpoint says so; a wrapper's language model under its prefix).
Anything else leaves the head check out, and the unit's record says why
(`FinalHead.missing`). The weights stay on the worker's host in the checkpoint's dtype
(the head of an 8B model is 1.2 GB), read while the engine starts (selfcheck.head_ahead).
The product runs on the rows checked only, in the head's dtype (bf16: the check 2.2x
faster than in float32 on a 2-core AVX-512 host, and no float32 copy), split over the
host's cores; each row's few largest logits and the engine token's are then computed
again in float32 (`FinalHead.agrees`). `check_samples` takes several samples' rows
through the head at once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hsx.finalnorm import Checkpoint, FinalNorm, FinalNormUnavailable

HEAD_FIRST = 8  # requests of a job on an engine checked first
HEAD_EVERY = 1000  # after them, one request in this many
HEAD_ROWS = 64  # rows of a checked sample compared, spread over it
# Rows of each of the first HEAD_FIRST samples: together the AGREEMENT_ROWS the pooled
# judgement needs. A job's first commit on an engine waits for their product, its one
# fixed cost (on one H100's host: 0.6 s with 64 rows each, 0.47 s with 32).
HEAD_FIRST_ROWS = 32
AGREEMENT_MIN = 0.98
AGREEMENT_ROWS = 256  # rows pooled before the agreement is judged
SAMPLE_AGREEMENT_MIN = 0.5
SAMPLE_MIN_ROWS = 8  # a sample's own agreement is judged from this many rows
PRENORM_TOLERANCE = 2e-2  # of fp8 states: their RMS rounds within ~1%
CANDIDATES = 8  # a row's largest logits of the head-dtype product, computed again exactly
MAX_PRODUCT_THREADS = 16  # threads the product is split over, at most (one per core)
TIE_ULPS = 2  # bf16 steps of the largest logit within which the engine's token agrees
TIE_SIGMAS = 4  # and standard deviations of the error the stored states' rounding makes
BF16_ROUNDOFF = 2.0**-8  # relative rounding of a value stored in bf16
FP8_ROUNDOFF = 2.0**-4  # in float8_e4m3 (3 mantissa bits)

@dataclass
class FinalHead:
    """The target's final norm and head, as the engine applies them to id N."""

    final_norm: FinalNorm | None
    head_weight: Any  # [V, H] torch tensor
    missing: str = ""  # why there is no head (the fields above are None then)
    _head32: Any = field(default=None, repr=False)  # a float16 head in float32

    @classmethod
    def unavailable(cls, reason: str) -> FinalHead:
        return cls(None, None, reason)

    @classmethod
    def of_engine(cls, model_path: str, engine_args: dict[str, Any]) -> FinalHead:
        """The head of the model an engine runs: none where the engine does not read the
        checkpoint's weights (`load_format: dummy` fills random ones)."""
        if engine_args.get("load_format") == "dummy":
            return cls.unavailable("the engine runs random weights (load_format: dummy), "
                                   "not the checkpoint's")
        return cls.load(model_path)

    @classmethod
    def load(cls, model_path: str) -> FinalHead:
        """The head of the model at `model_path`, or one saying why there is none."""
        try:
            checkpoint = Checkpoint.open(model_path)
            head_key = checkpoint.head_key
            if head_key is None and not checkpoint.tied:
                raise FinalNormUnavailable("the checkpoint holds no lm_head.weight and its "
                                           "head is not tied to the embeddings")
            final_norm = FinalNorm.of(checkpoint)
            head_key = head_key or checkpoint.inner("embed_tokens.weight")
            if head_key is None:
                raise FinalNormUnavailable("the head is tied, and no embeddings were found")
        except FinalNormUnavailable as err:
            return cls.unavailable(str(err))
        return cls(final_norm, checkpoint.read(head_key))

    @property
    def offset(self) -> bool:
        """The norm scales by 1 + weight."""
        assert self.final_norm is not None
        return self.final_norm.offset

    @property
    def scale(self) -> Any:
        """The norm's per-channel factor, in float32."""
        assert self.final_norm is not None
        return self.final_norm.scale

    def norm(self, states: Any) -> Any:
        """The final norm applied to [R, H] states (float32 out)."""
        assert self.final_norm is not None
        return self.final_norm.apply(states)

    def agrees(self, states: Any, tokens: Any, roundoff: Any = BF16_ROUNDOFF) -> Any:
        """[R] bool: whether the engine's token on each row is the argmax of
        `lm_head(norm(states))` for [R, H] states, up to a near-tie: its logit within
        `TIE_ULPS` bf16 steps of the largest (the engine's logits are bf16, where two
        tokens often hold the same value) plus what the states' own rounding (`roundoff`,
        relative, per value: bf16's, or fp8's for states stored in fp8) can move it:
        `TIE_SIGMAS` standard deviations of the top logit's error; a number, or one per
        row).

        The whole vocabulary's logits come from one product in the head's own dtype
        (`candidates`); the largest logit and the engine token's are then computed again
        in float32 from their head rows, as a float32 product of all would give them."""
        import torch

        normed = self.norm(states).to(self.head_weight.dtype)  # as the engine rounds them
        ids = self.candidates(normed)  # [R, CANDIDATES]
        exact = normed.float()
        heads = self.head_weight[ids].float()  # [R, CANDIDATES, H]
        logits = torch.einsum("rkh,rh->rk", heads, exact)
        best, pick = logits.max(-1)
        best_head = heads[torch.arange(len(ids)), pick]
        theirs = (self.head_weight[torch.as_tensor(tokens)].float() * exact).sum(-1)
        step = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-30))) - 7)
        # A value rounded to within +-u of itself errs by u/sqrt(3) of it (uniform).
        noise = (torch.linalg.vector_norm(best_head * exact, dim=-1)
                 * torch.as_tensor(roundoff, dtype=torch.float32) / 3**0.5)
        return theirs >= best - TIE_ULPS * step - TIE_SIGMAS * noise

    def candidates(self, normed: Any) -> Any:
        """[R, CANDIDATES] ids of each row's largest logits, from `normed @ head.T` in the
        head's dtype where the CPU has a fast product for it (bf16, float32; a float16
        head goes through a float32 copy, made once), a slice of the vocabulary on each
        of the host's cores (`MAX_PRODUCT_THREADS` at most). The worker keeps torch on
        one thread (its engine's cores), so each slice runs on the thread that asks for
        it; a process with torch's own thread team (tests, the hf engine) takes the whole
        product on it instead."""
        import torch

        weight = self.product_weight()
        rows = normed.to(weight.dtype)
        vocab = weight.shape[0]
        slices = _product_threads() if torch.get_num_threads() == 1 else 1
        width = max(-(-vocab // slices), CANDIDATES)

        def top(start: int) -> tuple[Any, Any]:
            values, ids = (rows @ weight[start:start + width].T).topk(
                min(CANDIDATES, vocab - start), dim=-1)
            return values.float(), ids + start

        starts = range(0, vocab, width)
        parts = list(_product_pool().map(top, starts)) if len(starts) > 1 else [top(0)]
        values = torch.cat([v for v, _ in parts], dim=1)
        ids = torch.cat([i for _, i in parts], dim=1)
        return ids.gather(1, values.topk(min(CANDIDATES, ids.shape[1]), dim=-1).indices)

    def product_weight(self) -> Any:
        """The head in the dtype of the logits product: its own where the CPU multiplies
        it fast, float32 otherwise (float16: 10x slower than bf16 on an AVX-512 host)."""
        import torch

        if self.head_weight.dtype in (torch.bfloat16, torch.float32):
            return self.head_weight
        if self._head32 is None:
            self._head32 = self.head_weight.float()
        return self._head32


_PRODUCT_POOL: ThreadPoolExecutor | None = None
_PRODUCT_LOCK = threading.Lock()


def _product_threads() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), MAX_PRODUCT_THREADS))


def _product_pool() -> ThreadPoolExecutor:
    """The threads the head's product is split over (torch releases the GIL in it)."""
    global _PRODUCT_POOL
    with _PRODUCT_LOCK:
        if _PRODUCT_POOL is None:
            _PRODUCT_POOL = ThreadPoolExecutor(max_workers=_product_threads(),
                                               thread_name_prefix="hsx-head-product")
        return _PRODUCT_POOL


class HeadSample(NamedTuple):
    """One sample for the head check: its id-N states `last` [T, H] (torch, dequantized),
    the engine's top-1 per position `predicted` [T] (None: the engine gave none; only the
    pre-norm check runs), N for the words, the states' storage's relative rounding, and
    how many of its rows to compare (spread over it)."""

    last: Any
    predicted: list[int] | None
    layer: int
    roundoff: float = BF16_ROUNDOFF
    rows: int = HEAD_ROWS


@dataclass
class HeadVerdict:
    """One checked sample: rows compared, rows agreed, and problems in words."""

    rows: int
    agreed: int
    problems: list[str]


def check_samples(head: FinalHead, samples: list[HeadSample]) -> list[HeadVerdict]:
    """Each sample's verdict, their rows through the head in one product: the head (1.2 GB
    for an 8B model) is streamed once for all of them, not once a sample (8 samples of 64
    rows, float32: one product of 512 rows took 3.2 s on 2 cores where eight of 64 took
    7.5 s)."""
    import torch

    picks = []  # per sample: its rows checked, the engine's tokens there (or None), words
    for last, predicted, layer, roundoff, count in samples:
        t = int(last.shape[0])
        rows = torch.linspace(0, t - 1, steps=min(t, count)).round().long().unique()
        engine = (torch.tensor(predicted, dtype=torch.long)[rows]
                  if predicted is not None and len(predicted) == t else None)
        picks.append((last[rows].float(), engine, layer, roundoff))
    compared = [(states, engine, roundoff) for states, engine, _, roundoff in picks
                if engine is not None]
    agreed_rows = iter(_agreement(head, compared))
    verdicts = []
    for states, engine, layer, _ in picks:
        problems = []
        rms = _rms_after_unscaling(states, head.scale)
        if len(states) >= 4 and bool(((rms - 1).abs() < PRENORM_TOLERANCE).all()):
            problems.append(f"layer {layer}: every row already has the RMS the final norm "
                            f"gives ({float(rms.min()):.4f}-{float(rms.max()):.4f}): it holds "
                            "the state after the final norm, where the format stores the one "
                            "before it")
        if engine is None:
            verdicts.append(HeadVerdict(0, 0, problems))
            continue
        agreed, rows = int(next(agreed_rows).sum()), len(engine)
        if rows >= SAMPLE_MIN_ROWS and agreed < SAMPLE_AGREEMENT_MIN * rows:
            problems.append(f"layer {layer}: lm_head(norm(state)) agrees with the engine's "
                            f"own next token on {agreed} of {rows} rows (states of "
                            "another request, or of another layer?)")
        verdicts.append(HeadVerdict(rows, agreed, problems))
    return verdicts


def _agreement(head: FinalHead, compared: list[tuple[Any, Any, float]]) -> list[Any]:
    """Per (states, engine's tokens, roundoff): `head.agrees` of its rows, all of them in
    one product."""
    import torch

    if not compared:
        return []
    agreed = head.agrees(torch.cat([states for states, _, _ in compared]),
                         torch.cat([tokens for _, tokens, _ in compared]),
                         torch.cat([torch.full((len(tokens),), roundoff)
                                    for _, tokens, roundoff in compared]))
    return list(agreed.split([len(tokens) for _, tokens, _ in compared]))


def pooled_problem(rows: int, agreed: int, layer: int) -> str | None:
    """The agreement of every row checked so far, once there are enough to judge."""
    if rows < AGREEMENT_ROWS or agreed >= AGREEMENT_MIN * rows:
        return None
    return (f"layer {layer}: lm_head(norm(state)) agrees with the engine's own next token "
            f"on {agreed} of {rows} rows checked ({agreed / rows:.3f}; a correct capture "
            f"agrees on at least {AGREEMENT_MIN}): the state is not the one before the "
            "final norm")


def _rms_after_unscaling(rows: Any, scale: Any) -> Any:
    """Per row, the RMS of `rows / scale` over the channels the norm does not zero."""
    keep = scale.abs() > 1e-3
    return (rows[:, keep] / scale[keep]).pow(2).mean(-1).sqrt()
