"""What the tiny vision-language models need to take images: an image placeholder token,
a chat template that renders image parts as it, the processor's files, and a
checkpoint layout vLLM's loader reads for the vision tower.

Llava: a 2-layer CLIP tower at 56 px, patch 14 (16 patches; `vision_feature_select_
strategy: "default"` drops the class token, so each image is 16 tokens), around the
tiny Llama; its processor is transformers' `LlavaProcessor` with `CLIPImageProcessor`,
which transformers builds from its PIL variant where torchvision is missing, as vLLM's
CPU build does at engine start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsx_workers.tiny_models.tokenizer import CHAT_TEMPLATE

LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_IMAGE_SIZE = 56
LLAVA_PATCH = 14
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2  # the class token dropped

# The tiny tokenizer's Llama-3-style template, with a user or system turn's content
# also as a list of parts (OpenAI's form, as hsx hands a chat with images to the
# template): a text part as its text, an image part as the model's placeholder.
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% else %}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}",
    "{% elif message['content'] is string %}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ image_token }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<|eot_id|>' }}",
)
if VISION_CHAT_TEMPLATE == CHAT_TEMPLATE:
    raise RuntimeError("the tiny chat template changed: VISION_CHAT_TEMPLATE no longer fits")


def vision_chat_template(image_token: str) -> str:
    """VISION_CHAT_TEMPLATE with `image_token` as the placeholder of an image part."""
    return "{% set image_token = '" + image_token + "' %}" + VISION_CHAT_TEMPLATE


def write_llava_processor(out: Path) -> None:
    """The processor files transformers' `AutoProcessor` (and vLLM's Llava processor)
    build Llava's processor from: a 56-px CLIP image processor, patch 14."""
    size = LLAVA_IMAGE_SIZE
    config = {
        "processor_class": "LlavaProcessor",
        "image_token": LLAVA_IMAGE_TOKEN,
        "num_additional_image_tokens": 1,
        "patch_size": LLAVA_PATCH,
        "vision_feature_select_strategy": "default",
        "image_processor": {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True, "size": {"shortest_edge": size},
            "do_center_crop": True, "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True, "resample": 3,
        },
    }
    (out / "processor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_llava(model: Any, out: Path) -> None:
    """Llava's checkpoint with the CLIP tower under `vision_tower.vision_model.`, as hub
    Llava checkpoints hold it and vLLM's loader reads it; transformers 5 saves it
    without `vision_model.` (its CLIPVisionModel keeps the encoder at the top) and loads
    both."""
    import tempfile

    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory(prefix="hsx-llava-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        weights = load_file(str(Path(tmp) / "model.safetensors"))
        renamed = {
            (name.replace("vision_tower.", "vision_tower.vision_model.", 1)
             if name.startswith("vision_tower.") and ".vision_model." not in name else name):
            tensor for name, tensor in weights.items()}
        for item in Path(tmp).iterdir():
            if item.name != "model.safetensors":
                (out / item.name).write_bytes(item.read_bytes())
        save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})


# --------------------------------------------------------------------------- datasets

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220),
           "yellow": (230, 220, 40), "white": (245, 245, 245), "black": (10, 10, 10)}
SHAPES = ("square", "disc", "cross")


def write_png(path: Path, colour: tuple[int, int, int], shape: str = "square",
              size: tuple[int, int] = (64, 48)) -> Path:
    """A small PNG: `shape` in `colour` on grey (`square` fills it)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (128, 128, 128))
    draw = ImageDraw.Draw(img)
    w, h = size
    box = (w // 6, h // 6, w - w // 6, h - h // 6)
    if shape == "square":
        draw.rectangle((0, 0, w, h), fill=colour)
    elif shape == "disc":
        draw.ellipse(box, fill=colour)
    else:
        draw.rectangle((w // 2 - w // 10, box[1], w // 2 + w // 10, box[3]), fill=colour)
        draw.rectangle((box[0], h // 2 - h // 10, box[2], h // 2 + h // 10), fill=colour)
    img.save(path, format="PNG")
    return path


def png_bytes(colour: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    """A PNG of one colour, as bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


IMAGE_BAD_KINDS = ("missing", "oversized", "remote", "corrupt")


def make_image_chats(path: str | Path, n: int = 24, *, seed: int = 0,
                     bad: Sequence[str] = IMAGE_BAD_KINDS) -> list[dict[str, Any]]:
    """JSONL of chats whose first message holds an image and a question, the answer
    naming its colour: images as files beside the file (`image_url` with a relative
    path), `data:` URIs, and two images in one row; then one bad row of each kind of
    `bad` (`missing`: a file that is not there, `oversized`: 5000x5000 pixels,
    `remote`: an https URL, `corrupt`: a PNG cut short). Returns the rows written."""
    import base64
    import random

    out = Path(path)
    folder = out.parent / f"{out.stem}-images"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = sorted(COLOURS)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        colour = rng.choice(names)
        size = (rng.randint(40, 90), rng.randint(30, 70))
        if i % 3 == 1:
            uri = "data:image/png;base64," + base64.b64encode(
                png_bytes(COLOURS[colour], size)).decode()
        else:
            uri = f"{folder.name}/{i:04d}.png"
            write_png(folder / f"{i:04d}.png", COLOURS[colour], size=size)
        parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": uri}},
                                       {"type": "text", "text": "What colour is this?"}]
        answer = f"It is {colour}."
        if i % 5 == 4:  # two images in one row
            other = rng.choice(names)
            write_png(folder / f"{i:04d}-b.png", COLOURS[other], "disc", size)
            parts.insert(1, {"type": "image_url",
                             "image_url": {"url": f"{folder.name}/{i:04d}-b.png"}})
            answer = f"The first is {colour}, the second {other}."
        rows.append({"messages": [{"role": "user", "content": parts},
                                  {"role": "assistant", "content": answer}]})
    for kind in bad:
        if kind == "missing":
            url = f"{folder.name}/missing.png"
        elif kind == "oversized":
            write_png(folder / "huge.png", COLOURS["red"], size=(5000, 5000))
            url = f"{folder.name}/huge.png"
        elif kind == "remote":
            url = "https://images.example.com/cat.png"
        elif kind == "corrupt":
            (folder / "cut.png").write_bytes(png_bytes(COLOURS["red"])[:40])
            url = f"{folder.name}/cut.png"
        else:
            raise ValueError(f"unknown bad image row {kind!r}")
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What colour is this?"}]},
            {"role": "assistant", "content": "It is red."}]})
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


# Qwen2.5-VL: its vision tokens, the last ids of the vocabulary in the config's order
# (configs.py: vision_end -4, vision_start -3, video_pad -2, image_pad -1), and an image
# part rendered as its chat template renders one.
QWEN_VL_TOKENS = ("<|vision_end|>", "<|vision_start|>", "<|video_pad|>", "<|image_pad|>")
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Images between 56 x 56 and 112 x 112 pixels once resized: 4 to 16 vision tokens
# (patch 14, merged 2 x 2).
QWEN_VL_PIXELS = (56 * 56, 112 * 112)


def write_qwen2_5_vl_processor(out: Path) -> None:
    """Qwen2.5-VL's processor files: its image processor (patch 14, merge 2, temporal
    patch 2) at small pixel bounds, and the processor class; the video processor the
    same (transformers' needs torchvision: a GPU machine's image has it)."""
    image = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
             "min_pixels": QWEN_VL_PIXELS[0], "max_pixels": QWEN_VL_PIXELS[1],
             "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711],
             "do_resize": True, "do_rescale": True, "do_normalize": True,
             "do_convert_rgb": True, "rescale_factor": 1 / 255}
    (out / "preprocessor_config.json").write_text(json.dumps(
        {**image, "image_processor_type": "Qwen2VLImageProcessor",
         "processor_class": "Qwen2_5_VLProcessor"}, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        {**image, "video_processor_type": "Qwen2VLVideoProcessor",
         "processor_class": "Qwen2_5_VLProcessor"}, indent=2) + "\n")
