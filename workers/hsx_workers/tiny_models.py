"""Random-weight tiny models, a tokenizer and chat datasets, all built locally.

Nothing can be downloaded on the development and CI machines, so every test, demo and
benchmark that needs a model or a dataset builds one here:

- `build_tokenizer`: a byte-level BPE tokenizer trained on a synthetic English-like
  corpus, with Llama-3 special tokens and a Llama-3-style chat template.
- `make_tiny_model`: random (seeded) weights for an architecture in `ARCHS`, saved with
  `save_pretrained` beside the tokenizer, so vLLM and transformers load the folder as
  they would a hub checkpoint.
- `make_chat_dataset`: a JSONL file of synthetic conversations, optionally with bad rows
  of every kind ingestion must record; `write_rows` writes rows as Parquet or as a
  `datasets.save_to_disk` folder too.

Command line (`python -m hsx_workers.tiny_models --help`):

    python -m hsx_workers.tiny_models model DIR [--arch llama] [--layers 4] ...
    python -m hsx_workers.tiny_models dataset FILE [--n 200] [--bad-rows 5]

torch and transformers are imported inside the functions that need them, so building a
dataset stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

BOS = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
# Fixed order: the special tokens get ids 0..4 whatever the corpus, so configs can name them.
SPECIAL_TOKENS = (BOS, START_HEADER, END_HEADER, EOT, PAD)
BOS_ID, EOT_ID, PAD_ID = 0, 3, 4

# Llama-3's template, plus `{% generation %}` around what the assistant produces (content
# and end-of-turn) so `return_assistant_tokens_mask=True` works; hsx's ingestion does not
# rely on the tags, because most real templates lack them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_WORDS = (  # noqa: SIM905 - a word list reads better as prose
    "the a an this that some every no one two three many few model data token layer "
    "state draft engine shard bucket worker trainer job unit sample batch stream cache "
    "weight vector matrix head block signal river mountain city garden window kitchen "
    "teacher student doctor farmer writer painter engineer pilot sailor runner child "
    "friend neighbour dog cat bird horse fish tree flower stone book letter song story "
    "question answer idea plan reason problem result number word language music light "
    "water fire wind rain snow sun moon star road bridge house door table chair paper "
    "is was will can should might must could would runs reads writes builds makes "
    "takes gives finds keeps moves turns opens closes starts stops learns teaches helps "
    "asks answers explains computes measures checks sends receives stores loads saves "
    "quick slow small large bright dark warm cold early late new old simple careful "
    "quiet loud happy tired clever strange common rare exact rough clear deep "
    "and or but because when while after before if then so yet also still again "
    "in on at by with from to into over under between across through near far "
    "very quite rather almost always often never sometimes today tomorrow here there"
).split()

_QUESTION_STARTS = (
    "Can you explain", "What is", "How does", "Why does", "Tell me about", "Describe",
    "Write a short note on", "Summarize", "Give an example of", "Compare",
)


def _sentence(rng: random.Random, lo: int = 3, hi: int = 10) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2048)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....!?;")


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def _question(rng: random.Random) -> str:
    topic = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))
    tail = _sentence(rng) if rng.random() < 0.5 else ""
    return f"{rng.choice(_QUESTION_STARTS)} {topic}? {tail}".strip()


def synthetic_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """English-like lines (plus some chat markup) to train the tokenizer on."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 5 == 0:
            lines.append(_question(rng))
        else:
            lines.append(_paragraph(rng, rng.randint(1, 4)))
    return lines


# ---------------------------------------------------------------------------- tokenizer


def build_tokenizer(
    path: str | Path | None = None, vocab_size: int = 512, *, seed: int = 0,
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (Llama-3 style) and save it to `path` if given.

    Byte-level, so any text tokenizes without unknown tokens and offsets map back to
    characters (ingestion's fallback for loss masks needs offsets). `extra_special_tokens`
    (a model's own markers, e.g. Kimi's media tokens) take the last ids of the vocabulary,
    in the order given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    extra = list(extra_special_tokens)
    if vocab_size - len(extra) < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE "
            f"(needs more than {256 + len(SPECIAL_TOKENS) + len(extra)})"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(extra),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    # As in Llama 3's tokenizer.json: BOS prepended for plain text, not for the template
    # (which writes bos_token itself and is tokenized with add_special_tokens=False).
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, BOS_ID)],
            ),
        ]
    )
    for i, tok in enumerate(SPECIAL_TOKENS):
        if backend.token_to_id(tok) != i:
            raise RuntimeError(f"special token {tok} got id {backend.token_to_id(tok)}, not {i}")
    backend.add_special_tokens(extra)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[START_HEADER, END_HEADER, *extra],
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if path is not None:
        save_tokenizer(tokenizer, path)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """`save_pretrained`, naming the class every loader knows.

    transformers 5 writes its internal class name ("TokenizersBackend"); the public alias
    loads in transformers 4 and 5 alike, and in vLLM's tokenizer loader.
    """
    tokenizer.save_pretrained(str(path))
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------- models


@dataclass(frozen=True)
class TinyShape:
    """The sizes every architecture entry turns into its own config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _common(shape: TinyShape) -> dict[str, Any]:
    return {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOT_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
    }


def _llama_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(shape), head_dim=shape.head_dim)


def _qwen3_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(shape), head_dim=shape.head_dim, use_sliding_window=False)


def _mistral_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**_common(shape), head_dim=shape.head_dim, sliding_window=None)


def _deepseek_v3_config(shape: TinyShape) -> PretrainedConfig:
    """DeepSeek-V3 style: multi-head latent attention (MLA) and a routed MoE.

    vLLM's CPU MLA kernel accepts only `kv_lora_rank + qk_rope_head_dim == 576` (the real
    model's 512 + 64), and its MoE loader wants `e_score_correction_bias`, which exists
    only with `topk_method="noaux_tc", scoring_func="sigmoid"` (see ENVIRONMENT.md).
    Layer 0 stays dense (`first_k_dense_replace=1`), as in the real model.
    """
    from transformers import DeepseekV3Config

    common = _common(shape)
    common["num_key_value_heads"] = shape.num_heads  # MLA has no grouped KV heads
    config = DeepseekV3Config(
        **common,
        moe_intermediate_size=shape.intermediate_size // 4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
    )
    # Not fields of transformers' config class, but read by vLLM's loader (saved as extras).
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    return config


def _qwen3_moe_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(shape),
        moe_intermediate_size=shape.intermediate_size // 4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        use_sliding_window=False,
    )


def _gemma2_config(shape: TinyShape) -> PretrainedConfig:
    """Gemma-class: vLLM's Gemma-2 has no EAGLE-3 aux outputs (the hook fallback's case).

    No attention logit soft-capping: it changes nothing about capture, and keeps the
    tiny model on the attention paths every CPU backend has.
    """
    from transformers import Gemma2Config

    # Gemma ties its output embeddings; vLLM's Gemma-2 has no lm_head to load otherwise.
    return Gemma2Config(
        **{**_common(shape), "tie_word_embeddings": True},
        head_dim=shape.head_dim,
        query_pre_attn_scalar=shape.head_dim,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window=4096,
    )


def _llava_config(shape: TinyShape) -> PretrainedConfig:
    """A multimodal wrapper (Llava) around the tiny Llama, with a one-layer CLIP tower.

    The image token is the last id of the vocabulary: the tiny tokenizer has no `<image>`
    token, and only the text path runs on the CPU machine (ENVIRONMENT.md).
    """
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        image_size=28, patch_size=14, projection_dim=64,
    )
    text = _llama_config(shape)
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=shape.vocab_size - 1,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def _qwen2_5_vl_config(shape: TinyShape) -> PretrainedConfig:
    """A multimodal wrapper whose vLLM class has EAGLE-3 aux outputs (Llava's has not).

    The text model is Qwen2-shaped with M-RoPE (sections sum to head_dim / 2); the vision
    tower is one block. Only the text path runs on the CPU machine (ENVIRONMENT.md).
    """
    from transformers import Qwen2_5_VLConfig

    text = {**_common(shape), "model_type": "qwen2_5_vl_text",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [8, 12, 12]}}
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 1,
                       "out_hidden_size": shape.hidden_size, "fullatt_block_indexes": [0]},
        image_token_id=shape.vocab_size - 1,
        video_token_id=shape.vocab_size - 2,
        vision_start_token_id=shape.vocab_size - 3,
        vision_end_token_id=shape.vocab_size - 4,
        tie_word_embeddings=False,
    )


# Kimi-K2.5's media tokens, as its tokenizer names them. vLLM's Kimi processor looks
# `<|media_pad|>` up by name at engine start (its image placeholder is
# "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"); the tiny tokenizer
# gives them the last ids of the vocabulary, in this order.
KIMI_MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")

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


def _kimi_k25_config(shape: TinyShape) -> PretrainedConfig:
    """Kimi-K2.5's shape: KimiK25ForConditionalGeneration around a DeepSeek-V3 text model.

    The architecture is vLLM's class name (transformers' `Kimi_K25ForConditionalGeneration`
    would make vLLM pick its Transformers backend). vLLM 0.32 reads transformers'
    `Kimi_K25Config` (`image_token_id`), vLLM 0.25.1 its own (`media_placeholder_token_id`):
    both name `<|media_pad|>`. The one-block vision tower takes Kimi's patch and merge
    sizes (KIMI_MEDIA_PROC_CFG).
    """
    from transformers import Kimi_K25Config

    text = _deepseek_v3_config(shape).to_dict()
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


def _write_kimi_k25_processor(out: Path) -> None:
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


def _save_kimi_k25(model: Any, out: Path) -> None:
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


# One entry per architecture: arch name -> config builder. See ENVIRONMENT.md for what
# each needs to load in vLLM's CPU build.
ARCHS: dict[str, Callable[[TinyShape], PretrainedConfig]] = {
    "llama": _llama_config,
    "qwen3": _qwen3_config,
    "mistral": _mistral_config,
    "deepseek_v3": _deepseek_v3_config,
    "qwen3_moe": _qwen3_moe_config,
    "gemma2": _gemma2_config,
    "llava": _llava_config,
    "qwen2_5_vl": _qwen2_5_vl_config,
    "kimi_k25": _kimi_k25_config,
}

# transformers' auto class for the architectures that are not plain causal LMs.
_AUTO_CLASS = {"llava": "AutoModelForImageTextToText",
               "qwen2_5_vl": "AutoModelForImageTextToText",
               "kimi_k25": "AutoModelForImageTextToText"}

# What some architectures need beyond `save_pretrained`: special tokens of their own
# (last ids of the vocabulary), files written with or without weights, and their own
# way of saving weights.
_SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {"kimi_k25": KIMI_MEDIA_TOKENS}
_EXTRA_FILES: dict[str, Callable[[Path], None]] = {"kimi_k25": _write_kimi_k25_processor}
_SAVE: dict[str, Callable[[Any, Path], None]] = {"kimi_k25": _save_kimi_k25}


# Router weights of tiny MoE models are scaled by this: at the usual init (std 0.02) the
# router logits of all experts nearly tie, so bf16 rounding in one engine or the other
# flips expert choices on many tokens, and two correct engines disagree by ~20% there.
ROUTER_SCALE = 50.0


def _decisive_routers(model: Any) -> None:
    """Make MoE routing decisive (see ROUTER_SCALE); dense models are left as they are."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the router, not a dense gate_proj
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


# ---------------------------------------------------------------------------- datasets

BadKind = Literal["malformed_json", "empty_messages", "unknown_role", "no_assistant",
                  "no_field"]
BAD_KINDS: tuple[BadKind, ...] = (
    "malformed_json", "empty_messages", "unknown_role", "no_assistant", "no_field",
)
RowFormat = Literal["messages", "sharegpt", "text", "mixed"]
ROW_FORMATS: tuple[str, ...] = ("messages", "sharegpt", "text", "mixed")


@dataclass
class ChatDataset:
    """What `make_chat_dataset` wrote: the file, its rows, and which rows are bad."""

    path: Path
    num_rows: int
    bad: dict[int, BadKind] = field(default_factory=dict)
    """Row index -> kind of bad row (one of BAD_KINDS)."""
    rows: list[Any] = field(default_factory=list, repr=False)
    """Every row as written: a dict, or the raw text of a malformed JSON line."""

    @property
    def good_indices(self) -> list[int]:
        return [i for i in range(self.num_rows) if i not in self.bad]


def _conversation(rng: random.Random, index: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": _sentence(rng)})
    long = index % 25 == 7  # a few long ones that ingestion truncates at ~256 tokens
    turns = 1 if long else rng.choice((1, 1, 1, 1, 2, 2, 3))
    for _ in range(turns):
        messages.append({"role": "user", "content": _question(rng)})
        sentences = rng.randint(15, 25) if long else rng.randint(1, 3)
        messages.append({"role": "assistant", "content": _paragraph(rng, sentences)})
    return messages


def _good_row(rng: random.Random, index: int, fmt: str) -> dict[str, Any]:
    if fmt == "mixed":
        fmt = ("messages", "messages", "sharegpt", "text")[index % 4]
        if fmt == "text" and index % 8 == 3:
            fmt = "prompt"
    if fmt in ("text", "prompt"):
        return {fmt: _paragraph(rng, rng.randint(1, 6))}
    messages = _conversation(rng, index)
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]}
                                  for m in messages]}
    return {"messages": messages}


def _bad_row(rng: random.Random, kind: BadKind) -> Any:
    if kind == "malformed_json":
        return '{"messages": [{"role": "user", "content": "unterminated'
    if kind == "empty_messages":
        return {"messages": []}
    if kind == "unknown_role":
        return {"messages": [{"role": "user", "content": _question(rng)},
                             {"role": "wizard", "content": _sentence(rng)}]}
    if kind == "no_assistant":
        return {"messages": [{"role": "user", "content": _question(rng)}]}
    if kind == "no_field":
        return {"title": _sentence(rng), "score": 3}
    raise ValueError(f"unknown bad-row kind {kind!r}")


def make_chat_dataset(
    path: str | Path,
    n: int = 200,
    *,
    seed: int = 0,
    bad_rows: int = 0,
    formats: RowFormat = "messages",
) -> ChatDataset:
    """Write `n` good rows plus `bad_rows` bad ones as JSONL, deterministically by seed.

    `formats`: `messages` (OpenAI style), `sharegpt` (`conversations` with from/value),
    `text` (plain text rows), or `mixed` (all of these and `prompt`). Bad rows cycle
    through BAD_KINDS and sit at seeded positions; the result says which and why.
    """
    if formats not in ROW_FORMATS:
        raise ValueError(f"unknown formats {formats!r}; known: {list(ROW_FORMATS)}")
    if n < 0 or bad_rows < 0:
        raise ValueError("n and bad_rows must be >= 0")
    rng = random.Random(seed)
    total = n + bad_rows
    bad_positions = sorted(rng.sample(range(total), bad_rows))
    bad = {pos: BAD_KINDS[i % len(BAD_KINDS)] for i, pos in enumerate(bad_positions)}

    rows: list[Any] = []
    for index in range(total):
        kind = bad.get(index)
        rows.append(_bad_row(rng, kind) if kind else _good_row(rng, index, formats))
    out = Path(path)
    write_rows(rows, out, "jsonl")
    logger.info("wrote %d rows (%d bad) to %s", total, bad_rows, out)
    return ChatDataset(path=out, num_rows=total, bad=bad, rows=rows)


def write_rows(rows: Sequence[Any], path: str | Path, fmt: Literal["jsonl", "parquet", "hf"]
               ) -> Path:
    """Write rows as JSONL, one Parquet file, or a `datasets` `save_to_disk` folder.

    Strings among the rows are written verbatim to JSONL (that is how a malformed line
    gets in); the other formats take dicts only.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
        return out
    if any(not isinstance(r, dict) for r in rows):
        raise ValueError(f"{fmt} rows must be dicts (a malformed JSON line exists only in JSONL)")
    # Columns are the union of all rows' keys (a missing key is null); both pyarrow's and
    # datasets' from-list constructors would take the first row's keys only.
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), out)
        return out
    if fmt == "hf":
        import datasets

        datasets.Dataset.from_dict(columns).save_to_disk(str(out))
        return out
    raise ValueError(f"unknown format {fmt!r}")


# ---------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsx_workers.tiny_models",
                                description="Build tiny random-weight models and datasets.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write a tiny random-weight model directory")
    m.add_argument("dir")
    m.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    m.add_argument("--layers", type=int, default=4, dest="num_layers")
    m.add_argument("--hidden-size", type=int, default=256)
    m.add_argument("--heads", type=int, default=4, dest="num_heads")
    m.add_argument("--kv-heads", type=int, default=2, dest="num_kv_heads")
    m.add_argument("--intermediate-size", type=int, default=512)
    m.add_argument("--vocab-size", type=int, default=512)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bfloat16")
    d = sub.add_parser("dataset", help="write a synthetic JSONL chat dataset")
    d.add_argument("file")
    d.add_argument("--n", type=int, default=200)
    d.add_argument("--bad-rows", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--formats", default="messages", choices=ROW_FORMATS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m hsx_workers.tiny_models` (and `hsx make-tiny-model`)."""
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "model":
        make_tiny_model(
            args.dir, args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
            intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
            seed=args.seed, dtype=args.dtype,
        )
    else:
        ds = make_chat_dataset(args.file, args.n, seed=args.seed, bad_rows=args.bad_rows,
                               formats=args.formats)
        for index, kind in sorted(ds.bad.items()):
            logger.info("bad row %d: %s", index, kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
