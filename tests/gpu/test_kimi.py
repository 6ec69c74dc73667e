"""Kimi-K2.5's shape on a GPU: the tiny wrapper with weights, end to end through vLLM.

hsx exists because extraction failed on Kimi-K2.5, a multimodal wrapper
(KimiK25ForConditionalGeneration) around DeepSeek-V3. The tiny Kimi-K2.5-shaped
checkpoint (`make_tiny_model(..., "kimi_k25")`: DeepSeek-V3 MLA + MoE text model, a
one-block vision tower, Kimi's media tokens and `media_proc_cfg`) goes through what a
user's job goes through on a GPU node:

1. the preflight answers `extract_hidden_states` on the wrapper, text path only
   (`language_model_only`), with vLLM's own image processor built from the folder;
2. `run_job` with the vllm engine (a Ray actor owning vLLM's GPU engine, in vLLM's
   default compiled mode; engine start ~1-2 min) commits every sample of a small chat
   dataset;
3. the captured states match transformers' forward of the same wrapper on the GPU (bf16):
   ids 1..N-1 are `output_hidden_states[k]`, id N the input of the final norm. Bounds are
   the DeepSeek-V3 ones of tests/integration/test_archs.py: median sample < 1e-2, worst
   sample < 3e-2 per layer (vLLM runs MLA in its absorbed form, transformers expanded).

The measured errors go to `$HSX_GPU_RESULTS/kimi_k25.json`. On the lent H200, after the
recipe's install (`bash .gpu/5/device.sh`):

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service VLLM_USE_FLASHINFER_SAMPLER=0 \
        python3 -m pytest tests/gpu/test_kimi.py -q -s
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hsx_workers.tiny_models import make_chat_dataset, make_tiny_model

NUM_LAYERS = 3
LAYERS = [1, 2, 3]  # vLLM's DeepSeek cannot give id 0 (the embeddings)
MEDIAN_BOUND = 1e-2
WORST_BOUND = 3e-2

# The lent machines have no FlashInfer (gpu/README.md of the recipe).
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kimi"), "kimi_k25", num_layers=NUM_LAYERS)


def test_kimi_k25_preflight_answers_extract_hidden_states(tiny_kimi: Path, record: Any) -> None:
    from hsx_workers.engines.vllm.compat import vllm_version
    from hsx_workers.preflight import format_report, inspect_model

    report = inspect_model(str(tiny_kimi))
    record("kimi_k25_preflight", vllm=vllm_version(), report=report.as_dict())
    assert report.capture == "extract_hidden_states", format_report(report)
    assert report.wrapper and report.supports_eagle3
    assert report.vllm_class is not None and report.vllm_class.endswith(
        "KimiK25ForConditionalGeneration")
    assert report.language_model_architecture == "DeepseekV3ForCausalLM"
    assert report.as_dict()["engine_options"] == {"language_model_only": True}
    assert report.valid_layers == LAYERS and report.default_layers == LAYERS
    assert report.gpu_memory_bytes and report.weights_fit is True


def test_kimi_k25_text_path_matches_transformers(tiny_kimi: Path, ray_gpus: None,
                                                  tmp_path: Path, record: Any) -> None:
    import torch

    from hsx.spec import JobSpec
    from hsx_service.engine_pool import EnginePool
    from hsx_service.runner import run_job
    from hsx_workers.engines.vllm.compat import vllm_version
    from tests.integration.helpers import by_sample, error_per_layer, wrapper_text_states

    chats = make_chat_dataset(tmp_path / "chat.jsonl", n=24, seed=3)
    spec = JobSpec(model=str(tiny_kimi), dataset=str(chats.path), output=str(tmp_path / "out"),
                   layers=LAYERS, engine="vllm", max_seq_len=256, unit_tokens=2048,
                   # vLLM's default mode (torch.compile, CUDA graphs), the one jobs run: not
                   # enforce_eager, whose custom ops are another code path (on the CPU
                   # build its rotary kernel garbles MLA's queries: docs/MODELS.md).
                   vllm={"gpu_memory_utilization": 0.3})
    engines = EnginePool()
    try:
        summary = run_job(spec, pool=engines)
    finally:
        engines.shutdown()  # the GPU is the reference's next
    assert summary.samples == len(chats.good_indices)
    got = by_sample(tmp_path / "out")
    assert sorted(got) == chats.good_indices
    ref = wrapper_text_states(tiny_kimi, got, LAYERS, device="cuda")
    median, worst = error_per_layer({i: s["hidden_states"] for i, s in got.items()}, ref,
                                    LAYERS)
    record("kimi_k25", vllm=vllm_version(), torch=torch.__version__,
           device=torch.cuda.get_device_name(0), layers=LAYERS, samples=len(ref),
           tokens=summary.tokens, seconds=summary.seconds, median_relative_error=median,
           worst_relative_error=worst, bounds={"median": MEDIAN_BOUND, "worst": WORST_BOUND})
    print(f"kimi_k25 text path on GPU: relative error per layer, median {median}, "
          f"worst {worst}")
    assert max(median.values()) < MEDIAN_BOUND, median
    assert max(worst.values()) < WORST_BOUND, worst
