"""The audit every chaos case ends with: nothing lost, nothing doubled, nothing corrupt."""

from __future__ import annotations

import re
from pathlib import Path

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output
from hsx.output.layout import SHARDS_DIR, TMP_DIR
from hsx_workers.tiny_models import ChatDataset


def audit(output: Path, dataset: ChatDataset) -> dict[str, int]:
    """Assert the output of a finished job is whole and true; returns its counts.

    - complete, and every planned unit committed;
    - every committed shard's checksums verified (whole shards, then every sample's
      digest as the dataset reads it back);
    - nothing visible but committed shards: shards/ holds exactly the shards commit
      records name, and no staging file is left in .tmp/;
    - every good row exactly once, and the error list is exactly the bad rows.
    """
    out = Output(output)
    assert out.is_complete(), f"{output} is not complete"
    records = out.commits()
    assert {r.unit for r in records} == {u.unit for u in out.manifest().units}
    bad = out.check_shards(records)
    assert bad == [], bad
    named = {r.shard for r in records}
    visible = {info.key for info in out.storage.list(SHARDS_DIR)}
    assert visible == named, f"shards no record names: {sorted(visible - named)}"
    tmp = output / TMP_DIR
    assert not tmp.exists() or not any(tmp.iterdir()), sorted(tmp.iterdir())
    ds = HiddenStatesDataset(output, backend="numpy")
    seen = [int(ds[i]["sample_index"]) for i in range(len(ds))]  # each sample's digest
    doubled = sorted({i for i in seen if seen.count(i) > 1})
    lost = sorted(set(dataset.good_indices) - set(seen))
    assert not doubled and not lost, f"doubled {doubled}, lost {lost}"
    assert sorted(seen) == dataset.good_indices
    errors = [e.sample_index for e in out.errors()]
    assert errors == sorted(dataset.bad), f"error list {errors}, bad rows {sorted(dataset.bad)}"
    return {"rows": dataset.num_rows, "samples": len(seen), "errors": len(errors),
            "shards": len(records), "lost": len(lost), "doubled": len(doubled),
            "corrupt": len(bad)}


def units_named(message: str) -> list[int]:
    """The units a JobFailed message says were given up ("... (units [0, 1]) ...")."""
    found = re.search(r"\(units \[([\d, ]*)\]\)", message)
    return [int(u) for u in found.group(1).split(",") if u.strip()] if found else []
