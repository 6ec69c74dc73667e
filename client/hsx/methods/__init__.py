"""Draft methods: one module each (eagle3.py, dflash.py, dspark.py, peagle.py), found by
name; what a method is and who asks it what: base.py.

One capture can serve several methods: a job's `layers:` may name methods, and the
output then holds the union of their ids. Each training reads its own subset
(`draft_aux_layers`).
"""

from __future__ import annotations

from hsx.methods.base import (
    DEFAULT_METHOD,
    DraftInputs,
    DraftMethod,
    all_methods,
    default_layers,
    draft_aux_layers,
    method,
    method_names,
    method_of_draft,
    resolve_layers,
)

__all__ = [
    "DEFAULT_METHOD",
    "DraftInputs",
    "DraftMethod",
    "all_methods",
    "default_layers",
    "draft_aux_layers",
    "method",
    "method_names",
    "method_of_draft",
    "resolve_layers",
]
