"""Export an hsx output into another tool's offline-data layout: the pipeline, and
speculators' layout (SpecForge's is hsx/export_specforge.py, picked by `fmt`).

`hsx export --format speculators URI DEST` lets a speculators user train on hsx data with
speculators' own `speculators train --data-path DEST` and no hsx at training time. The
layout is the one speculators 0.9 reads, taken from its source (not from its docs):

```
DEST/
  data-00000-of-00001.arrow, dataset_info.json, state.json
        a `datasets` save_to_disk folder, torch format, one row per exported sample:
        input_ids list<int64>, loss_mask list<int64>, seq_len int64, hsx_sample_index int64
  hidden_states/hs_{i}.safetensors
        sample i: hidden_states [seq, L, H] bf16 and token_ids [seq] int64
  token_freq.pt   {token_id: count} over loss-masked tokens (torch.save)
  hsx_export.json where it came from; target_layer_ids to pass to speculators
```

Where each piece comes from in speculators 0.9.0 (site-packages/speculators unless
noted):

- The dataset folder: `train/data.py` `ArrowDataset.__init__` calls
  `datasets.load_from_disk(datapath)`; `_compute_approx_lengths` reads the `seq_len`
  column; `_get_raw_data` reads `self.data[index]["input_ids"]` (compared with
  `torch.equal`, so the torch format must be saved with the dataset, as
  `data_generation/preprocessing.py` `build_speculator_training_dataset` does with
  `set_format(type="torch")`) and `["loss_mask"]`; `_append_row` there stores
  input_ids and loss_mask as int64 and `seq_len` as the row length.
- The hidden-state files: `ArrowDataset` defaults to
  `hs_connectors.FileTransfer(Path(datapath) / "hidden_states")` (hs_connectors 0.9.0,
  `transfer.py`), whose `get_cached(file_idx)` loads `hs_{file_idx}.safetensors` with
  `safetensors.torch.load_file`; `file_idx` is the dataset row (plus the split start,
  `ArrowDataset._map_to_file_idx`), so file i belongs to row i. `cli/generate_offline_data.py`
  `_worker` writes the same names, and vLLM's `ExampleHiddenStatesConnector` writes the
  two tensors (`hidden_states` [seq, n_layers, hidden], `token_ids` int64).
- Layer order: `ArrowDataset._get_raw_data` takes `hidden_states[:, :-1]` as the
  auxiliary layers (flattened to [seq, n_aux * H]) and `hidden_states[:, -1]` as
  `verifier_last_hidden_states`, the target's last layer before its final norm. hsx
  stores layer ids ascending with id N (the last layer, pre-norm) last, so the hsx
  tensor is already in that order; an output whose last id is not N is refused.
  speculators' `--target-layer-ids` are the auxiliary ids only
  (`train/config/schema.py`, "excluding the final layer launch_vllm.py appends").
- `token_freq.pt`: `train/vocab_mapping.py` `save_token_frequency_distribution`
  (counts of loss-masked token ids, `torch.save` of a dict); `train/cli.py`
  `_generate_vocab_mappings` reads `<data-path>/token_freq.pt` to build d2t/t2d when
  `--draft-vocab-size` is given.

Export index i is the i-th committed sample of `HiddenStatesDataset(URI)` (ascending
`sample_index` for a finished output); the `hsx_sample_index` column maps it back.
Samples without hidden states (hsx error lists) are not exported. fp8 outputs are
dequantized to bf16: speculators' own fp8 files have one scale per token over all layers
(`hs_connectors/fp8_utils.py`), hsx has one per token and layer, so the scales cannot be
carried over as they are.

This module imports only the standard library (and hsx.methods) at import time; torch,
safetensors and datasets (which any speculators install has) are imported when an export runs.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hsx.methods import DEFAULT_METHOD, draft_aux_layers
from hsx.methods import method as draft_method
from hsx.output.shards import MODALITY_MASK

logger = logging.getLogger(__name__)

EXPORT_RECORD = "hsx_export.json"
"""Written last into DEST; its presence marks a directory as an hsx export, which is what
`force=True` requires before it deletes anything."""

HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
DRAFT_VOCAB = 32000  # hsx's own default (TrainSpec.draft_vocab_size)
SAMPLE_INDEX_COLUMN = "hsx_sample_index"
SPECULATORS_FORMAT = "speculators"
SPECFORGE_FORMAT = "specforge"
FORMATS = (SPECULATORS_FORMAT, SPECFORGE_FORMAT)


def specforge_layer_ids(layers: list[int]) -> list[int]:
    """hsx layer ids in SpecForge's numbering, which counts a layer's output (hsx's id k,
    the input of layer k, is SpecForge's k - 1; docs/FORMAT.md)."""
    return [k - 1 for k in layers]


class ExportError(Exception):
    """The export was refused before anything was written (bad source or destination)."""


@dataclass
class ExportSummary:
    """What an export wrote; `as_dict()` is what `hsx export --json` prints."""

    dest: str
    source: str
    samples: int
    tokens: int
    bytes: int
    layers: list[int]
    target_layer_ids: list[int]
    source_storage_dtype: str
    source_complete: bool
    not_exported: int
    seconds: float
    model: str = ""  # the target the states came from (the manifest's)
    trust_remote_code: bool = False
    method: str | None = None  # the draft method whose layers were exported (None: all)
    format: str = SPECULATORS_FORMAT

    def as_dict(self) -> dict[str, Any]:
        if self.format == SPECFORGE_FORMAT:
            return {**asdict(self), "specforge_layer_ids": self.specforge_layer_ids,
                    "train_hint": self.specforge_hint()}
        return {**asdict(self), "train_command": self.train_command(),
                "fix_command": self.fix_command()}

    @property
    def specforge_layer_ids(self) -> list[int]:
        return specforge_layer_ids(self.target_layer_ids)

    def specforge_hint(self) -> str:
        """What a SpecForge run on this export sets: the data, the strategy, the layers."""
        key = draft_method(self.method or DEFAULT_METHOD).specforge_layer_key
        return (f"specforge train --config RECIPE.yaml data.hidden_states_path="
                f"{shlex.quote(self.dest)} training.strategy={self.method} "
                f"model.target_model_path={shlex.quote(self.model)}, with "
                f"{key} = {self.specforge_layer_ids} in the draft config")

    def train_command(self) -> str:
        """speculators' own trainer on this export, every argument spelled out: the
        target, the data, the auxiliary layers, the vocabulary mapping from the
        exported token counts (hsx's default draft vocabulary, capped at the target's),
        and the samples' states read only from the files (a sample without them is an
        error, never generated from a vLLM endpoint)."""
        dest = shlex.quote(self.dest)
        draft_vocab_size = min(DRAFT_VOCAB, _vocab_size(self.model) or DRAFT_VOCAB)
        parts = [
            f"speculators train --speculator-type {self.method or DEFAULT_METHOD}",
            f"--verifier-name-or-path {shlex.quote(self.model)}",
            *(["--trust-remote-code"] if self.trust_remote_code else []),
            f"--data-path {dest}",
            "--target-layer-ids " + " ".join(str(i) for i in self.target_layer_ids),
            f"--token-freq-path {shlex.quote(str(Path(self.dest) / TOKEN_FREQ))}",
            f"--draft-vocab-size {draft_vocab_size}",
            "--on-missing raise",
            # speculators 0.9's fused loss kernel fails under torch.compile with torch
            # 2.11 (dynamo: "... already tracked for mutation", seen on an H200); its
            # eager loss trains the same draft.
            "--loss-implementation eager",
            f"--save-path {shlex.quote(self.draft_path())}",
        ]
        return " ".join(parts)

    def draft_path(self) -> str:
        """Where the printed `speculators train` saves its drafts (one folder per epoch)."""
        return self.dest.rstrip("/") + "-draft"

    def fix_command(self) -> str:
        """Run after training, before vLLM loads the draft (see `fix_speculators_draft`)."""
        return f"hsx fix-draft {shlex.quote(self.draft_path())}"


def _vocab_size(model: str) -> int | None:
    """The vocabulary size in a local model folder's config.json (its text config's for
    a wrapper); None for a hub id or a folder without one."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    size = text.get("vocab_size", config.get("vocab_size"))
    return int(size) if size else None


def fix_speculators_draft(path: str | Path) -> list[Path]:
    """Make every draft speculators saved under PATH load in vLLM as it was trained;
    returns the config.json files it changed.

    What vLLM would read wrongly is the draft's method's to say
    (`DraftMethod.fix_draft_config`): speculators 0.9 records an EAGLE-3 draft's
    auxiliary layer count where vLLM 0.25's Llama EAGLE-3 does not read it, so a draft
    on 2 or 4 auxiliary layers failed to load ("Tried to load weights of size [H, 2H] to
    a parameter of size [H, 3H]"). A draft that needs nothing is left alone (the command
    is idempotent)."""
    changed = []
    for config_path in sorted(Path(path).rglob("config.json")):
        config = json.loads(config_path.read_text())
        if not _fixed(config):
            continue
        staged = config_path.with_name(f".config.json.{uuid.uuid4().hex}")
        staged.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(staged, config_path)
        changed.append(config_path)
    return changed


def draft_aux_count_unread(draft: str | Path) -> bool:
    """True when vLLM would read the speculators draft in DRAFT (a folder with
    config.json) wrongly; see `fix_speculators_draft`."""
    try:
        return _fixed(json.loads((Path(draft) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def _fixed(config: dict[str, Any]) -> bool:
    """Whether the draft's method changed `config` (in place) for vLLM; False for a
    config of no method hsx knows."""
    try:
        chosen = draft_method(str(config.get("speculators_model_type") or ""))
    except ValueError:
        return False
    return chosen.fix_draft_config(config)


def hs_file_name(index: int) -> str:
    """The file speculators' FileTransfer.get_cached(index) opens (hs_connectors/transfer.py)."""
    return f"hs_{index}.safetensors"


def export_output(
    uri: str | Path,
    dest: str | Path,
    *,
    fmt: str = SPECULATORS_FORMAT,
    force: bool = False,
    allow_incomplete: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    method: str | None = None,
    model: str | None = None,
) -> ExportSummary:
    """Write the hsx output at `uri` into `dest` in `fmt`'s offline-data layout:
    speculators' (above) or SpecForge's (hsx/export_specforge.py).

    Streams one sample at a time (memory does not grow with the dataset) into a hidden
    staging directory beside `dest`, which is renamed to `dest` only when everything is
    written, so `dest` never holds a half export. `dest` must be absent or empty; with
    `force=True` it may also be an earlier hsx export (it has hsx_export.json), which is
    replaced. A job that is still running (no complete.json) is refused unless
    `allow_incomplete`, since the export would silently miss its later shards.
    `on_progress(done, total)` is called after each sample. `method` (hsx.methods):
    only the layers a draft of that method reads, and N (an output captured for several
    methods holds more); None: every stored layer (SpecForge's layout is per method:
    None is EAGLE-3 there). `model`: where to read the target's final norm for
    SpecForge's post-norm features (default: the manifest's model). Raises ExportError
    when refused before writing.
    """
    from hsx.dataset import HiddenStatesDataset

    started = time.monotonic()
    from hsx.output import OutputCorrupt, StorageError
    from hsx.output.local_storage import make_output_dirs

    try:
        # One shard mapped at a time: the export reads each shard once, in order, and
        # keeping old mappings would make the process's RSS grow with the output.
        ds = HiddenStatesDataset(uri, backend="torch", max_open_shards=1)
    except (FileNotFoundError, ValueError, StorageError, OutputCorrupt) as err:
        raise ExportError(str(err)) from None
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: hsx exports {', '.join(FORMATS)}")
    stored, num_layers = _check_source(ds, allow_incomplete=allow_incomplete)
    layers = stored
    if fmt == SPECFORGE_FORMAT:
        method = method or DEFAULT_METHOD
    if method is not None:
        try:
            layers = [*draft_aux_layers(stored, num_layers, method), num_layers]
        except ValueError as err:
            raise ExportError(f"{ds.uri}: {err}") from None
    picks = [stored.index(k) for k in layers]
    writer: Callable[..., tuple[int, int, int, dict[str, Any]]] = _write
    if fmt == SPECFORGE_FORMAT:
        from hsx.export_specforge import SpecForgeWriter

        assert method is not None
        try:
            writer = SpecForgeWriter.for_method(method, model or ds.manifest.model).write
        except ValueError as err:
            raise ExportError(str(err)) from None
    dest_path = Path(dest).expanduser().resolve()
    source_root = ds.output.local_root
    _check_dest(dest_path, source_root.resolve() if source_root else None, force=force)

    total = len(ds)
    dest_path.parent.mkdir(parents=True, exist_ok=True)
    staging = dest_path.parent / f".{dest_path.name}.hsx-export-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        out = staging / "export"
        # dest is this folder, renamed: its mode keeps the exported states as private as
        # an output's (HSX_OUTPUT_MODE), whatever modes datasets gives the files inside.
        make_output_dirs(out)
        written, tokens, nbytes, described = writer(ds, out, staging, layers, picks,
                                                    on_progress)
        if written != total:
            raise RuntimeError(f"expected {total} samples, wrote {written}")
        record = {
            "format": f"{fmt}-offline-data",
            "exported_by": f"hsx {_hsx_version()}",
            "source": str(uri),
            "source_format_version": ds.manifest.format_version,
            "job_fingerprint": ds.manifest.job_fingerprint,
            "model": ds.manifest.model,
            "architecture": ds.manifest.architecture,
            "num_layers": num_layers,
            "hidden_size": ds.manifest.hidden_size,
            "layers": layers,
            "target_layer_ids": layers[:-1],
            **({"specforge_layer_ids": specforge_layer_ids(layers[:-1])}
               if fmt == SPECFORGE_FORMAT else {}),
            "method": method,
            "source_storage_dtype": ds.manifest.storage_dtype,
            "hidden_states_dtype": "bf16",
            "source_complete": ds.complete,
            "samples": written,
            "tokens": tokens,
            **described,
        }
        (out / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        # One sync for all files (instead of an fsync per file, costly for millions of
        # small files), so that dest never appears with contents still in the page cache.
        os.sync()
        _publish(out, dest_path, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    return ExportSummary(
        dest=str(dest_path), source=str(uri), samples=written, tokens=tokens, bytes=nbytes,
        layers=layers, target_layer_ids=layers[:-1],
        source_storage_dtype=ds.manifest.storage_dtype,
        source_complete=ds.complete, not_exported=len(ds.errors()),
        seconds=time.monotonic() - started, model=ds.manifest.model,
        # Printed in the command the user runs (`train_command`), never run here.
        trust_remote_code=bool(ds.manifest.spec.get("trust_remote_code")), method=method,
        format=fmt,
    )


def _check_source(ds: Any, *, allow_incomplete: bool) -> tuple[list[int], int]:
    """Refuse outputs speculators would misread; returns (layer ids, N)."""
    layers, num_layers = list(ds.manifest.layers), ds.manifest.num_layers
    if len(layers) < 2:
        raise ExportError(
            f"{ds.uri}: layers {layers}: speculators needs at least one auxiliary layer "
            "and the last layer"
        )
    if layers != sorted(set(layers)):
        raise ExportError(f"{ds.uri}: layers {layers} are not ascending and distinct")
    if layers[-1] != num_layers:
        # speculators/train/data.py ArrowDataset._get_raw_data: hidden_states[:, -1] is the
        # target's last layer; anything else would train the draft on the wrong state.
        raise ExportError(
            f"{ds.uri}: the last stored layer is {layers[-1]}, but speculators reads the "
            f"last one as the target's final layer (id {num_layers} = N); re-extract with "
            f"{num_layers} in layers"
        )
    if not ds.complete and not allow_incomplete:
        raise ExportError(
            f"{ds.uri}: the job is not complete (no complete.json; {len(ds)} samples "
            "committed so far); wait for it, or pass --allow-incomplete to export what "
            "is committed now"
        )
    if len(ds) == 0:
        raise ExportError(f"{ds.uri}: no committed samples to export")
    return layers, num_layers


def _check_dest(dest: Path, source: Path | None, *, force: bool) -> None:
    """Refuse a destination whose contents an export would clobber or that overlaps the
    source (`source`: the output's folder, None for an object store)."""
    if source is not None and (
            dest == source or dest.is_relative_to(source) or source.is_relative_to(dest)):
        raise ExportError(f"{dest}: the destination must not contain or lie inside the source")
    if not dest.exists():
        return
    if not dest.is_dir():
        raise ExportError(f"{dest} exists and is not a directory")
    if not any(dest.iterdir()):
        return
    if not force:
        raise ExportError(f"{dest} is not empty; pass --force to replace an earlier export")
    if not (dest / EXPORT_RECORD).is_file():
        raise ExportError(
            f"{dest} is not empty and is not an hsx export (no {EXPORT_RECORD}); "
            "refusing to delete it even with --force"
        )


def _write(
    ds: Any,
    out: Path,
    staging: Path,
    layers: list[int],
    picks: list[int],
    on_progress: Callable[[int, int], None] | None,
) -> tuple[int, int, int, dict[str, Any]]:
    """Stream every sample (the stored layers at `picks`: `layers`) into
    hs_{i}.safetensors and the inputs dataset; returns (samples, tokens, bytes of
    hidden-state files, the record's words on them)."""
    import datasets
    import torch
    from datasets.arrow_writer import ArrowWriter
    from safetensors.torch import save

    from hsx.output.local_storage import make_output_dirs

    columns = {
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
        SAMPLE_INDEX_COLUMN: datasets.Value("int64"),
    }
    images = ds.takes_images  # the modality of each token, as the shards say it
    if images:
        columns[MODALITY_MASK] = datasets.Sequence(datasets.Value("int64"))
    features = datasets.Features(columns)
    total = len(ds)
    freq: Counter[int] = Counter()
    written = tokens = nbytes = 0
    layers_meta = json.dumps(layers)
    inputs_tmp = staging / "inputs.arrow"
    make_output_dirs(out / HIDDEN_STATES_DIR)
    with ArrowWriter(features=features, path=str(inputs_tmp)) as writer:
        for i, sample in enumerate(ds):
            hidden = sample["hidden_states"]  # [T, L, H] bf16; fp8 already dequantized
            if hidden.dim() != 3 or hidden.shape[1] <= max(picks):
                raise RuntimeError(
                    f"sample {sample['sample_index']}: hidden_states shape "
                    f"{tuple(hidden.shape)} does not hold layers {layers}"
                )
            if len(picks) != hidden.shape[1]:
                hidden = hidden[:, picks]
            ids = sample["input_ids"].to(torch.int64)
            mask = sample["loss_mask"].to(torch.int64)
            data = save(
                {"hidden_states": hidden.contiguous(), "token_ids": ids},
                metadata={
                    "hsx_sample_index": str(sample["sample_index"]), "hsx_layers": layers_meta,
                },
            )
            (out / HIDDEN_STATES_DIR / hs_file_name(i)).write_bytes(data)
            row = {
                "input_ids": ids.tolist(), "loss_mask": mask.tolist(),
                "seq_len": int(ids.shape[0]), SAMPLE_INDEX_COLUMN: int(sample["sample_index"]),
            }
            if images:
                row[MODALITY_MASK] = sample[MODALITY_MASK].to(torch.int64).tolist()
            writer.write(row)
            masked = ids[mask.bool()]
            if masked.numel():
                uniq, counts = masked.unique(return_counts=True)
                freq.update(dict(zip(uniq.tolist(), counts.tolist(), strict=True)))
            written += 1
            tokens += int(ids.shape[0])
            nbytes += len(data)
            if on_progress is not None:
                on_progress(written, total)
        writer.finalize()

    table = datasets.Dataset.from_file(str(inputs_tmp))
    # speculators compares torch tensors (ArrowDataset._get_raw_data); the format is
    # stored in state.json and restored by load_from_disk.
    table.set_format(type="torch")
    table.save_to_disk(str(out))
    del table
    torch.save(dict(freq), out / TOKEN_FREQ)
    return written, tokens, nbytes, {
        "sample_index_column": SAMPLE_INDEX_COLUMN,
        "files": {
            "dataset": "datasets.save_to_disk (torch format)",
            "hidden_states": f"{HIDDEN_STATES_DIR}/hs_{{i}}.safetensors",
            "token_freq": TOKEN_FREQ,
        },
    }


def _publish(out: Path, dest: Path, staging: Path) -> None:
    """Move the finished export to `dest`, replacing an empty dir or an earlier export."""
    previous = staging / "previous"
    if dest.exists():
        if any(dest.iterdir()):
            # Checked by _check_dest: an earlier export and force=True. Move it aside first
            # so dest is missing only between two renames, never half-written.
            dest.rename(previous)
        else:
            dest.rmdir()
    try:
        out.rename(dest)
    except OSError:
        if previous.exists():  # put the earlier export back; the caller drops staging
            previous.rename(dest)
        raise


def _hsx_version() -> str:
    from hsx import __version__

    return __version__
