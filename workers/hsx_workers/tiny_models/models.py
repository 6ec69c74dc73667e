"""`make_tiny_model`: a random-weight (seeded) model of an architecture in `ARCHS`,
saved beside the tiny tokenizer as a hub checkpoint would be."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx_workers.tiny_models.configs import (
    TinyShape,
    deepseek_v3_config,
    gemma2_config,
    gemma3_config,
    gpt_oss_config,
    llama_config,
    llava_config,
    mistral_config,
    qwen2_5_vl_config,
    qwen3_config,
    qwen3_moe_config,
    qwen3_next_config,
)
from hsx_workers.tiny_models.kimi import (
    KIMI_IMAGE,
    KIMI_MEDIA_TOKENS,
    kimi_k25_config,
    save_kimi_k25,
    write_kimi_k25_processor,
)
from hsx_workers.tiny_models.tokenizer import (
    BOS_ID,
    EOT_ID,
    PAD_ID,
    build_tokenizer,
    save_tokenizer,
)
from hsx_workers.tiny_models.vision import (
    LLAVA_IMAGE_TOKEN,
    QWEN_VL_IMAGE,
    QWEN_VL_TOKENS,
    save_llava,
    vision_chat_template,
    write_llava_processor,
    write_qwen2_5_vl_processor,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


# One entry per architecture: arch name -> config builder. See ENVIRONMENT.md for what
# each needs to load in vLLM's CPU build.
ARCHS: dict[str, Callable[[TinyShape], PretrainedConfig]] = {
    "llama": llama_config,
    "qwen3": qwen3_config,
    "mistral": mistral_config,
    "deepseek_v3": deepseek_v3_config,
    "qwen3_moe": qwen3_moe_config,
    "gemma2": gemma2_config,
    "gemma3": gemma3_config,
    "gpt_oss": gpt_oss_config,
    "qwen3_next": qwen3_next_config,
    "llava": llava_config,
    "qwen2_5_vl": qwen2_5_vl_config,
    "kimi_k25": kimi_k25_config,
}

# transformers' auto class for the architectures that are not plain causal LMs.
_AUTO_CLASS = {"llava": "AutoModelForImageTextToText",
               "qwen2_5_vl": "AutoModelForImageTextToText",
               "kimi_k25": "AutoModelForImageTextToText"}

# What some architectures need beyond `save_pretrained`: special tokens of their own
# (last ids of the vocabulary), files written with or without weights, and their own
# way of saving weights.
_SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {"kimi_k25": KIMI_MEDIA_TOKENS,
                                                "llava": (LLAVA_IMAGE_TOKEN,),
                                                "qwen2_5_vl": QWEN_VL_TOKENS}
_EXTRA_FILES: dict[str, Callable[[Path], None]] = {"kimi_k25": write_kimi_k25_processor,
                                                   "llava": write_llava_processor,
                                                   "qwen2_5_vl": write_qwen2_5_vl_processor}
_SAVE: dict[str, Callable[[Any, Path], None]] = {"kimi_k25": save_kimi_k25,
                                                 "llava": save_llava}
# Models that take images render a chat's image parts as their placeholder.
_IMAGE_TOKEN = {"llava": LLAVA_IMAGE_TOKEN, "qwen2_5_vl": QWEN_VL_IMAGE,
                "kimi_k25": KIMI_IMAGE}

# Router weights of tiny MoE models are scaled by this: at the usual init (std 0.02) the
# router logits of all experts nearly tie, so bf16 rounding in one engine or the other
# flips expert choices on many tokens, and two correct engines disagree by ~20% there.
ROUTER_SCALE = 50.0


def _decisive_routers(model: Any) -> None:
    """Make MoE routing decisive (see ROUTER_SCALE); dense models are left as they are."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            # The router (gpt-oss names it `router`), not a dense gate_proj; its bias
            # is scaled with it, so the two keep their proportion.
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")):
                param.mul_(ROUTER_SCALE)


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "bfloat16",
    weights: bool = True,
) -> Path:
    """Write a random-weight model (safetensors), its tokenizer and generation config.

    The same arguments give the same bytes of weights: initialisation is seeded, so two
    test sessions (or two machines) compare hidden states of the same model. With
    `weights=False` the folder holds no weights: what preflight sees of a checkpoint it
    must not load, built in a second instead of several.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(ARCHS)}")
    if hidden_size % num_heads or hidden_size // num_heads != 64:
        # vLLM's CPU attention refuses small head sizes (16 was refused, 64 works).
        raise ValueError(
            f"hidden_size / num_heads must be 64 (vLLM CPU attention), got "
            f"{hidden_size} / {num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size, seed=seed,
                                extra_special_tokens=_SPECIAL_TOKENS.get(arch, ()))
    if arch in _IMAGE_TOKEN:
        tokenizer.chat_template = vision_chat_template(_IMAGE_TOKEN[arch])
        save_tokenizer(tokenizer, out)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(
            f"tokenizer has {len(tokenizer)} tokens, expected {vocab_size}; the synthetic "
            "corpus is too small for this vocab_size"
        )

    shape = TinyShape(num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size,
                      vocab_size)
    config = ARCHS[arch](shape)
    config.dtype = dtype
    generation = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOT_ID, pad_token_id=PAD_ID, do_sample=False
    )
    if arch in _EXTRA_FILES:
        _EXTRA_FILES[arch](out)
    if not weights:
        if not config.architectures:  # save_pretrained of a model would have set it
            from transformers.models.auto import modeling_auto

            names = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
                     if arch in _AUTO_CLASS else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
            config.architectures = [names[config.model_type]]
        config.save_pretrained(str(out))
        generation.save_pretrained(str(out))
        logger.info("wrote tiny %s config (%d layers, hidden %d, no weights) to %s", arch,
                    num_layers, hidden_size, out)
        return out
    auto_class = getattr(transformers, _AUTO_CLASS.get(arch, "AutoModelForCausalLM"))
    # Seeded with a private generator state so callers' global RNG use does not change
    # the weights, and building a model does not change the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
    _decisive_routers(model)
    model = model.to(torch_dtype).eval()
    model.generation_config = generation
    from transformers.utils import logging as hf_logging

    # A model of a few MB needs no progress bar on the terminal.
    hf_logging.disable_progress_bar()
    if arch in _SAVE:
        _SAVE[arch](model, out)
    else:
        model.save_pretrained(str(out), safe_serialization=True)
    logger.info("wrote tiny %s model (%d layers, hidden %d) to %s", arch, num_layers,
                hidden_size, out)
    return out
