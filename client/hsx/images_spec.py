"""`ImageSpec`: a job's `images:` section (hsx.spec.JobSpec), for a vision-language
target: where a dataset's images may come from and how large they may be."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ImageSpec(BaseModel):
    """Images in the dataset's chats, for a vision-language target (docs/MODELS.md,
    "Vision-language targets"). Without this section a row with an image part is a bad
    row: a job reads no image unless it says so.

    An image part is OpenAI's `{"type": "image_url", "image_url": {"url": ...}}` (a file
    path, a `data:` URI, or an http(s) URL of an allowed host), or `{"type": "image"}`
    taking the row's next image from its `images` (or `image`) column, as `datasets`
    loads an image column. Each image is read once, at ingestion, within these bounds (a
    row past one is a bad row naming it), and its bytes are kept in the inputs table:
    the engines never open a path or URL a dataset names.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_per_row: int = Field(
        4, ge=1, le=64, description=(
            "Images one row may hold (vLLM's `limit_mm_per_prompt`); a row with more is a "
            "bad row. At most 64."))
    max_bytes: int = Field(
        16 * 2**20, ge=1, le=2**30, description=(
            "Bytes of one image's file (or `data:` URI, or download); a larger one is a bad "
            "row, measured before it is read. At most 1 GiB."))
    max_pixels: int = Field(
        4096 * 4096, ge=1, le=2**28, description=(
            "Pixels (width x height) of one image, read from its header before it is "
            "decoded: a decompression bomb is a bad row. At most 268,435,456."))
    roots: list[str] = Field(
        default_factory=list, description=(
            "Folders an image's file path may lie in (symlinks resolved); a relative path "
            "is read from the dataset file's folder. Empty: the dataset's own folder only. "
            "A coordinator checks each against its allowed roots."))
    allow_hosts: list[str] = Field(
        default_factory=list, description=(
            "Hosts whose http(s) image URLs ingestion may fetch (`images.example.com`, or "
            "`host:port`). Empty: a row with a remote URL is a bad row; nothing is "
            "fetched. A coordinator takes only hosts its operator allows "
            "(`HSX_IMAGE_HOSTS`)."))

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if not host or "/" in host or "@" in host or host != host.strip().lower():
                raise ValueError(f"{host!r} is not a host name (lowercase, no scheme, path "
                                 "or user)")
        return hosts
