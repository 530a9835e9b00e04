"""The built-in demo (`make demo`): real SGLang serving an Engram model on this machine.

Shows DeepSeek-V4.1-Flash's table layout and sizes, builds the small Qwen3 + Engram demo
model once (model.py: a tokenizer trained here on text the machine has, weights from
a fixed seed, packed tables), serves it with `sglang.launch_server` with its tables on
disk, in host memory and in device memory, and once with Engram off (serve.py), sends
each server the same prompts at once (chosen from the corpus: prompts.py), prints
tokens/s, each placement's Engram cost per step beside one decoder layer's, the completions
with Engram on and off side by side, checks the served tokens against the PyTorch reference
forward, and stops.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from ...core.config import EngramConfig
from ...core.hashing import EngramLayout
from ...core.rowformat import ROW_BYTES
from .corpus import DEMO_PROSE, demo_corpus, train_tokenizer  # noqa: F401  (re-exported: bench/, tests)


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

    from . import model as generator

    model_dir = workdir / "model"
    stamp = model_dir / ".engram-demo-stamp"
    # The generator, the corpus it reads (corpus.py) and the table format decide the model's bytes.
    from ...core import config, hashing, rowformat, tablefile
    from . import corpus

    sources = [Path(m.__file__) for m in (generator, corpus, config, hashing, rowformat)]
    sources += sorted(Path(tablefile.__file__).parent.glob("*.py"))  # the package's every module
    blob = b"".join(p.read_bytes() for p in sources) + Path(__file__).read_bytes()
    want = hashlib.sha256(blob).hexdigest()[:16]
    if stamp.is_file() and stamp.read_text() == want:
        return model_dir, False
    generator.build_demo_model(model_dir, overwrite=True)
    stamp.write_text(want)
    return model_dir, True


def run_demo(workdir: str | os.PathLike = "build/demo", placements: Sequence[str] = ("disk", "host", "device"),
             n_prompts: int = 8, max_new_tokens: int = 32) -> int:
    """Build the demo model once, serve it with real `sglang.launch_server` in every placement
    and once with Engram off, complete the same prompts (all at once) on each, print tokens/s
    and each placement's Engram cost per step beside one decoder layer's, the completions with
    Engram on and off side by side, and check the served tokens against the PyTorch reference
    forward. Exit status 1 when placements disagree or serving disagrees with the reference."""
    import torch
    from transformers import AutoTokenizer

    from ...core.tablefile import inspect_tables, verify_tables
    from ...models.reference import ReferenceModel
    from .model import TABLE_DIR_NAME
    from .prompts import recall_prompts
    from .serve import OFF, engram_off_model, print_costs, serve_all

    workdir = Path(workdir)
    print_deepseek_layout()
    print()
    t0 = time.perf_counter()
    model_dir, built = demo_model(workdir)
    table_dir = model_dir / TABLE_DIR_NAME
    cfg = EngramConfig.from_pretrained(model_dir)
    verify_tables(table_dir, cfg, progress=False)
    off_dir = engram_off_model(model_dir, workdir / "model-engram-off")
    print(f"demo model {model_dir}: {'built' if built else 'reused'} and verified in {time.perf_counter() - t0:.1f} s")
    print(inspect_tables(table_dir))

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chosen = recall_prompts(tokenizer, demo_corpus(), n_prompts, max_new_tokens)
    prompts = [c.prompt for c in chosen]
    print(f"\n{len(prompts)} prompts from the corpus the tables were built from, where its own n-gram chain "
          f"runs {max_new_tokens} tokens, a clear winner at every step and no loop (engram_sglang/tools/demo/prompts.py)")
    print(f"serving them with sglang.launch_server, Engram tables placement {', '.join(placements)}, and once with "
          f"Engram off (value projection zeroed: {off_dir}) ...")
    runs = serve_all(model_dir, off_dir, placements, prompts, max_new_tokens, workdir)
    print("  servers stopped")
    print_costs(runs, len(prompts), max_new_tokens)

    on, off = runs[0], runs[-1]
    reference = ReferenceModel(model_dir, table_dir)
    reference_off = ReferenceModel(model_dir, table_dir, engram_scale=0.0, tokenizer=reference.tokenizer)

    def agrees(model, prompt, new) -> bool:
        """Greedy decoding by `model` gives `new`: at every step the served token is the
        reference's argmax (one forward over the whole served sequence)."""
        logits = model.forward(prompt + new).logits[len(prompt) - 1:-1]
        return logits.argmax(-1).tolist() == new

    def loglik(model, prompt, source) -> float:
        logp = model.forward(prompt + source).logits[len(prompt) - 1:-1].log_softmax(-1)
        return logp.gather(-1, torch.tensor(source).unsqueeze(-1)).mean().item()

    print(f"\nEngram on ({on.name}) vs off, same prompts; [n/{max_new_tokens}]: completion tokens equal to the "
          f"corpus's n-gram chain")
    match_on = match_off = 0
    for c, mine, theirs in zip(chosen, on.completions, off.completions):
        a = sum(x == y for x, y in zip(mine, c.source))
        b = sum(x == y for x, y in zip(theirs, c.source))
        match_on, match_off = match_on + a, match_off + b
        print(f"  {tokenizer.decode(c.prompt)!r}\n    on  [{a:>2}/{max_new_tokens}] {tokenizer.decode(mine)!r}"
              f"\n    off [{b:>2}/{max_new_tokens}] {tokenizer.decode(theirs)!r}")
    ll_on = sum(loglik(reference, c.prompt, c.source) for c in chosen) / len(chosen)
    ll_off = sum(loglik(reference_off, c.prompt, c.source) for c in chosen) / len(chosen)
    total = len(chosen) * max_new_tokens
    print(f"  tokens equal to the chain: on {match_on} of {total}, off {match_off} of {total}; the chain's mean "
          f"log-likelihood per token: on {ll_on:.2f}, off {ll_off:.2f} nats (reference forward)")

    same_placements = all(r.completions == on.completions for r in runs if r.name != OFF)
    same_on = sum(agrees(reference, p, new) for p, new in zip(prompts, on.completions))
    same_off = sum(agrees(reference_off, p, new) for p, new in zip(prompts, off.completions))
    print(f"\nevery placement served the same tokens: {'yes' if same_placements else 'NO'}; the PyTorch reference "
          f"forward gives the same tokens for {same_on} of {len(prompts)} prompts, and with Engram switched off for "
          f"{same_off} of {len(prompts)}")
    return 0 if same_placements and same_on == len(prompts) else 1
