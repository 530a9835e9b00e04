"""Shared fixtures: small Engram configs and tokenizers trained here, on text this machine has."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from engram_sglang import EngramConfig

# Text for tokenizers: code from the standard library plus prose with accents, mixed
# scripts and runs of whitespace, so that normalization and partial UTF-8 tokens occur.
_PROSE = (
    "Café naïve Ünïcödé façade — déjà vu!\tTabs\t\tand   spaces\n\nNew paragraph. "
    "日本語のテキストと中文文本，还有 한국어 텍스트. Ελληνικά κείμενα. Русский текст.\r\n"
    "ﬁ ligatures, ① circled, ＦＵＬＬＷＩＤＴＨ letters, e\u0301 combining accents. "
)


def training_text(limit_bytes: int = 400_000) -> list[str]:
    stdlib = Path(os.__file__).parent
    out, size = [_PROSE * 20], 0
    for p in sorted(stdlib.glob("*.py")):
        t = p.read_text(errors="replace")
        out.append(t)
        size += len(t)
        if size > limit_bytes:
            break
    return out


def train_tokenizer(kind: str = "bytelevel", vocab_size: int = 1500):
    """A fast HF tokenizer trained here (no hub): 'bytelevel' BPE or 'whitespace' WordPiece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<pad>", "</s>", "<image>"]
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    tok.train_from_iterator(training_text(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


@pytest.fixture(scope="session")
def bytelevel_tokenizer():
    return train_tokenizer("bytelevel")


@pytest.fixture(scope="session")
def wordpiece_tokenizer():
    return train_tokenizer("whitespace", 1200)


def small_config(compressed_vocab_size: int, **overrides) -> EngramConfig:
    fields = dict(
        layer_ids=(1, 3),
        max_ngram_size=4,
        n_heads=4,
        head_dim=256,
        vocab_size=1000,
        compressed_vocab_size=compressed_vocab_size,
        pad_token_id=2,
        hidden_size=64,
    )
    fields.update(overrides)
    return EngramConfig(**fields)


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}", file=sys.stderr)
    random.seed(seed)
    return torch.Generator().manual_seed(seed)
