"""Rows/s of each table placement on model-shaped calls, against this machine's same-run limits.

Decode-like calls: 256 requests x 24 rows (one token each); prefill-like: 8192 tokens x 24
rows; row ids from real text hashed the DeepSeek-V4.1 way (bench/workload.py), so duplicates
are realistic. Limits measured in the same run: memcpy bandwidth and the disk's 4 KiB random
read IOPS (fio when installed, else the store's own O_DIRECT path at the same queue depth).
The cold disk case evicts the table file from the page cache before every call.

`--part pipeline` (also in `all`) measures the disk pipeline on a table larger than this
machine's RAM (default 1.25x), read by O_DIRECT behind the DRAM row cache at 0, 1% and 10%
of the table: per decode step (batch 16, 64, 256 concurrent streams; each cache first
filled with `--warm-tokens` tokens of the same streams) its time against the floor its
unique misses set at the IOPS measured just before; per prefill chunk the rate of its misses against that IOPS, and how much of a chunk's
reads read-ahead hides behind the previous chunk. `--part placements` is the first part only.

    python -m bench.tiers [--rows-per-layer 16000000] [--kind code|prose] [--part all|placements|pipeline]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import OUT, drop_file_cache, print_table, torch_copy_bandwidth, write_json
from bench.workload import DECODE_BATCH, PREFILL_CHUNK, decode_steps, hashed_streams, prefill_chunks
from engram_sglang.core.errors import EngramError
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import open_store, rowio
from engram_sglang.core.tablefile import layer_file_name, open_tables, write_tables


def ensure_table(cfg, rows: int) -> Path:
    """A table of random rows (content does not matter for I/O), reused across runs."""
    root = OUT / f"tiers-table-{cfg.fingerprint()}"
    try:
        open_tables(root, cfg)
        return root
    except EngramError:
        pass
    rng = np.random.default_rng(0)
    from engram_sglang.core.hashing import EngramLayout

    n = EngramLayout(cfg).rows(cfg.layer_ids[0])
    chunks = (rng.integers(0, 256, (min(1 << 18, n - lo), ROW_BYTES), dtype=np.uint8) for lo in range(0, n, 1 << 18))
    print(f"writing a {n * ROW_BYTES / 2**30:.1f} GiB table to {root} ...", flush=True)
    return write_tables(root, cfg, {cfg.layer_ids[0]: chunks})


def ensure_big_table(cfg) -> Path:
    """A table of random rows that does not fit in RAM, written once (block-wise: random
    bytes from a generator are slower than the disk)."""
    root = OUT / f"tiers-big-{cfg.fingerprint()}"
    try:
        open_tables(root, cfg)
        return root
    except EngramError:
        pass
    from engram_sglang.core.hashing import EngramLayout

    n = EngramLayout(cfg).rows(cfg.layer_ids[0])
    block = np.random.default_rng(1).integers(0, 256, (1 << 18, ROW_BYTES), dtype=np.uint8)

    def chunks():
        for k, lo in enumerate(range(0, n, 1 << 18)):
            rows = np.roll(block, k, axis=0)[: min(1 << 18, n - lo)]
            rows[:, :8] = np.arange(lo, lo + rows.shape[0], dtype="<i8").view(np.uint8).reshape(-1, 8)
            yield rows

    print(f"writing a {n * ROW_BYTES / 2**30:.1f} GiB table to {root} (RAM {ram_bytes() / 2**30:.1f} GiB) ...",
          flush=True)
    root = write_tables(root, cfg, {cfg.layer_ids[0]: chunks()})
    drop_file_cache(root / layer_file_name(cfg.layer_ids[0]))
    return root


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def disk_iops(path: Path, seconds: float, threads: int) -> tuple[float, str]:
    """4 KiB random-read IOPS of the table's disk, cold, at `threads` in flight."""
    if shutil.which("fio"):
        drop_file_cache(path)
        out = subprocess.run(
            ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
             "--ioengine=libaio", f"--iodepth={threads}", f"--runtime={seconds}", "--time_based",
             "--output-format=json"], capture_output=True, text=True, check=True).stdout
        return json.loads(out)["jobs"][0]["read"]["iops"], f"fio libaio 4k O_DIRECT qd{threads}"
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        rows_in_file = (os.fstat(fd).st_size - 4096) // ROW_BYTES
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            rows = np.sort(np.random.default_rng(done).integers(0, rows_in_file, 8192)).astype(np.int64)
            out = np.empty((rows.shape[0], ROW_BYTES), np.uint8)
            rowio.pread_rows(fd, 4096, rows, out, threads, True)
            done += rows.shape[0]
        return done / (time.perf_counter() - t0), f"engram O_DIRECT row reads, {threads} threads"
    finally:
        os.close(fd)


def measure(store, calls, cold_path=None) -> dict:
    """Ids/s and unique rows/s over the calls; CPU seconds per call (all threads)."""
    elapsed = cpu = 0.0
    ids_total = 0
    unique_before = store.stats()["unique_rows"]
    for ids in calls:
        if cold_path is not None:
            drop_file_cache(cold_path)
        c0, t0 = time.process_time(), time.perf_counter()
        store.gather(ids)
        elapsed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        ids_total += ids.numel()
    unique = store.stats()["unique_rows"] - unique_before
    return {"rows_per_s": ids_total / elapsed, "unique_rows_per_s": unique / elapsed,
            "ms_per_call": 1e3 * elapsed / len(calls), "cpu_ms_per_call": 1e3 * cpu / len(calls),
            "unique_share": unique / ids_total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-layer", type=int, default=16_000_000)
    ap.add_argument("--kind", choices=("code", "prose"), default="code")
    ap.add_argument("--decode-steps", type=int, default=40)
    ap.add_argument("--prefill-chunks", type=int, default=3)
    ap.add_argument("--threads", type=int, default=64, help="disk reads in flight")
    ap.add_argument("--iops-seconds", type=float, default=5.0)
    ap.add_argument("--part", choices=("all", "placements", "pipeline"), default="all")
    ap.add_argument("--big-table-ratio", type=float, default=1.25, help="pipeline table size / RAM")
    ap.add_argument("--dram-shares", default="0,0.01,0.1", help="DRAM row cache sizes, shares of the table")
    ap.add_argument("--batches", default="16,64,256", help="decode batch sizes (concurrent streams)")
    ap.add_argument("--warm-tokens", type=int, default=512 * 1024,
                    help="tokens (all streams) read into each DRAM cache before measuring")
    ap.add_argument("--measure-steps", type=int, default=40)
    ap.add_argument("--chunk-compute-ms", type=float, default=1000.0,
                    help="model time of one 8192-token prefill chunk, all layers (stand-in: a sleep). Default: "
                         "~37e9 active params x 2 x 8192 tokens at ~600 TFLOP/s, a DeepSeek-class model on an H200")
    args = ap.parse_args()
    if args.part in ("all", "placements"):
        placements(args)
    if args.part in ("all", "pipeline"):
        pipeline(args)
    return 0


def placements(args) -> None:
    cfg, streams, n_tokens = hashed_streams(args.rows_per_layer, args.kind, layer_ids=(1,))
    decode = decode_steps(streams, 0, args.decode_steps)
    prefill = prefill_chunks(streams, 0, args.prefill_chunks)
    print(f"{n_tokens:,} tokens of real {args.kind} text; {len(decode)} decode calls of {DECODE_BATCH}x24, "
          f"{len(prefill)} prefill calls of {PREFILL_CHUNK}x24", flush=True)
    root = ensure_table(cfg, args.rows_per_layer)
    path = root / layer_file_name(cfg.layer_ids[0])

    limits = {"memcpy_GBps": torch_copy_bandwidth() / 1e9}  # all cores, as the gathers use
    limits["iops"], limits["iops_tool"] = disk_iops(path, args.iops_seconds, args.threads)
    results = []
    for placement, options, cold in [
        ("device", {}, False),
        ("host", {}, False),
        ("disk", {"threads": args.threads}, False),
        ("disk", {"threads": args.threads}, True),
    ]:
        store = open_store(root, placement, cfg=cfg, **options)[cfg.layer_ids[0]]
        name = f"{placement}{' cold' if cold else (' warm' if placement == 'disk' else '')}"
        store.gather(decode[0])  # first call: thread pools start, code paths warm up
        for shape, calls in (("decode", decode), ("prefill", prefill)):
            if placement == "disk" and not cold:
                measure(store, calls)  # the same calls once untimed: every row in the page cache
            r = measure(store, calls, path if cold else None)
            r.update(placement=name, shape=shape, backend=store.backend)
            r["GBps_moved"] = r["rows_per_s"] * (ROW_BYTES + 512) / 1e9  # packed read + bf16 written
            results.append(r)
            print(f"  {name:10s} {shape:8s} {r['rows_per_s'] / 1e6:8.2f} M rows/s", flush=True)
        store.close()
        del store

    device = {r["shape"]: r["rows_per_s"] for r in results if r["placement"] == "device"}
    table = []
    for r in results:
        r["vs_device"] = r["rows_per_s"] / device[r["shape"]]
        r["vs_memcpy"] = r["GBps_moved"] / limits["memcpy_GBps"]
        r["unique_vs_iops"] = r["unique_rows_per_s"] / limits["iops"] if "cold" in r["placement"] else None
        table.append([r["placement"], r["shape"], r["rows_per_s"] / 1e6, r["ms_per_call"], r["cpu_ms_per_call"],
                      r["unique_share"], r["vs_device"], r["vs_memcpy"],
                      "" if r["unique_vs_iops"] is None else f"{r['unique_vs_iops']:.0%}"])
    print_table(
        f"Engram table placements on this machine (memcpy {limits['memcpy_GBps']:.1f} GB/s, "
        f"disk {limits['iops'] / 1e3:.0f} k IOPS by {limits['iops_tool']})",
        ["placement", "call", "M rows/s", "ms/call", "CPU ms/call", "unique", "vs device", "vs memcpy", "unique/IOPS"],
        table,
    )
    write_json("tiers", {"args": vars(args), "limits": limits, "results": results})
    plot(results, limits)


def plot(results, limits) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, shape in zip(axes, ("decode", "prefill")):
        rs = [r for r in results if r["shape"] == shape]
        ax.bar([r["placement"] for r in rs], [r["rows_per_s"] / 1e6 for r in rs], color="tab:blue", label="rows/s")
        ax.bar([r["placement"] for r in rs], [r["unique_rows_per_s"] / 1e6 for r in rs], color="tab:orange",
               width=0.4, label="unique rows/s")
        ax.axhline(limits["iops"] / 1e6, color="tab:red", ls="--", label=f"disk IOPS ({limits['iops'] / 1e3:.0f} k)")
        ax.set_yscale("log")
        ax.set_title(f"{shape}: {'256' if shape == 'decode' else '8192'} tokens x 24 rows per call")
        ax.set_ylabel("M rows / s")
        ax.legend(fontsize=8)
    fig.suptitle(f"Engram placements vs same-run limits (memcpy {limits['memcpy_GBps']:.1f} GB/s)")
    fig.tight_layout()
    fig.savefig(OUT / "tiers.png", dpi=110)
    print(f"wrote {OUT / 'tiers.json'} and {OUT / 'tiers.png'}")


# ------------------------------------------------------------------ disk pipeline
def pipeline(args) -> None:
    rows = int(args.big_table_ratio * ram_bytes() / ROW_BYTES)
    cfg, streams, n_tokens = hashed_streams(rows, args.kind, layer_ids=(1,))
    root = ensure_big_table(cfg)
    path = root / layer_file_name(cfg.layer_ids[0])
    table_bytes = path.stat().st_size
    shares = [float(x) for x in args.dram_shares.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    length = min(s.shape[0] for s in streams)
    warm = min(length - args.measure_steps, max(1, args.warm_tokens // len(streams)))
    print(f"pipeline: {table_bytes / 2**30:.1f} GiB table, RAM {ram_bytes() / 2**30:.1f} GiB, {n_tokens:,} tokens of "
          f"{args.kind}; DRAM caches warmed with the first {warm} tokens of {len(streams)} streams", flush=True)
    # Prefill chunks from text after what the decode steps read (no rows of theirs cached).
    chunks = prefill_chunks([s[warm + args.measure_steps:] for s in streams], 0, 2 * args.prefill_chunks + 1)
    decode, prefill, iops_runs = [], [], []
    disk_iops(path, 2.0, args.threads)  # untimed: the first reads after a pause ran at a fraction of the IOPS here
    for share in shares:
        # The limit again before and after each cache size: this machine's disk varies minute
        # to minute (14-86 k IOPS seen in one hour); the floor uses the mean of the two.
        before, iops_tool = disk_iops(path, args.iops_seconds, args.threads)
        store = open_store(root, "disk", cfg=cfg, threads=args.threads, direct=True,
                           dram_cache_bytes=int(share * table_bytes))[cfg.layer_ids[0]]
        try:
            warmed = warm_cache(store, streams, warm)
            for batch in batches:
                decode.append(decode_run(store, streams, batch, warm, args.measure_steps, before)
                              | {"dram_share": share, "iops": before, "warm_rows": warmed})
                d = decode[-1]
                print(f"  DRAM {share:>5.0%} batch {batch:3d}: {d['ms_per_step']:7.2f} ms/step, floor "
                      f"{d['floor_ms_per_step']:6.2f} ms at {before / 1e3:.1f} k IOPS (before), x{d['vs_floor']:.2f}, "
                      f"hit {d['dram_hit_rate']:.0%}", flush=True)
            prefill.append(prefill_run(store, chunks, before, args.chunk_compute_ms / 1e3)
                           | {"dram_share": share, "iops": before})
        finally:
            store.close()
        after, _ = disk_iops(path, args.iops_seconds, args.threads)
        iops = (before + after) / 2
        iops_runs.append({"before": before, "after": after})
        steady = abs(after - before) <= 0.2 * iops
        for r in decode[-len(batches):] + prefill[-1:]:
            rescale = r["iops"] / iops  # the floor and ratios at the mean IOPS of the window
            r.update(iops=iops, iops_before=before, iops_after=after, iops_steady=steady)
            if "floor_ms_per_step" in r:
                r["floor_ms_per_step"] *= rescale
                r["vs_floor"] /= rescale
            else:
                r["vs_iops"] *= rescale
        if not steady:
            print(f"  WARNING: the disk moved from {before / 1e3:.1f} k to {after / 1e3:.1f} k IOPS during this cache "
                  f"size: its ratios are not reliable", flush=True)
        p = prefill[-1]
        hidden = "n/a (no cache to read into)" if p["hidden_share"] is None else f"{p['hidden_share']:.0%}"
        print(f"  DRAM {share:>5.0%} prefill: misses at {p['miss_rows_per_s'] / 1e3:.1f} k rows/s = "
              f"{p['vs_iops']:.0%} of IOPS; read-ahead hides {hidden}", flush=True)

    limits = {"iops": float(np.mean([(r["before"] + r["after"]) / 2 for r in iops_runs])), "iops_runs": iops_runs,
              "iops_tool": iops_tool,
              "ram_bytes": ram_bytes(), "table_bytes": table_bytes}
    print_table(
        f"Disk tier decode steps, {table_bytes / 2**30:.1f} GiB table (RAM {ram_bytes() / 2**30:.1f} GiB), O_DIRECT "
        f"native AIO, {args.threads} in flight; IOPS by {iops_tool}, mean of before and after each cache size",
        ["DRAM cache", "batch", "ms/step", "p99 ms", "misses/step", "k IOPS (before/after)", "floor ms", "vs floor",
         "DRAM hit", "CPU ms/step"],
        [[f"{d['dram_share']:.0%}", d["batch"], d["ms_per_step"], d["p99_ms"], d["misses_per_step"],
          f"{d['iops'] / 1e3:.1f} ({d['iops_before'] / 1e3:.0f}/{d['iops_after'] / 1e3:.0f})"
          + ("" if d["iops_steady"] else " UNSTEADY"),
          d["floor_ms_per_step"], d["vs_floor"], f"{d['dram_hit_rate']:.0%}", d["cpu_ms_per_step"]] for d in decode])
    print_table(
        f"Disk tier prefill chunks (8192 tokens x 24 rows); read-ahead behind {args.chunk_compute_ms:.0f} ms of "
        "compute per chunk",
        ["DRAM cache", "ms/chunk", "read ms", "unique", "misses", "miss rows/s", "vs IOPS",
         "exposed read ms w/ read-ahead", "hidden"],
        [[f"{p['dram_share']:.0%}", p["ms_per_chunk"], p["read_ms_per_chunk"], p["unique_per_chunk"],
          p["misses_per_chunk"], p["miss_rows_per_s"], f"{p['vs_iops']:.0%}", p["exposed_ms_read_ahead"],
          "n/a" if p["hidden_share"] is None else f"{p['hidden_share']:.0%}"] for p in prefill])
    write_json("tiers-pipeline", {"args": vars(args), "limits": limits, "decode": decode, "prefill": prefill})
    plot_pipeline(decode, prefill, limits)


def warm_cache(store, streams, tokens: int) -> int:
    """Fill the DRAM cache as decode would have: the first `tokens` tokens of every stream,
    read ahead in steps of 32 tokens (in order, so LRU keeps the latest), at full queue depth."""
    if store.dram is None or tokens == 0:
        return 0
    done = 0
    for t in range(0, tokens, 32):
        ids = torch.stack([s[t:min(tokens, t + 32), 0] for s in streams])
        done += store.read_ahead(ids).result()
    return done


def decode_run(store, streams, batch: int, start: int, steps: int, iops: float) -> dict:
    """Decode steps start..start+steps of the first `batch` streams: time per step against
    the floor its unique misses set at `iops`."""
    times, floors, misses, cpu = [], [], [], 0.0
    store.gather(torch.stack([streams[b][start - 1, 0] for b in range(batch)]))  # first call: AIO set-up
    hits0, looked0 = (store.dram.hits, store.dram.lookups) if store.dram else (0, 0)
    for t in range(start, start + steps):
        ids = torch.stack([streams[b][t, 0] for b in range(batch)])
        read0 = store.stats()["file_rows_read"]
        c0, t0 = time.process_time(), time.perf_counter()
        store.gather(ids)
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
        misses.append(store.stats()["file_rows_read"] - read0)
        floors.append(misses[-1] / iops)
    hit = (store.dram.hits - hits0) / max(1, store.dram.lookups - looked0) if store.dram else 0.0
    t = np.array(times)
    return {"batch": batch, "steps": len(times), "ms_per_step": 1e3 * t.mean(),
            "p99_ms": 1e3 * float(np.percentile(t, 99)), "misses_per_step": float(np.mean(misses)),
            "floor_ms_per_step": 1e3 * float(np.mean(floors)), "vs_floor": t.sum() / max(sum(floors), 1e-9),
            "dram_hit_rate": hit, "cpu_ms_per_step": 1e3 * cpu / len(times)}


def prefill_run(store, chunks, iops: float, compute_s: float) -> dict:
    """Half the chunks without read-ahead: the rate of their misses (rows read from the
    file / the read's own time). The other half (other text) with read-ahead: chunk k+1's
    rows read into the DRAM cache while chunk k is gathered and computed (a sleep of
    `compute_s`, a stand-in for the model's layers on that chunk); what stays exposed is
    the read time left in chunk k+1's gather."""
    n = (len(chunks) - 1) // 2
    plain, ahead_set = chunks[:n], chunks[n:]

    def gather(ids):
        read0, uniq0 = store.stats()["file_rows_read"], store.stats()["unique_rows"]
        t0 = time.perf_counter()
        store.gather(ids)
        total = time.perf_counter() - t0
        s = store.stats()
        return total, store._read_latencies[-1], s["file_rows_read"] - read0, s["unique_rows"] - uniq0

    runs = [gather(ids) for ids in plain]
    total, read, misses, unique = (np.array(x, dtype=float) for x in zip(*runs))
    rate = misses.sum() / read.sum()
    exposed, hidden_reads = [], 0
    pending = store.read_ahead(ahead_set[0])
    if pending is not None:
        pending.result()  # the first chunk of a prompt has nothing to hide behind
    for k in range(len(ahead_set) - 1):
        pending = store.read_ahead(ahead_set[k + 1])
        exposed.append(gather(ahead_set[k])[1])
        time.sleep(compute_s)
        if pending is not None:
            hidden_reads += pending.result()
    hidden = None if store.dram is None else 1 - float(np.mean(exposed)) / read.mean()
    return {"chunks": n, "ms_per_chunk": 1e3 * total.mean(), "read_ms_per_chunk": 1e3 * read.mean(),
            "unique_per_chunk": unique.mean(), "misses_per_chunk": misses.mean(), "miss_rows_per_s": rate,
            "vs_iops": rate / iops, "compute_ms": 1e3 * compute_s,
            "exposed_ms_read_ahead": 1e3 * float(np.mean(exposed)), "read_ahead_rows": hidden_reads,
            "hidden_share": hidden}


def plot_pipeline(decode, prefill, limits) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for share in sorted({d["dram_share"] for d in decode}):
        ds = [d for d in decode if d["dram_share"] == share]
        ax.plot([d["batch"] for d in ds], [d["ms_per_step"] for d in ds], "o-", label=f"DRAM {share:.0%}: measured")
        ax.plot([d["batch"] for d in ds], [d["floor_ms_per_step"] for d in ds], "x--", label=f"DRAM {share:.0%}: floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (streams)")
    ax.set_ylabel("ms per step (one layer)")
    ax.set_title("decode step vs unique misses / IOPS")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.bar([f"{p['dram_share']:.0%}" for p in prefill], [p["miss_rows_per_s"] / 1e3 for p in prefill])
    ax.axhline(limits["iops"] / 1e3, color="tab:red", ls="--", label=f"IOPS {limits['iops'] / 1e3:.0f} k")
    ax.axhline(0.7 * limits["iops"] / 1e3, color="tab:red", ls=":", label="70% of IOPS")
    ax.set_xlabel("DRAM row cache (share of the table)")
    ax.set_ylabel("k missed rows / s")
    ax.set_title("prefill chunk reads")
    ax.legend(fontsize=8)
    fig.suptitle(f"Disk tier, {limits['table_bytes'] / 2**30:.0f} GiB table > {limits['ram_bytes'] / 2**30:.0f} GiB RAM")
    fig.tight_layout()
    fig.savefig(OUT / "tiers-pipeline.png", dpi=110)
    print(f"wrote {OUT / 'tiers-pipeline.json'} and {OUT / 'tiers-pipeline.png'}")


if __name__ == "__main__":
    sys.exit(main())
