"""What one row, one chat template or one job may cost: rows and lines over the row limit
are bad rows, never read whole; a chat template that loops or renders gigabytes is
stopped on its row during ingestion, and refused at submit by an estimate in a child
process bounded in CPU time; a job's sizes have upper bounds (hsx.ingest.limits,
hsx.ingest.estimate, hsx.spec)."""

from __future__ import annotations

import json
import re
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.ingest import (
    DatasetFormatError,
    TemplateLimitError,
    bounded_estimate,
    check_dataset,
    count_rows,
    estimate_tokens,
    generation_prompt,
    ingest,
    iter_rows,
    load_tokenizer,
    resolve_source,
)
from hsx.ingest.datafiles import BadRow
from hsx.ingest.limits import IngestLimits, RenderTimeout, time_limit
from hsx.output import Output
from hsx.spec import SpecError, parse_job, parse_train
from hsx_service.errors import JobRefused
from hsx_service.prepare import check_estimated_output, preflight
from hsx_workers.tiny_models import CHAT_TEMPLATE, ChatDataset

# What the issue reported: 10^10 iterations, hours of one core.
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                "{% endfor %}")
# The tiny template, looping for ever on the rows that say "boom" only: the rows the
# estimate samples may all pass it.
ON_BOOM = CHAT_TEMPLATE.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{% if messages[0]['content'] == 'boom' %}" + NESTED_LOOPS + "{% endif %}")

# One operation in C on the rows that say "boom" (not folded when the template compiles:
# it depends on the row), which no line of Python interrupts: 9 ** 43046721.
POWER_ON_BOOM = CHAT_TEMPLATE.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{% if messages[0]['content'] == 'boom' %}"
    "{{ 9 ** (9 ** (messages[0]['content'] | length + 4)) }}{% endif %}")


def _chat(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text},
                         {"role": "assistant", "content": f"an answer to {text}"}]}


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    with path.open("w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _errors(out: Path) -> dict[int, str]:
    return {r["sample_index"]: r["reason"] for r in Output(out).ingest_errors().to_pylist()}


def _indices(out: Path) -> list[int]:
    return Output(out).inputs().column("sample_index").to_pylist()


# ------------------------------------------------------------------ chat templates


def test_a_template_that_loops_on_one_row_makes_it_a_bad_row(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The row is interrupted after HSX_TEMPLATE_SECONDS of CPU and recorded with the
    reason; the others are tokenized. On a thread other than the main one, as a
    coordinator's job thread ingests."""
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "1")
    data = _write_jsonl(tmp_path / "d.jsonl", [_chat("boom" if i == 3 else f"hi {i}")
                                               for i in range(8)])
    done: list[Any] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: done.append(ingest(
        str(data), str(tiny_tokenizer), 256, tmp_path / "out",
        chat_template_kwargs={"chat_template": ON_BOOM})))
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the template's loops were not interrupted"
    assert time.monotonic() - started < 60
    (result,) = done
    assert (result.num_samples, result.num_errors) == (7, 1)
    assert _errors(tmp_path / "out") == {
        3: "the chat template took more than 1 s to render the row (HSX_TEMPLATE_SECONDS)"}


def test_a_row_that_never_ends_in_c_stops_only_its_process_and_is_a_bad_row(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A huge integer power holds the interpreter inside one call into C: nothing in the
    tokenizing process can stop it. Its parent kills the process when it computed for
    HSX_TEMPLATE_SECONDS + 2 s of CPU time since a row began, finds the row (its batch
    again, a row at a time), records it as bad and goes on; the thread that ingests (a
    coordinator's job thread) never waited inside a row, and the other rows are the same
    samples as without it."""
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "0.5")
    rows = [_chat("boom" if i == 5 else f"hi {i}") for i in range(12)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    result = ingest(str(data), str(tiny_tokenizer), 256, tmp_path / "out", batch_rows=4,
                    chat_template_kwargs={"chat_template": POWER_ON_BOOM})
    assert (result.num_samples, result.num_errors) == (11, 1)
    assert _errors(tmp_path / "out") == {5: (
        "the chat template computed for more than 2.5 s of CPU time on the row without "
        "ending (HSX_TEMPLATE_SECONDS)")}
    plain = _write_jsonl(tmp_path / "plain.jsonl", [r for i, r in enumerate(rows) if i != 5])
    ingest(str(plain), str(tiny_tokenizer), 256, tmp_path / "plain", batch_rows=4,
           chat_template_kwargs={"chat_template": POWER_ON_BOOM})
    ours = Output(tmp_path / "out").inputs().column("input_ids").to_pylist()
    assert ours == Output(tmp_path / "plain").inputs().column("input_ids").to_pylist()


def test_a_template_slow_on_row_after_row_ends_the_ingestion(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three rows of a batch past the time limit: not hours of them, one after the
    other, before a cancel is seen between batches."""
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "0.5")
    data = _write_jsonl(tmp_path / "d.jsonl", [_chat("boom" if i % 2 else f"hi {i}")
                                               for i in range(40)])
    with pytest.raises(TemplateLimitError) as stopped:
        ingest(str(data), str(tiny_tokenizer), 256, tmp_path / "out",
               chat_template_kwargs={"chat_template": ON_BOOM})
    assert str(stopped.value) == ("the chat template took more than 0.5 s to render 3 "
                                  "rows of one batch (HSX_TEMPLATE_SECONDS)")


def test_the_limits_travel_with_the_slices_to_the_pool(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slices tokenized by other processes (a pool here, Ray tasks on a coordinator) keep
    the limits of the process that ingests: those processes started with another
    environment (the fork server's)."""
    from hsx.ingest import bounded, pipeline

    bounded.pool_context()  # the fork server starts without the limit
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "1")
    monkeypatch.setattr(pipeline, "PARALLEL_SLICE_BYTES", 2048)
    rows = [_chat("boom" if i in (30, 170) else f"row {i}") for i in range(200)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    assert len(resolve_source(str(data)).slices(slice_bytes=2048)) > 4
    # Parts of 10 samples: the first is published after the first slice, and the pool
    # takes the slices after it (rows 30 and 170 among them).
    result = ingest(str(data), str(tiny_tokenizer), 256, tmp_path / "out", workers=2,
                    batch_rows=16, rows_per_part=10,
                    chat_template_kwargs={"chat_template": ON_BOOM})
    assert (result.num_samples, result.num_errors) == (198, 2)
    errors = _errors(tmp_path / "out")
    assert sorted(errors) == [30, 170]
    assert all("more than 1 s" in reason for reason in errors.values())


def test_a_template_that_renders_too_much_makes_a_bad_row(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HSX_MAX_ROW_BYTES", str(64 * 1024))
    template = CHAT_TEMPLATE.replace(
        "{{ bos_token }}",
        "{{ bos_token }}{% if messages[0]['content'] == 'boom' %}{{ 'x' * 100000 }}"
        "{% endif %}")
    data = _write_jsonl(tmp_path / "d.jsonl", [_chat("boom" if i == 1 else "hi")
                                               for i in range(3)])
    result = ingest(str(data), str(tiny_tokenizer), 256, tmp_path / "out",
                    chat_template_kwargs={"chat_template": template})
    assert (result.num_samples, result.num_errors) == (2, 1)
    (reason,) = _errors(tmp_path / "out").values()
    assert re.fullmatch(r"the chat template rendered the row as 97\.\d KiB of text, over "
                        r"the 64\.0 KiB limit \(HSX_MAX_ROW_BYTES\)", reason), reason


def test_the_generation_prompt_is_bounded_too(
    tiny_tokenizer: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "0.5")
    tok = load_tokenizer(str(tiny_tokenizer))
    with pytest.raises(ValueError, match=r"more than 0\.5 s to render"):
        generation_prompt(tok, [{"role": "user", "content": "hi"}],
                          {"chat_template": NESTED_LOOPS})
    assert generation_prompt(tok, [{"role": "user", "content": "hi"}])


def test_the_time_limit_counts_cpu_not_waiting() -> None:
    """A thread that waits (a tokenizing thread behind busy engines gets little CPU)
    spends no CPU: it is not interrupted; one that computes is, at its next line."""
    with time_limit(0.2):
        time.sleep(0.5)
    started = time.monotonic()
    with pytest.raises(RenderTimeout), time_limit(0.2):
        while True:
            pass
    assert time.monotonic() - started < 5
    with time_limit(0.2):  # no exception left behind for later
        pass
    time.sleep(0.3)


def test_the_estimate_refuses_a_template_that_loops(
    tiny_tokenizer: Path, chat_dataset: ChatDataset, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a child process, within HSX_TEMPLATE_SECONDS (+ its start): the nested loops
    of the issue on every row, and one operation in C that no line of Python interrupts
    (the child's CPU limit stops it). An ordinary template gives the estimate of the
    same rows in this process."""
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "1")
    path, tokenizer = str(chat_dataset.path), str(tiny_tokenizer)
    estimate_tokens(path, tokenizer, 256)  # (the fork server starts meanwhile)
    started = time.monotonic()
    with pytest.raises(TemplateLimitError) as refused:
        bounded_estimate(path, tokenizer, 256, chat_template_kwargs={
            "chat_template": NESTED_LOOPS})
    assert str(refused.value) == ("the chat template took more than 1 s to render one row "
                                  "of the dataset (HSX_TEMPLATE_SECONDS)")
    assert time.monotonic() - started < 45
    with pytest.raises(TemplateLimitError, match=r"more than 1 s to render the dataset's "
                                                 r"\d+ sample rows"):
        bounded_estimate(path, tokenizer, 256, chat_template_kwargs={
            "chat_template": "{{ 7 ** 1000000000 }}"})
    assert bounded_estimate(path, tokenizer, 256) == estimate_tokens(path, tokenizer, 256)


def test_the_estimate_refuses_a_template_that_renders_gigabytes(
    tiny_tokenizer: Path, chat_dataset: ChatDataset,
) -> None:
    """A single repetition of 16 GiB: the child's memory limit fails it at once."""
    with pytest.raises(TemplateLimitError, match="ran out of memory rendering one row"):
        bounded_estimate(str(chat_dataset.path), str(tiny_tokenizer), 256,
                         chat_template_kwargs={"chat_template": "{{ 'x' * 2**34 }}"})
    with pytest.raises(TemplateLimitError, match=r"rendered one row of the dataset as "
                                                 r"32\.0 MiB of text, over the 16\.0 MiB"):
        bounded_estimate(str(chat_dataset.path), str(tiny_tokenizer), 256,
                         chat_template_kwargs={"chat_template": "{{ 'x' * 2**25 }}"})


def test_submit_refuses_the_template_naming_the_field(
    make_job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "1")
    spec = make_job(tmp_path / "out", chat_template_kwargs={"chat_template": NESTED_LOOPS})
    with pytest.raises(JobRefused, match=r"^chat_template_kwargs: the chat template took "
                                         r"more than 1 s to render one row"):
        check_estimated_output(spec, *preflight(spec))
    # An online job stores no shard, but its template is checked all the same.
    online = make_job(tmp_path / "online", train={"online": True},
                      chat_template_kwargs={"chat_template": NESTED_LOOPS})
    with pytest.raises(JobRefused, match=r"^chat_template_kwargs: "):
        check_estimated_output(online, *preflight(online))


def test_a_job_whose_template_stops_its_ingestion_is_refused_naming_the_field(
    make_job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows past the sample the estimate reads (its first 256 here) that the template
    loops on: the ingestion stops at the third, and the job is refused."""
    from hsx_service.prepare import prepare

    monkeypatch.setenv("HSX_TEMPLATE_SECONDS", "0.5")
    data = _write_jsonl(tmp_path / "d.jsonl", [
        _chat("boom" if i in (300, 302, 304) else f"row {i}") for i in range(400)])
    spec = make_job(tmp_path / "out", dataset=str(data),
                    chat_template_kwargs={"chat_template": ON_BOOM})
    with pytest.raises(JobRefused, match=r"^chat_template_kwargs: the chat template took "
                                         r"more than 0\.5 s to render 3 rows of one batch "
                                         r"\(HSX_TEMPLATE_SECONDS\); the ingestion stopped$"):
        prepare(spec, stream=False)


# ------------------------------------------------------------------ rows and lines


def test_a_giant_line_is_a_bad_row_never_read_whole(
    tiny_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 40 MiB JSON line over a 1 MiB limit: recorded with its size, skipped in chunks
    (reading the rows holds a few MiB), and the rows around it are tokenized, whatever
    the slices (those of several processes are cut every MiB, at the next line start:
    after the giant line, found in chunks too)."""
    monkeypatch.setenv("HSX_MAX_ROW_BYTES", str(2**20))
    giant = json.dumps({"text": "word " * (8 * 2**20)})
    assert len(giant) > 40 * 2**20
    data = _write_jsonl(tmp_path / "d.jsonl", [_chat("before"), giant, _chat("after"),
                                               _chat("last")])
    assert count_rows(str(data)) == 4
    tracemalloc.start()
    try:
        rows = list(iter_rows(str(data)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak
    assert rows[1] == BadRow("the row is 40.0 MiB, over the 1.0 MiB limit (HSX_MAX_ROW_BYTES)")
    assert [r["messages"][0]["content"] for r in (rows[0], rows[2], rows[3])] == [
        "before", "after", "last"]
    result = ingest(str(data), str(tiny_tokenizer), 256, tmp_path / "one")
    assert (result.num_samples, result.num_errors) == (3, 1)
    assert _errors(tmp_path / "one") == {1: rows[1].reason}
    parallel = ingest(str(data), str(tiny_tokenizer), 256, tmp_path / "two", workers=2)
    assert _indices(tmp_path / "two") == _indices(tmp_path / "one") == [0, 2, 3]
    assert parallel.num_errors == 1


def test_a_parquet_row_over_the_limit_is_a_bad_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HSX_MAX_ROW_BYTES", str(2**20))
    rows = [{"text": "small", "messages": [{"role": "user", "content": "hi"}]},
            {"text": "x" * (3 * 2**20), "messages": []}, {"text": "y" * 1000, "messages": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    got = list(iter_rows(str(tmp_path / "d.parquet")))
    assert got[1] == BadRow("the row is 3.0 MiB, over the 1.0 MiB limit (HSX_MAX_ROW_BYTES)")
    assert [got[0], got[2]] == [rows[0], rows[2]]


def test_a_json_array_over_its_limit_is_refused_saying_how_to_convert_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([_chat(f"row {i}") for i in range(100)]))
    monkeypatch.setenv("HSX_MAX_JSON_ARRAY_BYTES", "4096")
    for check in (lambda: check_dataset(str(data)), lambda: list(iter_rows(str(data)))):
        with pytest.raises(DatasetFormatError) as refused:
            check()
        assert "one JSON array of" in str(refused.value)
        assert "HSX_MAX_JSON_ARRAY_BYTES" in str(refused.value)
        assert "jq -c '.[]' sharegpt.json > sharegpt.jsonl" in str(refused.value)
    # Within it, an element over the row limit is a bad row, as a line would be.
    monkeypatch.delenv("HSX_MAX_JSON_ARRAY_BYTES")
    monkeypatch.setenv("HSX_MAX_ROW_BYTES", "1000")
    data.write_text(json.dumps([_chat("a"), _chat("b" * 2000), 7, _chat("c")], indent=1))
    first, big, number, last = iter_rows(str(data))
    assert isinstance(big, BadRow) and big.reason.startswith("the row is 4.0 KiB")
    assert big.reason.endswith("KiB, over the 1000 B limit (HSX_MAX_ROW_BYTES)")
    assert number == BadRow("the row is a JSON int, not an object")
    assert [first["messages"][0]["content"], last["messages"][0]["content"]] == ["a", "c"]


def test_a_folder_s_metadata_file_is_not_read_whole_when_large(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hsx.ingest import datafiles

    monkeypatch.setattr(datafiles, "METADATA_BYTES", 1000)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    (tmp_path / "saved" / "state.json").write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(DatasetFormatError, match=r"state\.json is 2,011 bytes, too large"):
        resolve_source(str(tmp_path / "saved"))


def test_a_bad_limit_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_MAX_ROW_BYTES", "lots")
    with pytest.raises(ValueError, match=r"HSX_MAX_ROW_BYTES='lots' is not a positive"):
        IngestLimits.from_env()


# ------------------------------------------------------------------ upper bounds


JOB = {"model": "m", "dataset": "d.jsonl", "output": "o"}


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("max_seq_len", 2**20 + 1, "1048576"),
    ("unit_tokens", 2**24 + 1, "16777216"),
    ("replicas", 4097, "4096"),
    ("tensor_parallel_size", 129, "128"),
    ("vllm.max_inflight_tokens", 2**24 + 1, "16777216"),
    ("vllm.max_num_batched_tokens", 2**20 + 1, "1048576"),
    ("vllm.cpu_kvcache_gib", 4097, "4096"),
    ("regenerate.max_tokens", 2**20 + 1, "1048576"),
])
def test_a_job_asking_for_absurd_sizes_is_refused_naming_the_field(
    field: str, value: int, limit: str,
) -> None:
    data: dict[str, Any] = {**JOB, "max_seq_len": 2**20}
    section, _, name = field.rpartition(".")
    (data.setdefault(section, {}) if section else data)[name] = value
    with pytest.raises(SpecError, match=rf"{field}: Input should be less than or equal "
                                        rf"to {limit}"):
        parse_job(data)


@pytest.mark.parametrize(("field", "value"), [
    ("batch_tokens", 2**24 + 1), ("pack_tokens", 2**20 + 1), ("draft_vocab_size", 2**20 + 1),
    ("num_layers", 33), ("ttt_steps", 33), ("eval_prompts", 65537),
    ("eval_max_tokens", 2**17 + 1), ("val_max_samples", 2**20 + 1),
    ("buffer_bytes", 2**40 + 1),
])
def test_a_training_asking_for_absurd_sizes_is_refused_naming_the_field(
    field: str, value: int,
) -> None:
    with pytest.raises(SpecError, match=rf"{field}: Input should be less than or equal"):
        parse_train({field: value})
    with pytest.raises(SpecError, match=rf"train\.{field}: Input should be less than"):
        parse_job({**JOB, "train": {field: value}})


def test_the_largest_sizes_are_accepted() -> None:
    spec = parse_job({**JOB, "max_seq_len": 2**20, "unit_tokens": 2**24, "replicas": 4096,
                      "tensor_parallel_size": 128, "regenerate": {"max_tokens": 2**20 - 1},
                      "vllm": {"max_inflight_tokens": 2**24, "max_num_batched_tokens": 2**20,
                               "cpu_kvcache_gib": 4096}})
    assert spec.max_seq_len == 2**20
    parse_train({"batch_tokens": 2**24, "pack_tokens": 2**20, "draft_vocab_size": 2**20,
                 "num_layers": 32, "ttt_steps": 32, "eval_prompts": 65536,
                 "eval_max_tokens": 2**17, "val_max_samples": 2**20, "buffer_bytes": 2**40})
