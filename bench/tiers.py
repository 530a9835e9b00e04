"""Rows/s of each table placement on model-shaped calls, against this machine's same-run limits.

Decode-like calls: 256 requests x 24 rows (one token each); prefill-like: 8192 tokens x 24
rows; row ids from real text hashed the DeepSeek-V4.1 way (bench/workload.py), so duplicates
are realistic. Limits measured in the same run: memcpy bandwidth and the disk's 4 KiB random
read IOPS (fio when installed, else the store's own O_DIRECT path at the same queue depth).
The cold disk case evicts the table file from the page cache before every call.

    python bench/tiers.py [--rows-per-layer 16000000] [--kind code|prose]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, drop_file_cache, print_table, torch_copy_bandwidth, write_json  # noqa: E402
from workload import DECODE_BATCH, PREFILL_CHUNK, decode_steps, hashed_streams, prefill_chunks  # noqa: E402

from engram_sglang.rowformat import ROW_BYTES  # noqa: E402
from engram_sglang.stores import open_store, rowio  # noqa: E402
from engram_sglang.tablefile import layer_file_name, open_tables, write_tables  # noqa: E402
from engram_sglang.errors import EngramError  # noqa: E402


def ensure_table(cfg, rows: int) -> Path:
    """A table of random rows (content does not matter for I/O), reused across runs."""
    root = OUT / f"tiers-table-{cfg.fingerprint()}"
    try:
        open_tables(root, cfg)
        return root
    except EngramError:
        pass
    rng = np.random.default_rng(0)
    from engram_sglang.hashing import EngramLayout

    n = EngramLayout(cfg).rows(cfg.layer_ids[0])
    chunks = (rng.integers(0, 256, (min(1 << 18, n - lo), ROW_BYTES), dtype=np.uint8) for lo in range(0, n, 1 << 18))
    print(f"writing a {n * ROW_BYTES / 2**30:.1f} GiB table to {root} ...", flush=True)
    return write_tables(root, cfg, {cfg.layer_ids[0]: chunks})


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
    args = ap.parse_args()

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
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
