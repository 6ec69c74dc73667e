"""Synthetic chat datasets, seeded: good rows in every format ingestion reads and bad
rows of every kind it must record (`make_chat_dataset`), written as JSONL, Parquet or a
`datasets` folder (`write_rows`)."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hsx_workers.tiny_models.corpus import paragraph, question, sentence

logger = logging.getLogger(__name__)


BadKind = Literal["malformed_json", "empty_messages", "unknown_role", "no_assistant",
                  "no_field"]
BAD_KINDS: tuple[BadKind, ...] = (
    "malformed_json", "empty_messages", "unknown_role", "no_assistant", "no_field",
)

RowFormat = Literal["messages", "sharegpt", "text", "mixed"]
ROW_FORMATS: tuple[str, ...] = ("messages", "sharegpt", "text", "mixed")


@dataclass
class ChatDataset:
    """What `make_chat_dataset` wrote: the file, its rows, and which rows are bad."""

    path: Path
    num_rows: int
    bad: dict[int, BadKind] = field(default_factory=dict)
    """Row index -> kind of bad row (one of BAD_KINDS)."""
    rows: list[Any] = field(default_factory=list, repr=False)
    """Every row as written: a dict, or the raw text of a malformed JSON line."""

    @property
    def good_indices(self) -> list[int]:
        return [i for i in range(self.num_rows) if i not in self.bad]


def _conversation(rng: random.Random, index: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": sentence(rng)})
    long = index % 25 == 7  # a few long ones that ingestion truncates at ~256 tokens
    turns = 1 if long else rng.choice((1, 1, 1, 1, 2, 2, 3))
    for _ in range(turns):
        messages.append({"role": "user", "content": question(rng)})
        sentences = rng.randint(15, 25) if long else rng.randint(1, 3)
        messages.append({"role": "assistant", "content": paragraph(rng, sentences)})
    return messages


def _good_row(rng: random.Random, index: int, fmt: str) -> dict[str, Any]:
    if fmt == "mixed":
        fmt = ("messages", "messages", "sharegpt", "text")[index % 4]
        if fmt == "text" and index % 8 == 3:
            fmt = "prompt"
    if fmt in ("text", "prompt"):
        return {fmt: paragraph(rng, rng.randint(1, 6))}
    messages = _conversation(rng, index)
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]}
                                  for m in messages]}
    return {"messages": messages}


def _bad_row(rng: random.Random, kind: BadKind) -> Any:
    if kind == "malformed_json":
        return '{"messages": [{"role": "user", "content": "unterminated'
    if kind == "empty_messages":
        return {"messages": []}
    if kind == "unknown_role":
        return {"messages": [{"role": "user", "content": question(rng)},
                             {"role": "wizard", "content": sentence(rng)}]}
    if kind == "no_assistant":
        return {"messages": [{"role": "user", "content": question(rng)}]}
    if kind == "no_field":
        return {"title": sentence(rng), "score": 3}
    raise ValueError(f"unknown bad-row kind {kind!r}")


def make_chat_dataset(
    path: str | Path,
    n: int = 200,
    *,
    seed: int = 0,
    bad_rows: int = 0,
    formats: RowFormat = "messages",
) -> ChatDataset:
    """Write `n` good rows plus `bad_rows` bad ones as JSONL, deterministically by seed.

    `formats`: `messages` (OpenAI style), `sharegpt` (`conversations` with from/value),
    `text` (plain text rows), or `mixed` (all of these and `prompt`). Bad rows cycle
    through BAD_KINDS and sit at seeded positions; the result says which and why.
    """
    if formats not in ROW_FORMATS:
        raise ValueError(f"unknown formats {formats!r}; known: {list(ROW_FORMATS)}")
    if n < 0 or bad_rows < 0:
        raise ValueError("n and bad_rows must be >= 0")
    rng = random.Random(seed)
    total = n + bad_rows
    bad_positions = sorted(rng.sample(range(total), bad_rows))
    bad = {pos: BAD_KINDS[i % len(BAD_KINDS)] for i, pos in enumerate(bad_positions)}

    rows: list[Any] = []
    for index in range(total):
        kind = bad.get(index)
        rows.append(_bad_row(rng, kind) if kind else _good_row(rng, index, formats))
    out = Path(path)
    write_rows(rows, out, "jsonl")
    logger.info("wrote %d rows (%d bad) to %s", total, bad_rows, out)
    return ChatDataset(path=out, num_rows=total, bad=bad, rows=rows)


def write_rows(rows: Sequence[Any], path: str | Path, fmt: Literal["jsonl", "parquet", "hf"]
               ) -> Path:
    """Write rows as JSONL, one Parquet file, or a `datasets` `save_to_disk` folder.

    Strings among the rows are written verbatim to JSONL (that is how a malformed line
    gets in); the other formats take dicts only.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
        return out
    if any(not isinstance(r, dict) for r in rows):
        raise ValueError(f"{fmt} rows must be dicts (a malformed JSON line exists only in JSONL)")
    # Columns are the union of all rows' keys (a missing key is null); both pyarrow's and
    # datasets' from-list constructors would take the first row's keys only.
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), out)
        return out
    if fmt == "hf":
        import datasets

        datasets.Dataset.from_dict(columns).save_to_disk(str(out))
        return out
    raise ValueError(f"unknown format {fmt!r}")
