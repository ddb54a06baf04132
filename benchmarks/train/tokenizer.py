"""A byte-level BPE trained on the corpus with `tokenizers`, saved as Hugging Face
tokenizer files with a ChatML chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from corpus import DOMAINS

VOCAB_SIZE = 8192
SAMPLE_CHARS = 2_000_000  # per domain: balanced, so no domain's words crowd out another's
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _samples(corpus_dir: Path):
    for domain in DOMAINS:
        text = (corpus_dir / f"{domain}.train.txt").read_text(encoding="utf-8")[:SAMPLE_CHARS]
        # one document at a time keeps the trainer's word counting bounded
        yield from text.split("<|endoftext|>")


def train(corpus_dir: Path, out_dir: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_samples(corpus_dir), trainer=trainer)
    save(tok, out_dir)
    return tok


def save(tok: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "tokenizer.json.tmp"
    tok.save(str(tmp))
    os.replace(tmp, out_dir / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
