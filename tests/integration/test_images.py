"""Chats with images on a tiny vision-language target (Llava: a 2-layer CLIP tower at
56 px around a 3-layer Llama), captured by vLLM's CPU build through its multimodal
prompts and by the hf engine, each against transformers' own processing and forward.

The reference is computed apart from hsx: transformers' processor renders each chat
with its images (`apply_chat_template` with the images as PIL images), expands each
placeholder into the image's 16 tokens, gives the assistant mask from the template's
generation tags, and the model's forward gives the states. So a shard whose token ids,
loss mask or modality mask were misaligned with vLLM's expansion, or whose image
positions held the placeholder's embedding instead of the image's, fails here.

A row with a missing, oversized (5000 x 5000), remote or cut-short image is a bad row
with its reason, and the job goes on.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.dataset import HiddenStatesDataset
from hsx.output import Output
from hsx.spec import JobSpec
from hsx_service.runner import run_job
from hsx_workers.tiny_models import make_tiny_model
from hsx_workers.tiny_models.vision import LLAVA_IMAGE_TOKENS, make_image_chats

from .helpers import relative_error

pytestmark = pytest.mark.integration

LAYERS = [0, 1, 2, 3]  # id 0 at an image token is the projected vision feature
GOOD, BAD = 12, ("missing", "oversized", "remote", "corrupt")
BOUND = 1e-2


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llava") / "model", "llava", num_layers=3)


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("image-chats") / "chats.jsonl"
    return path, make_image_chats(path, GOOD, bad=BAD)


@pytest.fixture(scope="module")
def image_pool(ray_local: None) -> Iterator[Any]:
    """The module's engines (an image engine is of this module only); gone after it, so
    the 2 cores hold the next module's."""
    from hsx_service.engine_pool import EnginePool

    pool = EnginePool()
    yield pool
    pool.shutdown()


def _open(url: str, root: Path) -> Any:
    from PIL import Image

    data = (base64.b64decode(url.split(",", 1)[1]) if url.startswith("data:")
            else (root / url).read_bytes())
    return Image.open(io.BytesIO(data)).convert("RGB")


@pytest.fixture(scope="module")
def reference(llava: Path, chats: tuple[Path, list[dict[str, Any]]]
              ) -> dict[int, dict[str, torch.Tensor]]:
    """Row -> transformers' input_ids, assistant mask, image-token mask and states."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hsx_workers.engines.hf_engine import _final_norm

    path, rows = chats
    processor = AutoProcessor.from_pretrained(str(llava))
    model: Any = AutoModelForImageTextToText.from_pretrained(str(llava), dtype=torch.bfloat16)
    model.eval()
    image_token = model.config.image_token_index
    pre_norm: list[torch.Tensor] = []
    _final_norm(model).register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    out = {}
    for index, row in enumerate(rows[:GOOD]):
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                     else [{"type": "image", "image": _open(p["image_url"]["url"], path.parent)}
                           if p["type"] == "image_url" else p for p in m["content"]]}
                    for m in row["messages"]]
        enc = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            chat_template=processor.tokenizer.chat_template, return_tensors="pt")
        with torch.inference_mode():
            pre_norm.clear()
            result = model(input_ids=enc["input_ids"],
                           pixel_values=enc["pixel_values"].to(torch.bfloat16),
                           output_hidden_states=True)
        states = [pre_norm[-1][0] if k == 3 else result.hidden_states[k][0] for k in LAYERS]
        ids = enc["input_ids"][0]
        out[index] = {"input_ids": ids, "loss_mask": enc["assistant_masks"][0],
                      "modality_mask": (ids == image_token).to(torch.uint8),
                      "hidden_states": torch.stack(states, dim=1).float()}
    return out


def _job(model: Path, data: Path, out: Path, engine: str) -> JobSpec:
    return JobSpec(model=str(model), dataset=str(data), output=str(out), layers=LAYERS,
                   engine=engine, max_seq_len=256, unit_tokens=2048,  # type: ignore[arg-type]
                   images={"max_pixels": 2**22})  # type: ignore[arg-type]


def _check_against(output: Path, ref: dict[int, dict[str, torch.Tensor]]) -> None:
    ds = HiddenStatesDataset(output, backend="torch")
    assert sorted(int(ds[i]["sample_index"]) for i in range(len(ds))) == list(range(GOOD))
    errors: dict[str, list[torch.Tensor]] = {"image": [], "text": []}
    for i in range(len(ds)):
        got = ds[i]
        want = ref[int(got["sample_index"])]
        assert torch.equal(got["input_ids"].long(), want["input_ids"].long())
        assert torch.equal(got["loss_mask"].long(), want["loss_mask"].long())
        assert torch.equal(got["modality_mask"].long(), want["modality_mask"].long())
        image = want["modality_mask"].bool()
        assert int(image.sum()) % LLAVA_IMAGE_TOKENS == 0 and image.any()
        states = got["hidden_states"].float()
        errors["image"].append(relative_error(states[image], want["hidden_states"][image]))
        errors["text"].append(relative_error(states[~image], want["hidden_states"][~image]))
    for where, per_sample in errors.items():
        stacked = torch.stack(per_sample)  # [samples, layers]
        print(f"{output.name}, {where} tokens: median {stacked.median(0).values.tolist()}, "
              f"worst {stacked.max(0).values.tolist()}")
        assert float(stacked.median(0).values.max()) < BOUND, (where, stacked)
        assert float(stacked.max()) < BOUND, (where, stacked)


def _check_bad_rows(output: Path) -> None:
    reasons = {r["sample_index"] - GOOD: r["reason"]
               for r in Output(str(output)).ingest_errors().to_pylist()}
    assert sorted(reasons) == list(range(len(BAD))), reasons
    said = dict(zip(BAD, (reasons[k] for k in range(len(BAD))), strict=True))
    assert "missing.png does not exist" in said["missing"], said
    assert "5000x5000" in said["oversized"] and "images.max_pixels" in said["oversized"], said
    assert "images.allow_hosts" in said["remote"], said
    assert "not an image file" in said["corrupt"], said


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_image_chats_capture_what_transformers_computes(
        engine: str, llava: Path, chats: tuple[Path, list[dict[str, Any]]],
        reference: dict[int, dict[str, torch.Tensor]], image_pool: Any, tmp_path: Path) -> None:
    data, _ = chats
    summary = run_job(_job(llava, data, tmp_path / engine, engine), pool=image_pool)
    assert (summary.samples, summary.errors) == (GOOD, len(BAD)), summary
    assert summary.samples_checked == GOOD and summary.check_problems == 0, summary
    _check_bad_rows(tmp_path / engine)
    _check_against(tmp_path / engine, reference)
    # The plan counted the vision tokens: the inputs' lengths are the shards' tokens.
    out = Output(str(tmp_path / engine))
    assert sum(out.inputs().column("length").to_pylist()) == summary.tokens
    assert sum(u.tokens for u in out.manifest().units) == summary.tokens
    image_pool.keep_only(None)  # the 2 cores hold one engine at a time
    if engine == "vllm":
        _check_exports(tmp_path / engine, tmp_path / "exports", reference)


def _check_exports(output: Path, dest: Path, ref: dict[int, dict[str, torch.Tensor]]) -> None:
    """The modality mask reaches Hugging Face datasets and both exports."""
    import datasets

    from hsx.export import export_output

    table = HiddenStatesDataset(output).to_hf_dataset()
    for row in table.select_columns(["sample_index", "modality_mask"]):
        want = ref[int(row["sample_index"])]["modality_mask"].tolist()
        assert list(row["modality_mask"]) == want
    export_output(output, dest / "speculators")
    exported = datasets.load_from_disk(str(dest / "speculators")).with_format(None)
    for row in exported:
        want = ref[int(row["hsx_sample_index"])]["modality_mask"].tolist()
        assert list(row["modality_mask"]) == want
    export_output(output, dest / "specforge", fmt="specforge", method="eagle3")
    order = json.loads((dest / "specforge" / "hsx_sample_index.json").read_text())
    first = torch.load(dest / "specforge" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert first["modality_mask"].tolist() == ref[order[0]]["modality_mask"].tolist()


def test_a_job_without_images_section_refuses_image_rows(
        llava: Path, chats: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Without `images:`, a row with an image is a bad row that says what to add; every
    row of this dataset has one, so the job fails naming it (no engine starts)."""
    from hsx_service.errors import JobRefused

    data, _ = chats
    spec = _job(llava, data, tmp_path / "o", "vllm").model_copy(update={"images": None})
    with pytest.raises(JobRefused) as err:
        run_job(spec, pool=object())  # type: ignore[arg-type]
    assert f"{GOOD + len(BAD)} rows: message 0 holds an image; this job takes no images" \
        in str(err.value), err.value
    json.dumps(str(err.value))
