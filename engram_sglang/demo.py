"""The built-in demo (`make demo`): the Engram core on real files, end to end on this machine.

Shows DeepSeek-V4.1-Flash's table layout and sizes, then builds a small Engram model's
tables (a tokenizer trained here on text the machine has, quantized rows from a fixed
seed), writes and verifies the packed table files, hashes a prompt by prefill + decode
steps with per-request history, and reads the rows it addresses.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .config import EngramConfig
from .hashing import EngramLayout, HashHistory, NgramHasher
from .rowformat import ROW_BYTES, quantize

# Prose with accents, mixed scripts and whitespace runs: normalization has work to do.
DEMO_PROSE = (
    "Café naïve Ünïcödé façade — déjà vu!\tTabs\t\tand   spaces\n\nNew paragraph. "
    "日本語のテキストと中文文本，还有 한국어 텍스트. Ελληνικά κείμενα. Русский текст.\r\n"
    "ﬁ ligatures, ① circled, ＦＵＬＬＷＩＤＴＨ letters, e\u0301 combining accents. "
)
DEMO_SEED = 1234


def demo_corpus(limit_chars: int = 400_000) -> list[str]:
    """Text available offline: the prose above and Python's own standard library sources."""
    stdlib = Path(os.__file__).parent
    out, size = [DEMO_PROSE * 20], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(errors="replace")
        out.append(text)
        size += len(text)
        if size > limit_chars:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 1500):
    """A byte-level BPE fast tokenizer trained locally (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "<pad>", "</s>", "<image>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def print_deepseek_layout() -> None:
    cfg = EngramConfig.from_preset("deepseek-v4.1-flash")
    layout = EngramLayout(cfg)
    total = layout.table_bytes(ROW_BYTES)
    print("DeepSeek-V4.1-Flash Engram tables (configs/deepseek-v4.1-flash.json)")
    print(f"  layers {list(cfg.layer_ids)}, n-gram orders 2..{cfg.max_ngram_size}, {cfg.n_heads} heads: "
          f"{cfg.hash_columns} rows per token per layer, {ROW_BYTES} B per row")
    for i, layer_id in enumerate(cfg.layer_ids):
        rows = layout.num_embeddings[i]
        primes = [p for order in layout.primes[i] for p in order]
        print(f"  layer {layer_id:>2}: {rows:,} rows = {rows * ROW_BYTES / 2**30:.2f} GiB "
              f"(primes {primes[0]:,} .. {primes[-1]:,})")
    per_token = cfg.n_layers * cfg.hash_columns * ROW_BYTES
    print(f"  total {total / 2**30:.2f} GiB; per rank at TP2 {total / 2 / 2**30:.2f}, TP4 {total / 4 / 2**30:.2f}, "
          f"TP8 {total / 8 / 2**30:.2f} GiB")
    print(f"  per token {per_token:,} B read ({per_token / 1024:.1f} KiB), "
          f"{cfg.n_layers * cfg.hash_columns * cfg.head_dim * 2:,} B of bf16 written; "
          f"decode batch 256: {256 * per_token / 1e6:.1f} MB per step")


def build_demo_tables(workdir: Path):
    """Tokenizer, config and packed tables of the small demo model (rebuilt each run: ~5 s)."""
    from .hashing import compressed_token_map
    from .tablefile import write_tables

    tokenizer = train_tokenizer(demo_corpus())
    _, size = compressed_token_map(tokenizer)
    cfg = EngramConfig(
        layer_ids=(1, 3), max_ngram_size=4, n_heads=4, head_dim=256, vocab_size=4099,
        compressed_vocab_size=size, pad_token_id=tokenizer.pad_token_id, hidden_size=256,
        source="demo model",
    )
    layout = EngramLayout(cfg)
    gen = torch.Generator().manual_seed(DEMO_SEED)
    tables = {L: quantize(torch.randn(layout.rows(L), cfg.head_dim, generator=gen)) for L in cfg.layer_ids}
    out = write_tables(workdir / "tables", cfg, tables, progress=False)
    return tokenizer, cfg, out


def run_demo(workdir: str | os.PathLike = "build/demo") -> int:
    from .tablefile import inspect_tables, open_tables, verify_tables
    from . import rowformat

    workdir = Path(workdir)
    print_deepseek_layout()
    print()
    t0 = time.perf_counter()
    tokenizer, cfg, table_dir = build_demo_tables(workdir)
    verify_tables(table_dir, cfg, progress=False)
    print(inspect_tables(table_dir))
    print(f"  built and verified in {time.perf_counter() - t0:.1f} s")
    tables = open_tables(table_dir, cfg)
    hasher = NgramHasher.from_tokenizer(cfg, tokenizer)

    prompt = "Engram rows are fetched before the layer that needs them."
    ids = tokenizer(prompt)["input_ids"]
    prefill, decode = ids[:-4], ids[-4:]
    print(f"\nprompt: {prompt!r} -> {len(ids)} tokens; prefill {len(prefill)}, then {len(decode)} decode steps")
    history = HashHistory(num_slots=4, max_ngram_size=cfg.max_ngram_size)
    slot = torch.tensor([0])
    row_ids, windows = hasher.hash_batch(
        torch.tensor(prefill), torch.arange(len(prefill)), history.rows(slot), torch.tensor([len(prefill)])
    )
    history.commit(slot, windows, torch.tensor([len(prefill) - 1]))
    steps = [row_ids]
    for pos, tok in enumerate(decode, start=len(prefill)):
        step_ids, windows = hasher.hash_batch(torch.tensor([tok]), torch.tensor([pos]), history.rows(slot), torch.tensor([1]))
        history.commit(slot, windows, torch.tensor([0]))
        steps.append(step_ids)
    all_ids = torch.cat(steps)
    same = torch.equal(all_ids, hasher.hash_sequence(ids))
    print(f"row ids [{', '.join(map(str, all_ids.shape))}]; prefill+decode equals one-shot hashing: {same}")
    for i, layer_id in enumerate(cfg.layer_ids):
        rows = rowformat.dequantize(torch.from_numpy(tables[layer_id][all_ids[:, i].reshape(-1).numpy()]))
        checksum = int(rows.view(torch.int16).to(torch.int64).sum())
        print(f"  layer {layer_id}: gathered {rows.shape[0]} rows -> bf16 {tuple(rows.shape)}, bit checksum {checksum}")
    return 0 if same else 1
