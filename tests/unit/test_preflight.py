"""Model preflight: every tiny architecture answered from its config alone.

The model folders here are config-only (`weights=False`): had the preflight loaded
weights, it would fail on them. vLLM is imported once for the module (~10 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hsx.modelinfo import read_model_info
from hsx.spec import JobSpec, TrainSpec
from hsx_service.errors import JobRefused
from hsx_service.prepare import preflight, prepare
from hsx_workers.engines.vllm import missing_torchvision
from hsx_workers.engines.vllm.classes import needs_torchvision_stub
from hsx_workers.engines.vllm.missing_torchvision import torchvision_missing
from hsx_workers.engines.vllm.settings import CaptureArgs
from hsx_workers.preflight import (
    ModelReport,
    environment_report,
    format_report,
    image_processors,
    inspect_model,
)
from hsx_workers.tiny_models import ARCHS, ChatDataset, make_tiny_model

LAYERS = 3

REQUIRED_KEYS = {
    "architecture", "wrapper", "language_model_architecture", "num_layers", "hidden_size",
    "supports_eagle3", "capture", "default_layers", "valid_layers", "bytes_per_token",
    "reasons", "trust_remote_code_needed",
}

# vLLM builds Kimi-K2.5's image processor at engine start even for the text path: its
# own numpy + numba one where numba imports, else transformers' torchvision-only one.
NUMBA = image_processors._importable("numba")
KIMI_CAPTURE = ("extract_hidden_states" if NUMBA or not torchvision_missing()
                else "unsupported")

# arch -> (architecture, wrapper, inner text architecture, EAGLE-3, capture, lowest id)
EXPECTED: dict[str, tuple[str, bool, str | None, bool, str, int]] = {
    "llama": ("LlamaForCausalLM", False, None, True, "extract_hidden_states", 0),
    "qwen3": ("Qwen3ForCausalLM", False, None, True, "extract_hidden_states", 0),
    "mistral": ("MistralForCausalLM", False, None, True, "extract_hidden_states", 0),
    "deepseek_v3": ("DeepseekV3ForCausalLM", False, None, True, "extract_hidden_states", 1),
    "qwen3_moe": ("Qwen3MoeForCausalLM", False, None, True, "extract_hidden_states", 0),
    "gemma2": ("Gemma2ForCausalLM", False, None, False, "hooks", 0),
    "gemma3": ("Gemma3ForCausalLM", False, None, False, "hooks", 0),
    "gpt_oss": ("GptOssForCausalLM", False, None, True, "extract_hidden_states", 0),
    "qwen3_next": ("Qwen3NextForCausalLM", False, None, True, "extract_hidden_states", 0),
    "llava": ("LlavaForConditionalGeneration", True, "LlamaForCausalLM", True,
              "extract_hidden_states", 0),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", True, "Qwen2ForCausalLM", True,
                   "extract_hidden_states", 0),
    "kimi_k25": ("KimiK25ForConditionalGeneration", True, "DeepseekV3ForCausalLM", True,
                 KIMI_CAPTURE, 1),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-configs")
    return {arch: make_tiny_model(root / arch, arch, num_layers=LAYERS, weights=False)
            for arch in ARCHS}


@pytest.fixture(scope="module")
def reports(configs: dict[str, Path]) -> dict[str, ModelReport]:
    return {arch: inspect_model(str(path)) for arch, path in configs.items()}


def test_every_arch_has_an_expectation() -> None:
    assert set(EXPECTED) == set(ARCHS)


def test_config_only_folders_hold_no_weights(configs: dict[str, Path]) -> None:
    for path in configs.values():
        assert (path / "config.json").is_file()
        assert not list(path.glob("*.safetensors")), path


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_preflight_answers_from_config_alone(arch: str, reports: dict[str, ModelReport]) -> None:
    report = reports[arch]
    name, wrapper, inner, eagle3, capture, low = EXPECTED[arch]
    data = report.as_dict()
    assert set(data) >= REQUIRED_KEYS
    json.dumps(data)  # the --json output
    assert data["architecture"] == name
    assert data["wrapper"] is wrapper
    assert data["language_model_architecture"] == inner
    assert data["supports_eagle3"] is eagle3
    assert data["capture"] == capture, report.reasons
    assert data["num_layers"] == LAYERS and data["hidden_size"] == 256
    assert data["valid_layers"] == list(range(low, LAYERS + 1))
    assert data["default_layers"] and min(data["default_layers"]) >= low
    assert data["trust_remote_code_needed"] is False
    assert all(isinstance(r, str) and r for r in data["reasons"])
    per_token = 2 * len(data["default_layers"]) * 256
    assert data["bytes_per_token"] == {
        "bf16": per_token, "fp8": per_token // 2 + 4 * len(data["default_layers"])
    }
    if wrapper and data["capture"] == "extract_hidden_states":
        assert report.engine_options == CaptureArgs(language_model_only=True)
        assert data["engine_options"] == {"language_model_only": True}
    elif data["capture"] == "hooks":
        assert data["engine_options"] == {"enforce_eager": True}
    else:
        assert data["engine_options"] == {}
    assert format_report(report)


def test_kimi_k25_resolves_wrapper_and_deepseek_text_model(
    reports: dict[str, ModelReport],
) -> None:
    """The seed story: the wrapper resolves, the EAGLE-3 check does not raise TypeError."""
    kimi = reports["kimi_k25"]
    assert kimi.vllm_class is not None and kimi.vllm_class.endswith(
        "KimiK25ForConditionalGeneration")
    assert kimi.language_model_class is not None and "deepseek" in kimi.language_model_class
    assert any("embeddings" in r for r in kimi.reasons)
    assert any("language_model_only" in r for r in kimi.reasons)
    # The trap the preflight avoids: issubclass on the protocol raises.
    from vllm.model_executor.models.interfaces import SupportsEagle3
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    with pytest.raises(TypeError):
        issubclass(KimiK25ForConditionalGeneration, SupportsEagle3)


def test_kimi_k25_with_numba_needs_no_torchvision(reports: dict[str, ModelReport]) -> None:
    """vLLM builds its numpy + numba image processor for Kimi, so no torchvision is
    needed: the preflight builds it too, from the folder's preprocessor_config.json."""
    if not NUMBA:
        pytest.skip("numba is not importable here")
    kimi = reports["kimi_k25"]
    assert kimi.capture == "extract_hidden_states", kimi.reasons
    assert kimi.engine_options == CaptureArgs(language_model_only=True)
    assert any("KimiK25FusedVisionProcessor" in r and "built here" in r for r in kimi.reasons)
    assert not any("Kimi_K25ImageProcessor" in r for r in kimi.reasons)
    # Its module imports without torchvision, so an engine needs no stub (and keeps
    # vLLM's processes and tensor parallelism); Llava's does not.
    assert needs_torchvision_stub("KimiK25ForConditionalGeneration") is False
    if torchvision_missing():
        assert needs_torchvision_stub("LlavaForConditionalGeneration") is True
        assert any("imports without it" in r for r in kimi.reasons)
        assert not any("stubbed" in r for r in kimi.reasons)


def _copy_config(source: Path, dest: Path) -> Path:
    import shutil

    return Path(shutil.copytree(source, dest))


def test_kimi_k25_refused_without_numba_and_torchvision(
    configs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where vLLM would fall back to transformers' torchvision-only processor and
    torchvision is missing, the job is refused, naming the step that would fail."""
    monkeypatch.setattr(image_processors, "_importable", lambda name: name != "numba")
    monkeypatch.setattr(missing_torchvision, "torchvision_missing", lambda: True)
    kimi = inspect_model(str(configs["kimi_k25"]))
    assert kimi.capture == "unsupported"
    assert any("Kimi_K25ImageProcessor" in r and "_supports_multimodal_inputs" in r
               and "numba is not importable" in r and "With numba installed" in r
               for r in kimi.reasons)
    # Wrappers whose processor has a PIL variant keep their text path.
    assert inspect_model(str(configs["llava"])).capture == "extract_hidden_states"


def test_kimi_k25_without_numba_judged_by_the_processor_vllm_loads(
    configs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without numba (and with torchvision), vLLM loads the processor transformers gives
    and reads its media_tokens_calculator: transformers' own Kimi class lacks it, the
    checkpoint's remote code has it."""
    import transformers

    class BuiltIn:  # what transformers' Kimi_K25ImageProcessor offers vLLM: no calculator
        pass

    class RemoteCode:
        def media_tokens_calculator(self, media: Any) -> int:
            return 1

    monkeypatch.setattr(image_processors, "_importable", lambda name: name != "numba")
    monkeypatch.setattr(missing_torchvision, "torchvision_missing", lambda: False)
    cases = ((BuiltIn, "unsupported", "lacks it"),
             (RemoteCode, "extract_hidden_states", "built here"))
    for given, capture, said in cases:
        monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained",
                            classmethod(lambda cls, *a, given=given, **k: given()))
        report = inspect_model(str(configs["kimi_k25"]))
        assert report.capture == capture, report.reasons
        assert any("numba is not importable" in r and given.__name__ in r and said in r
                   for r in report.reasons), report.reasons


def test_kimi_k25_refused_when_its_processor_cannot_be_built(
    configs: dict[str, Path], tmp_path: Path,
) -> None:
    if not NUMBA:
        pytest.skip("numba is not importable here")
    broken = _copy_config(configs["kimi_k25"], tmp_path / "no-media-cfg")
    (broken / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    report = inspect_model(str(broken))
    assert report.capture == "unsupported"
    assert any("KimiK25FusedVisionProcessor cannot be built" in r and
               "preprocessor_config.json" in r and "merge_kernel_size" in r
               for r in report.reasons), report.reasons
    (broken / "preprocessor_config.json").unlink()
    report = inspect_model(str(broken))
    assert report.capture == "unsupported"
    assert any("cannot be built" in r for r in report.reasons)


def test_wrappers_without_torchvision_say_only_text_runs(reports: dict[str, ModelReport]) -> None:
    from hsx_workers.engines.vllm.missing_torchvision import torchvision_missing

    if not torchvision_missing():
        pytest.skip("torchvision is installed here")
    for arch in ("llava", "qwen2_5_vl"):
        assert any("torchvision" in r and "text path" in r for r in reports[arch].reasons)


def test_forced_engines(configs: dict[str, Path]) -> None:
    gemma = inspect_model(str(configs["gemma2"]), engine="vllm")
    assert gemma.capture == "hooks"
    assert gemma.engine_options == CaptureArgs(enforce_eager=True)
    assert "with {'enforce_eager': True}" in format_report(gemma)
    assert any("EAGLE-3" in r and "hooks" in r and "eager" in r for r in gemma.reasons)
    assert inspect_model(str(configs["gemma2"]), engine="hf").capture == "hf"
    llava = inspect_model(str(configs["llava"]), engine="hf")
    assert llava.capture == "unsupported"
    assert any("causal-LM" in r for r in llava.reasons)


def test_capture_args_refuse_what_is_not_theirs() -> None:
    """The preflight's engine arguments are typed: a key vLLM's capture path does not set,
    or a value of another type, is an error where it is made (a dict took either)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="extra"):
        CaptureArgs(language_model_onyl=True)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="bool"):
        CaptureArgs(enforce_eager="yes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="frozen"):
        CaptureArgs().enforce_eager = True  # type: ignore[misc]
    assert CaptureArgs().engine_args() == {}
    assert CaptureArgs(language_model_only=True, enforce_eager=True).engine_args() == {
        "language_model_only": True, "enforce_eager": True}


def test_layer_ids_checked_per_model(configs: dict[str, Path]) -> None:
    bad = inspect_model(str(configs["deepseek_v3"]), layers=[0, 3])
    assert bad.capture == "unsupported"
    assert any("id 0" in r for r in bad.reasons)
    # The hf engine gives the embeddings of the same model.
    assert inspect_model(str(configs["deepseek_v3"]), engine="hf", layers=[0, 3]).capture == "hf"
    out_of_range = inspect_model(str(configs["llama"]), layers=[4])
    assert out_of_range.capture == "unsupported"


def test_unknown_architecture_never_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["NoSuchModelForCausalLM"], "model_type": "no_such_model",
        "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100,
        "num_attention_heads": 1,
    }))
    report = inspect_model(str(tmp_path))
    assert report.capture == "unsupported"
    assert report.reasons


def test_weights_fit_with_known_gpu_memory(configs: dict[str, Path]) -> None:
    path = str(configs["deepseek_v3"])
    unknown = inspect_model(path)
    assert unknown.weights_fit is None and unknown.weight_bytes
    assert any("unknown" in r for r in unknown.reasons)
    weight = unknown.weight_bytes
    assert inspect_model(path, gpu_memory_bytes=weight * 10).weights_fit is True
    assert inspect_model(path, gpu_memory_bytes=weight // 2).weights_fit is False
    # Tensor parallelism splits the weights.
    assert inspect_model(path, gpu_memory_bytes=int(weight * 0.6),
                         tensor_parallel_size=2).weights_fit is True


def test_param_estimate_matches_real_weights(tiny_llama: Path) -> None:
    from safetensors import safe_open

    real = 0
    with safe_open(str(tiny_llama / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            real += f.get_slice(name).get_shape()[0] * max(
                1, *(f.get_slice(name).get_shape()[1:] or [1]))
    estimate = read_model_info(str(tiny_llama)).estimate_num_params()
    assert estimate is not None
    assert abs(estimate - real) / real < 0.02


def test_stored_bytes_per_weight_follow_the_quantization(tmp_path: Path,
                                                         tiny_llama: Path) -> None:
    """bf16 by default; `bits` (GPTQ/AWQ), fp8, and compressed-tensors' config groups
    (Kimi-K2.5 ships int4 experts that way): what the weights take on the GPUs."""
    cases = [
        (None, 2.0),
        ({"quant_method": "gptq", "bits": 4}, 0.5),
        ({"quant_method": "fp8", "fmt": "e4m3"}, 1.0),
        ({"quant_method": "compressed-tensors", "config_groups": {
            "group_0": {"weights": {"num_bits": 4, "type": "int"}, "targets": ["Linear"]}},
          "ignore": ["lm_head"]}, 0.5),
    ]
    for quant, expected in cases:
        folder = tmp_path / str(expected) / (quant or {}).get("quant_method", "none")
        folder.mkdir(parents=True)
        config = json.loads((tiny_llama / "config.json").read_text())
        if quant is not None:
            config["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(config))
        assert read_model_info(str(folder)).weight_bytes_per_param() == expected, quant


def test_dataset_tokens_and_output_bytes(configs: dict[str, Path],
                                         chat_dataset: ChatDataset) -> None:
    report = inspect_model(str(configs["llama"]), dataset=str(chat_dataset.path),
                           max_seq_len=256)
    # Estimated as a submit does, from sample rows (a child process bounded in time).
    assert report.dataset_rows == chat_dataset.num_rows
    assert report.dataset_sampled and report.dataset_sampled <= 256
    assert report.dataset_tokens and report.dataset_tokens > report.dataset_rows
    assert report.output_bytes == {k: v * report.dataset_tokens
                                   for k, v in report.bytes_per_token.items()}


def test_environment_report_in_plain_words() -> None:
    checks = environment_report()
    names = {c.name for c in checks}
    assert "torch" in names and "transformers" in names
    assert all(c.message for c in checks)


# ------------------------------------------------------------------- job refusals


class ExplodingPool:
    """An engine pool that fails the test if anything asks it for an engine."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"an engine was asked for ({name}) on a refused job")


def _spec(model: Path, dataset: ChatDataset, out: Path, **fields: Any) -> JobSpec:
    return JobSpec(model=str(model), dataset=str(dataset.path), output=str(out),
                   **{"max_seq_len": 256, **fields})


def _unknown_architecture(source: Path, dest: Path) -> Path:
    """A copy of a config folder naming an architecture vLLM does not have."""
    import shutil

    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _run_refused(spec: JobSpec) -> str:
    from hsx_service.runner import run_job

    with pytest.raises(JobRefused) as err:
        run_job(spec, pool=ExplodingPool())  # type: ignore[arg-type]
    return str(err.value)


def test_refused_max_seq_len_beyond_the_models_positions(
        configs: dict[str, Path], chat_dataset: ChatDataset, tmp_path: Path) -> None:
    """vLLM's capture runs a prompt with 2 positions after it: a max_seq_len that leaves
    no room in the model's positions is refused before any engine starts (the engine's
    own start failed with vLLM's max_model_len error)."""
    message = _run_refused(_spec(configs["llama"], chat_dataset, tmp_path / "o",
                                 max_seq_len=2048))
    assert "max_seq_len" in message and "2048 positions" in message and "2046" in message
    from hsx.modelinfo import read_model_info
    from hsx_service.prepare import check_engine_args

    check_engine_args(_spec(configs["llama"], chat_dataset, tmp_path / "o2", max_seq_len=2046),
                      read_model_info(str(configs["llama"])))  # 2046 fits


def test_an_unset_max_seq_len_fits_the_models_positions(
        configs: dict[str, Path], chat_dataset: ChatDataset, tmp_path: Path) -> None:
    """The default (4,096) on a model of 2,048 positions becomes 2,046 where the job
    enters; once fitted it stays, and a max_seq_len the user set is left to be refused."""
    from hsx.spec import JobSpec
    from hsx_service.engine_config import fit_to_model

    unset = JobSpec(model=str(configs["llama"]), dataset=str(chat_dataset.path),
                    output=str(tmp_path / "o"))
    assert unset.max_seq_len == 4096
    fitted = fit_to_model(unset)
    assert fitted.max_seq_len == 2046 and fit_to_model(fitted) == fitted
    set_by_user = unset.model_copy(update={"max_seq_len": 4096})
    assert fit_to_model(set_by_user).max_seq_len == 4096
    assert fit_to_model(unset.model_copy(update={"engine": "hf"})).max_seq_len == 4096


def test_a_dataset_of_bad_rows_fails_naming_the_commonest_reasons(
        configs: dict[str, Path], tmp_path: Path) -> None:
    """A job whose every row is bad captures nothing: it fails before any engine starts,
    with the commonest reasons and their counts, and so does its rerun (no manifest was
    published that would make it look complete); the errors table keeps each row."""
    from hsx.output import Output

    rows = ([{"messages": [{"role": "user", "content": "hi"}]}] * 5
            + [{"messages": [{"role": "user", "content": 7}, {"role": "assistant",
                                                              "content": "x"}]}] * 3
            + [{"input_ids": [1, 10**9]}, {"input_ids": [1, 2 * 10**9]}, {"other": 1}])
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = JobSpec(model=str(configs["llama"]), dataset=str(data),
                   output=str(tmp_path / "o"), max_seq_len=256)
    for _ in range(2):
        message = _run_refused(spec)
        assert message.startswith("dataset: none of its 11 rows can be used"), message
        assert ("5 rows: the conversation has no assistant message" in message
                and "3 rows: message 0 content is neither text" in message
                and "2 rows: input_ids has token id 1000000000" in message
                and "1 row for other reasons" in message), message
        assert Output(str(tmp_path / "o")).read_manifest() is None
    assert Output(str(tmp_path / "o")).ingest_errors().num_rows == 11
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    message = _run_refused(spec.model_copy(update={"dataset": str(empty),
                                                   "output": str(tmp_path / "e")}))
    assert message == "dataset: it has no rows, so there is nothing to capture"


def test_refused_bad_layer_id_for_model(configs: dict[str, Path], chat_dataset: ChatDataset,
                                        tmp_path: Path) -> None:
    message = _run_refused(_spec(configs["deepseek_v3"], chat_dataset, tmp_path / "o",
                                 layers=[0, 2]))
    assert "id 0" in message and "1..3" in message
    # The same ids are fine for the hf engine (only the check is run here).
    preflight(_spec(configs["deepseek_v3"], chat_dataset, tmp_path / "o2", layers=[0, 2],
                    engine="hf"))


def test_refused_uncapturable_model_with_engine_forced(
    configs: dict[str, Path], chat_dataset: ChatDataset, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unknown = _unknown_architecture(configs["llama"], tmp_path / "unknown")
    message = _run_refused(_spec(unknown, chat_dataset, tmp_path / "g"))
    assert "engine vllm" in message and "NoSuchModelForCausalLM" in message
    with monkeypatch.context() as patch:  # a machine with neither numba nor torchvision
        patch.setattr(image_processors, "_importable", lambda name: name != "numba")
        patch.setattr(missing_torchvision, "torchvision_missing", lambda: True)
        # A folder of its own: the job preflight caches answers per model folder.
        kimi = _copy_config(configs["kimi_k25"], tmp_path / "kimi")
        message = _run_refused(_spec(kimi, chat_dataset, tmp_path / "k"))
        assert "Kimi_K25ImageProcessor" in message and "torchvision" in message
    message = _run_refused(_spec(configs["llava"], chat_dataset, tmp_path / "l", engine="hf"))
    assert "engine hf" in message and "causal-LM" in message


def test_submit_refuses_an_output_estimated_over_quota(
    configs: dict[str, Path], chat_dataset: ChatDataset, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hsx.ingest import count_rows, estimate_tokens, ingest
    from hsx_service.prepare import check_estimated_output

    spec = _spec(configs["llama"], chat_dataset, tmp_path / "e")
    assert count_rows(chat_dataset.path) == chat_dataset.num_rows
    tokens, rows, sampled, _ = estimate_tokens(chat_dataset.path, str(configs["llama"]),
                                               256, sample_rows=64)
    exact = ingest(chat_dataset.path, str(configs["llama"]), 256, tmp_path / "exact")
    assert rows == chat_dataset.num_rows and sampled == 64
    assert 0.5 * exact.num_tokens < tokens < 2 * exact.num_tokens
    monkeypatch.setenv("HSX_QUOTA_BYTES", "100000")
    with pytest.raises(JobRefused) as refused:
        check_estimated_output(spec, *preflight(spec))
    # A dataset of fewer rows than the sample is estimated from all of them.
    assert f"estimated from {rows} of its {rows} rows" in str(refused.value)
    assert "quota" in str(refused.value)
    # Under the margin x the quota the estimate lets it through: the plan decides.
    monkeypatch.setenv("HSX_QUOTA_BYTES", str(int(exact.num_tokens * 2 * 4 * 256 * 0.9)))
    check_estimated_output(spec, *preflight(spec))
    # An online job stores no shard: no estimate of shards refuses it (found on an
    # H200, where an 8B online job was refused for the 32 GiB its shards would take).
    monkeypatch.setenv("HSX_QUOTA_BYTES", "100000")
    online = spec.model_copy(update={"train": TrainSpec(online=True)})
    check_estimated_output(online, *preflight(online))


def test_the_estimate_samples_the_whole_dataset_not_its_head(
    configs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dataset sorted by length (short chats first) is estimated from rows spread
    over it: its first rows alone would say a tenth of its size."""
    from hsx.ingest import estimate_tokens, ingest, sources

    path = tmp_path / "sorted.jsonl"
    with path.open("w") as f:
        for i in range(2000):
            words = " ".join(["hello"] * (1 + i // 20))
            f.write(json.dumps({"messages": [{"role": "user", "content": words},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
    monkeypatch.setattr(sources, "SLICE_BYTES", 16384)  # its slices: ~50 of them
    tokens, rows, sampled, spread = estimate_tokens(path, str(configs["llama"]), 1024)
    exact = ingest(path, str(configs["llama"]), 1024, tmp_path / "exact").num_tokens
    assert rows == 2000 and 200 < sampled <= 256 and spread  # (a short last slice: fewer)
    assert 0.8 * exact < tokens < 1.25 * exact, (tokens, exact)
    monkeypatch.setattr(sources, "SLICE_BYTES", 1 << 30)  # one slice: its first rows
    head, _, _, spread = estimate_tokens(path, str(configs["llama"]), 1024)
    assert not spread
    assert head < 0.3 * exact, (head, exact)


def test_a_plan_that_outgrows_the_room_stops_its_ingestion(
    configs: dict[str, Path], chat_dataset: ChatDataset, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the estimate lets through (under ESTIMATE_MARGIN x the room) is refused while
    it is tokenized, as soon as its plan needs more than the room, not after its last
    row: the engines of a streamed job stop before they fill the disk."""
    from hsx.ingest import ingest, pipeline
    from hsx_service.prepare import ESTIMATE_MARGIN

    spec = _spec(configs["llama"], chat_dataset, tmp_path / "g", unit_tokens=1024)
    info, layers, _ = preflight(spec)
    exact = ingest(chat_dataset.path, str(configs["llama"]), 256, tmp_path / "exact")
    need = exact.num_tokens * info.bytes_per_token(len(layers))[spec.storage_dtype]
    quota = int(need / 1.15)
    assert need < ESTIMATE_MARGIN * quota
    monkeypatch.setenv("HSX_QUOTA_BYTES", str(quota))
    monkeypatch.setattr(pipeline, "ROWS_PER_PART", 16)
    job = prepare(spec)  # the estimate passes it: its ingestion runs
    assert job.ingestion is not None
    job.ingestion.join()
    refused = job.ingestion.error
    assert isinstance(refused, JobRefused), refused
    message = str(refused)
    assert "for the first" in message and "the quota" in message, message
    rows = int(message.split("for the first ")[1].split()[0].replace(",", ""))
    assert 0 < rows < chat_dataset.num_rows, message
    assert job.output.read_manifest() is None  # never ingested whole
    # With room for all of it, the same job is planned whole.
    monkeypatch.setenv("HSX_QUOTA_BYTES", str(need + 1))
    whole = prepare(_spec(configs["llama"], chat_dataset, tmp_path / "h", unit_tokens=1024),
                    stream=False)
    assert sum(u.tokens for u in whole.pending) == exact.num_tokens


def test_refused_engine_args_vllm_lacks_or_hsx_sets(configs: dict[str, Path],
                                                    chat_dataset: ChatDataset,
                                                    tmp_path: Path) -> None:
    message = _run_refused(_spec(configs["llama"], chat_dataset, tmp_path / "o",
                                 vllm={"load_formt": "dummy"}))
    assert "`load_formt` is not an engine argument" in message
    assert "did you mean `load_format`" in message
    message = _run_refused(_spec(configs["llama"], chat_dataset, tmp_path / "o",
                                 vllm={"speculative_config": {}}))
    assert "`speculative_config` is set by capture" in message
    message = _run_refused(_spec(configs["llama"], chat_dataset, tmp_path / "o", engine="hf",
                                 vllm={"load_format": "dummy"}))
    assert "engine is hf" in message
    # Arguments the installed vLLM takes pass the preflight.
    preflight(_spec(configs["llama"], chat_dataset, tmp_path / "o",
                    vllm={"load_format": "dummy", "max_num_seqs": 8}))


def test_refused_eager_mla_on_the_cpu_build(configs: dict[str, Path], chat_dataset: ChatDataset,
                                            tmp_path: Path) -> None:
    from hsx_workers.engines.vllm.compat import cpu_build

    spec = _spec(configs["deepseek_v3"], chat_dataset, tmp_path / "o", layers=[1, 2, 3],
                 vllm={"enforce_eager": True})
    if cpu_build():
        assert "multi-head latent attention" in _run_refused(spec)
    # Compiled (the default) is right on CPU; dense models are fine in eager mode.
    preflight(_spec(configs["deepseek_v3"], chat_dataset, tmp_path / "o", layers=[1, 2, 3]))
    preflight(_spec(configs["llama"], chat_dataset, tmp_path / "o",
                    vllm={"enforce_eager": True}))


def test_refused_gated_delta_net_outside_bf16_on_the_cpu_build(
        configs: dict[str, Path], chat_dataset: ChatDataset, tmp_path: Path) -> None:
    """vLLM's CPU kernel for gated delta-net layers takes bf16 only and fails at the first
    forward otherwise (after the engine started): such a job is refused before."""
    from hsx_workers.engines.vllm.compat import cpu_build

    assert read_model_info(str(configs["qwen3_next"])).uses_linear_attention
    assert not read_model_info(str(configs["qwen3_moe"])).uses_linear_attention
    spec = _spec(configs["qwen3_next"], chat_dataset, tmp_path / "o", vllm={"dtype": "float32"})
    if cpu_build():
        message = _run_refused(spec)
        assert message.startswith("vllm.dtype:") and "bfloat16 only" in message, message
        assert "would compute in float32" in message, message
    # bf16 (the tiny model's own dtype) passes; other models compute in float32 freely.
    preflight(_spec(configs["qwen3_next"], chat_dataset, tmp_path / "o",
                    vllm={"dtype": "bfloat16"}))
    preflight(_spec(configs["qwen3_moe"], chat_dataset, tmp_path / "o",
                    vllm={"dtype": "float32"}))


def test_supported_vllm_range() -> None:
    from hsx_workers.engines.vllm.compat import version_problem, vllm_version

    assert version_problem() is None, f"the installed vLLM {vllm_version()} is supported"
    assert version_problem("0.25.1") is None
    assert version_problem("0.32.0+cpu") is None
    assert "outside the range" in str(version_problem("0.24.0"))
    assert "outside the range" in str(version_problem("0.33.0"))
    assert version_problem("") is not None


def test_refused_output_over_quota(configs: dict[str, Path], chat_dataset: ChatDataset,
                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_QUOTA_BYTES", "1000000")
    message = _run_refused(_spec(configs["llama"], chat_dataset, tmp_path / "q"))
    assert "quota" in message and "MiB" in message
    monkeypatch.setenv("HSX_QUOTA_BYTES", str(10**12))
    job = prepare(_spec(configs["llama"], chat_dataset, tmp_path / "q"), stream=False)
    assert job.pending


# ------------------------------------------------------------------- CLI and REST


def test_cli_inspect_model_json_and_exit_codes(configs: dict[str, Path],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from hsx.cli import main

    code = main(["inspect-model", str(configs["kimi_k25"]), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == (0 if KIMI_CAPTURE == "extract_hidden_states" else 2)
    assert data["architecture"] == "KimiK25ForConditionalGeneration"
    assert data["capture"] == KIMI_CAPTURE
    assert main(["inspect-model", str(configs["deepseek_v3"]), "--tp", "2",
                 "--gpu-memory-gib", "0.001"]) == 0
    text = capsys.readouterr().out
    assert "do NOT fit" in text and "valid ids      1..3" in text
    assert main(["inspect-model", str(configs["gemma2"]), "--engine", "vllm"]) == 0
    assert "hooks" in capsys.readouterr().out


def test_cli_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    from hsx.cli import main

    code = main(["doctor", "--json"])
    checks = json.loads(capsys.readouterr().out)
    assert code == (0 if all(c["ok"] for c in checks) else 1)
    assert any(c["name"] == "torch" for c in checks)


def test_rest_inspect(configs: dict[str, Path], tmp_path: Path) -> None:

    from hsx_service.config import Settings
    from hsx_service.main import create_app
    from hsx_service.routes import models

    from .test_api import FakeScheduler, local_client

    app = create_app(Settings(), FakeScheduler())
    if not any(getattr(r, "path", "") == "/v1/models/inspect" for r in app.routes):
        app.include_router(models.router)
    with local_client(app) as client:
        ok = client.post("/v1/models/inspect", json={"model": str(configs["kimi_k25"])})
        assert ok.status_code == 200, ok.text
        assert ok.json()["language_model_architecture"] == "DeepseekV3ForCausalLM"
        if KIMI_CAPTURE == "extract_hidden_states":  # the JSON's shape, as before it was typed
            assert ok.json()["engine_options"] == {"language_model_only": True}
        missing = client.post("/v1/models/inspect", json={"model": str(tmp_path / "nope")})
        assert missing.status_code == 422 and "does not exist" in missing.text
        typo = client.post("/v1/models/inspect", json={"model": "x", "engin": "hf"})
        assert typo.status_code == 422
    restricted = create_app(Settings(allowed_roots=[tmp_path]), FakeScheduler())
    restricted.include_router(models.router)
    with local_client(restricted) as client:
        outside = client.post("/v1/models/inspect", json={"model": str(configs["llama"])})
        assert outside.status_code == 422 and "allowed roots" in outside.text


def test_ingest_workers_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from hsx_service.errors import JobRefused
    from hsx_service.prepare import INGEST_WORKERS_ENV, ingest_workers

    monkeypatch.delenv(INGEST_WORKERS_ENV, raising=False)
    assert ingest_workers() is None  # Ingestion decides: Ray tasks where Ray is connected
    monkeypatch.setenv(INGEST_WORKERS_ENV, "3")
    assert ingest_workers() == 3
    monkeypatch.setenv(INGEST_WORKERS_ENV, "0")
    assert ingest_workers() == (os.cpu_count() or 1)
    for bad in ("many", "-2"):
        monkeypatch.setenv(INGEST_WORKERS_ENV, bad)
        with pytest.raises(JobRefused, match=INGEST_WORKERS_ENV):
            ingest_workers()


def test_without_ray_connected_ingestion_takes_the_local_path() -> None:
    """No Ray tasks (and no import of Ray) where this process has not connected Ray:
    `hsx extract`'s ingestion, which starts before its engines connect it.
    tests/integration/test_ingest_ray.py runs them."""
    # A fresh interpreter: an earlier test of this process may have connected Ray.
    code = textwrap.dedent("""
        import sys
        from hsx.spec import DatasetSpec
        from hsx_service.ingest_tasks import tokenizing_tasks

        for path in ("/data/chats.jsonl", "s3://bucket/chats"):
            for workers in (None, 1, 4):
                assert tokenizing_tasks(DatasetSpec(path=path), workers) is None, (path, workers)
        assert "ray" not in sys.modules
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
