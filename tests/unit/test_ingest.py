"""Ingestion: every row kind, every error kind, exact loss masks, all source formats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from hsx.ingest import (
    NOT_A_CHAT,
    DatasetFormatError,
    DatasetNotFoundError,
    IngestProgress,
    IngestResult,
    dataset_fingerprint,
    generation_prompt,
    ingest,
    load_tokenizer,
    tokenize_conversations,
    tokenizer_fingerprint,
)
from hsx.output import Output, layout
from hsx.output.tables import ERRORS_SCHEMA, INPUTS_SCHEMA
from hsx_workers.tiny_models import CHAT_TEMPLATE, ChatDataset, build_tokenizer, write_rows

EOT = "<|eot_id|>"


def read_inputs(out: Path) -> pa.Table:
    return Output(out).inputs()


def read_errors(out: Path) -> pa.Table:
    return Output(out).ingest_errors()


@pytest.fixture(scope="module")
def tok(tiny_tokenizer: Path) -> Any:
    return load_tokenizer(str(tiny_tokenizer))


def _ingest(rows: list[Any], tokenizer: Path, tmp_path: Path, *, max_seq_len: int = 256,
            fmt: str = "jsonl", **kwargs: Any) -> tuple[IngestResult, list[dict], dict[int, str]]:
    suffix = {"jsonl": ".jsonl", "parquet": ".parquet", "hf": ""}[fmt]
    data = write_rows(rows, tmp_path / f"data{suffix}", fmt)  # type: ignore[arg-type]
    out = tmp_path / "out"
    result = ingest(str(data), str(tokenizer), max_seq_len, out, **kwargs)
    errors = {r["sample_index"]: r["reason"] for r in read_errors(out).to_pylist()}
    return result, read_inputs(out).to_pylist(), errors


def _runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Contiguous stretches of masked tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, m in zip(ids, mask, strict=True):
        if m and not previous:
            runs.append([])
        if m:
            runs[-1].append(token)
        previous = m
    return runs


def _template_tokenizer(path: Path, template: str | None) -> Path:
    """The tiny tokenizer with another chat template (None: without one)."""
    build_tokenizer(path)
    template_file = path / "chat_template.jinja"
    if not template_file.exists():
        raise RuntimeError("the tiny tokenizer no longer saves chat_template.jinja")
    if template is None:
        template_file.unlink()
    else:
        template_file.write_text(template)
    return path


CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a draft model?"},
    {"role": "assistant", "content": "A small model that guesses the next tokens."},
    {"role": "user", "content": "And the target?"},
    {"role": "assistant", "content": "The large model that checks the guesses!"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "  You are welcome.  "},
]


# ----------------------------------------------------------------------------- import


def test_import_leaves_heavy_modules_out() -> None:
    code = (
        "import sys, hsx.ingest\n"
        "heavy = [m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules]\n"
        "print(heavy)\n"
        "raise SystemExit(1 if heavy else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- chat rows


def test_loss_mask_is_exactly_the_assistant_turns(tiny_tokenizer: Path, tok: Any,
                                                  tmp_path: Path) -> None:
    result, inputs, errors = _ingest([{"messages": CHAT}], tiny_tokenizer, tmp_path)
    assert errors == {}
    assert result.num_samples == 1
    (sample,) = inputs
    assert sample["input_ids"] == tok.apply_chat_template(CHAT, tokenize=True,
                                                           return_dict=True)["input_ids"]
    decoded = [tok.decode(run) for run in _runs(sample["input_ids"], sample["loss_mask"])]
    # What each assistant turn generates: its (template-trimmed) content and end of turn.
    assert decoded == [m["content"].strip() + EOT for m in CHAT if m["role"] == "assistant"]
    assert result.num_loss_tokens == sum(sample["loss_mask"])
    assert sample["length"] == len(sample["input_ids"])


def test_loss_mask_matches_generation_tags(tiny_tokenizer: Path, tok: Any,
                                           chat_dataset: ChatDataset, tmp_path: Path) -> None:
    """The tiny template marks assistant output with {% generation %}; masks must agree."""
    result = ingest(str(chat_dataset.path), str(tiny_tokenizer), 100_000, tmp_path)
    assert result.num_truncated == 0
    rows = {i: chat_dataset.rows[i] for i in chat_dataset.good_indices}
    for sample in read_inputs(tmp_path).to_pylist():
        expected = tok.apply_chat_template(
            rows[sample["sample_index"]]["messages"], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert sample["input_ids"] == expected["input_ids"]
        assert sample["loss_mask"] == expected["assistant_masks"]


def test_sharegpt_conversations_equal_messages(tiny_tokenizer: Path, tmp_path: Path) -> None:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in CHAT]
    _, inputs, errors = _ingest([{"messages": CHAT}, {"conversations": sharegpt}],
                                tiny_tokenizer, tmp_path)
    assert errors == {}
    assert inputs[0]["input_ids"] == inputs[1]["input_ids"]
    assert inputs[0]["loss_mask"] == inputs[1]["loss_mask"]


def test_content_as_text_parts(tiny_tokenizer: Path, tmp_path: Path) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": "Hello"}]
    plain = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    _, inputs, errors = _ingest([{"messages": parts}, {"messages": plain}], tiny_tokenizer,
                                tmp_path)
    assert errors == {}
    assert inputs[0]["input_ids"] == inputs[1]["input_ids"]


def test_messages_win_over_prompt(tiny_tokenizer: Path, tok: Any, tmp_path: Path) -> None:
    """UltraChat-style rows carry both; the conversation is what is trained on."""
    _, inputs, _ = _ingest([{"prompt": "What is a draft model?", "messages": CHAT[1:3]}],
                           tiny_tokenizer, tmp_path)
    assert inputs[0]["input_ids"] == tok.apply_chat_template(
        CHAT[1:3], tokenize=True, return_dict=True)["input_ids"]


def test_chat_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    template = CHAT_TEMPLATE.replace("{{ bos_token }}",
                                     "{{ bos_token }}{% if greeting %}{{ greeting }}{% endif %}")
    tokenizer = _template_tokenizer(tmp_path / "tok", template)
    rows = [{"messages": CHAT[1:3]}]
    _, plain, _ = _ingest(rows, tokenizer, tmp_path / "a")
    _, greeted, _ = _ingest(rows, tokenizer, tmp_path / "b",
                            chat_template_kwargs={"greeting": "Good morning"})
    assert len(greeted[0]["input_ids"]) > len(plain[0]["input_ids"])
    assert sum(greeted[0]["loss_mask"]) == sum(plain[0]["loss_mask"])


def test_token_crossing_turn_boundary_falls_back_to_offsets(tmp_path: Path) -> None:
    """No separator between role and content: BPE merges across the turn boundary, so
    the prefix tokens are not a prefix of the full tokens; offsets locate the turn."""
    template = ("{% for m in messages %}{{ m['role'] }}{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}assistant{% endif %}")
    tokenizer = _template_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer(str(tokenizer))
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": "sample of the story"}]
    full = tok("userhelloassistantsample of the story", add_special_tokens=False)["input_ids"]
    prefix = tok("userhelloassistant", add_special_tokens=False)["input_ids"]
    assert full[: len(prefix)] != prefix, "the template must make tokens cross the boundary"
    _, inputs, errors = _ingest([{"messages": messages}], tokenizer, tmp_path)
    assert errors == {}
    (sample,) = inputs
    (run,) = _runs(sample["input_ids"], sample["loss_mask"])
    # The token that straddles the boundary is kept: it holds the turn's first characters.
    assert tok.decode(run).endswith("sample of the story")
    assert "hello" not in tok.decode(run)


def test_template_that_rewrites_history_falls_back_to_contents(tmp_path: Path) -> None:
    """A template that marks the final message differently: prefixes of the conversation
    are not prefixes of its rendering, so the assistant contents are searched for."""
    template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
        "{{ m['content'] }}{% if loop.last %}[final]{% endif %}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
        "{% endif %}"
    )
    tokenizer = _template_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer(str(tokenizer))
    _, inputs, errors = _ingest([{"messages": CHAT}], tokenizer, tmp_path)
    assert errors == {}
    decoded = [tok.decode(run) for run in _runs(inputs[0]["input_ids"],
                                                inputs[0]["loss_mask"])]
    assert decoded == [m["content"] for m in CHAT if m["role"] == "assistant"]


# ----------------------------------------------------------------------------- other rows


@pytest.mark.parametrize("field", ["text", "prompt"])
def test_plain_text_rows(field: str, tiny_tokenizer: Path, tok: Any, tmp_path: Path) -> None:
    text = "The river keeps moving under the old bridge."
    _, inputs, errors = _ingest([{field: text}], tiny_tokenizer, tmp_path)
    assert errors == {}
    (sample,) = inputs
    assert sample["input_ids"] == tok(text)["input_ids"]  # with BOS, no template
    assert sample["input_ids"][0] == tok.bos_token_id
    assert sample["loss_mask"] == [1] * len(sample["input_ids"])


def test_pretokenized_rows(tiny_tokenizer: Path, tmp_path: Path) -> None:
    rows = [
        {"input_ids": [0, 5, 6, 7]},
        {"input_ids": [0, 5, 6, 7], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [0, 5, 6, 7], "loss_mask": [False, True, True, False]},
        {"input_ids": list(range(20)), "loss_mask": [1] * 20},
    ]
    result, inputs, errors = _ingest(rows, tiny_tokenizer, tmp_path, max_seq_len=10)
    assert errors == {}
    assert [s["loss_mask"] for s in inputs[:3]] == [[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0]]
    assert inputs[3]["input_ids"] == list(range(10))
    assert inputs[3]["loss_mask"] == [1] * 10
    assert inputs[3]["length"] == 10
    assert result.num_truncated == 1


# ----------------------------------------------------------------------------- truncation


def test_truncation_keeps_the_first_tokens(tiny_tokenizer: Path, tok: Any,
                                           tmp_path: Path) -> None:
    long_answer = " ".join(["The careful engineer measures every layer again."] * 20)
    messages = [{"role": "user", "content": "Explain."},
                {"role": "assistant", "content": long_answer}]
    result, inputs, errors = _ingest([{"messages": messages}], tiny_tokenizer, tmp_path,
                                     max_seq_len=64)
    assert errors == {}
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert inputs[0]["input_ids"] == full[:64]
    assert inputs[0]["length"] == 64 == len(inputs[0]["loss_mask"])
    assert inputs[0]["loss_mask"][-1] == 1
    assert result.num_truncated == 1
    assert result.lengths.max == 64


def test_assistant_beyond_max_seq_len_is_an_error(tiny_tokenizer: Path, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Read this. " * 50},
                {"role": "assistant", "content": "Done."}]
    _, inputs, errors = _ingest([{"messages": messages}], tiny_tokenizer, tmp_path,
                                max_seq_len=32)
    assert inputs == []
    assert errors == {0: "no assistant tokens within the first 32 tokens (max_seq_len); the "
                         "row would train on nothing"}


# ----------------------------------------------------------------------------- row errors


BAD_ROWS: list[tuple[Any, str]] = [
    ('{"messages": [', "the line is not valid JSON (Expecting value: line 1 column 15"),
    ("", "the line is empty"),
    ("[1, 2]", "the row is a JSON list, not an object"),
    ({}, "the row is empty"),
    ({"messages": None, "text": None}, "the row is empty"),
    ({"messages": []}, "the conversation is empty (`messages` has no messages)"),
    ({"conversations": []}, "the conversation is empty (`conversations` has no messages)"),
    ({"messages": "hello"}, "`messages` is a str, not a list of messages"),
    ({"messages": ["hello"]}, "message 0 is a str, not an object"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
     "message 1 has unknown role 'wizard' (expected one of system, user, assistant, tool, "
     "or ShareGPT's human/gpt)"),
    ({"messages": [{"content": "a"}]}, "message 0 has unknown role None"),
    ({"messages": [{"role": "user", "content": 5}]},
     "message 0 content is neither text nor a list of text parts"),
    ({"messages": [{"role": "user", "content": "only a question"}]},
     "the conversation has no assistant message, so nothing would be trained on"),
    ({"text": ""}, "`text` is an empty string"),
    ({"prompt": ["a"]}, "`prompt` is a list, not a string"),
    ({"input_ids": "1 2 3"}, "input_ids is a str, not a list of integers"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [1, "2"]}, "input_ids is not a flat list of integers"),
    ({"input_ids": [1.5, 2]}, "input_ids is not a flat list of integers"),
    ({"input_ids": [[1], [2]]}, "input_ids is not a flat list of integers"),
    ({"input_ids": [1, 512]},
     "input_ids has token id 512, outside the tokenizer's vocabulary (0..511)"),
    ({"input_ids": [-1, 2]},
     "input_ids has token id -1, outside the tokenizer's vocabulary (0..511)"),
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]},
     "loss_mask has 2 entries but input_ids has 3; they must be the same length"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "loss_mask values must be 0 or 1"),
    ({"input_ids": [1, 2], "loss_mask": "11"}, "loss_mask is a str, not a list of 0/1 values"),
    ({"title": "x", "score": 3},
     "the row has none of the recognised fields (input_ids, messages, conversations, "
     "prompt, text); it has score, title"),
]


def test_every_bad_row_is_recorded_with_its_reason(tiny_tokenizer: Path, tmp_path: Path
                                                   ) -> None:
    good = {"messages": CHAT[1:3]}
    rows: list[Any] = []
    for bad, _ in BAD_ROWS:
        rows += [good, bad]
    rows.append(good)
    result, inputs, errors = _ingest(rows, tiny_tokenizer, tmp_path)
    assert [s["sample_index"] for s in inputs] == list(range(0, len(rows), 2))
    assert sorted(errors) == list(range(1, len(rows), 2))
    for position, (_, reason) in enumerate(BAD_ROWS):
        assert errors[2 * position + 1].startswith(reason), (position, errors[2 * position + 1])
    assert (result.num_rows, result.num_errors) == (len(rows), len(BAD_ROWS))
    assert result.num_samples == len(BAD_ROWS) + 1


def test_template_failure_is_a_row_error(tmp_path: Path) -> None:
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('system messages are not supported') }}{% endif %}"
                "{{ m['content'] }}{% endfor %}")
    tokenizer = _template_tokenizer(tmp_path / "tok", template)
    _, inputs, errors = _ingest([{"messages": CHAT}, {"messages": CHAT[1:3]}], tokenizer,
                                tmp_path)
    assert [s["sample_index"] for s in inputs] == [1]
    assert errors[0].startswith("the chat template failed: ")
    assert "system messages are not supported" in errors[0]


@pytest.mark.parametrize(
    ("generation_prompt", "reason"),
    [
        # Prefixes are prefixes of the rendering, and the assistant turn spans nothing.
        ("", "the chat template renders no tokens for the assistant messages"),
        # Prefixes are not prefixes, and the content is not in the rendering either.
        (">>", "assistant message 1 does not appear in the rendered chat text, so its "
               "tokens cannot be located"),
    ],
)
def test_template_that_drops_the_answer_is_a_row_error(generation_prompt: str, reason: str,
                                                       tmp_path: Path) -> None:
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}"
                + generation_prompt + "{% endif %}")
    tokenizer = _template_tokenizer(tmp_path / "tok", template)
    _, _, errors = _ingest([{"messages": CHAT[1:3]}], tokenizer, tmp_path)
    assert errors == {0: reason}


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    tokenizer = _template_tokenizer(tmp_path / "tok", None)
    _, inputs, errors = _ingest([{"messages": CHAT[1:3]}, {"text": "plain text works"}],
                                tokenizer, tmp_path)
    assert errors == {0: "the tokenizer has no chat template, so the conversation cannot be "
                         "rendered"}
    assert [s["sample_index"] for s in inputs] == [1]


def test_chat_dataset_bad_rows(tiny_tokenizer: Path, chat_dataset: ChatDataset,
                               tmp_path: Path) -> None:
    expected = {
        "malformed_json": "the line is not valid JSON",
        "empty_messages": "the conversation is empty",
        "unknown_role": "message 1 has unknown role 'wizard'",
        "no_assistant": "the conversation has no assistant message",
        "no_field": "the row has none of the recognised fields",
    }
    result = ingest(str(chat_dataset.path), str(tiny_tokenizer), 256, tmp_path)
    errors = {r["sample_index"]: r["reason"] for r in read_errors(tmp_path).to_pylist()}
    assert sorted(errors) == sorted(chat_dataset.bad)
    assert sorted(set(chat_dataset.bad.values())) == sorted(expected)
    for index, kind in chat_dataset.bad.items():
        assert errors[index].startswith(expected[kind])
    inputs = read_inputs(tmp_path)
    assert inputs["sample_index"].to_pylist() == chat_dataset.good_indices
    assert result.num_samples == 200
    assert 0 < result.num_truncated < 40, "a few long rows are truncated at 256"
    assert max(inputs["length"].to_pylist()) == 256


# ----------------------------------------------------------------------------- sources


def test_all_formats_give_the_same_inputs(tiny_tokenizer: Path, chat_dataset: ChatDataset,
                                          tmp_path: Path) -> None:
    rows = [r for r in chat_dataset.rows if isinstance(r, dict)]  # no malformed JSON line
    rows += [{"text": "Some plain text."}, {"input_ids": [0, 1, 2], "loss_mask": [0, 1, 1]},
             {"conversations": [{"from": "human", "value": "hi"},
                                {"from": "gpt", "value": "hello"}]}]
    sources = {
        "jsonl": write_rows(rows, tmp_path / "d.jsonl", "jsonl"),
        "parquet": write_rows(rows, tmp_path / "d.parquet", "parquet"),
        "hf": write_rows(rows, tmp_path / "hf", "hf"),
    }
    parts = tmp_path / "parts"
    parts.mkdir()
    write_rows(rows[:70], parts / "part-0.parquet", "parquet")
    write_rows(rows[70:], parts / "part-1.parquet", "parquet")
    sources["parquet-dir"] = parts
    tables = {}
    for name, source in sources.items():
        out = tmp_path / f"out-{name}"
        ingest(str(source), str(tiny_tokenizer), 256, out, batch_rows=64)
        tables[name] = (read_inputs(out), read_errors(out))
    reference_inputs, reference_errors = tables["jsonl"]
    assert reference_inputs.num_rows == len(rows) - 4  # four bad rows among the dicts
    for name, (inputs, errors) in tables.items():
        assert inputs.equals(reference_inputs), name
        assert errors["sample_index"].equals(reference_errors["sample_index"]), name


def test_batch_size_does_not_change_the_output(tiny_tokenizer: Path,
                                               chat_dataset: ChatDataset,
                                               tmp_path: Path) -> None:
    seen: list[IngestProgress] = []
    ingest(str(chat_dataset.path), str(tiny_tokenizer), 256, tmp_path / "a", batch_rows=7,
           progress=seen.append)
    assert sorted({p.rows for p in seen}) == [*range(7, chat_dataset.num_rows, 7),
                                              chat_dataset.num_rows]
    assert seen[-1].fraction == 1.0 and seen[-1].rows_expected == chat_dataset.num_rows
    ingest(str(chat_dataset.path), str(tiny_tokenizer), 256, tmp_path / "b")
    small = read_inputs(tmp_path / "a")
    assert small.equals(read_inputs(tmp_path / "b"))
    assert read_errors(tmp_path / "a").equals(read_errors(tmp_path / "b"))
    with pa.memory_map(str(tmp_path / "a" / layout.inputs_part_path(0))) as source:
        reader = pa.ipc.open_file(source)
        # Batches of a fixed row count, recorded for readers that fetch one at a time.
        assert reader.schema.metadata[b"hsx.rows_per_batch"] == b"1024"
        assert reader.get_batch(0).num_rows == small.num_rows


def test_output_files(tiny_tokenizer: Path, tok: Any, tmp_path: Path) -> None:
    texts = ["one", "two words", "and three words"]
    result, _, _ = _ingest([{"text": t} for t in texts], tiny_tokenizer, tmp_path)
    out = tmp_path / "out"
    assert read_inputs(out).schema.equals(INPUTS_SCHEMA)
    errors = read_errors(out)
    assert errors.schema.equals(ERRORS_SCHEMA)
    assert errors.num_rows == 0
    assert list((out / layout.TMP_DIR).iterdir()) == []
    assert result.inputs_path == Output(out).url(layout.INPUTS_DIR)
    # One part, the last: its inputs table, no errors table (it would be empty), its record.
    assert sorted(p.name for p in (out / layout.INPUTS_DIR).iterdir()) == [
        "part-00000.arrow", "part-00000.json"]
    assert not (out / layout.ERRORS_DIR).exists()
    (record,) = Output(out).part_records()
    assert (record.samples, record.errors, record.rows_end, record.last) == (3, 0, 3, True)
    summary = result.lengths
    lengths = sorted(len(tok(t)["input_ids"]) for t in texts)
    assert (summary.min, summary.p50, summary.max) == tuple(lengths)
    assert summary.mean == round(sum(lengths) / 3, 2)
    assert json.dumps(result.to_dict())


def test_empty_dataset(tiny_tokenizer: Path, tmp_path: Path) -> None:
    result, inputs, errors = _ingest([], tiny_tokenizer, tmp_path)
    assert (result.num_rows, result.num_samples, inputs, errors) == (0, 0, [], {})
    assert result.lengths.max == 0


def test_missing_dataset_names_the_path(tiny_tokenizer: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetNotFoundError, match=r"nope\.jsonl") as info:
        ingest(str(missing), str(tiny_tokenizer), 256, tmp_path / "out")
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: (p / "d.csv").write_text("a,b\n") and p / "d.csv",
         "unsupported file type '.csv'"),
        (lambda p: p, "holds no \\*.parquet or \\*.jsonl files"),
    ],
)
def test_unknown_format_is_refused(make: Any, message: str, tiny_tokenizer: Path,
                                   tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(DatasetFormatError, match=message):
        ingest(str(make(data)), str(tiny_tokenizer), 256, tmp_path / "out")


def test_dataset_dict_asks_for_a_split(tiny_tokenizer: Path, tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]}),
                               "test": datasets.Dataset.from_dict({"text": ["b"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetFormatError, match=r"splits \['test', 'train'\]"):
        ingest(str(tmp_path / "dd"), str(tiny_tokenizer), 256, tmp_path / "out")


def test_jsonl_directory_and_json_array(tiny_tokenizer: Path, tmp_path: Path) -> None:
    rows = [{"text": f"row {i}"} for i in range(5)]
    (tmp_path / "dir").mkdir()
    write_rows(rows[:2], tmp_path / "dir" / "a.jsonl", "jsonl")
    write_rows(rows[2:], tmp_path / "dir" / "b.jsonl", "jsonl")
    (tmp_path / "array.json").write_text(json.dumps(rows))
    ingest(str(tmp_path / "dir"), str(tiny_tokenizer), 64, tmp_path / "o1")
    ingest(str(tmp_path / "array.json"), str(tiny_tokenizer), 64, tmp_path / "o2")
    assert read_inputs(tmp_path / "o1").equals(read_inputs(tmp_path / "o2"))
    assert read_inputs(tmp_path / "o1")["sample_index"].to_pylist() == list(range(5))


# ----------------------------------------------------------------------------- fingerprints


def test_tokenizer_fingerprint(tiny_tokenizer: Path, tmp_path: Path) -> None:
    same = _template_tokenizer(tmp_path / "same", CHAT_TEMPLATE)
    other = _template_tokenizer(tmp_path / "other", CHAT_TEMPLATE + "{# changed #}")
    fingerprint = tokenizer_fingerprint(tiny_tokenizer)
    assert len(fingerprint) == 16
    assert tokenizer_fingerprint(same) == fingerprint
    assert tokenizer_fingerprint(other) != fingerprint
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer_fingerprint(tmp_path)


def test_dataset_fingerprint_follows_changes(tmp_path: Path) -> None:
    path = write_rows([{"text": "a"}], tmp_path / "d.jsonl", "jsonl")
    first = dataset_fingerprint(path)
    assert dataset_fingerprint(path) == first
    path.write_text(json.dumps({"text": "bb"}) + "\n")
    os.utime(path, ns=(1, 1))
    assert dataset_fingerprint(path) != first


def test_a_regenerating_job_keeps_each_conversation_and_refuses_rows_without_one(
    tiny_tokenizer: Path, tmp_path: Path, tok: Any
) -> None:
    result, inputs, errors = _ingest(
        [{"messages": CHAT}, {"prompt": "no conversation"}, {"text": "none either"}],
        tiny_tokenizer, tmp_path, keep_messages=True)
    assert result.num_samples == 1
    assert json.loads(inputs[0]["messages"]) == CHAT
    assert errors == {1: NOT_A_CHAT, 2: NOT_A_CHAT}
    # The worker tokenizes a regenerated conversation exactly as ingestion did.
    tokenized = tokenize_conversations(tok, [CHAT], 256)[0]
    assert not isinstance(tokenized, str)
    assert tokenized[0].tolist() == inputs[0]["input_ids"]
    assert tokenized[1].tolist() == inputs[0]["loss_mask"]
    prompt = generation_prompt(tok, CHAT[:2])
    assert inputs[0]["input_ids"][: len(prompt)] == prompt
