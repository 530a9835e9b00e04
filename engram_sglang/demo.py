"""The built-in demo (`make demo`): real SGLang serving an Engram model on this machine.

Shows DeepSeek-V4.1-Flash's table layout and sizes, builds the small Qwen3 + Engram demo
model once (demo_model.py: a tokenizer trained here on text the machine has, weights from
a fixed seed, packed tables), serves it with `sglang.launch_server` with its tables on
disk, completes a few prompts over HTTP, prints the completions and the table
statistics, checks the completions against the PyTorch reference forward, and stops.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .config import EngramConfig
from .hashing import EngramLayout
from .rowformat import ROW_BYTES

# Prose with accents, mixed scripts and whitespace runs: normalization has work to do.
DEMO_PROSE = (
    "Café naïve Ünïcödé façade — déjà vu!\tTabs\t\tand   spaces\n\nNew paragraph. "
    "日本語のテキストと中文文本，还有 한국어 텍스트. Ελληνικά κείμενα. Русский текст.\r\n"
    "ﬁ ligatures, ① circled, ＦＵＬＬＷＩＤＴＨ letters, e\u0301 combining accents. "
)

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


def demo_model(workdir: Path) -> tuple[Path, bool]:
    """The demo model in `workdir/model`, built once (rebuilt when its generator changed)."""
    import hashlib

    from . import demo_model as generator

    model_dir = workdir / "model"
    stamp = model_dir / ".engram-demo-stamp"
    # The generator, the corpus it reads (this file) and the table format decide the model's bytes.
    from . import config, hashing, rowformat, tablefile

    sources = (generator, config, hashing, rowformat, tablefile)
    blob = b"".join(Path(m.__file__).read_bytes() for m in sources) + Path(__file__).read_bytes()
    want = hashlib.sha256(blob).hexdigest()[:16]
    if stamp.is_file() and stamp.read_text() == want:
        return model_dir, False
    generator.build_demo_model(model_dir, overwrite=True)
    stamp.write_text(want)
    return model_dir, True


def run_demo(workdir: str | os.PathLike = "build/demo", placement: str = "disk", max_new_tokens: int = 24) -> int:
    """Build the demo model once, serve it with real `sglang.launch_server` (tables on disk
    by default), complete the demo prompts over HTTP, print the completions and the table
    statistics, check them against the PyTorch reference forward, and stop the server."""
    from .demo_model import DEMO_PROMPTS, TABLE_DIR_NAME
    from .models.reference import ReferenceModel
    from .serving.launch import Server
    from .tablefile import inspect_tables, verify_tables

    workdir = Path(workdir)
    print_deepseek_layout()
    print()
    t0 = time.perf_counter()
    model_dir, built = demo_model(workdir)
    table_dir = model_dir / TABLE_DIR_NAME
    cfg = EngramConfig.from_pretrained(model_dir)
    verify_tables(table_dir, cfg, progress=False)
    print(f"demo model {model_dir}: {'built' if built else 'reused'} and verified in {time.perf_counter() - t0:.1f} s")
    print(inspect_tables(table_dir))

    print(f"\nserving it with sglang.launch_server, Engram tables placement {placement} ...")
    t0 = time.perf_counter()
    server = Server(model_dir, engram={"placement": placement}, max_total_tokens=4096,
                    log_path=workdir / "sglang.log")
    with server:
        print(f"  ready in {time.perf_counter() - t0:.1f} s at {server.url} (log: {server.log_path})")
        t0 = time.perf_counter()
        outputs = [server.generate(p, max_new_tokens) for p in DEMO_PROMPTS]
        seconds = time.perf_counter() - t0
        for prompt, out in zip(DEMO_PROMPTS, outputs):
            print(f"  {prompt!r} -> {out['text']!r}")
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        print(f"  {len(outputs)} requests, {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.0f} tokens/s, one at a time)")
        stats = server.engram_stats()
    print("  server stopped")

    print("\nEngram table statistics (from /server_info):")
    print(f"  {stats['steps']} forward steps, {stats['tokens']} tokens; per step: forward "
          f"{stats['forward_seconds_per_step'] * 1e3:.2f} ms, Engram layers {stats['engram_seconds_per_step'] * 1e3:.2f} ms "
          f"(waiting for rows {stats['wait_seconds_per_step'] * 1e3:.3f} ms), one decoder layer "
          f"{stats['layer_seconds'] * 1e3:.2f} ms")
    for t in stats["tables"]:
        print(f"  layer {t['layer_id']}: {t['placement']}, {t['calls']} gathers, {t['rows_served']:,} rows "
              f"({t['bytes_served'] / 1e6:.2f} MB packed), {t['unique_rows']:,} read after deduplicating each call, "
              f"{t['gather_seconds'] * 1e3:.1f} ms gathering, {t['resident_bytes'] / 2**20:.1f} MiB resident")

    reference = ReferenceModel(model_dir, table_dir)
    off = ReferenceModel(model_dir, table_dir, engram_scale=0.0, tokenizer=reference.tokenizer)
    same = changed = 0
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        ids = reference.tokenizer(prompt)["input_ids"]
        want, _ = reference.generate(ids, max_new_tokens)
        without, _ = off.generate(ids, max_new_tokens)
        same += want == out["output_ids"]
        changed += without != want
    print(f"\nPyTorch reference forward gives the same tokens for {same} of {len(outputs)} prompts; "
          f"with Engram switched off {changed} of {len(outputs)} completions change")
    return 0 if same == len(outputs) else 1
