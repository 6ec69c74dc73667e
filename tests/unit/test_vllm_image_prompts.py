"""hsx's image prompts as vLLM's own input processing takes them (the CPU build's
processor, no engine): a Kimi-K2.5 target takes images as `vision_chunk` items only, so
a prompt that gives them as `image` items is refused, row after row (the first GPU run
of the image path recorded every Kimi-K2.5 row bad so); hsx's prompt and limits, in
the class's modality, are taken, and its placeholder becomes the image's vision tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

WIDTH, HEIGHT = 64, 48  # padded to 84 x 56: 6 x 4 patches of 14, merged 2 x 2 into 6 tokens


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hsx_workers.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kimi"), "kimi_k25", num_layers=2,
                           weights=False)


def _input_processor(model: Path, limits: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    config = EngineArgs(model=str(model), limit_mm_per_prompt=limits, max_model_len=256,
                        enforce_eager=True).create_engine_config()
    return InputProcessor(config)


def _expanded(processor: Any, prompt: Any) -> list[int]:
    """The prompt's token ids as vLLM's input processing makes them."""
    from vllm import SamplingParams

    request = processor.process_inputs("r0", prompt, SamplingParams(max_tokens=1),
                                       ("generate",))
    return [int(t) for t in request.prompt_token_ids]


def _chat_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
         {"role": "assistant", "content": "Red."}], tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def test_kimi_k25_takes_images_as_vision_chunks(kimi: Path) -> None:
    from hsx.ingest.images import realign
    from hsx.modelinfo import read_model_info
    from hsx_workers.engines.vllm.classes import image_limits, image_modality
    from hsx_workers.engines.vllm.compat import prompt_refusals
    from hsx_workers.engines.vllm.engine import image_prompt
    from hsx_workers.tiny_models.vision import COLOURS, png_bytes

    info = read_model_info(str(kimi))
    assert info.image_token_id is not None
    assert image_modality(info.architecture) == "vision_chunk"
    ids = _chat_ids(kimi)
    assert ids.count(info.image_token_id) == 1
    image = png_bytes(COLOURS["red"], (WIDTH, HEIGHT))
    processor = _input_processor(kimi, image_limits(info.architecture, 2, 2048))

    # As images, as the engine gave them before: refused, for every row (a refusal the
    # engine records as the row's error, whichever class this vLLM raises it as).
    with pytest.raises(prompt_refusals(), match="image"):
        _expanded(processor, image_prompt(ids, [image]))

    engine_ids = _expanded(processor, image_prompt(ids, [image], modality="vision_chunk"))
    vision = -(-WIDTH // 28) * -(-HEIGHT // 28)  # whole 2 x 2 merges of 14-pixel patches
    assert engine_ids.count(info.image_token_id) == vision == 6
    assert len(engine_ids) == len(ids) - 1 + vision
    mask, modality = realign(ids, [0] * len(ids), engine_ids, info.image_token_id)
    assert sum(modality) == vision and not any(mask)


def test_the_evaluation_gives_a_kimi_k25_target_its_images_as_vision_chunks(kimi: Path) -> None:
    """The draft's evaluation sizes the engine from the job's settings (an `image` limit)
    and sends its image prompts under the modality the class takes them in."""
    from hsx_workers.acceptance import EvalPrompt, _image_engine
    from hsx_workers.engines.vllm.settings import TargetSettings

    args = dict(TargetSettings(images_per_prompt=2).engine_args())
    prompts = [EvalPrompt(token_ids=[1, 2, 3], max_tokens=4, images=[b"a", b"b", b"c"])]
    assert _image_engine(str(kimi), args, prompts) == "vision_chunk"
    # the job's count in the class's modality, raised to the most a prompt holds
    assert args["limit_mm_per_prompt"] == {"vision_chunk": 3}
