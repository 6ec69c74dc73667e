"""The small JSON objects of an output, typed: the manifest and the commit records.

docs/FORMAT.md is the byte-level description; these models are its one parser. Both
formats allow fields they do not name (FORMAT.md: "new fields are added without a
version change"), so the models keep unknown fields (`extra="allow"`) instead of
refusing them: an output written by a newer hsx of the same format version stays
readable. What they do name is checked, and a file that does not parse raises
`OutputCorrupt` naming it.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hsx.output.layout import FORMAT_VERSION, REGENERATIONS_DIR, SHARDS_DIR
from hsx.plan import WorkUnit


class OutputCorrupt(Exception):
    """An object of an output is not what hsx wrote there: unreadable, or not whole."""


class JobMismatch(ValueError):
    """The output holds another job, or its dataset changed; the message says which."""


class UnitPlan(BaseModel):
    """One planned work unit, as the manifest stores it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: int = Field(..., ge=0, description="Unit number; its shard holds these rows.")
    rows: tuple[int, int] = Field(
        ..., description="Half-open range [start, end) of inputs.arrow rows in the unit."
    )
    tokens: int = Field(..., ge=0, description="Total tokens of those rows.")

    @classmethod
    def of(cls, unit: WorkUnit) -> UnitPlan:
        return cls(unit=unit.unit, rows=(unit.row_start, unit.row_end), tokens=unit.tokens)

    def work_unit(self) -> WorkUnit:
        return WorkUnit(self.unit, self.rows[0], self.rows[1], self.tokens)


class Manifest(BaseModel):
    """manifest.json: the job an output holds. Written once, before any unit runs."""

    model_config = ConfigDict(extra="allow", frozen=True)

    format: Literal["hsx-hidden-states"] = Field("hsx-hidden-states", description="Format name.")
    format_version: int = Field(
        FORMAT_VERSION, description="Format version; a reader refuses one it does not know."
    )
    hsx_version: str = Field(..., description="Version of hsx that prepared the output.")
    job_fingerprint: str = Field(
        ..., description="Hash of the job fields that decide the content; equal on a rerun."
    )
    dataset_fingerprint: str = Field(
        ...,
        description=(
            "Hash of the dataset at ingestion: its files' names, sizes and times (a "
            "bucket's keys, sizes and ETags; a hub split's datasets fingerprint)."
        ),
    )
    model: str = Field(..., description="Target model (directory or hub id).")
    architecture: str = Field(..., description="The model's architecture class.")
    num_layers: int = Field(..., ge=1, description="N, decoder layers of the (text) model.")
    hidden_size: int = Field(..., ge=1, description="H, the hidden size.")
    layers: list[int] = Field(
        ..., min_length=1, description="Layer ids stored, ascending (dimension 1 of states)."
    )
    layer_convention: str = Field(..., description="What a layer id means, in words.")
    storage_dtype: Literal["bf16", "fp8"] = Field(..., description="Dtype of the states.")
    engine: str = Field(..., description="Capture engine that wrote the shards.")
    tokenizer_fingerprint: str = Field(..., description="Hash of the tokenizer files used.")
    max_seq_len: int = Field(..., ge=1, description="Samples were truncated to this length.")
    num_samples: int = Field(..., ge=0, description="Good samples (rows of inputs.arrow).")
    num_errors: int = Field(..., ge=0, description="Rows refused at ingestion (errors.arrow).")
    num_tokens: int = Field(..., ge=0, description="Tokens of all good samples.")
    units: list[UnitPlan] = Field(..., description="The plan: every work unit, in order.")
    created_at: float = Field(..., description="When the output was prepared (Unix time).")
    spec: dict[str, Any] = Field(..., description="The job spec that prepared the output.")
    checks: dict[str, Any] | None = Field(
        None, description="The self-check of the job that prepared the output: `mode` (on, "
        "warn, off) and the `checks` it runs; what it found is in each commit record's "
        "`checks` and complete.json (None: written before the self-check).")
    provenance: dict[str, Any] | None = Field(
        None, description="Where the states came from: `versions` (vllm, torch, "
        "transformers, speculators, hsx), `engine_args` (secret-looking values "
        "redacted), `model_config_sha256` (None: written before provenance).")

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != FORMAT_VERSION:
            raise ValueError(
                f"format_version {version} is not supported (this hsx reads "
                f"{FORMAT_VERSION}); upgrade hsx"
            )
        return version

    @property
    def work_units(self) -> list[WorkUnit]:
        return [u.work_unit() for u in self.units]

    @property
    def tokens_total(self) -> int:
        """Tokens of every planned unit (equals num_tokens)."""
        return sum(u.tokens for u in self.units)

    def differences(self, expected: Mapping[str, Any]) -> list[str]:
        """The names in `expected` whose value this manifest does not hold: a field of the
        manifest, or `spec.NAME` for a field of the job spec it records."""
        def held(name: str) -> Any:
            if name.startswith("spec."):
                return self.spec.get(name.removeprefix("spec."))
            return getattr(self, name, None)

        return [name for name, value in expected.items() if held(name) != value]

    def check_same_job(self, expected: Mapping[str, Any], dataset_fingerprint: str, *,
                       output: str, dataset: str) -> None:
        """JobMismatch unless the job of `expected` (the fields a manifest of it holds,
        as `differences` names them) may resume this output: every one equal, field by
        field, and the dataset unchanged. A fingerprint alone is not enough: whoever can
        write the output can copy the fingerprint of a harmless job beside a spec of
        their own, and the manifest's spec is what an earlier hsx ran from."""
        differ = self.differences(expected)
        if differ:
            raise JobMismatch(
                f"output: {output} already holds a different job ({', '.join(differ)} "
                "differ from this job's); choose another output or remove that one"
            )
        if self.dataset_fingerprint != dataset_fingerprint:
            raise JobMismatch(
                f"dataset: {dataset} changed since {output} was started (its files' "
                "names, sizes, times or ETags differ); choose another output to extract "
                "the new version"
            )

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        return _parse(cls, data, where)


class IngestRecord(BaseModel):
    """ingest.json: the ingestion an output's inputs parts come from, written once when
    it starts, so that a driver that finds parts and no manifest knows whose they are
    and how to go on (docs/FORMAT.md, "Inputs in parts")."""

    model_config = ConfigDict(extra="allow")

    format_version: int = Field(FORMAT_VERSION, description="Version of the output format.")
    job_fingerprint: str = Field("", description="The job's (Manifest.job_fingerprint); "
                                 "empty when the tables were ingested outside a job.")
    dataset_fingerprint: str = Field(..., description="As in the manifest.")
    tokenizer_fingerprint: str = Field(..., description="As in the manifest.")
    max_seq_len: int = Field(..., ge=1)
    keep_messages: bool = Field(False, description="The inputs keep each conversation.")
    images: bool = Field(False, description="The inputs keep each row's images (a job "
                         "with `images:`); absent in records of jobs that take none.")
    rows_per_part: int = Field(..., ge=1, description="Good samples in each inputs part "
                               "but the last: row r of the inputs is row r % rows_per_part "
                               "of part r // rows_per_part.")
    slice_bytes: int = Field(0, ge=0, description="How JSON lines were cut into slices "
                             "(0: the default); a resumed ingestion cuts the same way.")
    first_unit_tokens: int = Field(0, ge=0, description="How the job's first units are "
                                   "cut (hsx.plan): the first at this many tokens, each "
                                   "next at twice the last, up to unit_tokens; 0 (records "
                                   "older than the rule): every unit at unit_tokens. A "
                                   "resumed ingestion plans by it.")
    created_at: float = Field(..., description="Unix time.")

    def check_same(self, other: IngestRecord, *, output: str) -> None:
        """JobMismatch unless `other` would ingest the same tables as this one (how they
        are cut into parts and slices is this record's to say: `other` follows it)."""
        for name in ("job_fingerprint", "dataset_fingerprint", "tokenizer_fingerprint",
                     "max_seq_len", "keep_messages", "images"):
            if getattr(self, name) != getattr(other, name):
                raise JobMismatch(
                    f"output: {output} holds the inputs of another ingestion ({name} "
                    "differs: another job, a changed dataset or tokenizer); choose another "
                    "output or remove that one")

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes, where: str) -> IngestRecord:
        return _parse(cls, data, where)


class PartRecord(BaseModel):
    """inputs/part-NNNNN.json: one part of the inputs and errors tables is whole. Written
    after both tables, so a part exists exactly when its record does."""

    model_config = ConfigDict(extra="allow")

    part: int = Field(..., ge=0)
    samples: int = Field(..., ge=0, description="Rows of inputs/part-NNNNN.arrow.")
    errors: int = Field(..., ge=0, description="Rows of errors/part-NNNNN.arrow.")
    rows_end: int = Field(..., ge=0, description="Source rows read through this part: "
                          "the sample_index the next part starts at.")
    tokens: int = Field(..., ge=0)
    loss_tokens: int = Field(..., ge=0)
    truncated: int = Field(..., ge=0, description="Samples cut to max_seq_len.")
    next_slice: int = Field(..., ge=0, description="Where the source goes on: this slice "
                            "(as ingest.json's slice_bytes cut it) ...")
    next_slice_row: int = Field(..., ge=0, description="... from this row of it.")
    last: bool = Field(False, description="The dataset ends with this part.")

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes, where: str) -> PartRecord:
        return _parse(cls, data, where)


class Checksum(BaseModel):
    """The digests of a shard: `header` over bytes [0, 8 + N), `data` over the data
    section's bytes after hidden_states (`scheme` "samples": those hold each sample's
    digest) or, in records without a scheme, over the whole data section."""

    model_config = ConfigDict(extra="allow", frozen=True)

    algorithm: str = Field(..., description="blake3 or sha256.")
    scheme: str = Field("whole", description="What `data` covers: samples or whole.")
    header: str = Field(..., description="Lowercase hex digest of the header bytes.")
    data: str = Field(..., description="Lowercase hex digest of the data section.")


class SampleError(BaseModel):
    """A sample with no hidden states, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sample_index: int = Field(..., ge=0, description="Row of the sample in the source dataset.")
    reason: str = Field(..., description="Why it has no hidden states, in words.")


def _key_in(key: str, folder: str, what: str) -> str:
    """`key` if it names an object directly inside `folder`, else ValueError."""
    parts = key.split("/")
    if len(parts) != 2 or parts[0] != folder or parts[1] in ("", ".", ".."):
        raise ValueError(f"names bad {what} {key!r}")
    return key


class RegenerationsRef(BaseModel):
    """The table of a unit's regenerated conversations, named by its commit record."""

    model_config = ConfigDict(extra="allow", frozen=True)

    key: str = Field(..., description="The table's key, relative to the output.")
    sha256: str = Field(..., description="Lowercase hex SHA-256 of the whole table file.")
    rows: int = Field(..., ge=0, description="Regenerated samples in it.")
    bytes: int = Field(..., ge=0, description="Size of the table file.")
    tokens: int = Field(0, ge=0, description="Tokens the engine generated for them.")
    truncated: int = Field(0, ge=0, description="Samples with a turn cut at max_tokens.")

    @field_validator("key")
    @classmethod
    def _key_in_folder(cls, key: str) -> str:
        return _key_in(key, REGENERATIONS_DIR, "regenerations table")


class UnitChecks(BaseModel):
    """The self-check's numbers for one unit (docs/FORMAT.md, "Self-check")."""

    model_config = ConfigDict(extra="allow", frozen=True)

    mode: Literal["on", "warn", "off"] = Field(..., description="The job's `checks:`.")
    samples: int = Field(0, ge=0, description="Samples checked.")
    problems: int = Field(0, ge=0, description="Problems found (under `warn`; `on` stops).")
    found: list[str] = Field(default_factory=list,
                             description="The first problems, in words (sample, layer, what).")
    head_samples: int = Field(0, ge=0, description="Samples the head check took.")
    head_rows: int = Field(0, ge=0, description="Rows of id N it compared with the engine's "
                           "own next token (lm_head(norm(h_N)) against its top-1).")
    head_agreed: int = Field(0, ge=0, description="Of those, rows that agreed.")
    head_missing: str = Field("", description="Why the head check did not run (id N not "
                              "captured, a head hsx cannot read); empty when it ran.")


class CommitRecord(BaseModel):
    """commits/unit-XXXXXX.json: the record that makes one unit's shard visible."""

    model_config = ConfigDict(extra="allow", frozen=True)

    unit: int = Field(..., ge=0, description="The unit committed.")
    shard: str = Field(..., description="The shard's key, relative to the output.")
    attempt: str = Field(..., description="The attempt that won the commit.")
    samples: int = Field(..., ge=0, description="Samples in the shard.")
    tokens: int = Field(..., ge=0, description="Tokens in the shard.")
    bytes: int = Field(..., ge=0, description="Size of the shard in bytes.")
    checksum: Checksum | None = Field(
        None, description="Digests of the shard (records before it carry *_sha256)."
    )
    header_sha256: str | None = Field(None, description="Older records: header SHA-256.")
    data_sha256: str | None = Field(None, description="Older records: data SHA-256.")
    sample_indices_first: int | None = Field(
        None, description="First sample_index in the shard (None without samples)."
    )
    sample_indices_last: int | None = Field(
        None, description="Last sample_index in the shard (None without samples)."
    )
    errors: list[SampleError] = Field(
        default_factory=list, description="The unit's samples that could not be extracted."
    )
    committed_at: str = Field("", description="When the record was created (ISO 8601).")
    regenerations: RegenerationsRef | None = Field(
        None, description="A regenerating job's answers of this unit (None otherwise)."
    )

    checks: UnitChecks | None = Field(
        None, description="What the self-check looked at in this unit (None: records "
        "written before it, or by a writer that does not check)."
    )

    @field_validator("shard")
    @classmethod
    def _shard_in_shards(cls, shard: str) -> str:
        return _key_in(shard, SHARDS_DIR, "shard")

    def checksums(self) -> tuple[str, str, str]:
        """(algorithm, header digest, data digest), from `checksum` or older records' keys."""
        if self.checksum is not None:
            return self.checksum.algorithm, self.checksum.header, self.checksum.data
        if self.header_sha256 is not None and self.data_sha256 is not None:
            return "sha256", self.header_sha256, self.data_sha256
        raise OutputCorrupt(f"commit record of unit {self.unit} has no checksum")

    def checksum_scheme(self) -> str:
        """What the data digest covers: "samples" or "whole" (older records)."""
        return self.checksum.scheme if self.checksum is not None else "whole"

    def to_json(self) -> builtins.bytes:
        legacy = {"header_sha256", "data_sha256"} if self.checksum is not None else None
        return self.model_dump_json(indent=1, exclude=legacy).encode() + b"\n"

    @classmethod
    def parse(cls, data: builtins.bytes, where: str) -> CommitRecord:
        return _parse(cls, data, where)


def _parse(model: type[Any], data: bytes, where: str) -> Any:
    try:
        return model.model_validate_json(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'document'}: {e['msg']}"
            for e in err.errors()[:3]
        )
        raise OutputCorrupt(f"{where} is not a valid hsx {model.__name__}: {problems}") from None
