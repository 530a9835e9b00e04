"""The disk tier's decode step, native step vs the numpy path, against the disk's own IOPS.

One layer's decode step (batch 16, 64, 256 concurrent streams of real text hashed the
DeepSeek-V4.1 way, 24 rows a token) on a table read by O_DIRECT (so every miss reaches the
disk, whatever the page cache holds) behind a DRAM row cache of 10% of the table, warmed with
the same streams' earlier tokens. Two stores on the same file with the same cache state (the
warmed one's arrays copied into the other): the native step (`native_step=True`, one native
call per step) and the numpy path it replaces, stepped alternately over the same steps, so
their hits, misses and disk are the same. Per step: wall time against its miss floor (unique
misses / the disk's 4 KiB random-read IOPS, fio, measured before and after in the same run)
and CPU time (process time, all threads), for two shapes of the call:

* cpu: the whole step where the compute device is the CPU (the native call decodes too);
* gpu-host-half: what the host does for a GPU step (dedupe, lookup, reads, admission into
  the packed staging; the GPU decodes), the CPU time a GPU server pays per layer and step.

Each shape also runs its first steps again once every row they read is cached ("... hits"
rows: 100% hits): the host work alone, without the kernel's own CPU time per O_DIRECT read
(a few us per read on a VM, the same for both paths), which bounds the ratio with misses.

A third store runs the native step with the store's own reads in flight (`--threads`, 64)
instead of the step's deeper queue (NativeStep.depth, 256: all of a small step's misses at
once): `native@64`, the same steps, so the depth's effect is a same-run ratio.

Then the read engines alone, same run: the same kind of random rows (a batch-256 step's misses,
distinct, ascending) read by native AIO and by io_uring (kernels/io/engram_uring.h) at both
depths, calls alternating: CPU per read and reads/s. That CPU per read is the whole process's
CPU time (process_time: every thread, user and system) over calls of ~3000 rows, divided by the
rows: the kernel's work for each read plus the reader's own (queueing, reaping, and the copy of
each row out of its bounce buffer), not the kernel's alone. It is the floor common to every
path: each path's CPU *above* it (CPU - misses x the floor of its engine and depth) is the host
work a path adds, and the ratio of those is reported too.

The floor of a step is its misses at the reads/s of its engine at its depth alone (the
engines are timed before and after the steps, the mean of the two): the IOPS at the depth
used. fio (4 KiB, libaio, --threads in flight) is kept beside it as in earlier runs (x fio
floor). Noise (a 2-core VM, a shared disk): fio is run until two 1 s samples agree (the first
reads after a pause ran at a tenth of the disk's rate), then twice before and twice after the
steps; a spread over 20% is flagged. Per step both the mean and the median (p50) are
reported against the floor.

    python -m bench.disk_step [--rows-per-layer 8000000] [--dram-share 0.1] [--batches 16,64,256] [--engine auto|aio]
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

from bench.common import OUT, drop_file_cache, print_table, write_json
from bench.tiers import disk_iops, ensure_table, warm_cache
from bench.workload import hashed_streams
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import open_store, rowio
from engram_sglang.core.stores.disk_step import NativeStep
from engram_sglang.core.tablefile import DATA_OFFSET, layer_file_name

PATHS = ("native", "python", "native@64")  # the last: the native step at the store's depth (--threads)
SHAPES = ("cpu", "gpu-host-half")
HIT_STEPS = 10  # steps re-run with every row cached


def copy_cache(src, dst) -> None:
    """dst's DRAM cache := src's (same size): both paths start from the same state."""
    a, b = src.dram, dst.dram
    for name in ("rows", "tags", "last", "count", "sketch", "_state"):
        np.copyto(getattr(b, name), getattr(a, name))


def host_half(store, ids: torch.Tensor) -> None:
    """The host's part of a GPU step: packed rows and staging indices, no decode."""
    flat = ids.reshape(-1).numpy()
    local = np.empty(flat.shape[0], np.int64)
    packed = np.empty((max(1, flat.shape[0]), ROW_BYTES), np.uint8)
    if store.native_step:
        store._native.run(flat, local, packed)
    else:
        wanted, _ = store._plan(flat, local_out=local)
        store._timed_read(wanted, out=packed[: wanted.shape[0]])


def run_steps(stores: dict, streams, batch: int, start: int, steps: int, shape: str, cached: bool = False) -> dict:
    """Steps start..start+steps of the first `batch` streams on both stores, alternating which
    goes first; per store: wall and CPU seconds, unique misses and DRAM hits per step. With
    `cached`, each step's rows are read ahead into both caches first (untimed)."""
    out = {p: {"wall": [], "cpu": [], "misses": [], "hits": 0, "lookups": 0} for p in PATHS}
    call = (lambda s, ids: s.gather(ids)) if shape == "cpu" else host_half
    for t in range(start, start + steps):
        ids = torch.stack([streams[b][t, 0] for b in range(batch)])
        if cached:
            for s in stores.values():
                s.read_ahead(ids).result()
        for p in (PATHS if t % 2 == 0 else PATHS[::-1]):
            s, r = stores[p], out[p]
            read0, hits0, looked0 = s.stats()["file_rows_read"], s.dram.hits, s.dram.lookups
            c0, t0 = time.process_time(), time.perf_counter()
            call(s, ids)
            r["wall"].append(time.perf_counter() - t0)
            r["cpu"].append(time.process_time() - c0)
            r["misses"].append(s.stats()["file_rows_read"] - read0)
            r["hits"] += s.dram.hits - hits0
            r["lookups"] += s.dram.lookups - looked0
    return out


def engine_reads(path: Path, depths: list[int], rows_per_call: int = 3000, calls: int = 8) -> list[dict]:
    """Random distinct rows of the file, ascending, read by each engine at each depth in turn
    (fresh rows each call, order alternating): the process's CPU us (every thread, user and
    system, the reader's copy out of the bounce buffers included) and wall per row read.
    Without io_uring here only native AIO is measured."""
    table_rows = (path.stat().st_size - DATA_OFFSET) // ROW_BYTES
    rng = np.random.default_rng(13)
    buf = np.empty((rows_per_call, ROW_BYTES), np.uint8)
    engines = ["aio"] + (["io_uring"] if rowio.read_engine("auto") == "io_uring" else [])
    combos = [(e, d) for e in engines for d in dict.fromkeys(depths)]
    acc = {c: {"cpu": 0.0, "wall": 0.0, "rows": 0} for c in combos}
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for k in range(calls + 1):
            for e, d in (combos if k % 2 else combos[::-1]):
                rowio.read_engine("aio" if e == "aio" else "auto")
                rows = np.unique(rng.integers(0, table_rows, rows_per_call))
                c0, t0 = time.process_time(), time.perf_counter()
                err, _ = rowio.aio_read_rows(fd, DATA_OFFSET, rows, buf, d)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if err != 0:
                    raise SystemExit(f"disk_step: {e} read of {path} failed (error {err})")
                if k > 0:  # the first call of each sets its engine up
                    a = acc[(e, d)]
                    a["cpu"] += cpu
                    a["wall"] += wall
                    a["rows"] += rows.shape[0]
    finally:
        os.close(fd)
        rowio.read_engine("auto")
    return [{"engine": e, "depth": d, "rows": a["rows"], "cpu_us_per_read": 1e6 * a["cpu"] / a["rows"],
             "reads_per_s": a["rows"] / a["wall"]} for (e, d), a in acc.items()]


def fio_sample(path: Path, seconds: float, depth: int) -> tuple[float, float]:
    """(4 KiB random-read IOPS, fio's own CPU us per IO: usr + sys) at `depth`, cold."""
    drop_file_cache(path)
    out = subprocess.run(
        ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
         "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based",
         "--output-format=json"], capture_output=True, text=True, check=True).stdout
    job = json.loads(out)["jobs"][0]
    ios = max(1, job["read"]["total_ios"])
    return job["read"]["iops"], 1e6 * (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3 / ios


def disk_samples(path: Path, seconds: float, depth: int, samples: int = 2) -> tuple[list[float], list[float], str]:
    """`samples` IOPS measurements (and CPU us per IO where fio gives it)."""
    if not shutil.which("fio"):
        iops = [disk_iops(path, seconds, depth)[0] for _ in range(samples)]
        return iops, [], f"engram O_DIRECT row reads, {depth} threads"
    got = [fio_sample(path, seconds, depth) for _ in range(samples)]
    return [g[0] for g in got], [g[1] for g in got], f"fio libaio 4k O_DIRECT qd{depth}"


def settle_disk(path: Path, depth: int, tries: int = 6) -> None:
    """1 s fio runs until two in a row agree within 15%: the first reads after a pause ran at
    a tenth of the disk's rate here (8.5 k vs 87 k IOPS), which made a floor of nothing."""
    if not shutil.which("fio"):
        disk_iops(path, 2.0, depth)
        return
    last = None
    for _ in range(tries):
        now, _ = fio_sample(path, 1.0, depth)
        if last is not None and abs(now - last) <= 0.15 * max(now, last):
            return
        last = now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-layer", type=int, default=8_000_000)
    ap.add_argument("--kind", choices=("code", "prose"), default="code")
    ap.add_argument("--dram-share", type=float, default=0.1)
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--steps", type=int, default=60, help="measured decode steps per batch and shape")
    ap.add_argument("--warm-tokens", type=int, default=96 * 1024, help="tokens (all streams) read into the cache first")
    ap.add_argument("--threads", type=int, default=64, help="reads in flight (the stores' knob)")
    ap.add_argument("--step-depth", type=int, default=None,
                    help="reads in flight of the native step at least (default NativeStep.depth; 0: --threads)")
    ap.add_argument("--iops-seconds", type=float, default=3.0, help="seconds of each fio sample (two before, two after)")
    ap.add_argument("--engine", choices=("auto", "aio"), default="auto",
                    help="O_DIRECT reads of the steps: io_uring where available (auto) or native AIO")
    args = ap.parse_args()
    engine = rowio.read_engine(args.engine)

    cfg, streams, n_tokens = hashed_streams(args.rows_per_layer, args.kind, layer_ids=(1,))
    root = ensure_table(cfg, args.rows_per_layer)
    path = root / layer_file_name(cfg.layer_ids[0])
    table_bytes = path.stat().st_size
    batches = [int(x) for x in args.batches.split(",")]
    warm = max(1, args.warm_tokens // len(streams))
    need = warm + 1 + len(batches) * len(SHAPES) * (args.steps + HIT_STEPS)
    if min(s.shape[0] for s in streams) < need:
        raise SystemExit(f"disk_step: streams of {min(s.shape[0] for s in streams)} tokens, need {need}: "
                         f"fewer --steps or --warm-tokens")
    step_depth = NativeStep.depth if args.step_depth is None else args.step_depth
    depth = {"native": max(args.threads, step_depth), "python": args.threads, "native@64": args.threads}
    settle_disk(path, args.threads)
    before, fio_cpu_before, tool = disk_samples(path, args.iops_seconds, args.threads)
    engines_before = engine_reads(path, sorted(set(depth.values())))
    opts = dict(cfg=cfg, threads=args.threads, direct=True, dram_cache_bytes=int(args.dram_share * table_bytes))
    stores = {p: open_store(root, "disk", **opts)[cfg.layer_ids[0]] for p in PATHS}
    stores["python"].native_step = False
    stores["native"]._native.depth = step_depth
    stores["native@64"]._native.depth = 0  # the store's own depth (--threads)
    results = []
    try:
        print(f"{table_bytes / 2**30:.2f} GiB table, O_DIRECT, DRAM cache {stores['native'].dram.nbytes / 2**20:.0f} MiB "
              f"({args.dram_share:.0%}); warming with {warm} tokens of {len(streams)} streams ...", flush=True)
        warm_cache(stores["native"], streams, warm)
        t = warm
        for p in PATHS[1:]:
            copy_cache(stores["native"], stores[p])
        for s in stores.values():  # first calls: AIO contexts, thread pools
            s.gather(torch.stack([streams[b][t, 0] for b in range(16)]))
        for p in PATHS[1:]:
            copy_cache(stores["native"], stores[p])
        t += 1
        for shape in SHAPES:
            for batch, cached in [(b, False) for b in batches] + [(b, True) for b in batches]:
                steps = HIT_STEPS if cached else args.steps
                r = run_steps(stores, streams, batch, t, steps, shape, cached)
                t += steps
                for p in PATHS:
                    x = r[p]
                    wall, cpu, misses = np.array(x["wall"]), np.array(x["cpu"]), np.array(x["misses"], float)
                    results.append({"shape": shape + (" hits" if cached else ""), "batch": batch, "path": p,
                                    "steps": steps,
                                    "ms_per_step": 1e3 * wall.mean(), "p50_ms": 1e3 * float(np.median(wall)),
                                    "p99_ms": 1e3 * float(np.percentile(wall, 99)),
                                    "cpu_ms_per_step": 1e3 * cpu.mean(), "misses_per_step": misses.mean(),
                                    "dram_hit_rate": x["hits"] / max(1, x["lookups"])})
                n, py, shallow = results[-3:]
                print(f"  {n['shape']:18s} batch {batch:3d}: native {n['ms_per_step']:7.2f} ms ({n['cpu_ms_per_step']:6.2f} "
                      f"CPU ms), python {py['ms_per_step']:7.2f} ms ({py['cpu_ms_per_step']:6.2f} CPU ms), "
                      f"native@64 {shallow['ms_per_step']:7.2f} ms, {n['misses_per_step']:.0f} misses, "
                      f"hit {n['dram_hit_rate']:.1%} / {py['dram_hit_rate']:.1%} / {shallow['dram_hit_rate']:.1%}",
                      flush=True)
    finally:
        for s in stores.values():
            s.close()
    engines_after = engine_reads(path, sorted(set(depth.values())))
    after, fio_cpu_after, _ = disk_samples(path, args.iops_seconds, args.threads)
    iops = float(np.mean(before + after))
    spread = (max(before + after) - min(before + after)) / iops
    # The engines alone before and after the steps, together: reads/s (the mean of the two) and
    # the process's CPU per O_DIRECT row read (the kernel's and the reader's, its copy included),
    # by engine and depth.
    engines = [{**a, "rows": a["rows"] + b["rows"], "reads_per_s": (a["reads_per_s"] + b["reads_per_s"]) / 2,
                "reads_per_s_before": a["reads_per_s"], "reads_per_s_after": b["reads_per_s"],
                "cpu_us_per_read": (a["cpu_us_per_read"] * a["rows"] + b["cpu_us_per_read"] * b["rows"]) /
                                   (a["rows"] + b["rows"])} for a, b in zip(engines_before, engines_after)]
    floor_us = {r["depth"]: r["cpu_us_per_read"] for r in engines if r["engine"] == engine}
    rate = {r["depth"]: r["reads_per_s"] for r in engines if r["engine"] == engine}
    for r in results:
        # The floor: the step's misses at the reads/s of its engine at its depth, alone, same
        # run (fio's 4 KiB IOPS at --threads, as in earlier runs: fio_floor_ms).
        r["depth"] = depth[r["path"]]
        r["fio_floor_ms"] = 1e3 * r["misses_per_step"] / iops
        r["floor_ms"] = 1e3 * r["misses_per_step"] / rate.get(r["depth"], iops)
        r["vs_floor"] = r["ms_per_step"] / r["floor_ms"] if r["misses_per_step"] else None
        r["p50_vs_floor"] = r["p50_ms"] / r["floor_ms"] if r["misses_per_step"] else None
        r["vs_fio_floor"] = r["ms_per_step"] / r["fio_floor_ms"] if r["misses_per_step"] else None
        us = floor_us.get(r["depth"])
        r["cpu_above_floor_ms"] = r["cpu_ms_per_step"] - r["misses_per_step"] * us / 1e3 if us else None
    by = {(r["shape"], r["batch"], r["path"]): r for r in results}
    for r in results:
        if r["path"] != "python":
            py = by[(r["shape"], r["batch"], "python")]
            r["cpu_x_below_python"] = py["cpu_ms_per_step"] / max(r["cpu_ms_per_step"], 1e-9)
            if r["cpu_above_floor_ms"] is not None and py["cpu_above_floor_ms"] is not None:
                r["above_floor_x_below_python"] = py["cpu_above_floor_ms"] / max(r["cpu_above_floor_ms"], 1e-3)
            r["same_hit_rate"] = r["dram_hit_rate"] == py["dram_hit_rate"]
    fio_cpu = fio_cpu_before + fio_cpu_after
    limits = {"iops": iops, "iops_before": before, "iops_after": after, "iops_spread": spread, "iops_tool": tool,
              "fio_cpu_us_per_io": float(np.mean(fio_cpu)) if fio_cpu else None, "table_bytes": table_bytes,
              "engine": engine, "kernel_cpu_us_per_read": floor_us, "load_average": os.getloadavg()}
    flag = f"; DISK MOVED {spread:.0%} (floor unreliable)" if spread > 0.2 else ""
    print_table(
        f"Disk tier decode step, one layer: {table_bytes / 2**30:.2f} GiB table by O_DIRECT, DRAM cache "
        f"{args.dram_share:.0%}; disk {iops / 1e3:.1f} k IOPS (before {', '.join(f'{x / 1e3:.1f}' for x in before)}, "
        f"after {', '.join(f'{x / 1e3:.1f}' for x in after)}; {tool}{flag}); reads by {engine}; "
        f"load average {os.getloadavg()[0]:.1f}",
        ["shape", "batch", "path", "depth", "ms/step", "p50 ms", "p99 ms", "misses", "floor ms", "x floor", "p50 x floor",
         "x fio floor", "CPU ms", "CPU x below py", "CPU above floor", "above-floor x below py", "DRAM hit"],
        [[r["shape"], r["batch"], r["path"], r["depth"], r["ms_per_step"], r["p50_ms"], r["p99_ms"], r["misses_per_step"],
          r["floor_ms"], "" if r["vs_floor"] is None else r["vs_floor"],
          "" if r["p50_vs_floor"] is None else r["p50_vs_floor"],
          "" if r["vs_fio_floor"] is None else r["vs_fio_floor"], r["cpu_ms_per_step"],
          f"{r['cpu_x_below_python']:.1f}" if "cpu_x_below_python" in r else "",
          "" if r["cpu_above_floor_ms"] is None else r["cpu_above_floor_ms"],
          f"{r['above_floor_x_below_python']:.1f}" if "above_floor_x_below_python" in r else "",
          f"{r['dram_hit_rate']:.1%}"] for r in results])
    if engines:
        print_table(f"O_DIRECT reads alone, before and after the steps (fio's own CPU: "
                    f"{limits['fio_cpu_us_per_io'] or 0:.2f} us an IO)",
                    ["engine", "depth", "rows", "process CPU us/read", "reads/s", "before", "after"],
                    [[r["engine"], r["depth"], r["rows"], r["cpu_us_per_read"], r["reads_per_s"], r["reads_per_s_before"],
                      r["reads_per_s_after"]] for r in engines])
    write_json("disk_step", {"args": vars(args), "limits": limits, "results": results, "engines": engines})
    plot(results, limits)
    return 0


def plot(results, limits) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, shape in zip(axes, SHAPES):  # the steps with misses (the "hits" rows are in the table)
        rs = [r for r in results if r["shape"] == shape]
        batches = sorted({r["batch"] for r in rs})
        x = np.arange(len(batches))
        width = 0.8 / len(PATHS)
        for k, p in enumerate(PATHS):
            ms = [next(r for r in rs if r["batch"] == b and r["path"] == p) for b in batches]
            at = x + (k - (len(PATHS) - 1) / 2) * width
            ax.bar(at, [r["ms_per_step"] for r in ms], width, label=f"{p}: wall ms")
            ax.bar(at, [r["cpu_ms_per_step"] for r in ms], width / 2, color="k", alpha=0.5,
                   label="CPU ms" if k == 0 else None)
        floors = [next(r for r in rs if r["batch"] == b and r["path"] == "native")["floor_ms"] for b in batches]
        ax.plot(x, floors, "r_", ms=30, mew=2, label="miss floor (misses / IOPS)")
        ax.set_xticks(x, [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (one layer)")
        ax.set_title(shape)
        ax.legend(fontsize=7)
    fig.suptitle(f"Disk tier step: native vs numpy, {limits['table_bytes'] / 2**30:.1f} GiB table, O_DIRECT, "
                 f"{limits['iops'] / 1e3:.0f} k IOPS")
    fig.tight_layout()
    fig.savefig(OUT / "disk_step.png", dpi=110)
    print(f"wrote {OUT / 'disk_step.json'} and {OUT / 'disk_step.png'}")


if __name__ == "__main__":
    sys.exit(main())
