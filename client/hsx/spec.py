"""The job file: what to extract, from which model and dataset, into which output.

`JobSpec` is the one schema a job is written in — the YAML/JSON file that `hsx extract`
reads and (later) the body of `POST /v1/jobs`. Compatibility rule: new fields get
defaults; a breaking change gets a new `version`.

Checks that need only the spec live here (unknown fields, duplicate layer ids, value
ranges). Checks that need the model (layer ids within `0..N`) or the output location
(writable) run in `hsx.preflight` before any engine starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from hsx.images_spec import ImageSpec
from hsx.methods import DEFAULT_METHOD, method_names

# The job file's `train:` section, a module of its own (re-exported here).
from hsx.train_spec import TrainDevice as TrainDevice
from hsx.train_spec import TrainLoss as TrainLoss
from hsx.train_spec import TrainSpec as TrainSpec

EngineName = Literal["vllm", "hf"]
StorageDtype = Literal["bf16", "fp8"]
CheckMode = Literal["on", "warn", "off"]
CHECK_MODES: tuple[str, ...] = get_args(CheckMode)  # the self-check's modes (docs/MODELS.md)


class SpecError(ValueError):
    """A job file that cannot be used; the message names the field and the problem."""


class VllmOptions(BaseModel):
    """Engine settings passed through to vLLM's `LLM(...)` for the `vllm` engine.

    The fields below are the ones hsx documents defaults for. Any other key is an engine
    argument passed to vLLM as it is (`load_format: dummy`, `max_num_seqs`,
    `kv_cache_dtype`, `quantization`, ...): a job that names a key the installed vLLM does
    not know, or one hsx sets itself for capture (`speculative_config`, `model`, ...), is
    refused before any engine starts, naming the key.
    """

    model_config = ConfigDict(extra="allow")

    dtype: str = Field("auto", description=(
        "Model dtype for vLLM (auto, bfloat16, float16, float32). auto: the model's own, "
        "but float32 on a CPU without native bf16 (no AVX-512 BF16 or AMX), where it "
        "computes ~4x faster, for an unquantized model whose float32 weights take at most "
        "a quarter of the host's memory; the shards store storage_dtype either way."))
    max_num_batched_tokens: int | None = Field(
        None, gt=0, le=2**20, description=(
            "vLLM scheduler token budget per step; None lets vLLM choose. At most "
            "1,048,576 (the longest max_seq_len: a larger step only holds more prompts' "
            "activations at once)."))
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="Fraction of GPU memory vLLM may take (GPU only)."
    )
    cpu_kvcache_gib: int = Field(
        1, ge=1, le=4096, description=(
            "KV cache size in GiB for vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE), allocated "
            "when the engine starts. At most 4096 (4 TiB, more than a CPU node's memory)."))
    enforce_eager: bool = Field(False, description="Disable CUDA graphs / torch.compile.")
    max_inflight_tokens: int = Field(
        65536,
        gt=0,
        le=2**24,
        description=(
            "Prompt tokens hsx keeps inside one engine at once (queued, computing, or "
            "waiting in its spool). It bounds the spool in /dev/shm to this many tokens' "
            "states; it must stay well above vLLM's per-step token budget to keep the "
            "engine's batches full. At most 16,777,216 (a spool of that many tokens' "
            "states would outgrow a large node's memory)."
        ),
    )

    def engine_args(self) -> dict[str, Any]:
        """The extra keys: vLLM engine arguments passed through as they are."""
        return dict(self.model_extra or {})


# Ray's label syntax (ray/_private/label_utils.py), checked here without importing Ray.
class RegenerateSpec(BaseModel):
    """Regenerate the assistant turns with the target before capturing them.

    The job's own vLLM engines first answer each conversation (vLLM sampling, with a
    seed per sample derived from `seed` and the sample index, so a retried unit gives
    the same answers), then capture the hidden states over the regenerated conversation
    (the chat template applied to it). The answers are stored per unit beside the
    shard and committed with it (docs/FORMAT.md, "Regenerated conversations").
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature; 0 is greedy decoding."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens "
        "whose probability reaches top_p."
    )
    max_tokens: int = Field(
        512, ge=1, le=2**20, description="At most this many tokens per regenerated turn; a "
        "turn that reaches it is kept and flagged `truncated` (not an error). Below "
        "max_seq_len, so at most 1,048,575."
    )
    seed: int = Field(
        0, ge=0, description="Job seed: each sample's sampling seed is derived from it, the "
        "sample index and the turn (hsx.regenerate.sample_seed)."
    )
    turns: Literal["last", "each"] = Field(
        "last",
        description=(
            "`last`: the last assistant turn is regenerated (messages after it are "
            "dropped). `each`: every assistant turn in order, each answered given the "
            "regenerated turns before it."
        ),
    )


class DatasetSpec(BaseModel):
    """A dataset and the split of it to read: `dataset: {path: ..., split: ...}`.

    `dataset: PATH` is the same as `{path: PATH}`. A dataset with several splits (a
    Hugging Face folder such as UltraChat's `data/train_sft-00000-of-00003.parquet`,
    `data/test_sft-...`; a `save_to_disk` DatasetDict; a hub dataset) is read one split
    at a time, and refused without one, naming its splits (README, "Preparing a dataset").
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(
        ...,
        min_length=1,
        description=(
            "A local file or folder, a bucket object or prefix (s3://bucket/key; gs://, "
            "az://), or a Hugging Face hub id (read with `datasets.load_dataset`)."
        ),
    )
    split: str | None = Field(
        None,
        min_length=1,
        description=(
            "The split to read: `train_sft` for files named `train_sft-00000-of-00003.*`, "
            "a subfolder's path for a folder of split folders, a DatasetDict's split, or "
            "a hub dataset's split. Unset: the dataset must have one split (or none)."
        ),
    )

    def __str__(self) -> str:
        return self.path if self.split is None else f"{self.path} (split {self.split})"


def _dataset_form_of(value: Any) -> str:
    return "str" if isinstance(value, str) else "DatasetSpec"


# A path, or path and split. The discriminator picks the form by the value's type, so a
# mistake in the mapping is reported on its own, not beside "should be a string".
DatasetField = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag("str")]
    | Annotated[DatasetSpec, Tag("DatasetSpec")],
    Discriminator(_dataset_form_of),
]


@dataclass(frozen=True)
class TargetModel:
    """The target a draft is trained against and measured with: its model (config,
    embeddings, head) and whether its own code may run. It comes from the job that
    passed the checks (`JobSpec.target`), or from the person who runs `hsx train`
    (`--trust-remote-code`), never from an output's manifest, which whoever can write
    the output controls."""

    model: str
    trust_remote_code: bool = False


class JobSpec(BaseModel):
    """One extraction job: model x dataset -> per-layer hidden states in `output`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    version: Literal[1] = Field(1, description="Version of this job-file schema.")
    name: str | None = Field(None, description="Optional human name for the job.")
    model: str = Field(
        ..., min_length=1, description="Target model: a local directory or a hub id."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory or hub id when it differs from `model`."
    )
    dataset: DatasetField = Field(
        ...,
        description=(
            "The rows to extract: a .jsonl/.json/.parquet file, a folder of them (one "
            "split at a time of a Hugging Face folder such as UltraChat's `data/`), a "
            "`datasets` save_to_disk folder, a bucket object or prefix (s3://bucket/key, "
            "credentials as for an s3:// output), or a hub id (`datasets.load_dataset`). "
            "A dataset with several splits is named with its split: `{path: ..., split: "
            "train_sft}`. Rows carry `messages`, `prompt`/`text`, or `input_ids` "
            "(optionally `loss_mask`)."
        ),
    )
    output: str = Field(
        ..., min_length=1,
        description=(
            "Output location: a directory path, a file:// URI, or an object-store prefix "
            "(s3://bucket/prefix; credentials and endpoint from the AWS_* variables)."
        ),
    )
    resume_foreign: bool = Field(
        False,
        description=(
            "On a coordinator: adopt an `output` that holds a job (its manifest or its "
            "ingestion) which no job of yours on this coordinator made (`hsx extract`, "
            "another coordinator, or anyone who can write that folder). Its manifest must "
            "then equal this job field by field (model, tokenizer, trust_remote_code, "
            "dataset, layers, engine, max_seq_len, storage_dtype, unit_tokens, "
            "chat_template_kwargs, regenerate); its committed shards are kept as they are. "
            "Off: such an output is refused. `hsx extract` resumes any output of the same "
            "job (its user's own folder)."
        ),
    )
    layers: list[int | str] | None = Field(
        None,
        description=(
            "Layer ids to capture (see docs/FORMAT.md: id k < N is the input of decoder "
            "layer k, id N the last layer's output before the final norm), or draft "
            "methods standing for their ids (`[eagle3, dflash]`: the union, one capture "
            "for both). None: the ids of `train.method` (EAGLE-3's, [2, N//2, N-3, N], "
            "without `train:`)."
        ),
    )
    engine: EngineName = Field("vllm", description="Capture engine: `vllm` (default) or `hf`.")
    max_seq_len: int = Field(
        4096, gt=1, le=2**20, description=(
            "Samples are truncated to this many tokens. At most 1,048,576, the longest "
            "context of today's models (one sample's states at that length are gigabytes "
            "per layer). Unset, 4,096, or as many as the model's positions hold with "
            "vLLM's capture (its max_position_embeddings less 2) when that is fewer.")
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=(
            "Number of engines (Ray actors) running at once. None: as many as fit — on a "
            "GPU cluster its GPUs ÷ tensor_parallel_size, less the trainer's GPUs when "
            "`train:` can run beside the engines; 1 on a CPU cluster. At most 4096 (512 "
            "nodes of 8 GPUs)."
        ),
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=128, description=(
            "GPUs (or CPU ranks) per engine for tensor parallelism. At most 128 (wider than "
            "an NVLink domain: 72 GPUs of a GB200 NVL72).")
    )
    storage_dtype: StorageDtype = Field(
        "bf16", description="How states are stored: `bf16`, or `fp8` (e4m3, per-token scales)."
    )
    checksum: Literal["blake3", "sha256"] = Field(
        "blake3",
        description=(
            "Checksum of every shard, kept in its commit record and verified by readers: "
            "`blake3` (several GB/s per core) or `sha256`."
        ),
    )
    checks: CheckMode = Field(
        "on",
        description=(
            "The self-check of every captured state (docs/MODELS.md): `on` fails the job "
            "at the first state that is NaN/inf, all zero, equal to another layer's or "
            "wildly out of scale, naming the sample and layer; `warn` records it and goes "
            "on; `off` skips it. The manifest says which."
        ),
    )
    unit_tokens: int = Field(
        65536,
        gt=0,
        le=2**24,
        description=(
            "Target tokens per work unit; one unit becomes one shard. A new job's first "
            "units ramp up to it from 8,192 tokens (8,192, 16,384, ...), so its first "
            "shard is committed soon after its engines start. At most 16,777,216 (a unit's "
            "inputs are held by its engine until it commits, and a shard of that many "
            "tokens is hundreds of GB)."
        ),
    )
    ray_address: str | None = Field(
        None,
        description=(
            "Ray cluster address, for `hsx extract` (a coordinator runs jobs on its own "
            "Ray and refuses a submitted job that sets it). None: `RAY_ADDRESS`, else the "
            "cluster a `ray start --head` runs on this machine (joined, and said), else a "
            "private local Ray; `local`: a private local Ray whatever runs here."
        ),
    )
    trust_remote_code: bool = Field(False, description="Allow the model's own Python code.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for the tokenizer's chat template.",
    )
    vllm: VllmOptions = Field(default_factory=VllmOptions, description="vLLM engine settings.")
    train: TrainSpec | None = Field(
        None,
        description=(
            "Train a draft on this output, of its `method` (EAGLE-3 unless it names "
            "another: DFlash, DSpark, P-EAGLE): with `follow` (the default) the trainer "
            "starts with the extraction and keeps up with it."
        ),
    )
    regenerate: RegenerateSpec | None = Field(
        None,
        description=(
            "Answer the dataset's conversations with the target before capture, and "
            "capture over its answers (rows must carry `messages`; engine `vllm`)."
        ),
    )
    images: ImageSpec | None = Field(
        None,
        description=(
            "Take the images of the dataset's chats (a vision-language target: its vision "
            "tower runs, and the shards mark the image tokens), within these bounds. Unset: "
            "a row with an image is a bad row, and a wrapper runs its text path only."
        ),
    )

    @field_validator("dataset")
    @classmethod
    def _dataset_form(cls, dataset: str | DatasetSpec) -> str | DatasetSpec:
        # One form per dataset: `{path: P}` without a split is the plain `P`, so both
        # spellings make the same job (fingerprint, idempotent resubmission).
        if isinstance(dataset, DatasetSpec) and dataset.split is None:
            return dataset.path
        return dataset

    @property
    def dataset_spec(self) -> DatasetSpec:
        """`dataset` as path and split, whichever form the job was written in."""
        if isinstance(self.dataset, DatasetSpec):
            return self.dataset
        return DatasetSpec(path=self.dataset)

    @field_validator("layers")
    @classmethod
    def _layers_unique(cls, layers: list[int | str] | None) -> list[int | str] | None:
        if layers is None:
            return None
        if not layers:
            raise ValueError("layers must not be empty (omit it for the default)")
        for i, k in enumerate(layers):
            if isinstance(k, str) and k not in method_names():
                raise ValueError(f"layers.{i}: {k!r} is neither a layer id nor a draft "
                                 f"method ({', '.join(method_names())})")
        negative = [k for k in layers if isinstance(k, int) and k < 0]
        if negative:
            raise ValueError(f"layer ids must be >= 0, got {negative}")
        dupes = sorted({str(k) for k in layers if layers.count(k) > 1})
        if dupes:
            raise ValueError(f"duplicate layer ids {dupes}")
        # Stored in ascending order whatever order is asked (vLLM emits them sorted),
        # the method names after the ids.
        return sorted(layers, key=lambda k: (isinstance(k, str), str(k).zfill(9)))

    @property
    def layers_method(self) -> str:
        """The method whose ids a job without `layers:` captures."""
        return self.train.method if self.train is not None else DEFAULT_METHOD

    @property
    def target(self) -> TargetModel:
        """The target its draft is trained against and measured with."""
        return TargetModel(self.model, self.trust_remote_code)

    @property
    def trains_online(self) -> bool:
        """Its training is fed by its engines (hsx.online): the job stores no shard."""
        return self.train is not None and self.train.online

    @model_validator(mode="after")
    def _regenerate_engine(self) -> JobSpec:
        if self.regenerate is not None and self.engine != "vllm":
            raise ValueError(
                f"regenerate needs engine `vllm` (it generates with the job's vLLM "
                f"engines); engine is `{self.engine}`")
        if self.regenerate is not None and self.regenerate.max_tokens >= self.max_seq_len:
            raise ValueError(
                f"regenerate.max_tokens ({self.regenerate.max_tokens}) leaves no room for "
                f"the conversation within max_seq_len ({self.max_seq_len})")
        if self.images is not None and self.regenerate is not None:
            raise ValueError("images with regenerate is not built: the answers would be "
                             "generated without the images")
        if self.regenerate is not None and self.train is not None and self.train.online:
            raise ValueError("train.online with regenerate is not built: regenerate first "
                             "(a job without train.online), then train on its output")
        return self

    def data_fingerprint(self) -> str:
        """Hash of the fields that decide the output's content.

        Two specs with the same fingerprint produce the same bytes; `replicas`,
        `ray_address` and engine tuning do not enter it, so a rerun with more replicas
        resumes the same output.
        """
        keys = (
            "model", "tokenizer", "dataset", "layers", "engine", "max_seq_len",
            "storage_dtype", "unit_tokens", "chat_template_kwargs",
        )
        payload = {k: getattr(self, k) for k in keys}
        if isinstance(self.dataset, DatasetSpec):
            payload["dataset"] = self.dataset.model_dump(mode="json")
        if self.regenerate is not None:
            # Only when set: outputs of jobs without it keep their fingerprint.
            payload["regenerate"] = self.regenerate.model_dump(mode="json")
        if self.images is not None:  # the same: only when set
            payload["images"] = self.images.model_dump(mode="json")
        blob = json.dumps(payload, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _format_validation_error(err: ValidationError, help_command: str = "hsx extract") -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(job)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (check the spelling; see `{help_command} --help`)"
        lines.append(f"{field}: {msg}")
    return "; ".join(lines)


_Spec = TypeVar("_Spec", bound=BaseModel)


def _parse(cls: type[_Spec], data: Any, source: str, what: str, command: str) -> _Spec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: {what} must be a mapping of fields, got "
                        f"{type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"{source}: {_format_validation_error(err, command)}") from None


def parse_train(data: dict[str, Any], *, source: str = "train spec") -> TrainSpec:
    """Validate a TrainSpec mapping; raise SpecError naming every bad field."""
    return _parse(TrainSpec, data, source, "a train spec", "hsx train")


def parse_job(data: dict[str, Any], *, source: str = "job") -> JobSpec:
    """Validate a job mapping; raise SpecError naming every bad field."""
    return _parse(JobSpec, data, source, "a job", "hsx extract")


def apply_sets(data: dict[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """`data` with each `KEY=VALUE` of `items` set (a command's `--set`): VALUE is read as
    YAML (`2`, `true`, `{trainer: 1}`), a dotted KEY names a field of a section
    (`train.place=apart`); SpecError for an item that is not KEY=VALUE."""
    out = dict(data)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected key=value")
        *sections, name = key.strip().split(".")
        where = out
        for section in sections:
            inner = where.get(section)
            where[section] = dict(inner) if isinstance(inner, dict) else {}
            where = where[section]
        try:
            where[name] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise SpecError(f"--set {item!r}: the value is not YAML: {err}") from None
    return out


def load_job(path: str | Path, sets: Iterable[str] = ()) -> JobSpec:
    """Read a YAML or JSON job file, with `sets` applied (`apply_sets`). Relative paths
    inside it resolve against its folder."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(f"cannot read job file {p}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(f"{p}: not valid YAML/JSON: {err}") from None
    if isinstance(data, dict):
        data = apply_sets(data, sets)
    spec = parse_job(data, source=str(p))
    return _resolve_relative(spec, p.parent)


def _resolve_relative(spec: JobSpec, base: Path) -> JobSpec:
    def resolve(value: str) -> str:
        if "://" in value:
            return value
        candidate = Path(value).expanduser()
        if candidate.is_absolute():
            return str(candidate)
        local = base / candidate
        # A bare hub id ("org/name") stays as it is unless it exists relative to the file.
        if local.exists() or value.startswith((".", "~")) or value.endswith(
            (".jsonl", ".json", ".parquet")
        ):
            return str(local.resolve())
        return value

    dataset = spec.dataset_spec
    located = resolve(dataset.path)
    updates: dict[str, Any] = {
        "model": resolve(spec.model),
        "dataset": located if dataset.split is None else dataset.model_copy(
            update={"path": located}),
        "output": str((base / spec.output).resolve())
        if "://" not in spec.output and not Path(spec.output).expanduser().is_absolute()
        else spec.output,
    }
    if spec.tokenizer:
        updates["tokenizer"] = resolve(spec.tokenizer)
    if spec.images is not None and spec.images.roots:
        updates["images"] = spec.images.model_copy(update={"roots": [
            str((base / Path(root).expanduser()).resolve()) for root in spec.images.roots]})
    return spec.model_copy(update=updates)
