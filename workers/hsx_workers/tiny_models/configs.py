"""Each architecture's transformers config at a tiny shape (`TinyShape`); `ARCHS`
(models.py) names them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx_workers.tiny_models.tokenizer import BOS_ID, EOT_ID, PAD_ID

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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


def llama_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(shape), head_dim=shape.head_dim)


def qwen3_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(shape), head_dim=shape.head_dim, use_sliding_window=False)


def mistral_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**_common(shape), head_dim=shape.head_dim, sliding_window=None)


def deepseek_v3_config(shape: TinyShape) -> PretrainedConfig:
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


def qwen3_moe_config(shape: TinyShape) -> PretrainedConfig:
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


def gemma2_config(shape: TinyShape) -> PretrainedConfig:
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


def llava_config(shape: TinyShape) -> PretrainedConfig:
    """A multimodal wrapper (Llava) around the tiny Llama, with a 2-layer CLIP tower at
    56 px, patch 14: 16 image tokens per image (vision.py).

    The image token `<image>` is the last id of the vocabulary (the tokenizer's last
    special token).
    """
    from transformers import CLIPVisionConfig, LlavaConfig

    from hsx_workers.tiny_models.vision import LLAVA_IMAGE_SIZE, LLAVA_PATCH

    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
        image_size=LLAVA_IMAGE_SIZE, patch_size=LLAVA_PATCH, projection_dim=64,
    )
    text = llama_config(shape)
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=shape.vocab_size - 1,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def qwen2_5_vl_config(shape: TinyShape) -> PretrainedConfig:
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


def gpt_oss_config(shape: TinyShape) -> PretrainedConfig:
    """gpt-oss: a routed MoE (clamped SwiGLU experts with biases, a router with a bias),
    attention sinks, sliding-window attention on every other layer (window 128, shorter
    than the test samples, so it takes effect), YaRN rope as the real model's."""
    from transformers import GptOssConfig

    return GptOssConfig(
        # The context YaRN stretches the original 4,096 to (factor 32), as the real model's.
        **{**_common(shape), "intermediate_size": shape.intermediate_size // 4,
           "max_position_embeddings": 131072},
        head_dim=shape.head_dim,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
    )


def gemma3_config(shape: TinyShape) -> PretrainedConfig:
    """Gemma 3's text model (`gemma3_text`, Gemma3ForCausalLM): like Gemma 2, no EAGLE-3
    aux outputs in vLLM (the hook fallback); q/k norms, sliding-window layers with a
    rope base of their own, then a full-attention layer. The window (64) is shorter than
    the test samples, so it takes effect."""
    from transformers import Gemma3TextConfig

    # Gemma ties its output embeddings, as for Gemma 2.
    return Gemma3TextConfig(
        **{**_common(shape), "tie_word_embeddings": True},
        head_dim=shape.head_dim,
        query_pre_attn_scalar=shape.head_dim,
        sliding_window=64,
        layer_types=["sliding_attention"] * (shape.num_layers - 1) + ["full_attention"],
    )


def qwen3_next_config(shape: TinyShape) -> PretrainedConfig:
    """Qwen3-Next: a hybrid of gated delta-net (linear attention) layers and a gated
    full-attention layer (the last of the tiny model's), each with an MoE and a shared
    expert.

    Every token goes to all 4 experts (weighted by the router): vLLM's CPU build runs
    this model in bf16 only, where a token whose top experts nearly tie is routed apart
    from a float32 reference, and the delta-net's recurrent state carries that
    difference on to every later token of the sample (measured with top-2 of 4: the
    median sample 0.84-1.09% off at the last layer, run to run). Top-k choice itself is
    exercised by the other MoE architectures.
    """
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common(shape),
        head_dim=shape.head_dim,
        layer_types=["linear_attention"] * (shape.num_layers - 1) + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=shape.head_dim,
        linear_value_head_dim=shape.head_dim,
        linear_num_key_heads=shape.num_kv_heads,
        linear_num_value_heads=shape.num_heads,
        moe_intermediate_size=shape.intermediate_size // 4,
        shared_expert_intermediate_size=shape.intermediate_size // 4,
        num_experts=4,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )
