"""Hostile rows: property-based fuzzing of the dataset readers (hypothesis).

Whatever the bytes of a JSONL file, the rows of a Parquet file or a `save_to_disk`
folder, `ingest` either accounts for every row — ingested as a valid sample, or recorded
in `errors.arrow` with a reason — or, when a file as a whole cannot be read (a truncated
Parquet footer, a damaged Arrow stream, a broken JSON array), refuses with a
`DatasetFormatError` that names the file and leaves no table behind. It never crashes
on a row.

Runs are derandomized (the same examples every run, so CI is reproducible);
`HSX_FUZZ_EXAMPLES=N` asks for N examples per property instead, drawn at random.
The rows fed to ingestion are counted and printed when the module ends (`pytest -s`):
the figure docs/RELIABILITY.md quotes.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx.ingest import DatasetFormatError, ingest, load_tokenizer
from hsx.output import Output, layout
from hsx_workers.tiny_models import write_rows

MAX_SEQ_LEN = 48
FUZZED: Counter[str] = Counter()

_EXAMPLES = int(os.environ.get("HSX_FUZZ_EXAMPLES", "0"))


def fuzz_settings(examples: int) -> Any:
    return settings(
        max_examples=_EXAMPLES or examples,
        derandomize=not _EXAMPLES,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
    )


# ----------------------------------------------------------------------------- strategies

# Text with what breaks readers: control characters, NUL, lone surrogates (JSON can
# escape them), non-BMP characters, template syntax, the tokenizer's special tokens.
_specials = st.sampled_from(["<|eot_id|>", "<|begin_of_text|>", "{{ x }}", "{% if %}", "\x00",
                             "\ud800", "\udfff", "\U0001f600", "\u202e", "\r", "\n", " "])
text = st.one_of(
    st.text(max_size=40),
    st.lists(st.one_of(st.text(max_size=8), _specials), max_size=8).map("".join),
)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)
role = st.one_of(
    st.sampled_from(["system", "user", "assistant", "tool", "human", "gpt"]),
    st.sampled_from(["wizard", "", "USER", "Assistant"]),
    json_value,
)
content = st.one_of(
    text,
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                    "text": st.one_of(text, json_value)}), max_size=3),
    json_value,
)
message = st.one_of(
    st.fixed_dictionaries({"role": role, "content": content}),
    st.fixed_dictionaries({"from": role, "value": content}),
    st.fixed_dictionaries({"role": role, "content": content},
                          optional={"name": json_value, "tool_calls": json_value}),
    json_value,
)
token_id = st.one_of(st.integers(0, 600), st.integers(), st.floats(), st.booleans(), text)
json_row = st.one_of(
    st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=5), json_value)}),
    st.fixed_dictionaries({"conversations": st.lists(message, max_size=4)}),
    st.fixed_dictionaries({"prompt": st.one_of(text, json_value)}),
    st.fixed_dictionaries({"text": st.one_of(text, json_value)}),
    st.fixed_dictionaries(
        {"input_ids": st.one_of(st.lists(token_id, max_size=80), json_value)},
        optional={"loss_mask": st.one_of(st.lists(st.integers(-1, 2), max_size=80),
                                         json_value)}),
    st.dictionaries(text, json_value, max_size=3),
    json_value,
)


def _nested(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


# A line as bytes: a JSON row, or what a damaged or foreign file holds instead.
line = st.one_of(
    json_row.map(lambda row: json.dumps(row).encode()),
    json_row.map(lambda row: json.dumps(row, ensure_ascii=False).encode(
        "utf-8", "surrogatepass")),  # raw surrogates: invalid UTF-8 on disk
    st.binary(max_size=64).map(lambda b: b.replace(b"\n", b"")),  # binary, invalid UTF-8
    json_row.map(lambda row: json.dumps(row).encode()).flatmap(  # a truncated line
        lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),
    st.integers(500, 5000).map(_nested),  # nesting past the JSON parser's recursion limit
    st.just(b""),
    st.just(b"\xef\xbb\xbf" + b'{"prompt": "a byte order mark"}'),
)


# ----------------------------------------------------------------------------- the audit


@pytest.fixture(scope="module", autouse=True)
def _count_rows() -> Any:
    yield
    print(f"\nrows fuzzed through ingestion: {dict(FUZZED)}, {sum(FUZZED.values())} in all")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer: Path) -> str:
    load_tokenizer(str(tiny_tokenizer))  # loaded once; later loads are cached
    return str(tiny_tokenizer)


def audit(dataset: Path, tokenizer: str, out: Path, expected_rows: int | None) -> int:
    """Ingest `dataset` into `out`; assert every row is a valid sample or has a reason.

    Returns the number of rows accounted for. When the dataset cannot be read as a whole
    the refusal must name the file and leave no table behind.
    """
    vocab = len(load_tokenizer(tokenizer))
    try:
        result = ingest(str(dataset), tokenizer, MAX_SEQ_LEN, out, batch_rows=7)
    except DatasetFormatError as err:
        assert str(dataset.name) in str(err) or str(dataset) in str(err), err
        assert not (out / layout.INPUTS).exists() and not (out / layout.ERRORS).exists()
        assert not list((out / layout.TMP_DIR).glob("*")), "a half-written table was left"
        return 0
    inputs = Output(out).inputs().to_pylist()
    errors = Output(out).ingest_errors().to_pylist()
    good = [r["sample_index"] for r in inputs]
    bad = [r["sample_index"] for r in errors]
    assert sorted(good + bad) == list(range(result.num_rows)), "a row is lost or doubled"
    assert good == sorted(good)
    if expected_rows is not None:
        assert result.num_rows == expected_rows
    assert result.num_samples == len(good) and result.num_errors == len(bad)
    for r in errors:
        assert isinstance(r["reason"], str) and r["reason"].strip()
    for r in inputs:
        assert 1 <= r["length"] == len(r["input_ids"]) == len(r["loss_mask"]) <= MAX_SEQ_LEN
        assert all(0 <= t < vocab for t in r["input_ids"])
        assert set(r["loss_mask"]) <= {0, 1}
    return result.num_rows


# ----------------------------------------------------------------------------- properties


@fuzz_settings(120)
@given(lines=st.lists(line, max_size=12), crlf=st.booleans())
def test_jsonl_rows_are_ingested_or_recorded(
    lines: list[bytes], crlf: bool, tokenizer: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("jsonl")
    data = folder / "rows.jsonl"
    data.write_bytes(b"".join(x + (b"\r\n" if crlf else b"\n") for x in lines))
    FUZZED["jsonl"] += audit(data, tokenizer, folder / "out", expected_rows=len(lines))


def _typed_rows(draw: Any) -> list[dict[str, Any]]:
    """Rows a columnar file can hold: one type per column, nulls anywhere."""
    n = draw(st.integers(1, 10))
    kind = draw(st.sampled_from(["messages", "prompt", "input_ids", "mixed"]))
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        row: dict[str, Any] = {}
        if kind in ("messages", "mixed"):
            row["messages"] = draw(st.one_of(st.none(), st.lists(st.fixed_dictionaries({
                "role": st.one_of(st.none(), st.sampled_from(
                    ["system", "user", "assistant", "tool", "gpt", "wizard", ""])),
                "content": st.one_of(st.none(), st.text(max_size=30))}), max_size=4)))
        if kind in ("prompt", "mixed"):
            row["prompt"] = draw(st.one_of(st.none(), st.text(max_size=30)))
        if kind in ("input_ids", "mixed"):
            row["input_ids"] = draw(st.one_of(st.none(), st.lists(
                st.integers(-5, 1000), max_size=60)))
        rows.append(row)
    return rows


@st.composite
def parquet_case(draw: Any) -> tuple[list[dict[str, Any]], str, int, int]:
    rows = _typed_rows(draw)
    damage = draw(st.sampled_from(["none", "truncate", "flip"]))
    return rows, damage, draw(st.integers(0, 10**6)), draw(st.integers(1, 8))


@fuzz_settings(60)
@given(case=parquet_case())
def test_parquet_rows_are_ingested_or_recorded(
    case: tuple[list[dict[str, Any]], str, int, int], tokenizer: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rows, damage, where, flips = case
    folder = tmp_path_factory.mktemp("parquet")
    data = folder / "rows.parquet"
    names = list(dict.fromkeys(k for row in rows for k in row))
    # Small row groups, so a damaged page spoils some rows and leaves the others.
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in names}), data,
                   row_group_size=3)
    raw = bytearray(data.read_bytes())
    expected: int | None = len(rows)
    if damage == "truncate":
        del raw[where % len(raw):]
    elif damage == "flip":
        rng = random.Random(where)
        # Inside the data pages only: the footer (its last bytes) stays readable.
        footer = int.from_bytes(raw[-8:-4], "little") + 8
        for _ in range(flips):
            raw[rng.randrange(4, max(5, len(raw) - footer))] ^= 1 << rng.randrange(8)
    data.write_bytes(bytes(raw))
    if damage != "none":
        expected = None  # a damaged footer may even say another row count
    FUZZED["parquet"] += audit(data, tokenizer, folder / "out", expected_rows=expected)


@fuzz_settings(12)
@given(case=parquet_case())
def test_save_to_disk_rows_are_ingested_or_recorded(
    case: tuple[list[dict[str, Any]], str, int, int], tokenizer: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rows, damage, where, _ = case
    folder = tmp_path_factory.mktemp("hf")
    data = write_rows(rows, folder / "rows", "hf")
    if damage != "none":
        arrow = next(data.glob("*.arrow"))
        raw = arrow.read_bytes()
        arrow.write_bytes(raw[: where % len(raw)])
    FUZZED["save_to_disk"] += audit(data, tokenizer, folder / "out",
                                    expected_rows=None if damage != "none" else len(rows))


# ----------------------------------------------------------------------------- named cases


def test_a_10_mb_message_is_ingested_truncated(tokenizer: str, tmp_path: Path) -> None:
    # " explain" is one token of the tiny tokenizer: 10 MB in ~1.3M tokens, so this stays
    # a few seconds (a tokenizer takes ~1 s per million tokens on CI's cores).
    huge = " explain" * (10 * 2**20 // 8)
    rows = [
        {"messages": [{"role": "user", "content": "summarize"},
                      {"role": "assistant", "content": huge}]},
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]},
        {"messages": []},
        {"prompt": ""},
    ]
    data = write_rows(rows, tmp_path / "big.jsonl", "jsonl")
    assert data.stat().st_size > 10 * 2**20
    assert audit(data, tokenizer, tmp_path / "out", expected_rows=4) == 4
    first = Output(tmp_path / "out").inputs().to_pylist()[0]
    assert first["sample_index"] == 0 and first["length"] == MAX_SEQ_LEN
    errors = Output(tmp_path / "out").ingest_errors().to_pylist()
    reasons = {r["sample_index"]: r["reason"] for r in errors}
    assert "empty" in reasons[2] and "empty string" in reasons[3]
    FUZZED["named"] += 4


def test_a_binary_file_named_jsonl_is_recorded_line_by_line(
    tokenizer: str, tmp_path: Path
) -> None:
    blob = random.Random(0).randbytes(256 * 1024)
    data = tmp_path / "really-a-blob.jsonl"
    data.write_bytes(blob)
    lines = blob.count(b"\n") + (not blob.endswith(b"\n"))
    assert audit(data, tokenizer, tmp_path / "out", expected_rows=lines) == lines
    assert len(Output(tmp_path / "out").inputs()) == 0
    FUZZED["named"] += lines


def test_hostile_lines_get_their_own_reasons(tokenizer: str, tmp_path: Path) -> None:
    data = tmp_path / "hostile.jsonl"
    data.write_bytes(b"\n".join([
        b'\xef\xbb\xbf{"prompt": "after a byte order mark"}',
        b'{"prompt": "caf\xe9"}',  # Latin-1, not UTF-8
        b'{"prompt": "a \\ud800 lone surrogate"}',
        _nested(100_000),
        b'{"messages": [{"role": "wizard", "content": "hi"}]}',
        b'{"messages": [{"role": "user", "content": "x\\udfff"},'
        b' {"role": "assistant", "content": "y"}]}',
    ]) + b"\n")
    assert audit(data, tokenizer, tmp_path / "out", expected_rows=6) == 6
    errors = Output(tmp_path / "out").ingest_errors().to_pylist()
    reasons = {r["sample_index"]: r["reason"] for r in errors}
    assert 0 not in reasons  # the byte order mark is not part of the row
    assert "not valid UTF-8" in reasons[1]
    assert "surrogate" in reasons[2]
    assert "too deeply" in reasons[3]
    assert "unknown role 'wizard'" in reasons[4]
    assert "surrogate" in reasons[5]
    FUZZED["named"] += 6


@pytest.mark.parametrize("body", [b'[{"prompt": "x"}', b'[{"prompt": "\xff"}]', b"[" * 100_000])
def test_a_broken_json_array_file_is_refused_naming_it(
    body: bytes, tokenizer: str, tmp_path: Path
) -> None:
    data = tmp_path / "array.json"
    data.write_bytes(body)
    with pytest.raises(DatasetFormatError, match=r"array\.json"):
        ingest(str(data), tokenizer, MAX_SEQ_LEN, tmp_path / "out")
    assert not (tmp_path / "out" / layout.INPUTS).exists()
