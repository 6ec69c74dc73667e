"""Names of the objects in a job's output location (see docs/FORMAT.md).

The same keys on local disk and in an object store (`s3://bucket/prefix/<key>`); only
`.tmp/` (local staging) is a local-disk thing. The trainer writes `draft/` on a file
system; for an object-store output it trains in a local folder and uploads each finished
checkpoint and the draft beside it, each folder ending with its `uploaded.json`
(`hsx.draft.BucketDraft`).

```
<output>/
  manifest.json                    job description: model, layer ids, dtype, units
  ingest.json                      the ingestion the inputs come from (fingerprints, part size)
  inputs/part-00000.arrow          good samples, in parts of rows_per_part rows:
                                   sample_index, input_ids, loss_mask, length
  inputs/part-00000.json           the part's record: it exists once both tables of the part do
  errors/part-00000.arrow          the part's bad rows from ingestion: sample_index, reason
  (inputs.arrow, errors.arrow      the tables whole, as outputs written before the parts hold them)
  shards/unit-000042-<attempt>.safetensors   one shard per work unit
  regenerations/unit-000042-<attempt>.arrow  a regenerating job's answers of that unit
  commits/unit-000042.json         the commit record that makes that shard visible
  complete.json                    written once every unit is committed
  .tmp/                            in-progress files (local disk); never read by readers
  draft/                           the draft trained on it (speculators format):
    config.json, model.safetensors   the best checkpoint by validation; vLLM loads this folder
    checkpoints/step-000200/         whole checkpoints (weights, trainer_state.pt, metrics.json)
    metrics.jsonl                    one record per logged step
    validation.jsonl                 one record per validation (at each checkpoint)
    visits.jsonl                     one record per step: its epoch and the samples it trained
    train.json                       the trainer's state, plan, best checkpoint
    eval.json                        the draft's acceptance in vLLM on held-out prompts
    uploaded.json                    in a bucket: written last, names the files of draft/
                                     (and of each checkpoint folder) a reader may take
```
"""

from __future__ import annotations

import re

FORMAT_NAME = "hsx-hidden-states"
FORMAT_VERSION = 1
SHARD_FORMAT_NAME = "hsx-shard"

MANIFEST = "manifest.json"
INPUTS = "inputs.arrow"  # the whole tables of outputs written before inputs/ parts
ERRORS = "errors.arrow"
INGEST = "ingest.json"
INPUTS_DIR = "inputs"
ERRORS_DIR = "errors"
COMPLETE = "complete.json"
SHARDS_DIR = "shards"
REGENERATIONS_DIR = "regenerations"
COMMITS_DIR = "commits"
TMP_DIR = ".tmp"
DRAFT_DIR = "draft"
DRAFT_CHECKPOINTS = "draft/checkpoints"
DRAFT_METRICS = "draft/metrics.jsonl"
DRAFT_STATE = "draft/train.json"
DRAFT_VALIDATION = "draft/validation.jsonl"
DRAFT_VISITS = "draft/visits.jsonl"  # one record per step: the samples it trained
DRAFT_EVAL = "draft/eval.json"
DRAFT_STOP = "draft/.stop"  # asks a running (distributed) training to checkpoint and stop
CHECKPOINT_METRICS = "metrics.json"  # in each checkpoint folder
DRAFT_UPLOADED = "uploaded.json"  # in a bucket: draft/'s and each checkpoint's, written last

# Layer-id convention recorded in the manifest (docs/FORMAT.md, "manifest.json").
LAYER_CONVENTION = (
    "id k < N: residual stream entering decoder layer k (= HF output_hidden_states[k]); "
    "id N: last decoder layer output before the final norm"
)


def unit_name(unit: int) -> str:
    return f"unit-{unit:06d}"


def commit_path(unit: int) -> str:
    return f"{COMMITS_DIR}/{unit_name(unit)}.json"


def shard_path(unit: int, attempt: str) -> str:
    return f"{SHARDS_DIR}/{unit_name(unit)}-{attempt}.safetensors"


def inputs_part_path(part: int) -> str:
    return f"{INPUTS_DIR}/part-{part:05d}.arrow"


def errors_part_path(part: int) -> str:
    return f"{ERRORS_DIR}/part-{part:05d}.arrow"


def part_record_path(part: int) -> str:
    return f"{INPUTS_DIR}/part-{part:05d}.json"


def regenerations_path(unit: int, attempt: str) -> str:
    return f"{REGENERATIONS_DIR}/{unit_name(unit)}-{attempt}.arrow"


_UNIT_KEY = re.compile(
    rf"^(?:{SHARDS_DIR}/unit-(\d{{6,}})-[A-Za-z0-9_.]+\.safetensors"
    rf"|{REGENERATIONS_DIR}/unit-(\d{{6,}})-[A-Za-z0-9_.]+\.arrow)$")


def unit_of_key(key: str) -> int | None:
    """The unit an attempt's object (`shard_path`, `regenerations_path`) belongs to, or
    None for any other key."""
    m = _UNIT_KEY.match(key)
    return None if m is None else int(m.group(1) or m.group(2))


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"
