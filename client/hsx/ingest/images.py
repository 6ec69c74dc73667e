"""The images of a chat row: each image part's source read within the job's bounds
(`hsx.spec.ImageSpec`), or the reason the row is bad; and how many tokens each image
becomes once the model's processor expands its placeholder.

A source is a file path (under `images.roots`, symlinks resolved; a relative path from
the dataset's folder), a `data:` URI, an http(s) URL of a host in `images.allow_hosts`
(fetched, bounded), or the bytes a `datasets` image column holds (`{"bytes", "path"}`).
Its bytes are measured before they are read (a file's size, a URI's length, a
download's length as it streams), and its pixels from its header before it is decoded
(`max_pixels`): a decompression bomb is a bad row, never a process out of memory. The
bytes kept are the source's own (not decoded and encoded again): the inputs table holds
them, so the engines never open a path or URL that a dataset names.

Everything here runs in the processes that tokenize (bounded.py), within the row's CPU
time (limits.py); PIL and transformers are imported inside the functions.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsx.progress import human_bytes

if TYPE_CHECKING:
    from PIL.Image import Image

    from hsx.spec import ImageSpec

FETCH_TIMEOUT_S = 30.0
CHUNK_BYTES = 1 << 20


class ImageRefused(ValueError):
    """An image that cannot be used; the message is the row's reason."""


@dataclass(frozen=True)
class ImagePolicy:
    """Where a job's images may come from and how large they may be (`ImageSpec`, with
    relative paths resolved against `base`, the dataset's folder)."""

    max_per_row: int
    max_bytes: int
    max_pixels: int
    roots: tuple[str, ...]
    allow_hosts: tuple[str, ...] = ()
    base: str | None = None  # relative image paths are read from here

    @classmethod
    def of(cls, spec: ImageSpec, dataset_path: str) -> ImagePolicy:
        """The policy of a job's `images:` over the dataset at `dataset_path` (a local
        file or folder: its folder is the base and, without `roots`, the one root; a
        bucket or hub dataset: no base, and file paths only under `roots`)."""
        local = "://" not in dataset_path and Path(dataset_path).expanduser().exists()
        base = None
        if local:
            path = Path(dataset_path).expanduser().resolve()
            base = str(path if path.is_dir() else path.parent)
        roots = tuple(str(Path(r).expanduser().resolve()) for r in spec.roots) or (
            (base,) if base is not None else ())
        return cls(spec.max_per_row, spec.max_bytes, spec.max_pixels, roots,
                   tuple(spec.allow_hosts), base)


@dataclass
class RowImage:
    """One image of a row, read and checked: its bytes and size in pixels."""

    data: bytes
    width: int
    height: int
    _decoded: Any = field(default=None, repr=False)

    def decoded(self) -> Image:
        """The image as PIL decodes it, in RGB (what processors take)."""
        if self._decoded is None:
            self._decoded = decode(self.data)
        return self._decoded


def read_image(source: Any, policy: ImagePolicy, number: int) -> RowImage:
    """Image `number` (0-based, for the reason) of a row from `source`: read, bounded and
    decoded once to prove it decodes; ImageRefused naming why not."""
    data = _source_bytes(source, policy, number)
    width, height = check_pixels(data, policy.max_pixels, number)
    image = RowImage(data, width, height)
    try:
        image.decoded()
    except Exception as err:  # PIL raises many kinds for a broken file
        raise ImageRefused(f"image {number} cannot be decoded: {type(err).__name__}: "
                           f"{err}") from None
    return image


def check_pixels(data: bytes, max_pixels: int, number: int = 0) -> tuple[int, int]:
    """(width, height) from the image's header, read without decoding it; ImageRefused
    when it is not an image PIL knows or has more than `max_pixels`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:  # the header only
            width, height = img.size
    except Image.DecompressionBombError as err:  # past PIL's own bound, before ours
        claimed = re.search(r"\((\d+) pixels\)", str(err))
        pixels = f"{int(claimed.group(1)):,}" if claimed else "more"
        raise ImageRefused(f"image {number} claims {pixels} pixels in its header, over "
                           f"images.max_pixels ({max_pixels:,}); it was not decoded"
                           ) from None
    except UnidentifiedImageError:
        raise ImageRefused(f"image {number} is not an image file PIL can read (not an "
                           "image, or cut short)") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageRefused(f"image {number} is not an image file PIL can read: {err}"
                           ) from None
    if width * height > max_pixels:
        raise ImageRefused(
            f"image {number} is {width}x{height} = {width * height:,} pixels, over "
            f"images.max_pixels ({max_pixels:,}); it was not decoded")
    return width, height


def decode(data: bytes) -> Image:
    """An image's bytes decoded (its first frame), in RGB. PIL's own bomb guard is
    kept: the header was checked against the job's bound before (`check_pixels`)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def _source_bytes(source: Any, policy: ImagePolicy, number: int) -> bytes:
    if isinstance(source, dict):  # a `datasets` image: {"bytes": ..., "path": ...}
        data = source.get("bytes")
        if isinstance(data, bytes | bytearray):
            return _bounded(bytes(data), policy, number)
        path = source.get("path")
        if isinstance(path, str) and path:
            return _read_file(path, policy, number)
        raise ImageRefused(f"image {number} has neither bytes nor a path")
    if isinstance(source, bytes | bytearray):
        return _bounded(bytes(source), policy, number)
    if not isinstance(source, str) or not source:
        raise ImageRefused(f"image {number} is a {type(source).__name__}, not a path, URL "
                           "or image")
    if source.startswith("data:"):
        return _data_uri(source, policy, number)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch(source, policy, number)
    if scheme == "file":
        return _read_file(urllib.parse.unquote(urllib.parse.urlsplit(source).path), policy,
                          number)
    if scheme and len(scheme) > 1:  # (a Windows drive letter is no scheme)
        raise ImageRefused(f"image {number} is a {scheme}:// URL; images come from files, "
                           "data: URIs and http(s) URLs of images.allow_hosts")
    return _read_file(source, policy, number)


def _bounded(data: bytes, policy: ImagePolicy, number: int) -> bytes:
    if len(data) > policy.max_bytes:
        raise ImageRefused(f"image {number} is {human_bytes(len(data))}, over "
                           f"images.max_bytes ({human_bytes(policy.max_bytes)})")
    return data


def _read_file(name: str, policy: ImagePolicy, number: int) -> bytes:
    given = Path(name).expanduser()
    if not given.is_absolute():
        if policy.base is None:
            raise ImageRefused(f"image {number}: {name} is a relative path, and this "
                               "dataset has no folder to read it from")
        given = Path(policy.base) / given
    path = given.resolve()  # where it really lands: `..` and symlinks resolved
    if not any(path.is_relative_to(root) for root in policy.roots):
        where = ", ".join(policy.roots) or "no folder (set images.roots)"
        raise ImageRefused(f"image {number}: {name} is not inside images.roots ({where})")
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ImageRefused(f"image {number}: {name} is not a file")
        if size > policy.max_bytes:
            raise ImageRefused(f"image {number}: {name} is {human_bytes(size)}, over "
                               f"images.max_bytes ({human_bytes(policy.max_bytes)})")
        with path.open("rb") as f:
            return _bounded(f.read(policy.max_bytes + 1), policy, number)
    except FileNotFoundError:
        raise ImageRefused(f"image {number}: {name} does not exist") from None
    except PermissionError:
        raise ImageRefused(f"image {number}: {name} cannot be read (permission denied)"
                           ) from None


def _data_uri(uri: str, policy: ImagePolicy, number: int) -> bytes:
    head, sep, payload = uri.partition(",")
    if not sep:
        raise ImageRefused(f"image {number} is a data: URI without a comma")
    if len(payload) * 3 // 4 > policy.max_bytes + 3:  # measured before it is decoded
        raise ImageRefused(f"image {number} is a data: URI of about "
                           f"{human_bytes(len(payload) * 3 // 4)}, over images.max_bytes "
                           f"({human_bytes(policy.max_bytes)})")
    if head.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ImageRefused(f"image {number} is a data: URI whose base64 is broken: "
                               f"{err}") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    return _bounded(data, policy, number)


def _fetch(url: str, policy: ImagePolicy, number: int) -> bytes:
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower()
    named = f"{host}:{parts.port}" if parts.port else host
    if host not in policy.allow_hosts and named not in policy.allow_hosts:
        raise ImageRefused(
            f"image {number} is a remote URL ({host or url}); remote images are fetched "
            "only from hosts the job lists in images.allow_hosts")
    import httpx

    try:
        # No redirects: a listed host must not lead to one that is not.
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False
                          ) as response:
            if response.status_code != 200:
                raise ImageRefused(f"image {number}: {url} answered HTTP "
                                   f"{response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes(CHUNK_BYTES):
                size += len(chunk)
                if size > policy.max_bytes:
                    raise ImageRefused(f"image {number}: {url} is over images.max_bytes "
                                       f"({human_bytes(policy.max_bytes)})")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as err:
        raise ImageRefused(f"image {number}: {url} could not be fetched: "
                           f"{type(err).__name__}: {err}") from None


# --------------------------------------------------------------------------- expansion


class ImageTokens:
    """How a model's processor expands an image's placeholder into its vision tokens:
    the token ids each image becomes (`expansion`), and a prompt's ids with every
    placeholder expanded (`expand`). Built from the model's `AutoProcessor`; the
    placeholder is `image_token_id` (hsx.modelinfo.ModelInfo.image_token_id)."""

    def __init__(self, processor: Any, image_token_id: int) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        tokenizer = getattr(processor, "tokenizer", None)
        token = getattr(processor, "image_token", None)
        if not isinstance(token, str) and tokenizer is not None:
            token = tokenizer.convert_ids_to_tokens(image_token_id)
        if not isinstance(token, str):
            raise ValueError("the processor names no image token")
        self.placeholder = token

    @classmethod
    def load(cls, model: str, image_token_id: int, *, trust_remote_code: bool = False
             ) -> ImageTokens:
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code),
                   image_token_id)

    def expansion(self, image: Image) -> list[int]:
        """The token ids the processor makes of one image's placeholder."""
        encoded = self.processor(text=[self.placeholder], images=[image],
                                 add_special_tokens=False)
        ids = encoded["input_ids"][0]
        return [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]

    def expand(self, ids: Sequence[int], expansions: Sequence[Sequence[int]]) -> list[int]:
        """`ids` with its k-th placeholder replaced by `expansions[k]`; ValueError when
        the placeholders are not one per image."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(expansions):
            raise ValueError(placeholder_count(len(at), len(expansions)))
        out: list[int] = []
        last = 0
        for i, expansion in zip(at, expansions, strict=True):
            out.extend(ids[last:i])
            out.extend(expansion)
            last = i + 1
        out.extend(ids[last:])
        return out


def realign(ids: Sequence[int], loss_mask: Sequence[int], engine_ids: Sequence[int],
            image_token_id: int) -> tuple[list[int], list[int]]:
    """The loss mask of `ids` (a prompt as ingestion made it, each image one placeholder
    or already expanded) carried over to `engine_ids` (the tokens an engine computed,
    each placeholder expanded into the image's vision tokens), and which of those are
    vision tokens: (loss mask, modality mask: 1 on a vision token). The two are walked
    side by side; a run of `image_token_id` in one stands for the run in the other.
    Vision tokens are never in the loss. ValueError where the two differ otherwise."""
    mask = [0] * len(engine_ids)
    modality = [0] * len(engine_ids)
    i = j = 0
    while i < len(ids) and j < len(engine_ids):
        if ids[i] == image_token_id and engine_ids[j] == image_token_id:
            while i < len(ids) and ids[i] == image_token_id:
                i += 1
            while j < len(engine_ids) and engine_ids[j] == image_token_id:
                modality[j] = 1
                j += 1
            continue
        if ids[i] != engine_ids[j]:
            raise ValueError(
                f"the engine's token {j} ({engine_ids[j]}) is not the prompt's token {i} "
                f"({ids[i]}): its tokens do not follow the prompt's with its images expanded")
        mask[j] = int(loss_mask[i])
        i += 1
        j += 1
    if i != len(ids) or j != len(engine_ids):
        raise ValueError(f"the engine computed {len(engine_ids)} tokens, which do not end "
                         f"where the prompt's {len(ids)} do with its images expanded")
    return mask, modality


def placeholder_count(found: int, images: int) -> str:
    """The reason a chat whose rendering holds `found` image placeholders for `images`
    images is bad."""
    if found == 0:
        return (f"the chat template wrote no image placeholder for the row's {images} "
                f"image{'s' if images != 1 else ''} (does the template take image parts?)")
    return (f"the rendered chat holds {found} image placeholders for {images} image"
            f"{'s' if images != 1 else ''}: the text itself holds the image token")


@dataclass(frozen=True)
class ImageSettings:
    """What a process that tokenizes needs for a job's images (sent to each one): the
    policy, and the model whose processor expands them (loaded once per process)."""

    policy: ImagePolicy
    model: str
    image_token_id: int
    trust_remote_code: bool = False

    def tokens(self) -> ImageTokens:
        key = (self.model, self.image_token_id, self.trust_remote_code)
        if key not in _PROCESSORS:
            _PROCESSORS.clear()
            _PROCESSORS[key] = ImageTokens.load(self.model, self.image_token_id,
                                                trust_remote_code=self.trust_remote_code)
        return _PROCESSORS[key]


_PROCESSORS: dict[tuple[str, int, bool], ImageTokens] = {}


def check_processor(model: str, image_token_id: int, *, trust_remote_code: bool = False
                    ) -> int:
    """The vision tokens the model's processor makes of a small test image, once it is
    built here as ingestion builds it; ValueError naming why it cannot be (no processor,
    one that needs what is missing here, an expansion without the image token)."""
    from PIL import Image

    try:
        tokens = ImageTokens.load(model, image_token_id, trust_remote_code=trust_remote_code)
        expansion = tokens.expansion(Image.new("RGB", (64, 48), (120, 30, 200)))
    except Exception as err:  # transformers raises many kinds for a processor it lacks
        said = next((line.strip() for line in str(err).splitlines() if line.strip()),
                    "(no message)")
        raise ValueError(f"the model's processor (transformers' AutoProcessor) cannot be "
                         f"used here: {type(err).__name__}: {said}") from None
    count = expansion.count(image_token_id)
    if not count:
        raise ValueError(f"the model's processor expands an image into {expansion[:8]}..., "
                         f"without the image token {image_token_id} of its config")
    return count
