"""The target's final norm, read from its checkpoint: what turns id N into the post-norm state.

hsx stores id N, the last layer's state *before* the final norm (docs/FORMAT.md). Two
readers need the state after it: the self-check's head check (`lm_head(norm(h_N))`,
hsx_workers/headcheck.py) and exports to tools that store the post-norm state themselves
(SpecForge's `hidden_state` / `target_last_hidden_states`, hsx.export). Both read the
norm here, from the model's safetensors, for the model types whose final norm hsx knows
(`NORM_OF_TYPE`); anything else raises `FinalNormUnavailable` with the reason.

Imports only the standard library at import time; torch and safetensors are imported
when a norm is read or applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.modelinfo import ModelConfigError, ModelInfo, read_model_info

# model_type of the text model -> how its final norm scales: "w" (RMSNorm times its
# weight) or "1+w" (times one plus its weight: Gemma, Qwen3-Next).
NORM_OF_TYPE = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                     "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "gpt_oss"), "w"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next"), "1+w"),
}


class FinalNormUnavailable(Exception):
    """hsx cannot read this model's final norm; the message says why."""


@dataclass
class Checkpoint:
    """A model's safetensors tensors, and the prefixes its language model's lie under."""

    info: ModelInfo
    names: dict[str, Path]  # tensor name -> the file that holds it

    @classmethod
    def open(cls, model_path: str) -> Checkpoint:
        try:
            info = read_model_info(model_path)
        except ModelConfigError as err:
            raise FinalNormUnavailable(str(err)) from None
        names = _tensor_files(Path(info.path))
        if not names:
            raise FinalNormUnavailable("the model has no safetensors weights to read from")
        return cls(info, names)

    @property
    def head_key(self) -> str | None:
        """The checkpoint's own head (the shortest `...lm_head.weight`), if it has one."""
        return min((k for k in self.names if k.endswith("lm_head.weight")), key=len,
                   default=None)

    def inner(self, suffix: str) -> str | None:
        """The language model's tensor `suffix` (`norm.weight`, `embed_tokens.weight`):
        under `model.`, or a wrapper's language model's prefix."""
        head = self.head_key
        prefix = head[: -len("lm_head.weight")] if head else ""
        prefixes = (prefix + "model.", "model.language_model.", prefix + "language_model.model.")
        return next((p + suffix for p in prefixes if p + suffix in self.names), None)

    @property
    def tied(self) -> bool:
        """The head is the embeddings (the config says so, or says nothing)."""
        value = self.info.shape.get("tie_word_embeddings",
                                    self.info.config.get("tie_word_embeddings"))
        return True if value is None else bool(value)

    def read(self, key: str) -> Any:
        from safetensors import safe_open

        with safe_open(str(self.names[key]), framework="pt") as f:
            return f.get_tensor(key)


@dataclass
class FinalNorm:
    """The final RMS norm: `x / rms(x) * w` (or `* (1 + w)`)."""

    weight: Any  # [H] torch tensor, the checkpoint's dtype
    eps: float
    offset: bool  # the norm scales by 1 + weight

    @classmethod
    def load(cls, model_path: str) -> FinalNorm:
        return cls.of(Checkpoint.open(model_path))

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> FinalNorm:
        info = checkpoint.info
        kind = NORM_OF_TYPE.get(info.text_model_type or "")
        if kind is None:
            raise FinalNormUnavailable(f"hsx does not know the final norm of model type "
                                       f"{info.text_model_type!r}")
        key = checkpoint.inner("norm.weight")
        if key is None or key.replace("weight", "bias") in checkpoint.names:
            raise FinalNormUnavailable("no RMS final norm found among the weights")
        eps = info.shape.get("rms_norm_eps", info.shape.get("norm_eps", 1e-6))
        return cls(checkpoint.read(key), float(eps), kind == "1+w")

    @property
    def scale(self) -> Any:
        """The per-channel factor, in float32."""
        weight = self.weight.float()
        return weight + 1 if self.offset else weight

    def apply(self, states: Any) -> Any:
        """The norm of [..., H] states, in float32 (as the engine computes it)."""
        import torch

        x = states.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (index or single file)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text()).get("weight_map", {})
        return {name: folder / file for name, file in mapping.items()}
    out: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        out.update({name: file for name in header if name != "__metadata__"})
    return out
