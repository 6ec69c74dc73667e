"""Whether an engine can run a wrapper's vision tower on image prompts (a job with
`images:`), known before any engine starts: vLLM's class takes multimodal inputs, or
transformers has an image-text-to-text class for the model. The processor that expands
the images is checked by hsx.ingest.images.check_processor, which ingestion uses."""

from __future__ import annotations

from hsx.modelinfo import ModelInfo


def vision_problem(info: ModelInfo, engine: str, trust_remote_code: bool = False
                   ) -> str | None:
    """Why `engine` cannot run the model's vision tower on image prompts, or None."""
    if engine == "hf":
        from transformers.models.auto import modeling_auto

        if info.model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return None
        if trust_remote_code and info.auto_map:
            return None  # its own code decides; the engine's start says what fails
        return (f"transformers has no image-text-to-text class for model_type "
                f"{info.model_type!r}")
    from hsx_workers.engines.vllm.classes import resolve
    from hsx_workers.preflight.model import _hf_config

    resolved = resolve([info.architecture], _hf_config(info, trust_remote_code))
    if resolved.cls is None:
        return resolved.problem or f"vLLM has no class for {info.architecture}"
    try:
        from vllm.model_executor.models.interfaces import supports_multimodal
    except ImportError:  # an older vLLM: the class flag says the same
        takes = bool(getattr(resolved.cls, "supports_multimodal", False))
    else:
        takes = bool(supports_multimodal(resolved.cls))
    if not takes:
        return f"vLLM's {resolved.name} takes no images (it is not a multimodal model class)"
    return None
