"""`hsx export --format specforge --method M`: an hsx output in SpecForge's offline layout.

SpecForge (0.2) trains offline from one file per sample, which its
`scripts/prepare_hidden_states.py` writes and its `OfflineManifestReader` lists
(`specforge/runtime/data_plane/offline_reader.py`: every `*.ckpt` under the folder,
sorted by path); `feature_store.load_feature_file` reads one with `torch.load`:

```
DEST/
  rows_{g}-{g+2000}/data_{i}.ckpt   torch.save of one sample's dict (below)
  hsx_sample_index.json             [hsx sample index of export index i, ...]
  hsx_export.json                   where it came from; the layers in both numberings
```

Each strategy names its own features (its `OfflineCaptureLayout` in
`specforge/algorithms/<strategy>/providers.py`; hsx's method holds them,
`DraftMethod.specforge_features`), all per token of the sample, unshifted:

| strategy | auxiliary layers, concatenated [1, T, n*H] | post-norm final state [1, T, H] |
|---|---|---|
| eagle3 | `aux_hidden_state` | `hidden_state` |
| dflash | `hidden_states` | (none) |
| dspark | `hidden_states` | `target_last_hidden_states` |

beside `input_ids` [T] and `loss_mask` [T] (int64). The post-norm state is the one after
the target's final norm (SpecForge's capture takes it where the head reads it); hsx stores
id N before that norm, so the export applies the norm read from the target's checkpoint
(hsx.finalnorm) in float32 and stores bf16, as every state here is. SpecForge counts a
layer's output, hsx a layer's input: its layer ids are hsx's minus one (docs/FORMAT.md);
hsx_export.json and the printed hint give both.

`i` is the export index (the i-th committed sample, as for speculators);
`hsx_sample_index.json` lists the hsx sample index of each. SpecForge lists the files in
path order (data_10 before data_2), which no offline trainer depends on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.finalnorm import FinalNorm, FinalNormUnavailable
from hsx.methods import all_methods
from hsx.methods import method as draft_method
from hsx.output.shards import MODALITY_MASK

SAMPLE_INDICES = "hsx_sample_index.json"
SPECFORGE_GROUP = 2000  # files per rows_{g}-{g+2000} folder (SpecForge's --file-group-size)


def specforge_file(index: int) -> str:
    """Where SpecForge's capture writes sample `index` (`_get_file_path` of its
    prepare_hidden_states.py), relative to its output folder."""
    group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
    return f"rows_{group}-{group + SPECFORGE_GROUP}/data_{index}.ckpt"


@dataclass
class SpecForgeWriter:
    """Writes one strategy's records; `final_norm` makes its post-norm feature."""

    method: str
    aux_feature: str
    last_feature: str | None
    final_norm: FinalNorm | None

    @classmethod
    def for_method(cls, method: str, model: str) -> SpecForgeWriter:
        """The writer of `method`'s records; ValueError when SpecForge has no such
        strategy, or it needs the post-norm state and the target's norm cannot be read
        (the export refuses with its words)."""
        # SpecForge's offline record of the strategy (its OfflineCaptureLayout): the
        # feature of the auxiliary layers (concatenated), that of the post-norm state.
        features = draft_method(method).specforge_features
        if features is None:
            held = [m.name for m in all_methods() if m.specforge_features is not None]
            raise ValueError(f"SpecForge's layout holds {', '.join(held)} drafts, not "
                             f"{method!r}")
        aux, last = features
        norm = None
        if last is not None:
            try:
                norm = FinalNorm.load(model)
            except FinalNormUnavailable as err:
                raise ValueError(
                    f"SpecForge's {method} data holds the target's state after its final "
                    f"norm, which hsx makes from id N with the norm in the target's "
                    f"checkpoint; reading it from {model!r} failed: {err}. Pass --model "
                    "with a local copy of the target") from None
        return cls(method, aux, last, norm)

    def write(self, ds: Any, out: Path, staging: Path, layers: list[int], picks: list[int],
              on_progress: Callable[[int, int], None] | None
              ) -> tuple[int, int, int, dict[str, Any]]:
        """One file per committed sample; returns (samples, tokens, bytes of the files,
        the record's words on them). `staging` is unused: each file is whole when made."""
        import torch

        from hsx.output.local_storage import make_output_dirs

        total = len(ds)
        written = tokens = nbytes = 0
        indices: list[int] = []
        for i, sample in enumerate(ds):
            hidden = sample["hidden_states"]  # [T, L, H] bf16; fp8 already dequantized
            if hidden.dim() != 3 or hidden.shape[1] <= max(picks):
                raise RuntimeError(f"sample {sample['sample_index']}: hidden_states shape "
                                   f"{tuple(hidden.shape)} does not hold layers {layers}")
            t = int(hidden.shape[0])
            record = {
                "input_ids": sample["input_ids"].to(torch.int64),
                "loss_mask": sample["loss_mask"].to(torch.int64),
                self.aux_feature: hidden[:, picks[:-1]].reshape(1, t, -1).contiguous(),
            }
            if self.last_feature is not None:
                assert self.final_norm is not None
                post = self.final_norm.apply(hidden[:, picks[-1]]).to(hidden.dtype)
                record[self.last_feature] = post.reshape(1, t, -1).contiguous()
            if MODALITY_MASK in sample:  # a job that took images
                record[MODALITY_MASK] = sample[MODALITY_MASK].to(torch.int64)
            path = out / specforge_file(i)
            if i % SPECFORGE_GROUP == 0:  # the first file of its folder
                make_output_dirs(path.parent)
            torch.save(record, path)
            indices.append(int(sample["sample_index"]))
            written += 1
            tokens += t
            nbytes += path.stat().st_size
            if on_progress is not None:
                on_progress(written, total)
        features = {"input_ids": "[T] int64", "loss_mask": "[T] int64",
                    self.aux_feature: f"[1, T, {len(layers) - 1}*H] bf16: layers "
                                      f"{layers[:-1]} (hsx ids) concatenated"}
        if self.last_feature is not None:
            features[self.last_feature] = (f"[1, T, H] bf16: the target's final norm "
                                           f"applied to id {layers[-1]}")
        if ds.takes_images:
            features[MODALITY_MASK] = "[T] int64: 1 on an image's vision tokens"
        (out / SAMPLE_INDICES).write_text(json.dumps(indices) + "\n")
        return written, tokens, nbytes, {
            "strategy": self.method,
            "files": {"samples": f"rows_{{g}}-{{g+{SPECFORGE_GROUP}}}/data_{{i}}.ckpt",
                      "features": features, "sample_indices": SAMPLE_INDICES},
        }
