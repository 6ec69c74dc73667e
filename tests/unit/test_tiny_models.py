"""Tiny models, tokenizer and datasets: deterministic, loadable, and usable by transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hsx_workers.tiny_models import (
    BAD_KINDS,
    CHAT_TEMPLATE,
    KIMI_MEDIA_PROC_CFG,
    KIMI_MEDIA_TOKENS,
    SPECIAL_TOKENS,
    build_tokenizer,
    main,
    make_chat_dataset,
    make_tiny_model,
)


def test_tokenizer_round_trip(tiny_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    assert len(tok) == 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(5))
    assert tok.chat_template == CHAT_TEMPLATE  # survives save/load
    assert (tiny_tokenizer / "chat_template.jinja").exists()
    config = json.loads((tiny_tokenizer / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    text = "The quick student explains 42 layers, café!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_generation_tags_give_assistant_masks(tiny_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(masked) == "Hello.<|eot_id|>"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tokenizer_is_deterministic(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (
        tmp_path / "b/tokenizer.json").read_bytes()


def test_tiny_llama_files_and_config(tiny_llama: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "chat_template.jinja"):
        assert (tiny_llama / name).exists(), name
    config = json.loads((tiny_llama / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["dtype"] == "bfloat16"
    assert (tiny_llama / "model.safetensors").stat().st_size < 8 * 2**20


def test_forward_with_hidden_states(tiny_llama: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()
    assert model.dtype == torch.bfloat16
    ids = tok("The river keeps moving under the bridge.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 4 + 1
    for h in out.hidden_states:
        assert h.shape == (1, ids.shape[1], 256)
        assert torch.isfinite(h.float()).all()
        assert h.float().std() > 1e-3  # not degenerate
    assert out.logits.shape == (1, ids.shape[1], 512)


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_same_seed_same_weights(tiny_llama: Path, tmp_path: Path) -> None:
    import torch

    again = make_tiny_model(tmp_path / "again", "llama", seed=0)
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    reference = _weights(tiny_llama)
    assert all(torch.equal(reference[k], v) for k, v in _weights(again).items())
    assert not torch.equal(reference["model.embed_tokens.weight"],
                           _weights(other)["model.embed_tokens.weight"])


@pytest.mark.parametrize(("arch", "cls"), [("qwen3", "Qwen3ForCausalLM"),
                                           ("mistral", "MistralForCausalLM")])
def test_other_archs_build_and_run(arch: str, cls: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, arch, num_layers=2)
    assert json.loads((path / "config.json").read_text())["architectures"] == [cls]
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        out = model(torch.tensor([[0, 10, 20, 30]]), output_hidden_states=True)
    assert len(out.hidden_states) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"arch": "gpt2"}, "unknown arch 'gpt2'"),
     ({"hidden_size": 64}, "must be 64"),
     ({"num_kv_heads": 3}, "not a multiple"),
     ({"dtype": "float7"}, "unknown dtype")],
)
def test_bad_model_arguments(kwargs: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path, **kwargs)


def test_chat_dataset_is_deterministic_and_records_bad_rows(tmp_path: Path) -> None:
    a = make_chat_dataset(tmp_path / "a.jsonl", n=50, seed=3, bad_rows=7)
    b = make_chat_dataset(tmp_path / "b.jsonl", n=50, seed=3, bad_rows=7)
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.bad == b.bad
    assert a.num_rows == 57 == len(a.path.read_text().splitlines())
    assert len(a.bad) == 7 and set(a.bad.values()) == set(BAD_KINDS)
    assert len(a.good_indices) == 50
    lines = a.path.read_text().splitlines()
    for index, kind in a.bad.items():
        if kind == "malformed_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(lines[index])
    for index in a.good_indices:
        roles = [m["role"] for m in json.loads(lines[index])["messages"]]
        assert "assistant" in roles and roles[-1] == "assistant"
    c = make_chat_dataset(tmp_path / "c.jsonl", n=50, seed=4)
    assert c.path.read_bytes() != a.path.read_bytes()


def test_chat_dataset_formats(tmp_path: Path) -> None:
    ds = make_chat_dataset(tmp_path / "mixed.jsonl", n=40, formats="mixed")
    fields = {next(iter(row)) for row in ds.rows}
    assert fields == {"messages", "conversations", "text", "prompt"}
    with pytest.raises(ValueError, match="unknown formats"):
        make_chat_dataset(tmp_path / "x.jsonl", formats="csv")  # type: ignore[arg-type]


def test_cli(tmp_path: Path) -> None:
    assert main(["dataset", str(tmp_path / "d.jsonl"), "--n", "10", "--bad-rows", "2"]) == 0
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 12
    assert main(["model", str(tmp_path / "m"), "--arch", "llama", "--layers", "2"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2


def test_extra_special_tokens_take_the_last_ids(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    extra = ("<|a|>", "<|b|>")
    build_tokenizer(tmp_path, extra_special_tokens=extra)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(list(extra)) == [510, 511]
    assert tok("x<|b|>y", add_special_tokens=False)["input_ids"][1] == 511
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(5))


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kimi"), "kimi_k25", num_layers=2)


def test_kimi_k25_folder_is_what_vllm_reads(tiny_kimi: Path) -> None:
    """Config with vLLM's class name and both media-token fields, the media tokens in
    the tokenizer, media_proc_cfg, and the text weights under Kimi-K2.5's names."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((tiny_kimi / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    tok = AutoTokenizer.from_pretrained(str(tiny_kimi))
    assert len(tok) == 512
    assert [tok.convert_tokens_to_ids(t) for t in KIMI_MEDIA_TOKENS] == [508, 509, 510, 511]
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    assert config["image_token_id"] == config["media_placeholder_token_id"] == pad
    assert config["vision_start_token_id"] == tok.convert_tokens_to_ids("<|media_begin|>")
    processor = json.loads((tiny_kimi / "preprocessor_config.json").read_text())
    assert processor["media_proc_cfg"] == KIMI_MEDIA_PROC_CFG
    vision = config["vision_config"]
    assert vision["patch_size"] == KIMI_MEDIA_PROC_CFG["patch_size"]
    assert vision["merge_kernel_size"] == [KIMI_MEDIA_PROC_CFG["merge_kernel_size"]] * 2
    with safe_open(str(tiny_kimi / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    text = {n for n in names if n.startswith("language_model.")}
    assert {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight",
            "language_model.model.norm.weight",
            "language_model.model.layers.1.self_attn.q_proj.weight",
            "language_model.model.layers.1.mlp.experts.3.gate_proj.weight",
            "language_model.model.layers.1.mlp.gate.e_score_correction_bias"} <= text
    assert not [n for n in text if "blocks" in n or "wqkv" in n], "vision renames hit the text"
    others = names - text
    assert others and all(n.startswith(("vision_tower.", "mm_projector.")) for n in others)
    assert (tiny_kimi / "model.safetensors").stat().st_size < 16 * 2**20


def test_kimi_k25_loads_in_transformers_with_every_weight(tiny_kimi: Path) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    loaded: Any = AutoModelForImageTextToText.from_pretrained(
        str(tiny_kimi), dtype=torch.bfloat16, output_loading_info=True)
    model, info = loaded
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    # What was saved is what the seeded model holds: the same arguments give it again.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fresh = AutoModelForImageTextToText.from_config(model.config, dtype=torch.float32)
    assert fresh.state_dict().keys() == model.state_dict().keys()
    embed = model.get_input_embeddings().weight
    assert torch.equal(embed, fresh.get_input_embeddings().weight.to(torch.bfloat16))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[0, 10, 20, 511, 30]]), output_hidden_states=True)
    assert len(out.hidden_states) == 3
    assert all(torch.isfinite(h.float()).all() for h in out.hidden_states)


def test_kimi_k25_same_seed_same_bytes(tiny_kimi: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", "kimi_k25", num_layers=2)
    for name in ("model.safetensors", "config.json", "tokenizer.json",
                 "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_kimi / name).read_bytes(), name
    config_only = make_tiny_model(tmp_path / "config-only", "kimi_k25", num_layers=2,
                                  weights=False)
    assert not list(config_only.glob("*.safetensors"))
    assert (config_only / "preprocessor_config.json").is_file()
    assert json.loads((config_only / "config.json").read_text())["architectures"] == [
        "KimiK25ForConditionalGeneration"]
