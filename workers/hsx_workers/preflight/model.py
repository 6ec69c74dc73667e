"""`inspect_model`: whether and how hsx can capture a model, from its config alone (see
the package docstring); `inspect_model_cached` for job submission."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.modelinfo import ModelConfigError, ModelInfo, read_model_info
from hsx.spec import DatasetSpec
from hsx_workers.engines.vllm import missing_torchvision
from hsx_workers.engines.vllm.classes import resolve, supports_eagle3
from hsx_workers.engines.vllm.settings import CaptureArgs
from hsx_workers.preflight.image_processors import wrapper_image_processor
from hsx_workers.preflight.report import Capture, EngineChoice, ModelReport, gib

logger = logging.getLogger(__name__)


def inspect_model(
    model: str,
    *,
    engine: EngineChoice = "auto",
    layers: list[int] | None = None,
    tensor_parallel_size: int = 1,
    dataset: str | DatasetSpec | None = None,
    tokenizer: str | None = None,
    max_seq_len: int = 4096,
    trust_remote_code: bool = False,
    gpu_memory_bytes: int | None = None,
) -> ModelReport:
    """Everything hsx can tell about capturing `model` without loading it.

    Raises ModelConfigError only when config.json cannot be read at all; every other
    problem becomes `capture="unsupported"` with its reasons.
    """
    info = read_model_info(model)
    reasons: list[str] = []
    remote_needed = info.auto_map and not _safe(lambda: _transformers_knows(info), False)
    if remote_needed:
        reasons.append("The config points at the model's own code (auto_map) that this "
                       "transformers does not have built in: set trust_remote_code.")
    lm_arch = _safe(lambda: _text_architecture(info), None) if info.wrapper else None
    view = _vllm_view(info, lm_arch, trust_remote_code, reasons)
    capture, options = _capture_path(model, info, engine, view, lm_arch, trust_remote_code,
                                     reasons)

    layer_engine = "hf" if capture == "hf" else "vllm"
    if info.min_layer_id(layer_engine) > 0:
        reasons.append(f"Layer id 0 (the embeddings) is not available: vLLM's "
                       f"{info.text_model_type} model fails on it; valid ids are "
                       f"1..{info.num_layers}.")
    chosen = layers if layers is not None else info.default_layers(layer_engine)
    if layers is not None:
        try:
            info.check_layers(layers, layer_engine)
        except ModelConfigError as err:
            reasons.append(str(err))
            capture = "unsupported"

    report = ModelReport(
        vllm_available=not (view.problem or "").startswith("vLLM cannot be imported"),
        model=model,
        architecture=info.architecture,
        wrapper=info.wrapper,
        language_model_architecture=lm_arch,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        supports_eagle3=view.eagle3,
        capture=capture,
        default_layers=info.default_layers(layer_engine),
        valid_layers=info.valid_layers(layer_engine),
        bytes_per_token=info.bytes_per_token(len(chosen)),
        reasons=reasons,
        trust_remote_code_needed=bool(remote_needed),
        vllm_class=view.vllm_class,
        language_model_class=view.lm_class,
        engine_options=options,
        tensor_parallel_size=tensor_parallel_size,
    )
    _fit(report, info, gpu_memory_bytes)
    if dataset is not None:
        _dataset_size(report, dataset, tokenizer or model, max_seq_len, trust_remote_code)
    return report


@dataclass
class _VllmView:
    """What vLLM here makes of a model: the class that serves it (and the inner language
    model's, for a wrapper), whether it has EAGLE-3 aux outputs, or why there is none."""

    vllm_class: str | None = None
    lm_class: str | None = None
    eagle3: bool = False
    problem: str | None = None


def _vllm_view(info: ModelInfo, lm_arch: str | None, trust_remote_code: bool,
               reasons: list[str]) -> _VllmView:
    """The vLLM classes of the model (and of a wrapper's language model); what is worth
    saying about them goes into `reasons`."""
    view = _VllmView()
    try:
        hf_config = _hf_config(info, trust_remote_code)
    except Exception as err:
        # Judge from the raw config's `architectures`: vLLM's registry needs no more.
        hf_config = _safe(lambda: _plain_config(info), None)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if hf_config is None:
            view.problem = f"transformers cannot read the config: {type(err).__name__}: {first}"
        else:
            reasons.append(f"transformers does not recognise this config ({first}); it is "
                           "judged from its architectures field.")
    if hf_config is not None:
        try:
            import vllm  # noqa: F401 - only to know it is there
        except Exception as err:
            view.problem = f"vLLM cannot be imported here: {type(err).__name__}: {err}"
    if view.problem is not None or hf_config is None:
        return view
    archs = list(getattr(hf_config, "architectures", None) or [info.architecture])
    top = resolve(archs, hf_config)
    if top.cls is not None:
        view.vllm_class = f"{top.cls.__module__}.{top.cls.__qualname__}"
        view.eagle3 = supports_eagle3(top.cls)
    else:
        view.problem = top.problem
    if top.stubbed:
        reasons.append(f"torchvision is not installed (or broken) here: vLLM's module for "
                       f"{top.name} was imported with torchvision stubbed, which serves "
                       "its text path only; images need a torchvision that matches torch.")
    elif info.wrapper and top.cls is not None and missing_torchvision.torchvision_missing():
        reasons.append(f"torchvision is not installed here; vLLM's module for {top.name} "
                       "imports without it.")
    if info.wrapper and lm_arch:
        text_cfg = getattr(hf_config, "text_config", None) or hf_config
        inner = resolve([lm_arch], text_cfg)
        if inner.cls is not None:
            view.lm_class = f"{inner.cls.__module__}.{inner.cls.__qualname__}"
            inner_eagle3 = supports_eagle3(inner.cls)
            if top.cls is None:
                reasons.append(
                    f"Its language model {lm_arch} "
                    + ("has" if inner_eagle3 else "does not have")
                    + " EAGLE-3 aux outputs in vLLM; the wrapper is what vLLM runs, so "
                    "the wrapper must import for capture through vLLM."
                )
    return view


def _capture_path(model: str, info: ModelInfo, engine: EngineChoice, view: _VllmView,
                  lm_arch: str | None, trust_remote_code: bool, reasons: list[str]
                  ) -> tuple[Capture, CaptureArgs]:
    """The capture path for the asked engine, and the vLLM settings it needs; why, in
    `reasons`."""
    capture: Capture
    options = CaptureArgs()
    hf_ok, hf_why = _safe(lambda: _hf_can_capture(info, trust_remote_code),
                          (False, "transformers cannot be imported here"))
    if info.wrapper:
        reasons.append(
            f"{info.architecture} is a multimodal wrapper around "
            f"{lm_arch or 'a ' + str(info.text_model_type) + ' text model'}: layers and "
            "hidden size come from its text_config, and capture runs on the inner "
            "language model."
        )
    if engine == "hf":
        capture = "hf" if hf_ok else "unsupported"
        reasons.append(f"Engine hf was asked: {hf_why}.")
    elif view.vllm_class is not None and view.eagle3:
        capture = "extract_hidden_states"
        reasons.append(f"vLLM's {view.vllm_class.rsplit('.', 1)[-1]} has EAGLE-3 aux "
                       "outputs: vLLM's extract_hidden_states method captures the layers.")
        if info.wrapper:
            options = CaptureArgs(language_model_only=True)
            reasons.append("Only its text path is captured (vLLM's language_model_only), "
                           "unless a job takes images (`images:`; docs/MODELS.md).")
    elif view.vllm_class is not None:
        name = view.vllm_class.rsplit(".", 1)[-1]
        capture = "hooks"
        options = CaptureArgs(enforce_eager=True)
        reasons.append(f"vLLM's {name} lacks EAGLE-3 aux outputs (vLLM refuses "
                       "extract_hidden_states for it): forward hooks on its decoder layers "
                       "inside the vLLM worker capture them instead, in eager mode (under "
                       "torch.compile or CUDA graphs hooks see nothing), one prompt per "
                       "forward pass, so expect lower throughput than extract_hidden_states.")
    else:
        reasons.append(f"vLLM cannot capture it here: {view.problem}.")
        capture = "hf" if hf_ok and engine == "auto" else "unsupported"
        if capture == "hf":
            reasons.append(f"The hf engine is used instead: {hf_why}.")
        elif hf_ok:
            reasons.append("The hf engine could capture it: use engine: hf.")
        else:
            reasons.append(f"The hf engine cannot either: {hf_why}.")

    if capture in ("extract_hidden_states", "hooks") and info.wrapper:
        processor_problem, processor_note = wrapper_image_processor(model, info,
                                                                    trust_remote_code)
        if processor_note:
            reasons.append(processor_note)
        if processor_problem:
            capture = "unsupported"
            reasons.append(processor_problem)
    return capture, options


def _safe(fn: Any, default: Any) -> Any:
    """A fact that needs transformers; `default` where transformers is missing or broken."""
    try:
        return fn()
    except Exception:
        return default


# Text model types whose config does not name a causal LM that vLLM knows, mapped to
# the class vLLM's wrapper builds for them (read from the wrappers' sources).
_INNER_ARCH = {
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
}


def _hf_config(info: ModelInfo, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(info.path, trust_remote_code=trust_remote_code)


def _plain_config(info: ModelInfo) -> Any:
    from transformers import PretrainedConfig

    return PretrainedConfig(**info.config)


def _text_architecture(info: ModelInfo) -> str | None:
    """The inner text model's class name: named by text_config, else transformers' map."""
    if info.text_architecture:
        return info.text_architecture
    if not info.text_model_type:
        return None
    if info.text_model_type in _INNER_ARCH:
        return _INNER_ARCH[info.text_model_type]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(info.text_model_type)
    return str(name) if name else None


def _transformers_knows(info: ModelInfo) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return info.model_type in CONFIG_MAPPING_NAMES


def _hf_can_capture(info: ModelInfo, trust_remote_code: bool) -> tuple[bool, str]:
    """Whether the hf engine (AutoModelForCausalLM) can load this model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if info.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return True, f"transformers loads {info.model_type} as a causal LM"
    if info.auto_map and trust_remote_code:
        return True, "the model's own code (auto_map) is trusted"
    return False, (f"transformers has no causal-LM class for model_type {info.model_type!r}"
                   + (" (the model's own code needs trust_remote_code)" if info.auto_map else ""))


def _gpu_memory() -> int | None:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        return None
    return None


def _fit(report: ModelReport, info: ModelInfo, gpu_memory_bytes: int | None) -> None:
    params = info.estimate_num_params()
    report.num_params = params
    if params is None:
        report.reasons.append("The parameter count cannot be estimated from the config.")
        return
    report.weight_bytes = int(params * info.weight_bytes_per_param())
    memory = gpu_memory_bytes if gpu_memory_bytes is not None else _gpu_memory()
    report.gpu_memory_bytes = memory
    per_gpu = report.weight_bytes / report.tensor_parallel_size
    if memory is None:
        report.reasons.append(
            f"Weights take about {gib(report.weight_bytes)}; {gib(per_gpu)} per GPU at "
            f"tensor_parallel_size {report.tensor_parallel_size}. GPU memory is unknown "
            "here, so whether they fit is unknown."
        )
        return
    # vLLM needs room for activations and KV cache besides the weights.
    report.weights_fit = per_gpu <= 0.9 * memory
    verdict = "fit" if report.weights_fit else "do NOT fit"
    report.reasons.append(
        f"Weights take about {gib(report.weight_bytes)}: {gib(per_gpu)} per GPU at "
        f"tensor_parallel_size {report.tensor_parallel_size}, which {verdict} in "
        f"{gib(memory)} of GPU memory (90% usable)."
    )


def _dataset_size(report: ModelReport, dataset: str | DatasetSpec, tokenizer: str,
                  max_seq_len: int, trust_remote_code: bool) -> None:
    """The dataset's tokens after ingestion (chat template, truncation), estimated from
    sample rows as a coordinator's submit estimates a job (hsx.ingest.bounded_estimate:
    a child process bounded in CPU time and memory, so neither a huge dataset nor a chat
    template that never ends holds this process), and the output they make."""
    from hsx.ingest import EstimateUnavailable, TemplateLimitError, bounded_estimate

    try:
        estimate = bounded_estimate(dataset, tokenizer, max_seq_len,
                                    trust_remote_code=trust_remote_code)
    except TemplateLimitError as err:
        report.reasons.append(f"The dataset cannot be ingested: {err}")
        return
    except EstimateUnavailable as err:
        report.reasons.append(f"The dataset's size could not be estimated: {err}")
        return
    report.dataset_tokens = round(estimate.tokens)
    report.dataset_rows = estimate.rows
    report.dataset_sampled = estimate.sampled
    report.output_bytes = {k: v * report.dataset_tokens for k, v in report.bytes_per_token.items()}


_CACHE: dict[tuple[Any, ...], ModelReport] = {}


def warm_imports() -> None:
    """Import vLLM, its model registry and interfaces, and transformers' auto classes:
    the modules `inspect_model` needs, which take seconds to import the first time."""
    for module in ("transformers.models.auto", "vllm", "vllm.model_executor.models.registry",
                   "vllm.model_executor.models.interfaces", "hsx.ingest"):
        try:
            importlib.import_module(module)
        except Exception as err:  # inspect_model reports it when a job needs it
            logger.debug("warming %s: %s", module, err)


def inspect_model_cached(model: str, engine: EngineChoice, layers: tuple[int, ...],
                         trust_remote_code: bool) -> ModelReport:
    """`inspect_model` for job preflight, cached per model config version.

    The coordinator preflights every submission; the answer only changes when the
    model's config.json does (its modification time is part of the key).
    """
    path = Path(read_model_info(model).path) / "config.json"
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = 0
    key = (model, engine, layers, trust_remote_code, stamp)
    if key not in _CACHE:
        _CACHE[key] = inspect_model(model, engine=engine, layers=list(layers),
                                    trust_remote_code=trust_remote_code)
    return _CACHE[key]
