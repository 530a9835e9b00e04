"""gather_dequant bandwidth of each backend against the same-run memory limit.

On this kind of machine (no GPU): the host library (`cpu`, all cores and one core) and the
torch reference, on model-shaped id batches (decode 256 x 24, prefill 8192 x 24; shapes
imported from tests/core/test_gather.py), uniform and Zipf-skewed ids, against the same-run memcpy
bandwidth. Bytes moved per row: 264 read + 512 written; the "lines" column counts the five
64-byte lines a row touches instead of its 264 bytes. memcpy is a limit random 264-byte rows
never reach; the limit that matters is `raw`, measured in the same rounds: the host library's
own gather loop (same ids, prefetch and threads) copying the packed rows with no decode. The
"vs raw" column is the fused gather + decode's rows/s over raw's at the same thread count
(`cpu xN`: the library called directly, as raw is; `cpu op`: through the torch op, on torch's
intra-op threads; `cpu op sorted`: the same with the ids sorted first and the rows scattered
back, as the host store reads on a GPU without ATS). Each backend's pass starts with the
last-level cache evicted, so that none runs on rows another left cached.
Where the host library decodes with AVX-512 VBMI, `portable` is its other decode (what CPUs
without VBMI run) in the same rounds.

On a GPU: bench/gpu_check.py's run (its correctness checks, then gathers from HBM and from
registered host memory against the same-run device copy and host-to-device bandwidth, upstream
SGLang alongside when ENGRAM_SGLANG_WHEEL names its wheel).

    python -m bench.gather [--rows 2000000] [--calls 20] [--cpu]
Writes bench/out/gather.json and bench/out/gather.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
from bench.common import OUT, memcpy_bandwidth, print_table, torch_copy_bandwidth, write_json
from engram_sglang.core import rowformat
from engram_sglang.core.ops import gather_dequant, native
from engram_sglang.testing import DECODE_IDS, PREFILL_IDS

READ, WRITTEN, LINES = rowformat.ROW_BYTES, 2 * rowformat.PAYLOAD_BYTES, 5 * 64


def realistic_table(rows: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Rows quantized from Gaussian data by the OCP MX rule (scales and codes as real tables
    have them), 64 Ki distinct rows tiled to `rows`, in anonymous memory advised into huge
    pages before it is filled, as the host store keeps tables. Returns (table, huge page
    coverage)."""
    import mmap

    gen = torch.Generator().manual_seed(seed)
    distinct = rowformat.quantize(torch.randn((1 << 16, 256), generator=gen) * 0.02)
    nbytes = rows * rowformat.ROW_BYTES
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mem.madvise(mmap.MADV_HUGEPAGE)
    table = torch.from_numpy(np.frombuffer(mem, dtype=np.uint8).reshape(rows, rowformat.ROW_BYTES))
    for lo in range(0, rows, distinct.shape[0]):
        hi = min(rows, lo + distinct.shape[0])
        table[lo:hi] = distinct[: hi - lo]
    try:
        from engram_sglang.core.stores.hostmem import huge_page_report

        coverage = huge_page_report(table.data_ptr(), shmem=False).coverage
    except Exception:  # noqa: BLE001 - a report, not a requirement
        coverage = float("nan")
    return table, coverage


def id_batches(shape, rows: int, dist: str, count: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dist == "uniform":
        return [torch.from_numpy(rng.integers(0, rows, n)).view(shape) for _ in range(count)]
    # Zipf-skewed: hot n-grams recur; hot rows scattered over the table.
    perm = rng.permutation(rows)
    return [torch.from_numpy(perm[(rng.zipf(1.2, n) - 1) % rows]).view(shape) for _ in range(count)]


def cache_evictor():
    """A function that writes twice the last-level cache (one thread): run before each backend's
    pass so that every backend starts with none of the table's rows cached. Without it each one
    ran on whatever rows the backend before it left in L3 (20 decode batches touch ~39 MB, about
    this machine's 32 MiB L3), and the first backend of a case ran coldest; serving reads a table
    far larger than the cache."""
    try:
        llc = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        llc = 0
    junk = np.zeros(max(64 << 20, 2 * llc), dtype=np.uint8)

    def evict():
        np.add(junk, 1, out=junk)

    return evict


def time_calls(fn, batches, evict=None) -> float:
    """Best seconds per call over distinct id batches, after `evict` (the first call warms up on
    a batch that is not timed: its rows would be cached)."""
    if evict is not None:
        evict()
    fn(batches[0])
    best = float("inf")
    for ids in batches[1:]:
        t0 = time.perf_counter()
        fn(ids)
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_bench(args) -> dict:
    """Each case best of `--repeat` rounds, the memcpy limits measured in every round too: on a
    shared machine the quiet moments are what is comparable."""
    threads = torch.get_num_threads()
    table, coverage = realistic_table(args.rows)
    print(f"table: {args.rows:,} rows ({args.rows * READ / 2**30:.2f} GiB, huge pages {coverage:.0%}), "
          f"{threads} threads", flush=True)
    lib, why = native.try_load("cpu")
    if lib is None:
        print(f"host library unavailable ({why}): only the torch reference runs")
    cases = []  # (batch, dist, shape, batches)
    for batch, shape in (("decode", DECODE_IDS), ("prefill", PREFILL_IDS)):
        for dist in ("uniform", "zipf"):
            count = 1 + (args.calls if batch == "decode" else max(3, args.calls // 4))  # + the warm-up's
            cases.append((batch, dist, shape, id_batches(shape, args.rows, dist, count, seed=len(cases))))
    outs = {shape: torch.empty((*shape, 256), dtype=torch.bfloat16) for shape in (DECODE_IDS, PREFILL_IDS)}
    packed = {shape: torch.empty((*shape, READ), dtype=torch.uint8) for shape in (DECODE_IDS, PREFILL_IDS)}
    runs = {}
    if lib is not None:
        # The library called directly, as raw is, so that "vs raw" compares the decode alone;
        # "cpu op" is the same gather through the torch op (its per-call cost on top).
        runs["cpu op"] = lambda ids: gather_dequant(table, ids, out=outs[tuple(ids.shape)], backend="cpu")

        def address_order(ids):
            # What HostStore does on a GPU without ATS (sort, gather, scatter back), here on the
            # CPU: whether reading rows in address order pays for its sort on this backend too.
            flat = ids.reshape(-1)
            order = torch.argsort(flat)
            rows = gather_dequant(table, flat[order], backend="cpu")
            outs[tuple(ids.shape)].view(-1, 256).index_copy_(0, order, rows)

        runs["cpu op sorted"] = address_order
        for t in (threads, 1):
            runs[f"cpu x{t}"] = lambda ids, t=t: lib.gather(table.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0,
                                                            args.rows, outs[tuple(ids.shape)].data_ptr(), t)
        # Where the production decode is the AVX-512 one, the portable decode (what CPUs without
        # AVX-512 VBMI run) in the same rounds: the before/after of that decode.
        avx512 = bool(lib.lib.engram_cpu_decode_avx512())
        print(f"host decode: {'AVX-512 VBMI' if avx512 else 'portable (ISA clones)'}", flush=True)
        if avx512:
            emulated = lib.lib.engram_cpu_gather_dequant_emulated
            for t in (threads, 1):
                runs[f"portable x{t}"] = lambda ids, t=t: emulated(
                    table.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0, args.rows,
                    outs[tuple(ids.shape)].data_ptr(), t, 5)
        raw = lib.lib.engram_cpu_gather_raw  # bound by ops/native.py
        for t in (threads, 1):
            runs[f"raw x{t}"] = lambda ids, t=t: raw(table.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0, args.rows,
                                                     packed[tuple(ids.shape)].data_ptr(), t)
    runs["torch"] = lambda ids: gather_dequant(table, ids, backend="torch")
    limits = {"memcpy_1_thread": 0.0, "memcpy_torch": 0.0}
    best: dict[tuple, float] = {}
    evict = cache_evictor()
    for round_ in range(args.repeat):
        limits["memcpy_1_thread"] = max(limits["memcpy_1_thread"], memcpy_bandwidth(512 << 20))
        limits["memcpy_torch"] = max(limits["memcpy_torch"], torch_copy_bandwidth())
        for batch, dist, shape, batches in cases:
            for name, fn in runs.items():
                if name == "torch" and round_:  # the reference is slow and only a yardstick
                    continue
                sec = time_calls(fn, batches[:3] if name == "torch" else batches, evict)
                key = (batch, dist, name)
                best[key] = min(best.get(key, float("inf")), sec)
    results = []
    for batch, dist, shape, _ in cases:
        n = int(np.prod(shape))
        torch_sec = best[(batch, dist, "torch")]
        for name in runs:
            sec = best[(batch, dist, name)]
            results.append({"batch": batch, "ids": dist, "backend": name, "n": n, "us": sec * 1e6,
                            "rows_per_s": n / sec, "gb_s": n * (READ + WRITTEN) / sec / 1e9,
                            "gb_s_lines": n * (LINES + WRITTEN) / sec / 1e9, "x_torch": torch_sec / sec})
    # Like for like: one-thread rows against one-thread memcpy, the others against torch's copy
    # on all intra-op threads (the gather's own thread count).
    for r in results:
        if r["backend"].startswith(("cpu x", "portable x")):  # fused decode over raw, same threads
            raw_name = "raw " + r["backend"].split(" ")[1]
            r["vs_raw"] = r["rows_per_s"] / next(x["rows_per_s"] for x in results if (x["batch"], x["ids"]) ==
                                                 (r["batch"], r["ids"]) and x["backend"] == raw_name)
        if r["backend"].startswith("raw"):  # 264 B read + 264 B written
            r["gb_s"] = r["rows_per_s"] * 2 * READ / 1e9
            r["gb_s_lines"] = r["rows_per_s"] * (LINES + READ) / 1e9
        if r["backend"] in ("cpu op", "cpu op sorted"):  # torch's intra-op threads, as the op passes them
            r["vs_raw"] = r["rows_per_s"] / next(x["rows_per_s"] for x in results if (x["batch"], x["ids"]) ==
                                                 (r["batch"], r["ids"]) and x["backend"] == f"raw x{threads}")
        copy = limits["memcpy_1_thread"] if r["backend"].endswith("x1") else limits["memcpy_torch"]
        r["memcpy_over_gather"] = copy / (r["gb_s"] * 1e9)
        r["memcpy_over_gather_lines"] = copy / (r["gb_s_lines"] * 1e9)
    print_table(
        f"gather_dequant on the CPU; same-run memcpy {limits['memcpy_1_thread'] / 1e9:.1f} GB/s (1 thread), "
        f"{limits['memcpy_torch'] / 1e9:.1f} GB/s (torch, {threads} threads), read + write; best of {args.repeat}",
        ["batch", "ids", "backend", "us/call", "Mrows/s", "GB/s", "GB/s lines", "memcpy/gather",
         "(lines)", "x torch", "vs raw"],
        [[r["batch"], r["ids"], r["backend"], r["us"], r["rows_per_s"] / 1e6, r["gb_s"], r["gb_s_lines"],
          r["memcpy_over_gather"], r["memcpy_over_gather_lines"], r["x_torch"],
          f"{r['vs_raw']:.2f}" if "vs_raw" in r else ""] for r in results])
    return {"limits": limits, "results": results, "rows": args.rows, "threads": threads,
            "host_decode": None if lib is None else ("avx512" if lib.lib.engram_cpu_decode_avx512() else "portable"),
            "huge_page_coverage": coverage, "repeat": args.repeat}


def plot(payload: dict, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = payload["results"]
    groups = sorted({(r["batch"], r["ids"]) for r in results}, key=lambda g: (g[0] != "decode", g[1]))
    backends = list(dict.fromkeys(r["backend"] for r in results))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        vals = [next((r["gb_s"] for r in results if (r["batch"], r["ids"]) == g and r["backend"] == b), 0)
                for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], vals, width, label=b)
    for name, bw in payload["limits"].items():
        ax.axhline(bw / 1e9, linestyle="--", linewidth=1, color="grey")
        ax.text(len(groups) - 0.5, bw / 1e9, f" {name}", va="bottom", ha="right", fontsize=8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], [f"{b}\n{d}" for b, d in groups])
    ax.set_ylabel("GB/s per row: 264 B read + 512 B written")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = OUT / "gather.png"
    fig.savefig(path, dpi=110)
    return path


def gpu_bench(args) -> dict:
    """bench/gpu_check.py's run (its checks, then the bandwidth table) as this benchmark's data."""
    import types

    from bench import gpu_check as gc

    report = gc.Report()
    gc.gpu_run(types.SimpleNamespace(rows=args.gpu_rows, quick=False), report)
    lim = report.info["limits"]
    results = [{**r, "ids": r["placement"]} for r in report.bandwidth]  # plot groups: batch x placement
    return {"limits": {"device copy": lim["d2d_bytes_per_s"], "host-to-device": lim["h2d_bytes_per_s"]},
            "results": results, "info": report.info, "checks": report.checks, "failed": report.failed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000, help="CPU table rows (default ~0.5 GiB, past the caches)")
    ap.add_argument("--gpu-rows", type=int, default=9_000_000, help="GPU table rows (default ~2.2 GiB)")
    ap.add_argument("--calls", type=int, default=20, help="decode calls timed on the CPU (prefill: a quarter)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds on the CPU; each case keeps its best")
    ap.add_argument("--cpu", action="store_true", help="the CPU benchmark even where a GPU is visible")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    payload = gpu_bench(args) if gpu else cpu_bench(args)
    path = write_json("gather", payload)
    png = plot(payload, "GPU gathers vs same-run copies (host rows: 64-byte lines read)" if gpu else
               "gather_dequant vs same-run memcpy")
    print(f"wrote {path} and {png}")
    return 1 if payload.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
