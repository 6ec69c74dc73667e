"""The tiny models' tokenizer: byte-level BPE trained on the synthetic corpus, with
Llama-3's special tokens and a Llama-3-style chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hsx_workers.tiny_models.corpus import synthetic_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


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


def build_tokenizer(
    path: str | Path | None = None, vocab_size: int = 512, *, seed: int = 0,
    extra_special_tokens: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (Llama-3 style) and save it to `path` if given.

    Byte-level, so any text tokenizes without unknown tokens and offsets map back to
    characters (ingestion's fallback for loss masks needs offsets). `extra_special_tokens`
    (a model's own markers, e.g. Kimi's media tokens) take the last ids of the vocabulary,
    in the order given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    extra = list(extra_special_tokens)
    if vocab_size - len(extra) < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE "
            f"(needs more than {256 + len(SPECIAL_TOKENS) + len(extra)})"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(extra),
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
    backend.add_special_tokens(extra)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[START_HEADER, END_HEADER, *extra],
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if path is not None:
        save_tokenizer(tokenizer, path)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """`save_pretrained`, naming the class every loader knows.

    transformers 5 writes its internal class name ("TokenizersBackend"); the public alias
    loads in transformers 4 and 5 alike, and in vLLM's tokenizer loader.
    """
    tokenizer.save_pretrained(str(path))
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")
