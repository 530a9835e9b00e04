"""Small Engram configs, random tables and tokenizers trained here (on text this machine has),
shared by the tests (the fixtures in tests/conftest.py build on them)."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from engram_sglang import EngramConfig
from engram_sglang.tools.demo import run as demo


def train_tokenizer(kind: str = "bytelevel", vocab_size: int = 1500):
    """A fast HF tokenizer trained here (no hub): 'bytelevel' BPE or 'whitespace' WordPiece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytelevel":
        return demo.train_tokenizer(demo.demo_corpus(), vocab_size)
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "<pad>", "</s>", "<image>"], show_progress=False)
    tok.train_from_iterator(demo.demo_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


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


def random_rows(cfg: EngramConfig) -> dict:
    """Random packed rows for every Engram layer of `cfg` (layer id -> uint8 [rows, ROW_BYTES]
    numpy), from a fresh seed each run, printed so that a failure can be replayed."""
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.rowformat import ROW_BYTES

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random table seed {seed}", file=sys.stderr)
    gen, layout = torch.Generator().manual_seed(seed), EngramLayout(cfg)
    return {L: torch.randint(0, 256, (layout.rows(L), ROW_BYTES), dtype=torch.uint8, generator=gen).numpy()
            for L in cfg.layer_ids}


def random_table_dir(parent, cfg: EngramConfig) -> tuple:
    """(a table directory of random rows for `cfg` written under `parent`, its rows)."""
    from engram_sglang.core.tablefile import write_tables

    rows = random_rows(cfg)
    return write_tables(parent / "t", cfg, rows, progress=False), rows


def held_mask(ids, ranges):
    """Which ids (a tensor or a numpy array) lie in a shard's row ranges [(lo, hi), ...]."""
    held = torch.zeros_like(ids, dtype=torch.bool) if isinstance(ids, torch.Tensor) else np.zeros(ids.shape, bool)
    for lo, hi in ranges:
        held = held | ((ids >= lo) & (ids < hi))
    return held
