"""Image prompts through vLLM's GPU build (0.25.1, with a working torchvision): tiny
Llava-, Qwen2.5-VL- and Kimi-K2.5-shaped targets, each a job with `images:` against
transformers' own processing and forward of the same images on the GPU.

For each: `run_job` with the vllm engine on chats whose first message holds an image
(files, `data:` URIs, two images in some rows) and four bad rows (missing, oversized,
remote, cut short); then, per committed sample, the reference of
tests/integration/test_images.py computed on the GPU: the processor renders the chat
with its images (`apply_chat_template`), expands each placeholder and gives the
assistant mask; the model's forward gives the states. The reference's loss mask is the
tokenizer's assistant mask of the chat with one placeholder an image (the template's
generation tags), carried over the processor's expanded ids: transformers before 5.19
places the processor's own mask by the characters of the chat before its images were
expanded, so past an image it lands on the wrong tokens (5.17, the GPU bundle's: every
Qwen2.5-VL sample). The processor's mask is recorded beside it
(`processor_mask_misaligned`). Asserted: the shard's ids, loss mask and modality mask
equal the reference's, and its states are within 1e-2 relative error per layer (median
and worst sample) at image and at text tokens. Kimi-K2.5's bounds are DeepSeek-V3's
(median 1e-2, worst 3e-2: vLLM's absorbed MLA). A target whose processor transformers
cannot build here (the job's preflight refuses it, naming why) is recorded as such and
skipped, not failed: that is the answer for that family.

What a failure leaves in the JSON, before the assertion that fails: every reason a row
has no states (ingestion's and capture's, with counts), and for each sample whose ids or
masks differ, which of the three differ, their lengths, the first position where each
differs, both sides around it (ids with their tokens) and the vision tokens each side.

The numbers go to `$HSX_GPU_RESULTS/vision_<arch>.json`. On the lent machine, after the
recipe's install (benchmarks/gpu/README.md, `bash .gpu/5/device.sh`), about 6 minutes:

    PYTHONPATH=/tmp/site:$PWD/client:$PWD/workers:$PWD/service VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 -m pytest tests/gpu/test_vision_gpu.py -q -s
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

import pytest

from hsx_workers.tiny_models import make_tiny_model
from hsx_workers.tiny_models.vision import make_image_chats

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

GOOD, BAD = 12, ("missing", "oversized", "remote", "corrupt")
WINDOW = 6  # tokens each side of a first difference, in what a mismatch records
# arch -> (layer ids, median bound, worst bound)
CASES = {"llava": ([0, 1, 2, 3], 1e-2, 1e-2), "qwen2_5_vl": ([0, 1, 2, 3], 1e-2, 1e-2),
         "kimi_k25": ([1, 2, 3], 1e-2, 3e-2)}


def _open(url: str, root: Path) -> Any:
    from PIL import Image

    data = (base64.b64decode(url.split(",", 1)[1]) if url.startswith("data:")
            else (root / url).read_bytes())
    return Image.open(io.BytesIO(data)).convert("RGB")


def _carried(text_ids: list[int], text_mask: list[int], ids: list[int], image_token: int
             ) -> list[int]:
    """The mask of a chat rendered with one placeholder an image (`text_ids`) over its
    ids with each placeholder expanded (`ids`): vision tokens are no assistant tokens."""
    out: list[int] = []
    for token, bit in zip(text_ids, text_mask, strict=True):
        if token != image_token:
            out.append(int(bit))
            continue
        while len(out) < len(ids) and ids[len(out)] == image_token:
            out.append(0)
    if len(out) != len(ids):
        raise ValueError(f"the chat's {len(text_ids)} tokens with its images expanded are "
                         f"{len(out)} tokens, the processor's are {len(ids)}")
    return out


def _difference(got: dict[str, Any], want: dict[str, Any], tokenizer: Any, image_token: int
                ) -> dict[str, Any]:
    """What differs between a shard's sample and the reference's: per sequence that
    differs, both lengths, the first position where they differ and both sides around it
    (ids with their tokens); the vision tokens each side."""
    said: dict[str, Any] = {"image_tokens": {
        "shard": int((got["input_ids"] == image_token).sum()),
        "reference": int((want["input_ids"] == image_token).sum())}}
    for name in ("input_ids", "loss_mask", "modality_mask"):
        a, b = got[name].long().tolist(), want[name].long().tolist()
        if a == b:
            continue
        short = min(len(a), len(b))  # past it, the longer one differs
        at = next((i for i in range(short) if a[i] != b[i]), short)
        lo, hi = max(at - WINDOW, 0), at + WINDOW + 1
        entry: dict[str, Any] = {"lengths": {"shard": len(a), "reference": len(b)},
                                 "first_difference": at, "window_from": lo,
                                 "shard": a[lo:hi], "reference": b[lo:hi]}
        ids = {"shard": got["input_ids"].long().tolist()[lo:hi],
               "reference": want["input_ids"].long().tolist()[lo:hi]}
        entry["tokens"] = {side: tokenizer.convert_ids_to_tokens(v) for side, v in ids.items()}
        if name != "input_ids":
            entry["ids"] = ids
        said[name] = entry
    return said


def _reference(model_dir: Path, rows: list[dict[str, Any]], root: Path, layers: list[int],
               image_token: int) -> dict[int, dict[str, Any]]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hsx_workers.engines.hf_engine import _final_norm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    processor = AutoProcessor.from_pretrained(str(model_dir))
    model: Any = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.bfloat16).to(device).eval()
    n = model.config.get_text_config().num_hidden_layers
    pre_norm: list[Any] = []
    _final_norm(model).register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0]))
    out = {}
    for index, row in enumerate(rows[:GOOD]):
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                     else [{"type": "image", "image": _open(p["image_url"]["url"], root)}
                           if p["type"] == "image_url" else p for p in m["content"]]}
                    for m in row["messages"]]
        enc = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            chat_template=processor.tokenizer.chat_template, return_tensors="pt")
        text = processor.tokenizer.apply_chat_template(
            [{**m, "content": m["content"] if isinstance(m["content"], str) else
              [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
             for m in messages], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)
        inputs = {k: v.to(device) for k, v in enc.items()
                  if k not in ("assistant_masks", "mm_token_type_ids")}
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        with torch.inference_mode():
            pre_norm.clear()
            result = model(**inputs, output_hidden_states=True)
        states = [pre_norm[-1][0] if k == n else result.hidden_states[k][0] for k in layers]
        ids = enc["input_ids"][0].cpu()
        mask = _carried(list(text["input_ids"]), list(text["assistant_masks"]), ids.tolist(),
                        image_token)
        out[index] = {"input_ids": ids, "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                      "processor_loss_mask": enc["assistant_masks"][0].cpu(),
                      "modality_mask": (ids == image_token).to(torch.uint8),
                      "hidden_states": torch.stack(states, dim=1).float().cpu()}
    return out


@pytest.mark.parametrize("arch", sorted(CASES))
def test_image_prompts_through_vllm_on_gpu(arch: str, ray_gpus: None, tmp_path: Path,
                                           record: Any) -> None:
    from collections import Counter

    import torch
    import transformers

    from hsx.dataset import HiddenStatesDataset
    from hsx.modelinfo import read_model_info
    from hsx.output import Output
    from hsx.spec import JobSpec
    from hsx_service.engine_pool import EnginePool
    from hsx_service.errors import JobRefused
    from hsx_service.runner import run_job
    from hsx_workers.engines.vllm.compat import vllm_version

    layers, median_bound, worst_bound = CASES[arch]
    model = make_tiny_model(tmp_path / "model", arch, num_layers=3)
    data = tmp_path / "chats.jsonl"
    rows = make_image_chats(data, GOOD, bad=BAD)
    spec = JobSpec(model=str(model), dataset=str(data), output=str(tmp_path / "out"),
                   layers=layers, max_seq_len=512, unit_tokens=4096,  # type: ignore[arg-type]
                   images={"max_pixels": 2**22},  # type: ignore[arg-type]
                   vllm={"gpu_memory_utilization": 0.3})  # type: ignore[arg-type]
    engines = EnginePool()
    try:
        summary = run_job(spec, pool=engines)
    except JobRefused as err:
        record(f"vision_{arch}", vllm=vllm_version(), refused=str(err))
        pytest.skip(f"{arch}: the job is refused here: {err}")
    finally:
        engines.shutdown()  # the GPU is the reference's next
    output = Output(str(tmp_path / "out"))
    refused = {int(i): str(r) for i, r in zip(
        output.ingest_errors().column("sample_index").to_pylist(),
        output.ingest_errors().column("reason").to_pylist(), strict=True)}
    bad = {e.sample_index: e.reason for e in output.errors()}
    found: dict[str, Any] = {
        "vllm": vllm_version(), "transformers": transformers.__version__, "layers": layers,
        "samples": summary.samples, "errors": summary.errors, "tokens": summary.tokens,
        "bad_reasons": dict(Counter(bad.values()).most_common()),
        "bad_rows": {i: ("ingestion: " if i in refused else "capture: ") + r
                     for i, r in sorted(bad.items())}}
    record(f"vision_{arch}", **found)
    for reason, count in found["bad_reasons"].items():
        print(f"{arch}: {count} row(s) bad: {reason}")
    assert (summary.samples, summary.errors) == (GOOD, len(BAD)), (summary, found["bad_rows"])
    image_token = read_model_info(str(model)).image_token_id
    assert image_token is not None
    ref = _reference(model, rows, data.parent, layers, image_token)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    ds = HiddenStatesDataset(tmp_path / "out", backend="torch")
    errors: dict[str, list[Any]] = {"image": [], "text": []}
    mismatched: dict[int, dict[str, Any]] = {}
    misaligned = []  # the processor's own assistant mask is not the reference's
    for i in range(len(ds)):
        got = ds[i]
        index = int(got["sample_index"])
        want = ref[index]
        if not torch.equal(want["processor_loss_mask"].long(), want["loss_mask"].long()):
            misaligned.append(index)
        same = (torch.equal(got["input_ids"].long(), want["input_ids"].long())
                and torch.equal(got["loss_mask"].long(), want["loss_mask"].long())
                and torch.equal(got["modality_mask"].long(), want["modality_mask"].long()))
        if not same:
            mismatched[index] = _difference(got, want, tokenizer, image_token)
            print(f"{arch}: sample {index} differs: {mismatched[index]}")
            continue
        image = want["modality_mask"].bool()
        for where, rows_ in (("image", image), ("text", ~image)):
            a, b = got["hidden_states"].float()[rows_], want["hidden_states"][rows_]
            errors[where].append((a - b).pow(2).sum((0, 2)).sqrt()
                                  / b.pow(2).sum((0, 2)).sqrt().clamp_min(1e-12))
    state_errors = {where: {"median": torch.stack(e).median(0).values.tolist(),
                            "worst": torch.stack(e).max(0).values.tolist()} if e else None
                    for where, e in errors.items()}
    record(f"vision_{arch}", **found, mismatched_samples=sorted(mismatched),
           mismatches=mismatched, processor_mask_misaligned=misaligned,
           state_errors=state_errors)
    print(f"{arch}: {state_errors}; samples whose ids or masks differ: {sorted(mismatched)}; "
          f"the processor's own assistant mask misplaced in: {misaligned}")
    assert not mismatched, {i: sorted(set(d) - {"image_tokens"}) for i, d in mismatched.items()}
    for where, numbers in state_errors.items():
        assert numbers is not None
        assert max(numbers["median"]) < median_bound, (where, numbers)
        assert max(numbers["worst"]) < worst_bound, (where, numbers)
