"""Rows with images, without an engine: where an image may come from, the bounds that
make a row bad (count, bytes, pixels read from the header, a path out of the roots, a
remote host not allowed), the vision tokens counted in `length` as the model's
processor expands them, truncation that never cuts an image, the loss mask carried over
to an engine's expanded ids, and the modality mask in a shard (under its digest)."""

from __future__ import annotations

import base64
import http.server
import io
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx.ingest import ingest
from hsx.ingest.images import ImagePolicy, ImageSettings, check_pixels, realign
from hsx.output import Output, ShardReader, ShardWriter
from hsx.output.shards import ShardCorrupt
from hsx.spec import ImageSpec
from hsx_workers.tiny_models import make_tiny_model, write_rows
from hsx_workers.tiny_models.vision import COLOURS, LLAVA_IMAGE_TOKENS, png_bytes, write_png

IMAGE_ID = 511  # the tiny Llava's <image>: the vocabulary's last id


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Config, tokenizer and processor: all ingestion reads of a model."""
    return make_tiny_model(tmp_path_factory.mktemp("llava"), "llava", num_layers=2,
                           weights=False)


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(*parts: Any, answer: str = "It is red.") -> dict[str, Any]:
    content = [p if isinstance(p, dict) else {"type": "image_url", "image_url": {"url": p}}
               for p in parts] + [{"type": "text", "text": "What colour?"}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": answer}]}


def _run(rows: list[Any], llava: Path, tmp_path: Path, *, fmt: str = "jsonl",
         max_seq_len: int = 256, **spec: Any) -> tuple[list[dict[str, Any]], dict[int, str]]:
    suffix = {"jsonl": ".jsonl", "hf": ""}[fmt]
    data = write_rows(rows, tmp_path / f"data{suffix}", fmt)  # type: ignore[arg-type]
    images = ImageSettings(ImagePolicy.of(ImageSpec(**spec), str(data)), str(llava), IMAGE_ID)
    out = tmp_path / "out"
    ingest(str(data), str(llava), max_seq_len, out, images=images)
    output = Output(str(out))
    errors = {r["sample_index"]: r["reason"] for r in output.ingest_errors().to_pylist()}
    return output.inputs().to_pylist(), errors


def test_images_from_files_uris_and_a_datasets_column(llava: Path, tmp_path: Path) -> None:
    red = png_bytes(COLOURS["red"])
    write_png(tmp_path / "a.png", COLOURS["blue"])
    rows = [_chat("a.png"), _chat(_uri(red)), _chat(str(tmp_path / "a.png"), _uri(red))]
    inputs, errors = _run(rows, llava, tmp_path)
    assert not errors, errors
    assert [len(r["images"]) for r in inputs] == [1, 1, 2]
    assert inputs[1]["images"] == [red]  # the source's own bytes, not decoded and encoded
    assert inputs[0]["images"][0] == (tmp_path / "a.png").read_bytes()
    for row in inputs:
        placeholders = row["input_ids"].count(IMAGE_ID)
        assert placeholders == len(row["images"])
        # Each placeholder becomes the processor's 16 vision tokens in the length.
        assert row["length"] == len(row["input_ids"]) + placeholders * (LLAVA_IMAGE_TOKENS - 1)

    # As `datasets` loads an image column: parts without a source take the row's images.
    import datasets

    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"),
                                   "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image())})
    from PIL import Image

    table = {"messages": [[{"role": "user", "content": [{"type": "image", "text": None},
                                                        {"type": "text", "text": "Colour?"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]],
             "images": [[Image.open(io.BytesIO(red))]]}
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(folder))
    images = ImageSettings(ImagePolicy.of(ImageSpec(), str(folder)), str(llava), IMAGE_ID)
    ingest(str(folder), str(llava), 256, tmp_path / "hf-out", images=images)
    (row,) = Output(str(tmp_path / "hf-out")).inputs().to_pylist()
    assert len(row["images"]) == 1 and row["length"] == len(row["input_ids"]) + 15


def _huge_header_png(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height pixels (a decompression bomb's)."""
    data = bytearray(png_bytes(COLOURS["red"], (8, 8)))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4:ihdr + 13]))
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


def test_bounds_make_bad_rows_naming_the_image(llava: Path, tmp_path: Path) -> None:
    (tmp_path / "inside").mkdir()
    write_png(tmp_path / "inside" / "ok.png", COLOURS["green"])
    write_png(tmp_path / "outside.png", COLOURS["green"])
    (tmp_path / "inside" / "link.png").symlink_to(tmp_path / "outside.png")
    bomb = _huge_header_png(100_000, 100_000)
    assert len(bomb) < 200
    rows = [
        _chat("ok.png"),
        _chat("ok.png", "ok.png", "ok.png"),  # over max_per_row
        _chat(_uri(bomb)),
        _chat(_uri(b"\0" * 3000)),  # over max_bytes
        _chat("../outside.png"),
        _chat("link.png"),
        _chat("https://img.example.com/a.png"),
        _chat("s3://bucket/a.png"),
        _chat("missing.png"),
        _chat({"type": "image_url", "image_url": {"url": "ok.png"}}, answer="x") | {
            "messages": [{"role": "user", "content": "Look."},
                         {"role": "assistant", "content": [{"type": "image_url",
                                                            "image_url": {"url": "ok.png"}}]}]},
        _chat({"type": "text", "text": "<image>"}, "ok.png"),  # the text holds the token
    ]
    data = tmp_path / "inside" / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    images = ImageSettings(ImagePolicy.of(ImageSpec(max_per_row=2, max_bytes=2500,
                                                    max_pixels=10**6), str(data)),
                           str(llava), IMAGE_ID)
    ingest(str(data), str(llava), 256, tmp_path / "out", images=images)
    output = Output(str(tmp_path / "out"))
    errors = {r["sample_index"]: r["reason"] for r in output.ingest_errors().to_pylist()}
    assert [r["sample_index"] for r in output.inputs().to_pylist()] == [0]
    expected = {
        1: "the row holds 3 images, over images.max_per_row (2)",
        2: "image 0 claims 10,000,000,000 pixels in its header, over images.max_pixels "
           "(1,000,000); it was not decoded",
        3: "image 0 is a data: URI of about 2.9 KiB, over images.max_bytes (2.4 KiB)",
        4: f"image 0: ../outside.png is not inside images.roots ({tmp_path / 'inside'})",
        5: f"image 0: link.png is not inside images.roots ({tmp_path / 'inside'})",
        6: "image 0 is a remote URL (img.example.com); remote images are fetched only from "
           "hosts the job lists in images.allow_hosts",
        7: "image 0 is a s3:// URL; images come from files, data: URIs and http(s) URLs of "
           "images.allow_hosts",
        8: "image 0: missing.png does not exist",
        9: "message 1 is an assistant message with an image: a draft is trained on what "
           "the assistant writes, which is text",
        10: "the rendered chat holds 2 image placeholders for 1 image: the text itself "
            "holds the image token",
    }
    for index, reason in expected.items():
        assert errors.get(index, "").startswith(reason.split(" (")[0]), (index, errors)
        assert errors[index] == reason or index == 3, (index, errors[index])
    assert "over images.max_bytes" in errors[3]


def test_check_pixels_reads_the_header_only() -> None:
    with pytest.raises(ValueError, match="9000x9000 = 81,000,000 pixels"):
        check_pixels(_huge_header_png(9_000, 9_000), 10**7)
    assert check_pixels(png_bytes(COLOURS["red"], (64, 48)), 64 * 48) == (64, 48)


@pytest.fixture
def image_server(tmp_path: Path) -> Iterator[str]:
    """A loopback HTTP server of tmp_path's files: `127.0.0.1:<port>`."""
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,),
                   {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_remote_images_only_from_allowed_hosts(llava: Path, tmp_path: Path,
                                               image_server: str) -> None:
    write_png(tmp_path / "small.png", COLOURS["red"])
    write_png(tmp_path / "big.png", COLOURS["red"], size=(900, 900))
    rows = [_chat(f"http://{image_server}/small.png"), _chat(f"http://{image_server}/big.png"),
            _chat(f"http://{image_server}/none.png")]
    inputs, errors = _run(rows, llava, tmp_path / "a", allow_hosts=[image_server],
                          max_bytes=(tmp_path / "small.png").stat().st_size + 10)
    assert [r["sample_index"] for r in inputs] == [0]
    assert inputs[0]["images"] == [(tmp_path / "small.png").read_bytes()]
    assert "is over images.max_bytes" in errors[1]
    assert errors[2].endswith("answered HTTP 404")
    _, refused = _run(rows[:1], llava, tmp_path / "b")
    assert "images.allow_hosts" in refused[0]


def test_truncation_never_cuts_an_image(llava: Path, tmp_path: Path) -> None:
    write_png(tmp_path / "a.png", COLOURS["red"])
    long_answer = " ".join(["red"] * 60)
    inputs, errors = _run([_chat("a.png", answer=long_answer), _chat(
        {"type": "text", "text": "word " * 60}, "a.png")], llava, tmp_path, max_seq_len=64)
    (row,) = inputs
    assert row["length"] == 64 and len(row["input_ids"]) == 64 - (LLAVA_IMAGE_TOKENS - 1)
    assert 0 < sum(row["loss_mask"]) < 60
    assert errors[1].startswith("its images end at token ") and "an image is never cut" \
        in errors[1]


def test_realign_carries_the_mask_over_the_expanded_images() -> None:
    ids = [0, 7, IMAGE_ID, 8, IMAGE_ID, 9, 10, 11]
    mask = [0, 0, 0, 0, 0, 0, 1, 1]
    engine = [0, 7, *[IMAGE_ID] * 3, 8, *[IMAGE_ID] * 2, 9, 10, 11]
    got_mask, modality = realign(ids, mask, engine, IMAGE_ID)
    assert got_mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert modality == [0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0]
    assert realign(engine, got_mask, engine, IMAGE_ID) == (got_mask, modality)  # expanded
    with pytest.raises(ValueError, match="not the prompt's token"):
        realign(ids, mask, [0, 7, IMAGE_ID, 5, 9, 10, 11], IMAGE_ID)
    with pytest.raises(ValueError, match="do not end where"):
        realign(ids, mask, engine[:-1], IMAGE_ID)


def test_a_shard_keeps_each_tokens_modality_under_its_digest(tmp_path: Path) -> None:
    states = np.ones((5, 1, 8), np.float32)
    modality = np.array([0, 1, 1, 0, 0], np.uint8)
    with ShardWriter(tmp_path, 0, layers=[1], hidden_size=8, storage_dtype="bf16",
                     modality=True) as w:
        w.add(3, [1, 2, 2, 4, 5], [0, 0, 0, 1, 1], states, modality_mask=modality)
        w.add(4, [1, 4, 5], [0, 1, 1], states[:3])  # a text sample: all zeros
        record = w.commit().record
    with ShardWriter(tmp_path / "text", 0, layers=[1], hidden_size=8,
                     storage_dtype="bf16") as text:
        with pytest.raises(ValueError, match="opened without modality=True"):
            text.add(1, [1, 2, 3, 4, 5], [0] * 5, states, modality_mask=modality)
        text.abort()
    path = tmp_path / record.shard
    reader = ShardReader(path)
    assert reader.has_modality
    assert reader.sample(0)["modality_mask"].tolist() == modality.tolist()
    assert reader.sample(1)["modality_mask"].tolist() == [0, 0, 0]
    # The digest covers it: a flipped modality byte is named with its sample.
    start = reader._data_start + reader._tensors["modality_mask"]["data_offsets"][0]
    reader.close()
    data = bytearray(path.read_bytes())
    data[start + 1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match="sample 0"):
        ShardReader(path).sample(0)


def test_held_out_image_prompts_carry_their_images(llava: Path, tmp_path: Path) -> None:
    """eval-draft's prompts of an output with images: each image prompt with the images
    of the placeholders it holds (vLLM's multi_modal_data), text prompts without; and
    the acceptance of each modality from vLLM's counters read between them."""
    from hsx.spec import TrainSpec
    from hsx_workers.acceptance import _rates, held_out_prompts

    red = png_bytes(COLOURS["red"])
    text = {"messages": [{"role": "user", "content": "Name a colour."},
                         {"role": "assistant", "content": "Red."}]}
    _run([_chat(_uri(red)), text, _chat(_uri(red), _uri(red)), text], llava, tmp_path)
    output = Output(str(tmp_path / "out"))
    prompts, source = held_out_prompts(output, TrainSpec(val_fraction=0.0), 8,
                                       image_token=IMAGE_ID)
    assert source.startswith("training samples")
    assert [p.modality for p in prompts] == ["image", "text", "image", "text"]
    for prompt in prompts:
        assert prompt.token_ids.count(IMAGE_ID) == len(prompt.images or [])
    assert prompts[2].images == [red, red]
    rates = _rates((30, 90, 45, [20, 15, 10]), (10, 30, 5, []))
    assert rates["drafts"] == 20 and rates["accepted_tokens"] == 40
    assert rates["mean_acceptance_length"] == 3.0
    assert rates["acceptance_per_position"] == [1.0, 0.75, 0.5]
