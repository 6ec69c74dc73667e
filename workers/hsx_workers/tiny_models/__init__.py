"""Random-weight tiny models, a tokenizer and chat datasets, all built locally.

Nothing can be downloaded on the development and CI machines, so every test, demo and
benchmark that needs a model or a dataset builds one here:

- `build_tokenizer`: a byte-level BPE tokenizer trained on a synthetic English-like
  corpus, with Llama-3 special tokens and a Llama-3-style chat template.
- `make_tiny_model`: random (seeded) weights for an architecture in `ARCHS`, saved with
  `save_pretrained` beside the tokenizer, so vLLM and transformers load the folder as
  they would a hub checkpoint.
- `make_chat_dataset`: a JSONL file of synthetic conversations, optionally with bad rows
  of every kind ingestion must record; `write_rows` writes rows as Parquet or as a
  `datasets.save_to_disk` folder too.
- `make_long_tailed_chats`: chats whose token lengths under a tokenizer's chat template
  follow a long tail (log-normal: median ~600 tokens, ~1% beyond 8k, capped), the length
  mix of real chat data, readable by hsx and by speculators' `prepare-data`.

Command line (`python -m hsx_workers.tiny_models --help`):

    python -m hsx_workers.tiny_models model DIR [--arch llama] [--layers 4] ...
    python -m hsx_workers.tiny_models dataset FILE [--n 200] [--bad-rows 5]

torch and transformers are imported inside the functions that need them, so building a
dataset stays light.

- tokenizer.py: the tokenizer, its special tokens and chat template;
- corpus.py: the synthetic English the tokenizer is trained on and the chats are made of;
- configs.py: each architecture's config at a tiny shape; kimi.py: Kimi-K2.5's, whose
  processor and checkpoint layout need more;
- models.py: `ARCHS` and `make_tiny_model`;
- chat_datasets.py: `make_chat_dataset`, `write_rows`;
- long_tailed.py: `make_long_tailed_chats`, `long_tailed_lengths`;
- cli.py: the command line.
"""

from __future__ import annotations

from hsx_workers.tiny_models.chat_datasets import (
    BAD_KINDS,
    ROW_FORMATS,
    BadKind,
    ChatDataset,
    RowFormat,
    make_chat_dataset,
    write_rows,
)
from hsx_workers.tiny_models.cli import main
from hsx_workers.tiny_models.configs import TinyShape
from hsx_workers.tiny_models.corpus import synthetic_corpus
from hsx_workers.tiny_models.kimi import KIMI_MEDIA_PROC_CFG, KIMI_MEDIA_TOKENS
from hsx_workers.tiny_models.long_tailed import (
    LongTailedChats,
    long_tailed_lengths,
    make_long_tailed_chats,
)
from hsx_workers.tiny_models.models import ARCHS, ROUTER_SCALE, make_tiny_model
from hsx_workers.tiny_models.tokenizer import (
    BOS,
    BOS_ID,
    CHAT_TEMPLATE,
    END_HEADER,
    EOT,
    EOT_ID,
    PAD,
    PAD_ID,
    SPECIAL_TOKENS,
    START_HEADER,
    build_tokenizer,
    save_tokenizer,
)

__all__ = [
    "ARCHS",
    "BAD_KINDS",
    "BOS",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "END_HEADER",
    "EOT",
    "EOT_ID",
    "KIMI_MEDIA_PROC_CFG",
    "KIMI_MEDIA_TOKENS",
    "PAD",
    "PAD_ID",
    "ROUTER_SCALE",
    "ROW_FORMATS",
    "SPECIAL_TOKENS",
    "START_HEADER",
    "BadKind",
    "ChatDataset",
    "LongTailedChats",
    "RowFormat",
    "TinyShape",
    "build_tokenizer",
    "long_tailed_lengths",
    "main",
    "make_chat_dataset",
    "make_long_tailed_chats",
    "make_tiny_model",
    "save_tokenizer",
    "synthetic_corpus",
    "write_rows",
]
