"""What a job needs to know about its target model, read from config.json alone.

No weights, no transformers, no torch: this runs in the client and before any engine
starts, so a bad layer id is refused in milliseconds. Multimodal wrappers keep the text
model's shape in `text_config` (Kimi-K2.5, Qwen2.5-VL, Llava, ...); the layer count and
hidden size come from there when it exists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """The model's config cannot be found or lacks what capture needs."""


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

    def default_layers(self) -> list[int]:
        return default_layers(self.num_layers)

    def check_layers(self, layers: list[int]) -> None:
        """Raise ModelConfigError naming the ids outside 0..N."""
        bad = [k for k in layers if not 0 <= k <= self.num_layers]
        if bad:
            raise ModelConfigError(
                f"layers: ids {bad} are outside 0..{self.num_layers} for {self.architecture} "
                f"({self.num_layers} decoder layers; id {self.num_layers} is the last layer's "
                "output before the final norm)"
            )


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default: three auxiliary layers and the last one, as speculators reads them.

    Tiny models make some of these coincide; duplicates are dropped, order is ascending.
    """
    n = num_layers
    return sorted({k for k in (2, n // 2, n - 3, n) if 0 <= k <= n})


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
    )
