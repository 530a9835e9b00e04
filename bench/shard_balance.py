"""How evenly the tensor-parallel ranks share a step's distinct rows: contiguous vs balanced shards.

Each rank of a sharded placement reads (from its host copy, its files or its caches) the
distinct rows of a step that fall in the rows it holds. The table's columns are laid out
order-major (all 2-gram columns, then 3-gram, then 4-gram), and 2-grams repeat far more than
4-grams, so today's contiguous row ranges (`shard_range`, key `contiguous`) give the rank
holding the 4-gram columns the most distinct rows. The balanced split (`column_shards`, key
`balanced`) deals the columns round-robin (or, where TP does not divide the column count,
splits each column in TP pieces): every rank holds the same share of each order.

Row ids: the profile corpora (bench/workload.py: code and prose this machine has) tokenized
by a byte-level BPE trained here with the `tokenizers` library (no hub; the JSON records its
vocabulary and corpus) and hashed with the project's hasher (core/hashing.py, upstream's
scheme) in DeepSeek-V4.1-Flash's real layout (configs/deepseek-v4.1-flash.json: 2 layers x 24
columns, 384M rows a layer). For TP 2/4/8 and the shapes decode (256 streams, one token
each) and prefill (chunks of 8192 tokens), each rank's distinct rows per step are summed over
all steps and both layers; `max_over_mean` = the largest rank's sum / the ranks' mean.
Goal: balanced <= 1.05.

    python -m bench.shard_balance [--json F] [--png F] [--decode-steps 512] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import OUT, machine, print_table
from bench.workload import DECODE_BATCH, PREFILL_CHUNK, code_corpus, prose_corpus
from engram_sglang.core.config import EngramConfig, configs_dir
from engram_sglang.core.hashing import EngramLayout, NgramHasher, compressed_token_map
from engram_sglang.core.stores.base import column_shards, shard_range
from engram_sglang.tools.demo.corpus import train_tokenizer

CONFIG = configs_dir() / "deepseek-v4.1-flash.json"
TPS = (2, 4, 8)
GOAL = 1.05


def rank_ranges(bounds, tp: int) -> dict[str, list[list[tuple[int, int]]]]:
    """{split: [ranges of rank 0, ...]} for one layer."""
    rows = int(bounds[-1])
    return {"contiguous": [[shard_range(rows, r, tp)] for r in range(tp)],
            "balanced": [column_shards(bounds, r, tp) for r in range(tp)]}


def distinct_per_rank(uniq: np.ndarray, ranges: list[list[tuple[int, int]]]) -> np.ndarray:
    """Distinct rows of one step (sorted unique ids) that each rank holds."""
    out = np.zeros(len(ranges), dtype=np.int64)
    for r, held in enumerate(ranges):
        for lo, hi in held:
            out[r] += np.searchsorted(uniq, hi) - np.searchsorted(uniq, lo)
    return out


def steps_of(ids: np.ndarray, shape: str, decode_steps: int) -> list[np.ndarray]:
    """Row ids [tokens, 24] of each step: decode reads token t of DECODE_BATCH streams, prefill
    PREFILL_CHUNK consecutive tokens."""
    if shape == "prefill":
        return [ids[i: i + PREFILL_CHUNK] for i in range(0, ids.shape[0] - PREFILL_CHUNK + 1, PREFILL_CHUNK)]
    per = ids.shape[0] // DECODE_BATCH
    streams = ids[: per * DECODE_BATCH].reshape(DECODE_BATCH, per, *ids.shape[1:])
    return [streams[:, t % per] for t in range(min(decode_steps, per))]


def hashed_corpus(vocab: int) -> tuple[EngramConfig, EngramLayout, np.ndarray, dict]:
    """(cfg, layout, row ids [T, layers, 24], tokenizer facts) of the profile corpora in
    DeepSeek-V4.1-Flash's layout (bench/attn_dp_rows.py reads the same ids)."""
    texts = code_corpus() + prose_corpus()
    tokenizer = train_tokenizer(texts, vocab)
    tokens = [t for text in texts for t in tokenizer(text)["input_ids"]]
    _, compressed = compressed_token_map(tokenizer)
    cfg = dataclasses.replace(EngramConfig.from_file(CONFIG), compressed_vocab_size=compressed)
    hasher = NgramHasher.from_tokenizer(cfg, tokenizer)
    facts = {"kind": "byte-level BPE trained on this machine with the tokenizers library (no hub)",
             "vocab_size": vocab, "compressed_vocab_size": compressed,
             "corpus": "bench/workload.py code_corpus() + prose_corpus()",
             "corpus_chars": sum(map(len, texts)), "tokens": len(tokens)}
    return cfg, EngramLayout(cfg), hasher.hash_sequence(tokens).numpy(), facts


def measure(args) -> dict:
    t0 = time.perf_counter()
    cfg, layout, ids, tokenizer_facts = hashed_corpus(args.vocab)  # ids [T, layers, 24]
    hashed_s = time.perf_counter() - t0
    results = []
    for li, layer_id in enumerate(cfg.layer_ids):
        bounds = layout.column_bounds(li)
        for shape in ("decode", "prefill"):
            steps = steps_of(ids[:, li], shape, args.decode_steps)
            uniqs = [np.unique(s) for s in steps]
            for tp in args.tps:
                for split, ranges in rank_ranges(bounds, tp).items():
                    per_rank = sum(distinct_per_rank(u, ranges) for u in uniqs)
                    results.append({"layer": layer_id, "shape": shape, "tp": tp, "split": split,
                                    "steps": len(steps), "per_rank": per_rank.tolist()})
    figures = []
    for shape in ("decode", "prefill"):
        for tp in args.tps:
            row = {"shape": shape, "tp": tp}
            for split in ("contiguous", "balanced"):
                per_rank = np.sum([r["per_rank"] for r in results
                                   if r["shape"] == shape and r["tp"] == tp and r["split"] == split], axis=0)
                row[split] = float(per_rank.max() / per_rank.mean())
                row[f"{split}_distinct_rows_per_rank"] = per_rank.tolist()
            row["steps"] = next(r["steps"] for r in results if r["shape"] == shape)
            figures.append(row)
    return {
        "config": str(CONFIG.name), "columns": len(layout.column_bounds(0)) - 1,
        "rows_per_layer": list(layout.num_embeddings),
        "tokenizer": tokenizer_facts,
        "hasher": "engram_sglang.core.hashing.NgramHasher",
        "balanced_split": "column_shards: column c to rank c % tp (each column split in tp pieces where tp "
                          "does not divide the column count)",
        "contiguous_split": "shard_range: contiguous row ranges",
        "goal_balanced_max_over_mean": GOAL, "hash_seconds": round(hashed_s, 1), "load_average": os.getloadavg(),
        "figures": figures, "per_layer": results,
    }


def plot(figures: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, shape in zip(axes, ("decode", "prefill")):
        rows = [f for f in figures if f["shape"] == shape]
        x = np.arange(len(rows))
        for k, split in enumerate(("contiguous", "balanced")):
            ax.bar(x + (k - 0.5) * 0.38, [f[split] for f in rows], 0.38, label=split)
        ax.axhline(GOAL, color="k", ls="--", lw=0.8, label=f"goal {GOAL}")
        ax.set_xticks(x, [f"TP {f['tp']}" for f in rows])
        ax.set_ylim(0.9, max(1.1, *(f["contiguous"] for f in figures)) * 1.05)
        ax.set_title(f"{shape} ({DECODE_BATCH if shape == 'decode' else PREFILL_CHUNK} tokens a step)")
        ax.set_ylabel("max / mean distinct rows per rank")
        ax.legend()
    fig.suptitle("DeepSeek-V4.1-Flash layout, profile corpora: distinct rows per rank, summed over steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=OUT / "shard_balance.json")
    p.add_argument("--png", type=Path, default=OUT / "shard_balance.png")
    p.add_argument("--decode-steps", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tps", type=int, nargs="+", default=list(TPS))
    args = p.parse_args(argv)
    payload = measure(args)
    figures = payload["figures"]
    print_table("max_over_mean of distinct rows per rank (summed over steps, both layers)",
                ["shape", "tp", "steps", "contiguous", "balanced"],
                [[f["shape"], f["tp"], f["steps"], f"{f['contiguous']:.4f}", f"{f['balanced']:.4f}"] for f in figures])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    import json

    args.json.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    args.png.parent.mkdir(parents=True, exist_ok=True)  # a --json elsewhere leaves bench/out unmade
    plot(figures, args.png)
    worst = max(f["balanced"] for f in figures)
    print(f"\nbalanced worst {worst:.4f} (goal <= {GOAL}); wrote {args.json} and {args.png}")
    return 0 if worst <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
