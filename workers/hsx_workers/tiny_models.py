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

Command line (`python -m hsx_workers.tiny_models --help`):

    python -m hsx_workers.tiny_models model DIR [--arch llama] [--layers 4] ...
    python -m hsx_workers.tiny_models dataset FILE [--n 200] [--bad-rows 5]

torch and transformers are imported inside the functions that need them, so building a
dataset stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

BOS = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
# Fixed order: the special tokens get ids 0..4 whatever the corpus, so configs can name them.
SPECIAL_TOKENS = (BOS, START_HEADER, END_HEADER, EOT, PAD)
BOS_ID, EOT_ID, PAD_ID = 0, 3, 4

# Llama-3's template, plus `{% generation %}` around what the assistant produces (content
# and end-of-turn) so `return_assistant_tokens_mask=True` works; hsx's ingestion does not
# rely on the tags, because most real templates lack them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_WORDS = (  # noqa: SIM905 - a word list reads better as prose
    "the a an this that some every no one two three many few model data token layer "
    "state draft engine shard bucket worker trainer job unit sample batch stream cache "
    "weight vector matrix head block signal river mountain city garden window kitchen "
    "teacher student doctor farmer writer painter engineer pilot sailor runner child "
    "friend neighbour dog cat bird horse fish tree flower stone book letter song story "
    "question answer idea plan reason problem result number word language music light "
    "water fire wind rain snow sun moon star road bridge house door table chair paper "
    "is was will can should might must could would runs reads writes builds makes "
    "takes gives finds keeps moves turns opens closes starts stops learns teaches helps "
    "asks answers explains computes measures checks sends receives stores loads saves "
    "quick slow small large bright dark warm cold early late new old simple careful "
    "quiet loud happy tired clever strange common rare exact rough clear deep "
    "and or but because when while after before if then so yet also still again "
    "in on at by with from to into over under between across through near far "
    "very quite rather almost always often never sometimes today tomorrow here there"
).split()

_QUESTION_STARTS = (
    "Can you explain", "What is", "How does", "Why does", "Tell me about", "Describe",
    "Write a short note on", "Summarize", "Give an example of", "Compare",
)


def _sentence(rng: random.Random, lo: int = 3, hi: int = 10) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2048)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....!?;")


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def _question(rng: random.Random) -> str:
    topic = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))
    tail = _sentence(rng) if rng.random() < 0.5 else ""
    return f"{rng.choice(_QUESTION_STARTS)} {topic}? {tail}".strip()


def synthetic_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """English-like lines (plus some chat markup) to train the tokenizer on."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 5 == 0:
            lines.append(_question(rng))
        else:
            lines.append(_paragraph(rng, rng.randint(1, 4)))
    return lines


# ---------------------------------------------------------------------------- tokenizer


def build_tokenizer(
    path: str | Path | None = None, vocab_size: int = 512, *, seed: int = 0
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (Llama-3 style) and save it to `path` if given.

    Byte-level, so any text tokenizes without unknown tokens and offsets map back to
    characters (ingestion's fallback for loss masks needs offsets).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE "
            f"(needs more than {256 + len(SPECIAL_TOKENS)})"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    # As in Llama 3's tokenizer.json: BOS prepended for plain text, not for the template
    # (which writes bos_token itself and is tokenized with add_special_tokens=False).
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, BOS_ID)],
            ),
        ]
    )
    for i, tok in enumerate(SPECIAL_TOKENS):
        if backend.token_to_id(tok) != i:
            raise RuntimeError(f"special token {tok} got id {backend.token_to_id(tok)}, not {i}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[START_HEADER, END_HEADER],
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if path is not None:
        tokenizer.save_pretrained(str(path))
        # transformers 5 writes its internal class name ("TokenizersBackend"); the public
        # alias loads in transformers 4 and 5 alike, and in vLLM's tokenizer loader.
        config_file = Path(path) / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer


# ---------------------------------------------------------------------------- models


@dataclass(frozen=True)
class TinyShape:
    """The sizes every architecture entry turns into its own config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _common(shape: TinyShape) -> dict[str, Any]:
    return {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOT_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
    }


def _llama_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(shape), head_dim=shape.head_dim)


def _qwen3_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(shape), head_dim=shape.head_dim, use_sliding_window=False)


def _mistral_config(shape: TinyShape) -> PretrainedConfig:
    from transformers import MistralConfig

    return MistralConfig(**_common(shape), head_dim=shape.head_dim, sliding_window=None)


# One entry per architecture: arch name -> config builder. More (qwen3_moe, deepseek_v3,
# gemma2, multimodal wrappers) are added here; see ENVIRONMENT.md for what each needs.
ARCHS: dict[str, Callable[[TinyShape], PretrainedConfig]] = {
    "llama": _llama_config,
    "qwen3": _qwen3_config,
    "mistral": _mistral_config,
}


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> Path:
    """Write a random-weight model (safetensors), its tokenizer and generation config.

    The same arguments give the same bytes of weights: initialisation is seeded, so two
    test sessions (or two machines) compare hidden states of the same model.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(ARCHS)}")
    if hidden_size % num_heads or hidden_size // num_heads != 64:
        # vLLM's CPU attention refuses small head sizes (16 was refused, 64 works).
        raise ValueError(
            f"hidden_size / num_heads must be 64 (vLLM CPU attention), got "
            f"{hidden_size} / {num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    if len(tokenizer) != vocab_size:
        raise RuntimeError(
            f"tokenizer has {len(tokenizer)} tokens, expected {vocab_size}; the synthetic "
            "corpus is too small for this vocab_size"
        )

    shape = TinyShape(num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size,
                      vocab_size)
    config = ARCHS[arch](shape)
    config.dtype = dtype
    # Seeded with a private generator state so callers' global RNG use does not change
    # the weights, and building a model does not change the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch_dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOT_ID, pad_token_id=PAD_ID, do_sample=False
    )
    from transformers.utils import logging as hf_logging

    # A model of a few MB needs no progress bar on the terminal.
    hf_logging.disable_progress_bar()
    model.save_pretrained(str(out), safe_serialization=True)
    logger.info("wrote tiny %s model (%d layers, hidden %d) to %s", arch, num_layers,
                hidden_size, out)
    return out


# ---------------------------------------------------------------------------- datasets

BadKind = Literal["malformed_json", "empty_messages", "unknown_role", "no_assistant",
                  "no_field"]
BAD_KINDS: tuple[BadKind, ...] = (
    "malformed_json", "empty_messages", "unknown_role", "no_assistant", "no_field",
)
RowFormat = Literal["messages", "sharegpt", "text", "mixed"]
ROW_FORMATS: tuple[str, ...] = ("messages", "sharegpt", "text", "mixed")


@dataclass
class ChatDataset:
    """What `make_chat_dataset` wrote: the file, its rows, and which rows are bad."""

    path: Path
    num_rows: int
    bad: dict[int, BadKind] = field(default_factory=dict)
    """Row index -> kind of bad row (one of BAD_KINDS)."""
    rows: list[Any] = field(default_factory=list, repr=False)
    """Every row as written: a dict, or the raw text of a malformed JSON line."""

    @property
    def good_indices(self) -> list[int]:
        return [i for i in range(self.num_rows) if i not in self.bad]


def _conversation(rng: random.Random, index: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": _sentence(rng)})
    long = index % 25 == 7  # a few long ones that ingestion truncates at ~256 tokens
    turns = 1 if long else rng.choice((1, 1, 1, 1, 2, 2, 3))
    for _ in range(turns):
        messages.append({"role": "user", "content": _question(rng)})
        sentences = rng.randint(15, 25) if long else rng.randint(1, 3)
        messages.append({"role": "assistant", "content": _paragraph(rng, sentences)})
    return messages


def _good_row(rng: random.Random, index: int, fmt: str) -> dict[str, Any]:
    if fmt == "mixed":
        fmt = ("messages", "messages", "sharegpt", "text")[index % 4]
        if fmt == "text" and index % 8 == 3:
            fmt = "prompt"
    if fmt in ("text", "prompt"):
        return {fmt: _paragraph(rng, rng.randint(1, 6))}
    messages = _conversation(rng, index)
    if fmt == "sharegpt":
        names = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": names[m["role"]], "value": m["content"]}
                                  for m in messages]}
    return {"messages": messages}


def _bad_row(rng: random.Random, kind: BadKind) -> Any:
    if kind == "malformed_json":
        return '{"messages": [{"role": "user", "content": "unterminated'
    if kind == "empty_messages":
        return {"messages": []}
    if kind == "unknown_role":
        return {"messages": [{"role": "user", "content": _question(rng)},
                             {"role": "wizard", "content": _sentence(rng)}]}
    if kind == "no_assistant":
        return {"messages": [{"role": "user", "content": _question(rng)}]}
    if kind == "no_field":
        return {"title": _sentence(rng), "score": 3}
    raise ValueError(f"unknown bad-row kind {kind!r}")


def make_chat_dataset(
    path: str | Path,
    n: int = 200,
    *,
    seed: int = 0,
    bad_rows: int = 0,
    formats: RowFormat = "messages",
) -> ChatDataset:
    """Write `n` good rows plus `bad_rows` bad ones as JSONL, deterministically by seed.

    `formats`: `messages` (OpenAI style), `sharegpt` (`conversations` with from/value),
    `text` (plain text rows), or `mixed` (all of these and `prompt`). Bad rows cycle
    through BAD_KINDS and sit at seeded positions; the result says which and why.
    """
    if formats not in ROW_FORMATS:
        raise ValueError(f"unknown formats {formats!r}; known: {list(ROW_FORMATS)}")
    if n < 0 or bad_rows < 0:
        raise ValueError("n and bad_rows must be >= 0")
    rng = random.Random(seed)
    total = n + bad_rows
    bad_positions = sorted(rng.sample(range(total), bad_rows))
    bad = {pos: BAD_KINDS[i % len(BAD_KINDS)] for i, pos in enumerate(bad_positions)}

    rows: list[Any] = []
    for index in range(total):
        kind = bad.get(index)
        rows.append(_bad_row(rng, kind) if kind else _good_row(rng, index, formats))
    out = Path(path)
    write_rows(rows, out, "jsonl")
    logger.info("wrote %d rows (%d bad) to %s", total, bad_rows, out)
    return ChatDataset(path=out, num_rows=total, bad=bad, rows=rows)


def write_rows(rows: Sequence[Any], path: str | Path, fmt: Literal["jsonl", "parquet", "hf"]
               ) -> Path:
    """Write rows as JSONL, one Parquet file, or a `datasets` `save_to_disk` folder.

    Strings among the rows are written verbatim to JSONL (that is how a malformed line
    gets in); the other formats take dicts only.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
        return out
    if any(not isinstance(r, dict) for r in rows):
        raise ValueError(f"{fmt} rows must be dicts (a malformed JSON line exists only in JSONL)")
    # Columns are the union of all rows' keys (a missing key is null); both pyarrow's and
    # datasets' from-list constructors would take the first row's keys only.
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {name: [row.get(name) for row in rows] for name in names}
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), out)
        return out
    if fmt == "hf":
        import datasets

        datasets.Dataset.from_dict(columns).save_to_disk(str(out))
        return out
    raise ValueError(f"unknown format {fmt!r}")


# ---------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsx_workers.tiny_models",
                                description="Build tiny random-weight models and datasets.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write a tiny random-weight model directory")
    m.add_argument("dir")
    m.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    m.add_argument("--layers", type=int, default=4, dest="num_layers")
    m.add_argument("--hidden-size", type=int, default=256)
    m.add_argument("--heads", type=int, default=4, dest="num_heads")
    m.add_argument("--kv-heads", type=int, default=2, dest="num_kv_heads")
    m.add_argument("--intermediate-size", type=int, default=512)
    m.add_argument("--vocab-size", type=int, default=512)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bfloat16")
    d = sub.add_parser("dataset", help="write a synthetic JSONL chat dataset")
    d.add_argument("file")
    d.add_argument("--n", type=int, default=200)
    d.add_argument("--bad-rows", type=int, default=0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--formats", default="messages", choices=ROW_FORMATS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m hsx_workers.tiny_models` (and `hsx make-tiny-model`)."""
    args = _parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "model":
        make_tiny_model(
            args.dir, args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
            intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
            seed=args.seed, dtype=args.dtype,
        )
    else:
        ds = make_chat_dataset(args.file, args.n, seed=args.seed, bad_rows=args.bad_rows,
                               formats=args.formats)
        for index, kind in sorted(ds.bad.items()):
            logger.info("bad row %d: %s", index, kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
