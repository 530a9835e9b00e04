"""Whole rows from the node's copy vs a shard + all-reduce per rank (host placement, shared copy).

Per step (a decode step of 256 tokens, a prefill chunk of 8192) for DeepSeek-V4.1-Flash's
Engram shapes (its preset: 2 layers x 24 hash columns, 256-value rows, 264-byte packed rows)
at TP 2, 4 and 8:

* collective bytes removed per GPU: the ring all-reduce of the bf16 rows that whole rows no
  longer need (2 (TP-1)/TP of the payload sent per GPU);
* host-link bytes added per GPU: the 64-byte lines of the rows of the other (TP-1)/TP of the
  table that each rank now reads itself; raw, and less what a hot-row cache serves;
* hot-cache hit rates at the same HBM budget per GPU: real code text (bench/workload.py,
  256 streams, one token each per decode step, the table sized to 0.5 reads per row as in
  bench/cache.py) replayed through the store's own cache policy (`RowDirectory`, 16 ways,
  maintenance every 8 steps): sharded, rank 0 caches rows of its shard only (the ids of
  other shards never reach its cache); whole, every rank caches rows of the whole table
  from every id of its tokens. Hit rate = reads served by the cache / reads the rank makes.
* bit-identical outputs on a small table: each rank's whole rows (the node's one copy,
  `open_store(..., agree=)`) against the private shards of all ranks summed, at every TP;
* the planner's recommendation per SKU (configs/gpus.json: host and GPU link peaks), the
  figures at each link's peak, and this machine's memcpy bandwidth in the same run (its
  own limit for host-memory reads; the GPU links are not on this machine).

    python -m bench.whole_rows [--budgets 0.005 0.02] [--steps 600] [--tps 2 4 8]

Writes bench/out/whole_rows.json and whole_rows.png.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import OUT, memcpy_bandwidth, print_table, write_json
from bench.workload import DECODE_BATCH, PREFILL_CHUNK, decode_steps, hasher_for, split_streams, tokenized
from engram_sglang.core.config import EngramConfig
from engram_sglang.core.planning import whole_rows
from engram_sglang.core.planning.data import load_gpus
from engram_sglang.core.planning.model import lines_per_row, row_bytes
from engram_sglang.core.stores.base import shard_range
from engram_sglang.core.stores.row_directory import RowDirectory

PRESET = "deepseek-v4.1-flash"
TPS = (2, 4, 8)
BUDGETS = (0.005, 0.02)  # hot-row cache per GPU, as a share of one layer's rows


def step_figures(cfg: EngramConfig, tps, hit_rates: dict) -> list[dict]:
    """Bytes per GPU per step for each TP and phase; host bytes also at the measured hit rates."""
    lines = lines_per_row(row_bytes(cfg))
    out = []
    for tp in tps:
        for phase, tokens in (("decode", DECODE_BATCH), ("prefill", PREFILL_CHUNK)):
            b = whole_rows.step_bytes(tokens=tokens, layers=cfg.n_layers, columns=cfg.hash_columns,
                                      head_dim=cfg.head_dim, lines_per_row=lines, tp=tp)
            row = {"tp": tp, "phase": phase, "tokens": tokens, **{k: int(v) for k, v in b.items()}}
            for budget, rates in hit_rates.items():
                r = rates.get(tp)
                if r is None:
                    continue
                # Whole: every read of the rank's tokens, less the whole-table cache's hits;
                # sharded: its 1/TP of them, less its shard cache's hits.
                row[f"host_bytes_added_cached_{budget:g}"] = int(
                    b["host_bytes_whole"] * (1 - r["whole"]) - b["host_bytes_shard"] * (1 - r["sharded"]))
            out.append(row)
    return out


def hit_rates(budgets, tps, steps: int, reads_per_row: float, vocab: int) -> tuple[dict, dict]:
    """{budget: {tp: {"whole": rate, "sharded": rate}}} on real code text (layer index 0)."""
    t0 = time.perf_counter()
    tokenizer, tokens = tokenized("code", vocab)
    tokens = tokens[: steps * DECODE_BATCH]
    rows_target = int(len(tokens) * 24 / reads_per_row)
    cfg, hasher = hasher_for(tokenizer, rows_target, (1, 14))
    from engram_sglang.core.hashing import EngramLayout

    rows = EngramLayout(cfg).rows(cfg.layer_ids[0])
    trace = decode_steps(split_streams(hasher, tokens), 0, len(tokens) // DECODE_BATCH)
    info = {"tokens": len(tokens), "steps": len(trace), "rows": rows, "reads_per_row": reads_per_row,
            "trace_seconds": round(time.perf_counter() - t0, 1)}
    out: dict = {}
    for budget in budgets:
        capacity = max(16, int(budget * rows) // 16 * 16)
        whole = _replay(trace, capacity, None)
        out[budget] = {tp: {"whole": whole, "sharded": _replay(trace, capacity, shard_range(rows, 0, tp))}
                       for tp in tps}
    return out, info


def _replay(trace, capacity: int, rng_range) -> float:
    """Hit rate of a RowDirectory of `capacity` rows (the store's policy, cold, every step
    counted) over the reads of the ids in `rng_range` (None: all): the planner's replay."""
    return whole_rows.replay_hits(trace, RowDirectory(capacity, ways=16), rng_range)


def bit_identical(tps) -> dict:
    """Each rank's whole rows vs the private shards of all ranks summed, bit for bit."""
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits
    from engram_sglang.core.stores import open_store
    from engram_sglang.core.tablefile import write_tables

    cfg = EngramConfig(layer_ids=(1, 3), max_ngram_size=4, n_heads=2, head_dim=256, vocab_size=1000,
                       compressed_vocab_size=300, pad_token_id=2, source="bench")
    gen = np.random.default_rng(0)
    tables = {L: gen.integers(0, 256, (EngramLayout(cfg).rows(L), ROW_BYTES), dtype=np.uint8) for L in cfg.layer_ids}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = write_tables(Path(tmp) / "t", cfg, tables, progress=False)
        for tp in tps:
            ok = True
            whole = [open_store(root, "host", cfg=cfg, tp_rank=r, tp_size=tp, shared=True, shm_dir=tmp,
                                agree=lambda everywhere: everywhere) for r in range(tp)]
            shards = [open_store(root, "host", cfg=cfg, tp_rank=r, tp_size=tp) for r in range(tp)]
            try:
                for L in cfg.layer_ids:
                    ids = torch.from_numpy(gen.integers(0, tables[L].shape[0], (512, 12)))
                    summed = sum(s[L].gather(ids).float() for s in shards).to(torch.bfloat16)
                    for rank in whole:
                        ok &= rank[L].holds_whole_rows and torch.equal(bf16_bits(rank[L].gather(ids)), bf16_bits(summed))
            finally:
                for stores in whole + shards:
                    for s in stores.values():
                        s.close()
            out[tp] = bool(ok)
    return out


def recommendations(cfg: EngramConfig, tps) -> list[dict]:
    lines = lines_per_row(row_bytes(cfg))
    out = []
    for sku in load_gpus().values():
        for tp in tps:
            r = whole_rows.compare(tokens_by_phase={"decode": DECODE_BATCH, "prefill": PREFILL_CHUNK},
                                   layers=cfg.n_layers, columns=cfg.hash_columns, head_dim=cfg.head_dim,
                                   lines_per_row=lines, tp=tp, host_gbps=sku.host_link_gbps, gpu_gbps=sku.gpu_link_gbps)
            d = r["phases"]["decode"]
            out.append({"gpu": sku.key, "tp": tp, "host_link_gbps": sku.host_link_gbps, "gpu_link_gbps": sku.gpu_link_gbps,
                        "decode_host_us_added": d["host_seconds_added"] * 1e6,
                        "decode_allreduce_us_removed": d["allreduce_seconds_removed"] * 1e6,
                        "recommend": r["recommend"], "reason": r["reason"]})
    return out


def plot(figures, rates, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, phase in zip(axes[:2], ("decode", "prefill")):
        rs = [f for f in figures if f["phase"] == phase]
        x = np.arange(len(rs))
        ax.bar(x - 0.2, [f["collective_bytes_removed"] / 1e6 for f in rs], 0.4, label="all-reduce bytes removed")
        ax.bar(x + 0.2, [f["host_bytes_added"] / 1e6 for f in rs], 0.4, label="host-link bytes added (no cache)")
        ax.set_xticks(x, [f"TP{f['tp']}" for f in rs])
        ax.set_ylabel("MB per GPU per step")
        ax.set_title(f"{phase}, {rs[0]['tokens']} tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    ax = axes[2]
    for budget, by_tp in rates.items():
        tps = sorted(by_tp)
        ax.plot(tps, [100 * by_tp[t]["sharded"] for t in tps], "o-", label=f"sharded, {budget:.1%} of rows per GPU")
        ax.plot(tps, [100 * by_tp[t]["whole"] for t in tps], "s--", label=f"whole, {budget:.1%} of rows per GPU")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("TP")
    ax.set_ylabel("hot-row cache hit rate, % of the rank's reads")
    ax.set_title("same HBM budget per GPU, real code text")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tps", nargs="+", type=int, default=list(TPS))
    p.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS),
                   help="hot-row cache per GPU, shares of one layer's rows")
    p.add_argument("--steps", type=int, default=600, help="decode steps of the replayed trace")
    p.add_argument("--reads-per-row", type=float, default=0.5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = EngramConfig.from_preset(PRESET)
    memcpy = memcpy_bandwidth(256 << 20)
    print(f"this machine: memcpy {memcpy / 1e9:.1f} GB/s (read + write, one thread)")
    same = bit_identical(args.tps)
    print("bit-identical (each rank's whole rows == all ranks' shards summed): "
          + ", ".join(f"TP{t} {'yes' if ok else 'NO'}" for t, ok in same.items()))
    rates, trace = hit_rates(args.budgets, args.tps, args.steps, args.reads_per_row, args.vocab)
    print(f"trace: {trace['tokens']:,} tokens, {trace['steps']} decode steps, {trace['rows']:,} rows "
          f"({trace['trace_seconds']} s)")
    figures = step_figures(cfg, args.tps, rates)
    print_table(f"{PRESET}: per GPU per step (MB); host bytes added at 0 hits and with the hot-row cache",
                ["TP", "phase", "all-reduce payload", "all-reduce removed", "host shard", "host whole",
                 "host added", *[f"added, cache {b:.1%}" for b in args.budgets]],
                [[f["tp"], f["phase"], f["allreduce_payload_bytes"] / 1e6, f["collective_bytes_removed"] / 1e6,
                  f["host_bytes_shard"] / 1e6, f["host_bytes_whole"] / 1e6, f["host_bytes_added"] / 1e6,
                  *[f.get(f"host_bytes_added_cached_{b:g}", 0) / 1e6 for b in args.budgets]] for f in figures])
    print_table("hot-row cache hit rate, same HBM budget per GPU (real code text, decode)",
                ["budget", "TP", "sharded", "whole"],
                [[f"{b:.1%}", t, f"{r['sharded']:.1%}", f"{r['whole']:.1%}"] for b, by in rates.items()
                 for t, r in sorted(by.items())])
    recs = recommendations(cfg, args.tps)
    print_table("planner: whole or sharded per SKU (decode, at link peaks, no cache)",
                ["GPU", "TP", "host GB/s", "GPU link GB/s", "host us added", "all-reduce us removed", "recommend"],
                [[r["gpu"], r["tp"], r["host_link_gbps"], r["gpu_link_gbps"], r["decode_host_us_added"],
                  r["decode_allreduce_us_removed"], r["recommend"]] for r in recs])
    path = write_json("whole_rows", {"preset": PRESET, "memcpy_bytes_per_s": memcpy, "bit_identical": same,
                                     "trace": trace, "hit_rates": {str(b): v for b, v in rates.items()},
                                     "per_step": figures, "recommendations": recs,
                                     "allreduce_latency_s": whole_rows.ALLREDUCE_LATENCY_S})
    plot(figures, rates, OUT / "whole_rows.png")
    print(f"\nwrote {path} and {OUT / 'whole_rows.png'}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
