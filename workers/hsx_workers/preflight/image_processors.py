"""Whether a multimodal wrapper's image processor lets vLLM start its engine: vLLM
builds it while it builds the model config, even for the text path."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from hsx.modelinfo import ModelInfo
from hsx_workers.engines.vllm import missing_torchvision


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


def _importable(package: str) -> bool:
    """Whether `package` can be found for import (vLLM's own test for optional packages)."""
    return importlib.util.find_spec(package) is not None


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


def wrapper_image_processor(model: str, info: ModelInfo, trust_remote_code: bool
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
    if entry is None or missing_torchvision.torchvision_missing():
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
    if not missing_torchvision.torchvision_missing():
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
