"""Model-shaped Engram lookups from real text this machine has (nothing downloaded).

Code: Python's standard library sources. Prose: the Python reference manual's topics
(pydoc_data/topics.py) and the license texts in /usr/share/common-licenses. Tokens come
from a byte-level BPE trained here; row ids from the DeepSeek-V4.1 hashing scheme with a
smaller prime search start, so the table fits the benchmark while the duplicate structure
(2-grams repeat, 4-grams rarely do) stays that of real text.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engram_sglang import EngramConfig, NgramHasher
from engram_sglang.core.hashing import compressed_token_map
from engram_sglang.tools.demo.run import train_tokenizer

DECODE_BATCH = 256  # concurrent requests: one token each per decode step
PREFILL_CHUNK = 8192  # tokens of one prefill chunk


def code_corpus(limit_chars: int = 3_000_000, skip_chars: int = 0) -> list[str]:
    """Standard library sources in path order; `skip_chars` skips the files that the call
    with `limit_chars=skip_chars` returns (other code of the same kind, e.g. to learn from)."""
    stdlib = Path(os.__file__).parent
    out, size, skipped = [], 0, 0
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        text = path.read_text(errors="replace")
        if skipped < skip_chars:
            skipped += len(text)
            continue
        out.append(text)
        size += len(text)
        if size >= limit_chars:
            break
    return out


def prose_corpus() -> list[str]:
    import pydoc_data.topics as topics

    out = list(topics.topics.values())
    for path in sorted(Path("/usr/share/common-licenses").glob("*")):
        if path.is_file():
            out.append(path.read_text(errors="replace"))
    return out


def bench_config(rows_per_layer: int, compressed_vocab_size: int, layer_ids=(1, 14)) -> EngramConfig:
    """DeepSeek-V4.1's hashing (orders 2..4, 8 heads, layers 1 and 14), with the prime search
    started so that each layer table has about `rows_per_layer` rows."""
    return EngramConfig(
        layer_ids=tuple(layer_ids), max_ngram_size=4, n_heads=8, head_dim=256,
        vocab_size=max(3, rows_per_layer // 24), compressed_vocab_size=compressed_vocab_size,
        pad_token_id=2, source="bench config",
    )


def hashed_streams(rows_per_layer: int, kind: str = "code", vocab: int = 8192, layer_ids=(1, 14)):
    """(cfg, per-request row ids): DECODE_BATCH token streams of real text, each hashed
    whole, ids [T, layers, 24] per stream."""
    tokenizer, tokens = tokenized(kind, vocab)
    cfg, hasher = hasher_for(tokenizer, rows_per_layer, layer_ids)
    return cfg, split_streams(hasher, tokens), len(tokens)


def tokenized(kind: str = "code", vocab: int = 8192):
    """(tokenizer trained on the kind's corpus, that corpus as one list of token ids)."""
    texts = code_corpus() if kind == "code" else prose_corpus()
    tokenizer = train_tokenizer(texts, vocab)
    return tokenizer, [t for text in texts for t in tokenizer(text)["input_ids"]]


def hasher_for(tokenizer, rows_per_layer: int, layer_ids=(1, 14)):
    """(cfg, hasher) of bench_config for this tokenizer."""
    _, size = compressed_token_map(tokenizer)
    cfg = bench_config(rows_per_layer, size, layer_ids)
    return cfg, NgramHasher.from_tokenizer(cfg, tokenizer)


def split_streams(hasher, tokens) -> list[torch.Tensor]:
    """Tokens cut into DECODE_BATCH equal streams, each hashed whole: ids [T, layers, 24]."""
    per = len(tokens) // DECODE_BATCH
    return [hasher.hash_sequence(tokens[i * per : (i + 1) * per]) for i in range(DECODE_BATCH)]


def decode_steps(streams, layer_index: int, steps: int) -> list[torch.Tensor]:
    """Row ids of `steps` decode steps: step t reads token t of every stream, [256, 24]."""
    length = min(s.shape[0] for s in streams)
    return [torch.stack([s[t % length, layer_index] for s in streams]) for t in range(steps)]


def prefill_chunks(streams, layer_index: int, count: int) -> list[torch.Tensor]:
    """Row ids of `count` prefill chunks of PREFILL_CHUNK consecutive tokens, [8192, 24]."""
    whole = torch.cat([s[:, layer_index] for s in streams])
    return [whole[i * PREFILL_CHUNK : (i + 1) * PREFILL_CHUNK] for i in range(count) if (i + 1) * PREFILL_CHUNK <= whole.shape[0]]
