"""A job's images before any engine starts (a job with `images:`): the checks that
refuse it (`check_images`, called by prepare.preflight) and what its ingestion needs to
read them (`image_settings`). docs/MODELS.md, "Vision-language targets"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.modelinfo import ModelInfo
from hsx.spec import JobSpec
from hsx_service.errors import JobRefused

if TYPE_CHECKING:
    from hsx.ingest.images import ImageSettings

IMAGE_SAMPLE_ROWS = 32  # rows an image job's estimate reads and processes the images of


def image_settings(spec: JobSpec, info: ModelInfo) -> ImageSettings | None:
    """What ingestion needs to take a job's images (None: it takes none)."""
    if spec.images is None:
        return None
    from hsx.ingest.images import ImagePolicy, ImageSettings

    if info.image_token_id is None:
        raise JobRefused(f"images: {spec.model} takes no images (its config has no vision "
                         "tower and image token)")
    return ImageSettings(ImagePolicy.of(spec.images, spec.dataset_spec.path),
                         spec.model,
                         info.image_token_id, spec.trust_remote_code)


def check_images(spec: JobSpec, info: ModelInfo) -> None:
    """A job that takes images: the model has a vision tower and an image token, its
    processor builds here and expands an image into vision tokens (as ingestion will),
    and the engine runs the tower on image prompts (vLLM's class is multimodal; the hf
    engine has an image-text-to-text class). JobRefused naming `images` otherwise."""
    if spec.images is None:
        return
    if info.image_token_id is None:
        raise JobRefused(f"images: {spec.model} takes no images (its config has no vision "
                         "tower and image token)")
    from hsx.ingest.images import check_processor

    try:
        check_processor(spec.model, info.image_token_id,
                        trust_remote_code=spec.trust_remote_code)
    except ValueError as err:
        raise JobRefused(f"images: {err}") from None
    try:
        from hsx_workers.preflight.vision import vision_problem
    except ImportError:  # the workers' package is not installed here
        return
    try:
        problem = vision_problem(info, spec.engine, spec.trust_remote_code)
    except ImportError:  # no vLLM here: the engine's start says what fails
        return
    if problem:
        raise JobRefused(f"images: engine {spec.engine} cannot run {spec.model}'s vision "
                         f"tower: {problem}")
