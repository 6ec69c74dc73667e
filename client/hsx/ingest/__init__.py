"""Dataset ingestion: rows -> token ids, loss masks and lengths, plus a table of bad rows.

`ingest` reads a dataset (JSONL, Parquet, a Hugging Face `save_to_disk` folder or hub
dataset; on local disk or in a bucket; one split at a time: sources.py), tokenizes each
row and writes two Arrow IPC files into the output (through `hsx.output.Output`, which
owns their schemas and readers):

- `inputs.arrow`: one row per good sample — sample_index, input_ids, loss_mask, length —
  in ascending sample_index. It travels with the hidden states, so a trainer needs
  nothing but the output location.
- `errors.arrow`: one row per bad row — sample_index, reason — always written, possibly
  empty. Together the two account for every row of the dataset exactly once.

A row carries one of these fields, tried in this order:

- `input_ids` (pre-tokenized; optional `loss_mask` of the same length, else all ones),
- `messages` (OpenAI style `{role, content}`) or `conversations` (ShareGPT style
  `{from, value}`, human -> user, gpt -> assistant): rendered with the tokenizer's chat
  template; the loss mask is 1 exactly on what each assistant turn produces,
- `prompt` or `text`: plain text, tokenized without a template; loss mask all ones.

`sample_index` is a row's 0-based position in the source (across files, in sorted
order), so an error names the line a person can look up. Rows that cannot be used are
recorded with a plain-sentence reason and skipped; the ingestion goes on. So are rows
over the limits of limits.py, which bound what one row may cost whoever wrote the
dataset and the chat template: a line or row over `HSX_MAX_ROW_BYTES` (never read
whole), a chat whose template renders more than that, or takes more than
`HSX_TEMPLATE_SECONDS` of CPU (interrupted).

Memory stays constant in the number of rows: rows are read, tokenized and written
`batch_rows` at a time. A dataset is read as independent slices (byte ranges of JSON
lines, runs of Parquet row groups, Arrow files: `DatasetSource.slices`), which `ingest`
can tokenize on several processes (`workers`) and writes back in order: the tables are
byte for byte those of one process. This package imports no torch, vllm or ray; transformers is
imported inside the functions that load a tokenizer.

- sources.py: where a dataset's rows come from (`resolve_source`: local files and
  folders, bucket objects and prefixes, `save_to_disk` folders, hub ids; which split),
  its rows in source order, its fingerprint, and the check before any engine starts
  (`check_dataset`); the files it reads and their folders are datafiles.py's, the rows
  read from each kind of file readers.py's;
- rows.py: what a row asks for (pre-tokenized ids, a conversation, plain text), or
  why it is bad;
- limits.py: what one row may cost (bytes, rendered bytes, template CPU time), from
  the environment, and the time limit on a thread's rendering;
- tokenizer.py: the tokenizer, its fingerprint, and chats rendered with its template
  into token ids and assistant masks;
- samples.py: a batch of rows into samples (template, assistant mask, truncation) or
  the reasons they are skipped, and the same for other callers
  (`tokenize_conversations`, `estimate_tokens`);
- estimate.py: `bounded_estimate`, the estimate in a child process bounded in time and
  memory (a coordinator's submit);
- slices.py: a slice's rows into tokenized batches (what a tokenizing process runs);
- bounded.py: the tokenizing child processes, killed when a row will not end;
- pipeline.py: `ingest`, batch by batch into the output's tables.
"""

from __future__ import annotations

from hsx.ingest.estimate import EstimateUnavailable, bounded_estimate
from hsx.ingest.limits import IngestLimits
from hsx.ingest.pipeline import (
    IngestProgress,
    IngestResult,
    LengthSummary,
    ingest,
)
from hsx.ingest.samples import estimate_tokens, tokenize_conversations
from hsx.ingest.slices import NOT_A_CHAT
from hsx.ingest.sources import (
    DatasetAccessError,
    DatasetError,
    DatasetFormatError,
    DatasetLike,
    DatasetNotFoundError,
    DatasetSource,
    check_dataset,
    count_rows,
    dataset_fingerprint,
    is_hub_id,
    iter_rows,
    resolve_source,
)
from hsx.ingest.tokenizer import (
    TemplateLimitError,
    generation_prompt,
    load_tokenizer,
    tokenizer_fingerprint,
)

__all__ = [
    "NOT_A_CHAT",
    "DatasetAccessError",
    "DatasetError",
    "DatasetFormatError",
    "DatasetLike",
    "DatasetNotFoundError",
    "DatasetSource",
    "EstimateUnavailable",
    "IngestLimits",
    "IngestProgress",
    "IngestResult",
    "LengthSummary",
    "TemplateLimitError",
    "bounded_estimate",
    "check_dataset",
    "count_rows",
    "dataset_fingerprint",
    "estimate_tokens",
    "generation_prompt",
    "ingest",
    "is_hub_id",
    "iter_rows",
    "load_tokenizer",
    "resolve_source",
    "tokenize_conversations",
    "tokenizer_fingerprint",
]
