"""The vLLM class that serves an architecture (vLLM's own model registry resolves it,
without its full ModelConfig), and whether it has EAGLE-3 aux outputs."""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import Any

from hsx_workers.engines.vllm import missing_torchvision


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
        with missing_torchvision.torchvision_stub():
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
    if not missing_torchvision.torchvision_missing():
        return False
    return _import_model_module(architecture)[1]


def resolve(architectures: list[str], hf_config: Any) -> _Resolved:
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


def supports_eagle3(cls: type) -> bool:
    """vLLM's own helper (an isinstance check on the class object), else the class flag."""
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3

        return bool(supports_eagle3(cls))
    except Exception:  # an older vLLM without the helper: the flag says the same
        return bool(getattr(cls, "supports_eagle3", False))


def _vllm_version() -> str:
    from hsx_workers.engines.vllm.compat import vllm_version

    return vllm_version() or "(not installed)"


# vLLM classes that take images under a modality of their own. Kimi-K2.5's processor
# takes images and video chunks as one modality, `vision_chunk` (its only one: an image
# is a `{"type": "image", "image", "uuid"}` item there); it refuses an `image` item ("At
# most 0 image(s) may be provided in one prompt"), as vLLM 0.25.1 to 0.32 do.
VISION_CHUNK_CLASSES = frozenset({"KimiK25ForConditionalGeneration"})


def image_modality(architecture: str) -> str:
    """The modality under which vLLM's class for `architecture` takes an image: `image`,
    or `vision_chunk` (VISION_CHUNK_CLASSES)."""
    return "vision_chunk" if architecture in VISION_CHUNK_CLASSES else "image"


def image_items(modality: str, images: list[Any]) -> dict[str, list[Any]]:
    """vLLM's `multi_modal_data` of decoded images under `modality` (image_modality)."""
    if modality == "vision_chunk":
        return {"vision_chunk": [{"type": "image", "image": image, "uuid": None}
                                 for image in images]}
    return {"image": list(images)}


def image_limits(architecture: str, count: int, side: int | None = None) -> dict[str, Any]:
    """vLLM's `limit_mm_per_prompt` for prompts of at most `count` images and no video:
    profiled at `side` x `side` pixels where the modality takes a size (`image`; vLLM's
    Kimi-K2.5 profiles its `vision_chunk` at its own largest size)."""
    if image_modality(architecture) == "vision_chunk":
        return {"vision_chunk": count}
    if side is None:
        return {"image": count, "video": 0}
    return {"image": {"count": count, "width": side, "height": side}, "video": 0}
