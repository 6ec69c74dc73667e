"""Wrong states on purpose, for the self-check's tests: `HSX_FAULT_STATES`.

The value names the fault, as the bugs it stands for would make it:

- `zeros`: every state is zero (vLLM #46301);
- `nan:<sample>`: one value of that sample (its sample_index) is NaN (speculators #994);
- `copy_layer`: the second stored layer holds the first one's state (layer ids shifted);
- `scale:<factor>`: every state times `factor`; `scale:<factor>:<sample>`: that sample's.
- `postnorm`: id N holds the state after the final norm (vLLM #50815): the target's own
  norm (headcheck.FinalHead) applied to it;
- `swap`: each sample holds the states of the request before it on the engine, cut or
  filled out to its own length (speculators #279: states written under another
  request's index).

**Design note: read by the driver, passed per unit.** The engines of a pool are Ray
actors started once and shared by every job (tests/conftest.py's pool, the coordinator's),
so a variable set after they started would never reach their processes (Ray gives an
actor its environment when it is created). The job driver reads the variable for each
unit (`fault_of_environment`) and hands it to `ExtractionWorker.run_unit`, which applies
it before the check. It is the driver's process environment, which only whoever starts
`hsx extract` or `hsx serve` sets: no job option can name a fault, and a job runs no code.
Unset, a unit carries `None` and nothing here runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hsx import settings

ENV = settings.FAULT_STATES.name


def fault_of_environment() -> str | None:
    """The fault the driver's environment asks for (validated), or None."""
    value = settings.FAULT_STATES.get()
    if not value:
        return None
    parse(value)
    return value


def parse(value: str) -> tuple[str, float, int | None]:
    """(kind, factor, sample) of a fault; ValueError for a value that names none."""
    kind, _, rest = value.partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind in ("zeros", "copy_layer", "postnorm", "swap") and not args:
            return kind, 1.0, None
        if kind == "nan" and len(args) == 1:
            return kind, 1.0, int(args[0])
        if kind == "scale" and len(args) in (1, 2):
            return kind, float(args[0]), int(args[1]) if len(args) == 2 else None
    except ValueError:
        pass
    raise ValueError(f"{ENV}={value!r} names no fault (zeros, nan:<sample>, copy_layer, "
                     "scale:<factor>[:<sample>], postnorm, swap)")


def apply(value: str, sample_index: int, states: Any, scales: Any, *, head: Any = None,
          last: int | None = None, memory: dict[str, Any] | None = None
          ) -> tuple[Any, Any]:
    """`states` (and fp8 `scales`) of one sample with the fault in them: a copy, where
    the fault touches this sample; the arrays given otherwise. `postnorm` needs the
    target's `head` and where id N is stored (`last`); `swap` keeps the previous
    sample's states in `memory` (one dict per unit)."""
    kind, factor, sample = parse(value)
    if sample is not None and sample != sample_index:
        return states, scales
    states = _copy(states)
    scales = None if scales is None else _copy(scales)
    if kind == "postnorm":
        return _postnorm(states, scales, head, last), scales
    if kind == "swap":
        return _swapped(states, memory if memory is not None else {}), scales
    if kind == "zeros":
        states[...] = 0
    elif kind == "copy_layer":
        states[:, 1] = states[:, 0]
        if scales is not None:
            scales[:, 1] = scales[:, 0]
    elif kind == "nan":
        t, layers = states.shape[0], states.shape[1]
        if scales is not None:
            scales[t // 2, layers // 2] = np.nan
        else:
            states[t // 2, layers // 2, 0] = np.nan
    elif scales is not None:
        scales *= factor
    else:
        states = _scaled(states, factor)
    return states, scales


def _copy(array: Any) -> Any:
    return array.clone() if hasattr(array, "clone") else np.array(array)


def _scaled(states: Any, factor: float) -> Any:
    if hasattr(states, "clone"):
        return (states.float() * factor).to(states.dtype)
    return (states.astype(np.float32) * factor).astype(states.dtype)


def _postnorm(states: Any, scales: Any, head: Any, last: int | None) -> Any:
    if head is None or head.missing or last is None or scales is not None:
        raise ValueError(f"{ENV}=postnorm needs id N captured in bf16 and a model whose "
                         "head hsx reads")
    from hsx_workers.selfcheck import as_torch

    x = as_torch(states)
    x[:, last] = head.norm(x[:, last]).to(x.dtype)
    return states


def _swapped(states: Any, memory: dict[str, Any]) -> Any:
    previous = memory.get("previous")
    memory["previous"] = _copy(states)
    if previous is None:
        return states
    t = min(len(previous), len(states))
    states[:t] = previous[:t]
    return states
