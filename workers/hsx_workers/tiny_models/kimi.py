"""Kimi-K2.5 at a tiny shape: its config around a DeepSeek-V3 text model, its media
tokens and image processor config, and its checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx_workers.tiny_models.configs import TinyShape, deepseek_v3_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# Kimi-K2.5's media tokens, as its tokenizer names them. vLLM's Kimi processor looks
# `<|media_pad|>` up by name at engine start (its image placeholder is
# "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"); the tiny tokenizer
# gives them the last ids of the vocabulary, in this order.
KIMI_MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
# An image part as Kimi-K2.5's chat template (and vLLM's processor) writes it; vLLM
# expands `<|media_pad|>` into the image's vision tokens.
KIMI_IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"

# Kimi-K2.5's preprocessor_config.json (its `media_proc_cfg` values), with the tiny vision
# tower's patch and merge sizes. vLLM builds an image processor from it when the engine
# starts, even for the text path: `KimiK25FusedVisionProcessor` (numpy + numba) where
# numba imports, else the torchvision one transformers has.
KIMI_MEDIA_PROC_CFG: dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "temporal_merge_kernel_size": 4,
    "in_patch_limit": 16384,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "timestamp_mode": "hh:mm:ss.fff",
    "config_type": "media_proc_cfg",
}


def _kimi_media_token_id(vocab_size: int, token: str) -> int:
    return vocab_size - len(KIMI_MEDIA_TOKENS) + KIMI_MEDIA_TOKENS.index(token)


def kimi_k25_config(shape: TinyShape) -> PretrainedConfig:
    """Kimi-K2.5's shape: KimiK25ForConditionalGeneration around a DeepSeek-V3 text model.

    The architecture is vLLM's class name (transformers' `Kimi_K25ForConditionalGeneration`
    would make vLLM pick its Transformers backend). vLLM 0.32 reads transformers'
    `Kimi_K25Config` (`image_token_id`), vLLM 0.25.1 its own (`media_placeholder_token_id`):
    both name `<|media_pad|>`. The one-block vision tower takes Kimi's patch and merge
    sizes (KIMI_MEDIA_PROC_CFG).
    """
    from transformers import Kimi_K25Config

    text = deepseek_v3_config(shape).to_dict()
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    media_pad = _kimi_media_token_id(shape.vocab_size, "<|media_pad|>")
    config = Kimi_K25Config(
        text_config=text,
        vision_config={"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
                       "num_attention_heads": 1,
                       "patch_size": KIMI_MEDIA_PROC_CFG["patch_size"],
                       "merge_kernel_size": [KIMI_MEDIA_PROC_CFG["merge_kernel_size"]] * 2},
        projection_hidden_size=64,
        image_token_id=media_pad,
        vision_start_token_id=_kimi_media_token_id(shape.vocab_size, "<|media_begin|>"),
        vision_end_token_id=_kimi_media_token_id(shape.vocab_size, "<|media_end|>"),
        tie_word_embeddings=False,
    )
    config.media_placeholder_token_id = media_pad
    config.architectures = ["KimiK25ForConditionalGeneration"]
    return config


def write_kimi_k25_processor(out: Path) -> None:
    (out / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": KIMI_MEDIA_PROC_CFG}, indent=2) + "\n")


# Vision weights that transformers 5 saves under names vLLM's Kimi-K2.5 class lacks, and
# the names vLLM's modules have (the real checkpoint's). vLLM skips weights under its
# text path's missing towers by their first name component, so every vision weight must
# start with one of KIMI_TOWERS.
KIMI_VISION_RENAMES = {"vision_tower.encoder.patch_embed.": "vision_tower.patch_embed.",
                       "model.vision_tower.": "vision_tower.",
                       "model.mm_projector.": "mm_projector."}
KIMI_TOWERS = ("vision_tower.", "mm_projector.")


def _kimi_vision_name(name: str) -> str:
    for old, new in KIMI_VISION_RENAMES.items():
        if name.startswith(old):
            name = new + name[len(old):]
    if not name.startswith(KIMI_TOWERS):
        raise RuntimeError(f"transformers saved a Kimi-K2.5 weight as {name!r}, outside the "
                           f"text model and {KIMI_TOWERS}: vLLM's loader would refuse it")
    return name


def save_kimi_k25(model: Any, out: Path) -> None:
    """Kimi-K2.5's checkpoint layout, which vLLM's loader and transformers' both read.

    transformers 5 saves its Kimi-K2.5 class by reversing its load-time renames, and for
    the text model the reversal goes wrong (renames meant for the vision tower hit it:
    `layers` become `blocks`, `self_attn.q_proj` becomes `self_wqkv`). So the text model's
    weights are written as transformers' DeepSeek-V3 class saves them (the layout vLLM's
    DeepseekV2 loader reads, experts one by one) under the checkpoint's `language_model.`
    prefix, which transformers maps back when it loads the wrapper. The vision tower and
    projector keep transformers' names but two (KIMI_VISION_RENAMES), which get the names
    of vLLM's modules; transformers finds those too. vLLM skips the vision weights on the
    text path (language_model_only). Nothing lands in `out` until the weights are complete.
    """
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    architectures = list(model.config.architectures)  # save_pretrained overwrites them
    with tempfile.TemporaryDirectory(prefix="hsx-kimi-") as tmp:
        whole, text_dir = Path(tmp) / "whole", Path(tmp) / "text"
        model.save_pretrained(str(whole), safe_serialization=True)
        with torch.device("meta"):
            text = DeepseekV3ForCausalLM._from_config(model.config.text_config,
                                                      dtype=model.dtype)
        text.model.load_state_dict(model.model.language_model.state_dict(), assign=True)
        text.lm_head.load_state_dict(model.lm_head.state_dict(), assign=True)
        text.save_pretrained(str(text_dir), safe_serialization=True)
        for folder in (whole, text_dir):
            if not (folder / "model.safetensors").is_file():
                raise RuntimeError(f"expected one model.safetensors in {folder}: a tiny "
                                   "model is written as a single file")
        weights = {_kimi_vision_name(name): tensor
                   for name, tensor in load_file(whole / "model.safetensors").items()
                   if not name.startswith("language_model.")}
        weights.update({f"language_model.{name}": tensor
                        for name, tensor in load_file(text_dir / "model.safetensors").items()})
        save_file(weights, str(whole / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((whole / "config.json").read_text())
        config["architectures"] = architectures
        (whole / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for item in whole.iterdir():
            item.replace(out / item.name)
