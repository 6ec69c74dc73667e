"""The dtype an engine computes in (hsx_workers/dtypes.py): `auto` on a CPU without native
bf16 is float32 for a model whose float32 weights fit a quarter of the host's memory;
what a job names it gets; a GPU, a CPU with native bf16, a model too large or quantized
keep the model's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hsx_workers import dtypes

# A Llama of ~0.85M parameters (embeddings, 2 layers, LM head): ~3.4 MB in float32.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
          "intermediate_size": 256, "vocab_size": 2048, "torch_dtype": "bfloat16"}


def _model(root: Path, **extra: object) -> str:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**CONFIG, **extra}))
    return str(root)


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_float32_only_on_a_cpu_without_native_bf16(
        native: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    model = _model(tmp_path / "m")
    assert dtypes.compute_dtype("auto", on_cpu=True, model=model) == (
        "auto" if native else "float32")
    assert dtypes.compute_dtype("auto", on_cpu=False, model=model) == "auto"
    for named in ("bfloat16", "float16", "float32"):
        assert dtypes.compute_dtype(named, on_cpu=True, model=model) == named
        assert dtypes.compute_dtype(named, on_cpu=False, model=model) == named


def test_a_model_too_large_quantized_or_unsized_keeps_its_own_dtype(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    model = _model(tmp_path / "m")
    need = dtypes.float32_weight_bytes(model)
    assert need is not None and 3_000_000 < need < 4_000_000
    monkeypatch.setattr(dtypes, "host_memory_bytes", lambda: 4 * need)  # exactly the share
    assert dtypes.compute_dtype("auto", on_cpu=True, model=model) == "float32"
    monkeypatch.setattr(dtypes, "host_memory_bytes", lambda: 4 * need - 1)
    assert dtypes.compute_dtype("auto", on_cpu=True, model=model) == "auto"
    monkeypatch.setattr(dtypes, "host_memory_bytes", lambda: 2**40)
    quantized = _model(tmp_path / "q", quantization_config={"quant_method": "fp8"})
    assert dtypes.compute_dtype("auto", on_cpu=True, model=quantized) == "auto"
    assert dtypes.compute_dtype("auto", on_cpu=True, model=str(tmp_path / "none")) == "auto"
