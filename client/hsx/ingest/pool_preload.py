"""Imported once by the fork server that ingestion's tokenizing children are forked from
(bounded.py, `pool_context`): what every child needs to load a tokenizer.

transformers' AutoTokenizer imports torch. Each spawned pool process imported both
itself (seconds of CPU and hundreds of MiB resident each); forked from a server that
imported them once, a process starts in milliseconds and shares those pages. Not
imported by `import hsx`.
"""

from transformers import AutoTokenizer  # noqa: F401

import hsx.ingest.bounded  # noqa: F401
