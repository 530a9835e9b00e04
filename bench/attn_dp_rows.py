"""The disk tier under attention DP: whole rows of a rank's own tokens, or a shard + id exchange.

Under DeepSeek's attention data parallelism (DP = TP ranks, each running its own tokens) a disk
rank can read from the table files either

* `whole`: the rows of its own tokens, its DRAM row cache covering the whole table, no
  collective (today's serving: a row several ranks need is read once per rank); or
* `shard`: every rank's ids gathered to every rank, each rank reading the rows of ALL ranks'
  ids that its balanced column shard (core/shards.py `column_shards`) holds, its DRAM cache
  covering that shard, the rows returned to their owners by an exact reduce-scatter.

Per step and rank, each scheme's distinct rows read from the files after the rank's DRAM
cache come from replaying the steps through the store's own cache (planning/disk.py
`_dram_cache`: DramRowCache's class and geometry, its policy; the first half of the steps warm
it, as the planner's `replay`). A step's reads take `latency + reads / (IOPS / ranks)` on its
slowest rank (the replica's IOPS split evenly over its ranks, as the planner counts a replica's
reads against one replica's disk), at the planner's assumed disk (1M IOPS, 0.1 ms) and at this
machine's disk measured in the same run (planning/disk.py `measure_disk`). The shard scheme
adds, per Engram layer, an all-gather of the int64 ids and a ring reduce-scatter of the bf16
rows (T_all x 24 x 256 x 2 B: (DP-1)/DP of it per GPU) at each SKU's GPU link peak
(configs/gpus.json) plus one collective latency each (planning/whole_rows.py's assumption).
Exposed per step = reads + exchange, against the planner's assumed 20 ms decode step.

Ids: bench/shard_balance.py's (profile corpora, BPE trained here, the project's hasher,
configs/deepseek-v4.1-flash.json). Decode: 256 streams per rank, one token each a step (384
steps); prefill: one 8192-token chunk per rank a step (8 steps); the first half of the steps
warm the caches. DRAM cache per rank: the planner's size (the smallest of `plan --placement
disk`'s DRAM-cache sweep whose exposed time fits its step budget, computed here) and 1/16 of
it (`--cache-scales`: at these trace lengths the planner's size already holds every row the
warm half read, so a larger one reads the same rows). About 20 minutes on 2 busy cores (the
replay is the store's numpy policy, a call per rank, layer and step).

    python -m bench.attn_dp_rows [--json F] [--png F] [--dps 2 4 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import OUT, machine, print_table
from bench.shard_balance import hashed_corpus
from bench.workload import DECODE_BATCH, PREFILL_CHUNK
from engram_sglang.core.planning import disk as disk_model
from engram_sglang.core.planning.data import GIB, load_gpus
from engram_sglang.core.planning.whole_rows import ALLREDUCE_LATENCY_S, BF16_BYTES
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.shards import column_shards, ranges_rows
from engram_sglang.core.stores.base import split_by_rows

DPS = (2, 4, 8)
SCHEMES = ("whole", "shard")
ID_BYTES = 8  # int64 row ids on the wire
HEAD_DIM = 256  # bf16 values of a row after dequantization (DeepSeek-V4.1-Flash)


# ------------------------------------------------------------------------ steps
def rank_steps(ids: np.ndarray, dp: int, shape: str, max_steps: int) -> list[list[np.ndarray]]:
    """Per step, each rank's ids [tokens, columns] of one layer `ids` [T, columns]: decode cuts
    the tokens into dp x DECODE_BATCH streams (rank r runs streams r*256 ... r*256+255, one token
    each a step), prefill gives each rank the next PREFILL_CHUNK tokens."""
    if shape == "prefill":
        n = min(max_steps, ids.shape[0] // (PREFILL_CHUNK * dp))
        return [[ids[(s * dp + r) * PREFILL_CHUNK: (s * dp + r + 1) * PREFILL_CHUNK] for r in range(dp)]
                for s in range(n)]
    streams = dp * DECODE_BATCH
    per = ids.shape[0] // streams
    s = ids[: per * streams].reshape(streams, per, ids.shape[1])
    return [[s[r * DECODE_BATCH:(r + 1) * DECODE_BATCH, t] for r in range(dp)] for t in range(min(max_steps, per))]


def in_ranges(uniq: np.ndarray, ranges) -> np.ndarray:
    """The sorted unique ids of `uniq` that lie in the row ranges [(lo, hi), ...]."""
    parts = [uniq[np.searchsorted(uniq, lo): np.searchsorted(uniq, hi)] for lo, hi in ranges]
    return np.concatenate(parts) if parts else uniq[:0]


def fetches(steps: list[list[np.ndarray]], scheme: str, rank: int, ranges=None, unions=None) -> list[np.ndarray]:
    """The distinct ids rank `rank` fetches each step: its own tokens' (whole), or all ranks'
    that its shard `ranges` holds (shard; `unions`: each step's distinct ids, if known)."""
    if scheme == "whole":
        return [np.unique(step[rank]) for step in steps]
    if unions is None:
        unions = [np.unique(np.concatenate([a.reshape(-1) for a in step])) for step in steps]
    return [in_ranges(u, ranges) for u in unions]


# ------------------------------------------------------------------------ replay
def replay_reads(calls: list[np.ndarray], rows: int, nbytes: int) -> np.ndarray:
    """Rows read from the files per call (sorted unique ids) behind a DRAM cache of `nbytes`
    (the store's class and policy, planning/disk.py `_dram_cache`) of at most `rows` slots."""
    seen = np.unique(np.concatenate(calls)).shape[0] if calls else 0
    # As the planner's replay: more slots than 16x the ids it will see never fill a set.
    cache = disk_model._dram_cache(min(rows, 16 * seen + 16), nbytes) if nbytes else None
    out = np.zeros(len(calls), np.int64)
    try:
        for i, uniq in enumerate(calls):
            if cache is None:
                out[i] = uniq.shape[0]
                continue
            with cache.lock:
                hit, _ = cache.lookup(uniq)
                missed = uniq[~hit]
                cache.admit(missed, np.zeros((1, ROW_BYTES), np.uint8)[np.zeros(missed.shape[0], np.int64)])
            out[i] = missed.shape[0]
    finally:
        if cache is not None:
            cache.close()
    return out


def scheme_reads(steps: list[list[np.ndarray]], scheme: str, bounds, dram_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(fetches, reads) [steps, ranks] of one layer: each rank's distinct ids and the rows it
    reads from the files behind its own DRAM cache of `dram_bytes` (this layer's share),
    which covers the whole table (whole) or the rank's shard (shard)."""
    dp = len(steps[0])
    fetched, reads = np.zeros((2, len(steps), dp), np.int64)
    unions = [np.unique(np.concatenate([a.reshape(-1) for a in step])) for step in steps] if scheme == "shard" else None
    for r in range(dp):
        ranges = column_shards(bounds, r, dp) if scheme == "shard" else [(int(bounds[0]), int(bounds[-1]))]
        calls = fetches(steps, scheme, r, ranges, unions)
        fetched[:, r] = [c.shape[0] for c in calls]
        reads[:, r] = replay_reads(calls, ranges_rows(ranges), dram_bytes)
    return fetched, reads


# ------------------------------------------------------------------------ times
def read_ms(reads: np.ndarray, iops: float, latency_ms: float) -> float:
    """Mean over steps of the slowest rank's read time: reads [steps, ranks], the replica's
    `iops` split evenly over its ranks."""
    share = iops / reads.shape[1]
    return float(np.mean([max(disk_model.read_time_ms(n, share, latency_ms) for n in row) for row in reads]))


def exchange_ms(tokens_per_rank: int, dp: int, columns: int, layers: int, gbps: float) -> dict[str, float]:
    """The shard scheme's collectives per step on one GPU: per layer an all-gather of every
    rank's int64 ids and a ring reduce-scatter of the bf16 rows of all ranks' tokens, at the
    link's peak `gbps` (GB/s per direction) plus ALLREDUCE_LATENCY_S each."""
    ids = (dp - 1) * tokens_per_rank * columns * ID_BYTES
    rows = (dp - 1) / dp * dp * tokens_per_rank * columns * HEAD_DIM * BF16_BYTES
    ms = layers * (2 * ALLREDUCE_LATENCY_S + (ids + rows) / (gbps * 1e9)) * 1e3
    return {"ids_bytes_per_layer": ids, "rows_bytes_per_layer": rows, "ms": ms}


# ------------------------------------------------------------------------ inputs
def planner_cache_gib(dp: int, gpu: str = "H200") -> dict:
    """The smallest per-rank DRAM cache of `engram-sglang plan --placement disk`'s sweep whose
    eager exposed time fits the step budget, at TP `dp` and the planner's assumed disk."""
    from engram_sglang.tools.planner import plan

    d = plan(model="deepseek-v4.1-flash", gpu=gpu, tp=dp, placement="disk", disk_iops=disk_model.DEFAULT_IOPS)["disk"]
    fit = [c["dram_cache_gib"] for c in d["by_dram_cache"] if c["exposed_ms_prefetch"] <= d["budget_ms"]]
    return {"gib": min(fit) if fit else max(c["dram_cache_gib"] for c in d["by_dram_cache"]),
            "sweep": {c["dram_cache_gib"]: round(c["exposed_ms_prefetch"], 3) for c in d["by_dram_cache"]},
            "budget_ms": d["budget_ms"], "batch": d["batch"], "step_ms": d["step_ms"]}


def measure_iops(seconds: float, mib: int) -> dict:
    """This machine's 4 KiB random-read IOPS and latency (planning/disk.py `measure_disk`) on a
    scratch file of `mib` MiB on the disk under bench/out."""
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=OUT, suffix=".iops") as f:
        chunk = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        for _ in range(mib):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        return {**disk_model.measure_disk(f.name, seconds=seconds), "file_mib": mib}


# ------------------------------------------------------------------------ run
def measure(args, done=None) -> dict:
    """The whole run; `done(payload)` after each DP (the results so far, written as they come)."""
    t0 = time.perf_counter()
    cfg, layout, ids, tokenizer = hashed_corpus(args.vocab)
    hashed_s = time.perf_counter() - t0
    gpus = {k: g for k, g in load_gpus().items() if g.gpu_link_gbps}
    disk = measure_iops(args.iops_seconds, args.iops_mib)
    lat0 = disk_model.DEFAULT_LATENCY_MS
    layers, columns = len(cfg.layer_ids), cfg.hash_columns
    rows = [int(r) for r in layout.num_embeddings]
    results, planner = [], {}

    def payload() -> dict:
        return {
            "config": cfg.source, "columns": columns, "rows_per_layer": rows, "tokenizer": tokenizer,
            "hash_seconds": round(hashed_s, 1), "disk": {"planner": {"iops": disk_model.DEFAULT_IOPS, "latency_ms": lat0,
                                                                      "source": "planning/disk.py DEFAULT_IOPS, DEFAULT_LATENCY_MS (assumption)"},
                                                          "measured": disk},
            "planner_cache": planner, "step_ms": disk_model.DEFAULT_STEP_MS,
            "budget_ms": disk_model.step_budget_ms(disk_model.DEFAULT_STEP_MS),
            "steps": {"decode": args.decode_steps, "prefill": args.prefill_steps, "warm": "the first half"},
            "gpu_link_gbps": {k: g.gpu_link_gbps for k, g in gpus.items()},
            "collective_latency_s": ALLREDUCE_LATENCY_S, "load_average": os.getloadavg(),
            "seconds": round(time.perf_counter() - t0, 1), "results": results,
        }

    for dp in args.dps:
        planner[dp] = planner_cache_gib(dp)
        sizes = sorted({planner[dp]["gib"] * k for k in args.cache_scales})
        for shape in ("decode", "prefill"):
            per_layer = [rank_steps(ids[:, li], dp, shape, args.decode_steps if shape == "decode" else args.prefill_steps)
                         for li in range(layers)]
            n = len(per_layer[0])
            warm = n // 2
            tokens = DECODE_BATCH if shape == "decode" else PREFILL_CHUNK
            ex = {k: exchange_ms(tokens, dp, columns, layers, g.gpu_link_gbps) for k, g in gpus.items()}
            for gib in sizes:
                for scheme in SCHEMES:
                    reads = np.zeros((n - warm, dp), np.int64)
                    fetched = np.zeros((n - warm, dp), np.int64)
                    # The rank's DRAM cache bytes over its layers in proportion to the rows it holds.
                    held = {li: rows[li] if scheme == "whole" else rows[li] // dp for li in range(layers)}
                    for li in range(layers):
                        f, r = scheme_reads(per_layer[li], scheme, layout.column_bounds(li),
                                            split_by_rows(int(gib * GIB), held)[li])
                        fetched += f[warm:]
                        reads += r[warm:]
                    read = {"planner": read_ms(reads, disk_model.DEFAULT_IOPS, lat0),
                            "measured": read_ms(reads, disk["iops"], disk["latency_ms"])}
                    exch = {k: (v["ms"] if scheme == "shard" else 0.0) for k, v in ex.items()}
                    results.append({
                        "shape": shape, "dp": dp, "dram_cache_gib": gib, "scheme": scheme,
                        "steps": n - warm, "warm_steps": warm,
                        "reads_per_rank": reads.mean(0).tolist(), "reads_max_rank": float(reads.max(1).mean()),
                        "reads_all_ranks": float(reads.sum(1).mean()),
                        "fetches_all_ranks": float(fetched.sum(1).mean()), "fetches_max_rank": float(fetched.max(1).mean()),
                        "read_ms": read, "exchange_ms": exch,
                        "exchange_bytes_per_layer": {k: ex[next(iter(ex))][k] for k in ("ids_bytes_per_layer", "rows_bytes_per_layer")}
                        if scheme == "shard" else None,
                        "exposed_ms": {f"{iops}/{sku}": read[iops] + exch[sku] for iops in read for sku in exch},
                    })
                    print(f"  {shape} DP{dp} {gib:g} GiB {scheme}: {reads.max(1).mean():,.0f} reads on the slowest rank, "
                          f"{read['planner']:.2f} ms at 1M IOPS ({time.perf_counter() - t0:.0f} s)", flush=True)
        if done is not None:
            done(payload())
    return payload()


def verdicts(results: list[dict]) -> list[dict]:
    """Per shape, DP and cache size: the cheaper scheme at each disk and SKU."""
    out = []
    keys = sorted({(r["shape"], r["dp"], r["dram_cache_gib"]) for r in results})
    for shape, dp, gib in keys:
        w, s = (next(r for r in results if (r["shape"], r["dp"], r["dram_cache_gib"], r["scheme"]) == (shape, dp, gib, k))
                for k in SCHEMES)
        picks = {k: ("shard" if s["exposed_ms"][k] < w["exposed_ms"][k] else "whole") for k in w["exposed_ms"]}
        # The replica's IOPS above which the reads the shard saves on the slowest rank take less
        # than its exchange (whole rows then cheaper): saved x DP / exchange seconds.
        saved = w["reads_max_rank"] - s["reads_max_rank"]
        even = {k: (saved * dp / (ms / 1e3) if saved > 0 else 0.0) for k, ms in s["exchange_ms"].items()}
        out.append({"shape": shape, "dp": dp, "dram_cache_gib": gib, "picks": picks,
                    "whole_ms": w["exposed_ms"], "shard_ms": s["exposed_ms"],
                    "reads_whole": w["reads_max_rank"], "reads_shard": s["reads_max_rank"],
                    "breakeven_iops": even})
    return out


def plot(results: list[dict], path: Path, key: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for ax, shape in zip(axes, ("decode", "prefill")):
        rows = [r for r in results if r["shape"] == shape]
        cases = sorted({(r["dp"], r["dram_cache_gib"]) for r in rows})
        x = np.arange(len(cases))
        for k, scheme in enumerate(SCHEMES):
            vals = [next(r for r in rows if (r["dp"], r["dram_cache_gib"], r["scheme"]) == (dp, g, scheme))["exposed_ms"][key]
                    for dp, g in cases]
            ax.bar(x + (k - 0.5) * 0.38, vals, 0.38, label=scheme)
        ax.set_xticks(x, [f"DP{dp}\n{g:g} GiB" for dp, g in cases], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(f"exposed ms per step ({key})")
        ax.set_title(f"{shape}: {DECODE_BATCH if shape == 'decode' else PREFILL_CHUNK} tokens per rank a step")
        ax.legend()
    fig.suptitle("Disk tier under attention DP, DeepSeek-V4.1-Flash layout: whole rows vs shard + id exchange")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=OUT / "attn_dp_rows.json")
    p.add_argument("--png", type=Path, default=OUT / "attn_dp_rows.png")
    p.add_argument("--quick", action="store_true", help="DP 2, 8 decode steps, 2 prefill steps, the planner's cache only")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dps", type=int, nargs="+", default=list(DPS))
    p.add_argument("--decode-steps", type=int, default=384, help="decode steps per DP, the first half warming")
    p.add_argument("--prefill-steps", type=int, default=8, help="prefill steps (one chunk per rank) per DP")
    p.add_argument("--cache-scales", type=float, nargs="+", default=[1 / 16, 1],
                   help="DRAM cache sizes per rank as multiples of the planner's")
    args = p.parse_args(argv)
    if args.quick:
        args.dps = [2]
        args.decode_steps, args.prefill_steps = 8, 2
        args.cache_scales = [1]
    args.iops_seconds, args.iops_mib = (3.0, 512) if not args.quick else (0.5, 16)
    def write(payload: dict) -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine(), **payload, "verdicts": verdicts(payload["results"])},
                                        indent=1))
        plot(payload["results"], args.png, "planner/H200")

    payload = measure(args, write)
    res = payload["results"]
    d = payload["disk"]["measured"]
    print_table(f"reads per step (both layers) and exposed ms (reads + exchange; planner disk 1M IOPS per replica / "
                f"measured {d['iops']:,.0f} IOPS; exchange at H200 NVLink), step {payload['step_ms']:g} ms",
                ["shape", "DP", "DRAM GiB", "scheme", "reads max rank", "reads all ranks", "read ms 1M", "exch ms",
                 "exposed 1M", "exposed meas"],
                [[r["shape"], r["dp"], f"{r['dram_cache_gib']:g}", r["scheme"], f"{r['reads_max_rank']:,.0f}",
                  f"{r['reads_all_ranks']:,.0f}", f"{r['read_ms']['planner']:.3f}", f"{r['exchange_ms']['H200']:.3f}",
                  f"{r['exposed_ms']['planner/H200']:.3f}", f"{r['exposed_ms']['measured/H200']:.1f}"] for r in res])
    v = verdicts(res)
    skus = sorted(payload["gpu_link_gbps"])
    print_table("cheaper scheme by exposed ms: at the planner's disk on H200, on every SKU, at the measured disk",
                ["shape", "DP", "DRAM GiB", "1M H200", f"1M {'/'.join(skus)}", "measured H200",
                 "break-even M IOPS (lowest SKU)"],
                [[x["shape"], x["dp"], f"{x['dram_cache_gib']:g}", x["picks"]["planner/H200"],
                  "/".join(x["picks"][f"planner/{k}"] for k in skus), x["picks"]["measured/H200"],
                  f"{min(x['breakeven_iops'].values()) / 1e6:,.0f}"] for x in v])
    write(payload)
    print(f"\nload average {payload['load_average']}; disk measured {d['iops']:,.0f} IOPS, {d['latency_ms']:.3f} ms "
          f"({d['tool']}); {payload['seconds']:.0f} s; wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
