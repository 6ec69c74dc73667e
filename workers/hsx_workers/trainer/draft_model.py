"""The draft model: speculators' model of the training's method for an output's target
(the method builds it: hsx.methods), and its vocabulary mapped from the training
samples' token counts.

Embeddings and lm_head come from the target (speculators' `load_verifier_weights`);
d2t/t2d from the frequencies of loss-masked tokens of the training samples
(speculators' `build_vocab_mappings_from_distribution`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from hsx.methods import DEFAULT_METHOD, DraftInputs, draft_aux_layers
from hsx.output import Manifest, Output
from hsx.spec import TargetModel, TrainSpec
from hsx_workers.trainer.plan import TrainRefused


class _EagerFrameInOneLine(logging.Filter):
    """dynamo's warning that it runs a frame eagerly, cut to one line: the frame and the
    exception's first two lines. dynamo writes the whole traceback twice into it; a GPU
    DSpark training's log held 2,522 such lines for six frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg if isinstance(record.msg, str) else ""
        if text.startswith("WON'T CONVERT"):
            error = record.exc_info[1] if record.exc_info else None
            lines = [x.strip() for x in str(error or "").splitlines() if x.strip()]
            why = f"{type(error).__name__}: {' '.join(lines[:2])[:300]}" if error else "?"
            record.msg = "torch.compile runs %s eagerly: %s"
            record.args = (text.splitlines()[0].removeprefix("WON'T CONVERT ").strip(), why)
            record.exc_info = record.exc_text = None
        return True


def eager_frames_in_one_line() -> None:
    """Make dynamo's notes of frames it runs eagerly one line each (in this process)."""
    log = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(f, _EagerFrameInOneLine) for f in log.filters):
        log.addFilter(_EagerFrameInOneLine())


def draft_layout(manifest: Manifest, method: str = DEFAULT_METHOD) -> tuple[list[int], int]:
    """(aux layer ids, num_layers N) for a `method` draft trained on this output, or
    TrainRefused naming what the output lacks."""
    n = manifest.num_layers
    try:
        return draft_aux_layers(manifest.layers, n, method), n
    except ValueError as err:
        raise TrainRefused(str(err)) from None


def layer_picks(manifest: Manifest, method: str = DEFAULT_METHOD) -> list[int]:
    """Where the draft's auxiliary ids sit on a sample's layer axis (N is the last)."""
    aux, _ = draft_layout(manifest, method)
    return [manifest.layers.index(k) for k in aux]


def token_frequencies(output: Output, exclude: Sequence[int] = ()) -> Counter[int]:
    """Counts of loss-masked tokens of every ingested sample but `exclude` (what the
    draft must say)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    table = output.inputs()
    if exclude:
        keep = pc.invert(pc.is_in(table.column("sample_index"),
                                  value_set=pa.array(list(exclude), pa.int64())))
        table = table.filter(keep)
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    chosen = ids[mask.astype(bool)]
    values, counts = np.unique(chosen, return_counts=True)
    return Counter(dict(zip(values.tolist(), counts.tolist(), strict=True)))


def vocab_mappings(
    freqs: Counter[int], draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(d2t, t2d, draft vocab size); no mappings when the draft keeps the whole vocab."""
    if draft_vocab_size >= target_vocab_size:
        return None, None, target_vocab_size
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        dict(freqs), draft_vocab_size, target_vocab_size
    )
    return d2t, t2d, draft_vocab_size


def build_draft_model(output: Output, manifest: Manifest, spec: TrainSpec,
                      device: torch.device, exclude: Sequence[int],
                      target: TargetModel) -> Any:
    """A new draft for `target` (the job's model, trained on this output), its
    vocabulary mapped from the loss-masked tokens of every sample but `exclude` (the
    held-out ones); on the CPU until moved."""
    from transformers import AutoConfig

    aux, _ = draft_layout(manifest, spec.method)
    model_path, trust = target.model, target.trust_remote_code
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
    text_config = getattr(config, "text_config", None) or config
    layers = spec.num_layers or spec.draft.default_draft_layers
    freqs = token_frequencies(output, exclude=exclude)
    if not freqs:
        raise TrainRefused(f"{output}: no loss-masked token in inputs.arrow")
    vocab = int(text_config.vocab_size)
    d2t, t2d, draft_vocab = vocab_mappings(freqs, spec.draft_vocab_size, vocab)
    torch.manual_seed(spec.seed)
    # speculators' own choice on GPU (flex attention, compiled); eager on CPU, where
    # flex attention has no fast kernel.
    attn = "simple_flex_attention" if device.type == "cuda" else "eager"
    if device.type == "cuda":
        # speculators compiles the draft's forward; with torch 2.11 dynamo fails to
        # trace its fused loss's Triton kernel ("ListVariable ... already tracked for
        # mutation", seen on an H200). A frame dynamo cannot compile then runs eagerly
        # instead of ending the training.
        from torch._dynamo import config as dynamo_config

        dynamo_config.suppress_errors = True
        eager_frames_in_one_line()
    model = spec.draft.build(DraftInputs(
        text_config=text_config, spec=spec, num_layers=layers, aux=aux, t2d=t2d, d2t=d2t,
        draft_vocab=draft_vocab, model_path=model_path, trust_remote_code=trust, attn=attn))
    # speculators starts the draft's lm_head as the target's but its final norm at
    # ones: a head that is neither. Starting the norm as the target's too makes the
    # draft's head the target's own (what it predicts), which matters where the
    # target's final norm has outlier weights, as real models' do.
    with torch.no_grad():
        model.norm.weight.copy_(model.verifier_norm.weight)
    return model
