"""What a job needs to know about its target model, read from config.json alone.

No weights, no transformers, no torch: this runs in the client and before any engine
starts, so a bad layer id is refused in milliseconds. Multimodal wrappers keep the text
model's shape in `text_config` (Kimi-K2.5, Qwen2.5-VL, Llava, ...); the layer count and
hidden size come from there when it exists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx.methods import DEFAULT_METHOD, resolve_layers


class ModelConfigError(ValueError):
    """The model's config cannot be found or lacks what capture needs."""


# Text model types whose vLLM model cannot give layer id 0 (the embeddings): vLLM's
# DeepseekV2/V3 forward computes `hidden_states + residual` with no residual yet when the
# aux layer is the first one (measured, ENVIRONMENT.md). "kimi_k2" is the old name of
# Kimi's DeepSeek-V3 text config.
NO_EMBEDDING_ID_IN_VLLM = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"})

# Bytes of hidden states per token and captured layer, per storage dtype: bf16 values; fp8
# values plus one float32 scale per token and layer (hsx.output.shards.quantize_fp8).
STORAGE_BYTES_PER_VALUE = {"bf16": 2.0, "fp8": 1.0}
STORAGE_BYTES_PER_ROW = {"bf16": 0, "fp8": 4}


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int | None
    wrapper: bool
    torch_dtype: str | None
    text_model_type: str | None = None
    """model_type of the text model (of `text_config` for a wrapper)."""
    text_architecture: str | None = None
    """`text_config.architectures[0]` of a wrapper, when its config names one."""
    auto_map: bool = False
    """The config points at the model's own Python code (`auto_map`)."""
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The raw config.json, for the estimates below."""

    @property
    def shape(self) -> dict[str, Any]:
        """The text model's config: `text_config` of a wrapper, else the whole config."""
        text = self.config.get("text_config")
        return text if isinstance(text, dict) else self.config

    @property
    def image_token_id(self) -> int | None:
        """The token a wrapper's vision tokens carry, one per vision token once its
        processor (or vLLM) expands an image's placeholder: `image_token_index` (Llava),
        `image_token_id` (Qwen2.5-VL), `media_placeholder_token_id` (Kimi-K2.5); None for
        a model without a vision tower."""
        if not isinstance(self.config.get("vision_config"), dict):
            return None
        for key in ("image_token_id", "image_token_index", "media_placeholder_token_id"):
            value = self.config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    @property
    def max_positions(self) -> int | None:
        """Positions the text model was built for (`max_position_embeddings`), if said."""
        value = self.shape.get("max_position_embeddings")
        return int(value) if isinstance(value, int | float) and value > 0 else None

    @property
    def uses_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2's text model)."""
        return bool(self.shape.get("kv_lora_rank"))

    @property
    def uses_linear_attention(self) -> bool:
        """Gated delta-net (linear attention) layers, as in Qwen3-Next's hybrid stack."""
        kinds = self.shape.get("layer_types")
        return isinstance(kinds, list) and "linear_attention" in kinds

    def min_layer_id(self, engine: str | None = None) -> int:
        """Smallest capturable id: 1 where vLLM cannot give the embeddings, else 0."""
        if engine in (None, "vllm") and self.text_model_type in NO_EMBEDDING_ID_IN_VLLM:
            return 1
        return 0

    def valid_layers(self, engine: str | None = None) -> list[int]:
        return list(range(self.min_layer_id(engine), self.num_layers + 1))

    def default_layers(self, engine: str | None = None, method: str = DEFAULT_METHOD
                       ) -> list[int]:
        """The ids a capture for `method` holds (hsx.methods) that `engine` can capture."""
        low = self.min_layer_id(engine)
        return resolve_layers([method], self.num_layers, low) or [self.num_layers]

    def job_layers(self, asked: Sequence[int | str] | None, engine: str | None = None,
                   method: str = DEFAULT_METHOD) -> list[int]:
        """A job's `layers:` as ids (method names stand for their ids); unset: `method`'s."""
        if asked is None:
            return self.default_layers(engine, method)
        return resolve_layers(asked, self.num_layers, self.min_layer_id(engine))

    def check_layers(self, layers: list[int], engine: str | None = None) -> None:
        """Raise ModelConfigError naming the ids outside 0..N (1..N where 0 cannot be had)."""
        bad = [k for k in layers if not 0 <= k <= self.num_layers]
        if bad:
            raise ModelConfigError(
                f"layers: ids {bad} are outside 0..{self.num_layers} for {self.architecture} "
                f"({self.num_layers} decoder layers; id {self.num_layers} is the last layer's "
                "output before the final norm)"
            )
        if 0 in layers and self.min_layer_id(engine) > 0:
            raise ModelConfigError(
                f"layers: id 0 (the embeddings) cannot be captured from {self.architecture} "
                f"with vLLM (its {self.text_model_type} model fails on it); use ids "
                f"1..{self.num_layers}, or engine: hf"
            )

    def bytes_per_token(self, num_captured_layers: int) -> dict[str, int]:
        """Output bytes of hidden states per token for each storage dtype."""
        return {
            dtype: int(num_captured_layers * (self.hidden_size * per_value
                                              + STORAGE_BYTES_PER_ROW[dtype]))
            for dtype, per_value in STORAGE_BYTES_PER_VALUE.items()
        }

    def estimate_num_params(self) -> int | None:
        """Parameters of the text model, estimated from its config (None if it cannot tell).

        Counts embeddings, attention (MLA or grouped heads), dense and MoE MLPs and the
        LM head; norms and a wrapper's vision tower are left out (the text path does not
        load the tower). Good to a few percent, which is what a fit check needs.
        """
        c = self.shape
        h, n = self.hidden_size, self.num_layers
        vocab = c.get("vocab_size") or self.vocab_size
        heads = c.get("num_attention_heads")
        if not isinstance(vocab, int) or not isinstance(heads, int) or heads <= 0:
            return None
        kv_heads = c.get("num_key_value_heads") or heads
        if c.get("kv_lora_rank"):
            rope, nope = c.get("qk_rope_head_dim") or 0, c.get("qk_nope_head_dim") or 0
            v_dim, kv_rank = c.get("v_head_dim") or 0, c["kv_lora_rank"]
            q_rank = c.get("q_lora_rank")
            q_out = heads * (nope + rope)
            q = (h * q_rank + q_rank * q_out) if q_rank else h * q_out
            attn = q + h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
        else:
            head_dim = c.get("head_dim") or h // heads
            attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
        inter = c.get("intermediate_size") or 4 * h
        experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
        dense_mlp = 3 * h * inter
        if experts:
            moe_inter = c.get("moe_intermediate_size") or inter
            shared = (c.get("n_shared_experts") or 0) * 3 * h * moe_inter
            shared += 3 * h * (c.get("shared_expert_intermediate_size") or 0)
            moe_mlp = experts * 3 * h * moe_inter + shared + h * experts
            dense_layers = min(int(c.get("first_k_dense_replace") or 0), n)
            mlp = dense_layers * dense_mlp + (n - dense_layers) * moe_mlp
        else:
            mlp = n * dense_mlp
        tied = bool(c.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))
        return int(vocab * h * (1 if tied else 2) + n * attn + mlp)

    def weight_bytes_per_param(self) -> float:
        """Bytes per weight as stored: from `quantization_config`, else the dtype."""
        quant = self.config.get("quantization_config") or self.shape.get("quantization_config")
        if isinstance(quant, dict):
            bits = quant.get("bits") or quant.get("weight_bits") or _compressed_bits(quant)
            if isinstance(bits, int) and bits > 0:
                return bits / 8
            if "fp8" in str(quant.get("quant_method", "")).lower():
                return 1.0
        dtype = self.config.get("torch_dtype") or self.config.get("dtype") or self.torch_dtype
        return 4.0 if str(dtype) in ("float32", "torch.float32") else 2.0


def _compressed_bits(quant: dict[str, Any]) -> int | None:
    """The weights' bits of a compressed-tensors config (Kimi-K2.5's int4 experts): its
    config groups' `weights.num_bits`, the smallest when groups differ. Layers it leaves
    unquantized (its `ignore` list) are counted at that width too: an estimate."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict):
        return None
    bits = [g.get("weights", {}).get("num_bits") for g in groups.values() if isinstance(g, dict)]
    found = [b for b in bits if isinstance(b, int) and b > 0]
    return min(found) if found else None


def _config_path(model: str) -> Path:
    local = Path(model).expanduser()
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"model: {local} has no config.json")
        return path
    if local.exists():
        raise ModelConfigError(f"model: {local} is a file; expected a model directory")
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelConfigError(f"model: directory {model} does not exist")
    return _hub_config_path(model)


def _hub_config_path(repo_id: str) -> Path:
    """config.json of a hub model, from the local cache or the hub."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ModelConfigError(
            f"model: {repo_id} is not a local directory, and huggingface_hub is not "
            "installed to fetch it"
        ) from None
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception as err:  # the hub raises many kinds; all mean "cannot read it"
        offline = os.environ.get("HF_HUB_OFFLINE")
        hint = " (HF_HUB_OFFLINE is set)" if offline else ""
        raise ModelConfigError(
            f"model: cannot read config.json of {repo_id}{hint}: {type(err).__name__}: {err}"
        ) from None


def read_model_info(model: str) -> ModelInfo:
    path = _config_path(model)
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelConfigError(f"model: cannot parse {path}: {err}") from None
    archs = config.get("architectures") or []
    architecture = archs[0] if archs else config.get("model_type", "unknown")
    text = config.get("text_config")
    wrapper = isinstance(text, dict)
    shape = text if isinstance(text, dict) else config
    num_layers = shape.get("num_hidden_layers", shape.get("n_layer"))
    hidden = shape.get("hidden_size", shape.get("n_embd"))
    text_archs = shape.get("architectures") if wrapper else None
    if not isinstance(num_layers, int) or not isinstance(hidden, int):
        raise ModelConfigError(
            f"model: {path} does not say num_hidden_layers and hidden_size "
            f"(looked in {'text_config' if wrapper else 'the top level'})"
        )
    return ModelInfo(
        path=str(path.parent),
        architecture=str(architecture),
        model_type=str(config.get("model_type", "")),
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=shape.get("vocab_size", config.get("vocab_size")),
        wrapper=wrapper,
        torch_dtype=shape.get("torch_dtype", shape.get("dtype", config.get("torch_dtype"))),
        text_model_type=str(shape.get("model_type") or config.get("model_type") or "") or None,
        text_architecture=str(text_archs[0]) if isinstance(text_archs, list) and text_archs
        else None,
        auto_map=bool(config.get("auto_map") or shape.get("auto_map")),
        config=config,
    )
