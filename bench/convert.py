"""`tables convert` throughput against this machine's same-run limits.

Builds its own checkpoint the shape DeepSeek-V4.1's is (`layers.{1,14}.engram.embed.weight`
F8_E4M3 [R, 256] and `.scale` F8_E8M0 [R, 8], written with safetensors; each weight in a shard
of its own, both scales in a third), `--gib` of it in all, then measures in the same run:

* the disk's O_DIRECT sequential write (64 MiB writes, one writer and `--threads` writers at
  their own offsets, the better counted) and its buffered write (+ fsync), in the output's
  directory;
* the checkpoint's sequential read, cold (its pages evicted first), 64 MiB reads;
* both at once, one thread each, the same bytes (what a convert does when the checkpoint and
  the tables share a disk, as here): bytes / the time both took, the 1:1 rate the disk gives;
* a 1-thread convert into tmpfs (/dev/shm), the checkpoint in the page cache: the pipeline's
  CPU rate on one core, and the same at `--threads` (skipped, with the reason, when /dev/shm
  lacks the room);
* converts to disk, the checkpoint cold, at 1, 2 and `--threads` threads (and, with
  `--baseline TREE`, the convert of another engram_sglang tree, e.g. `git archive` of an
  older commit, in a subprocess on the same checkpoint).

Goal: the parallel convert >= 0.8 x min(O_DIRECT write, checkpoint read, 2 x the 1-thread
tmpfs rate) and >= 2x 0.34 GB/s (the single-threaded convert's rate on this machine before);
where one disk holds both, the read-and-write-at-once rate bounds it too (reported beside).
Rates are table bytes (R x 264 per layer) per second of the whole convert (checks, fsync and
the opening check included), in GB/s (1e9). Prints a table, writes bench/out/convert.json
and convert.png; removes its files afterwards unless --keep.

    python -m bench.convert [--gib 4.5] [--dir bench/out/convert-work] [--threads N] [--baseline TREE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import OUT, drop_file_cache, print_table, write_json
from bench.workload import bench_config
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import PAYLOAD_BYTES, ROW_BYTES, SCALE_BYTES
from engram_sglang.core.tablefile import convert_checkpoint
from engram_sglang.core.tablefile.write import default_threads

BLOCK = 64 << 20
BEFORE_GBPS = 0.34  # the single-threaded convert, this machine (issue 25)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def build_checkpoint(root: Path, gib: float):
    """(cfg, table bytes): the checkpoint, written block by block from one random block."""
    import torch
    from safetensors.torch import save_file

    cfg = bench_config(int(gib * 2**30 / ROW_BYTES / 2), 8192, layer_ids=(1, 14))
    layout = EngramLayout(cfg)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"text_config": cfg.hash_fields()}))
    block = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8)
    weight_map, scales = {}, {}
    for L in cfg.layer_ids:
        rows = layout.rows(L)
        w = np.resize(block, rows * PAYLOAD_BYTES).reshape(rows, PAYLOAD_BYTES)
        w[:, :8] = np.arange(rows, dtype="<u8").view(np.uint8).reshape(rows, 8)  # rows differ
        name, shard = f"model.layers.{L}.engram.embed.weight", f"model-weight-{L}.safetensors"
        save_file({name: torch.from_numpy(w).view(torch.float8_e4m3fn)}, root / shard)
        weight_map[name] = shard
        del w
        s = np.resize(block[::-1], rows * SCALE_BYTES).reshape(rows, SCALE_BYTES)
        scales[f"model.layers.{L}.engram.embed.scale"] = torch.from_numpy(s.copy()).view(torch.float8_e8m0fnu)
    save_file(scales, root / "model-scales.safetensors")
    weight_map.update({k: "model-scales.safetensors" for k in scales})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return cfg, sum(layout.rows(L) for L in cfg.layer_ids) * ROW_BYTES


def shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def odirect_write(directory: Path, nbytes: int, writers: int) -> float:
    """GB/s of 64 MiB O_DIRECT writes of a new file, `writers` threads at their own offsets, + fsync."""
    from concurrent.futures import ThreadPoolExecutor

    path = directory / "odirect.bin"
    bufs = [np.frombuffer(mmap.mmap(-1, BLOCK), np.uint8) for _ in range(writers)]
    for b in bufs:
        b[:] = 7
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    n = nbytes // BLOCK

    def put(i: int) -> None:
        for k in range(i, n, writers):
            os.pwrite(fd, bufs[i], k * BLOCK)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(put, range(writers)))
        os.fsync(fd)
        took = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return gbps(n * BLOCK, took)


def buffered_write(directory: Path, nbytes: int) -> float:
    path = directory / "buffered.bin"
    block = np.full(BLOCK, 7, np.uint8)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // BLOCK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - t0
    drop_file_cache(path)
    path.unlink()
    return gbps(nbytes // BLOCK * BLOCK, took)


def read_and_write(directory: Path, files: list[Path], nbytes: int) -> float:
    """GB/s of `nbytes` read cold from `files` while `nbytes` more are written O_DIRECT, at once."""
    import threading

    took = {}

    def write() -> None:
        t0 = time.perf_counter()
        odirect_write(directory, nbytes, 1)
        took["write"] = time.perf_counter() - t0

    def read() -> None:
        t0, left, buf = time.perf_counter(), nbytes, bytearray(BLOCK)
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while left > 0 and (n := f.readinto(buf)):
                    left -= n
        took["read"] = time.perf_counter() - t0

    for p in files:
        drop_file_cache(p)
    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return gbps(nbytes, max(took.values()))


def read_cold(files: list[Path]) -> float:
    for p in files:
        drop_file_cache(p)
    buf = bytearray(BLOCK)
    total, t0 = 0, time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return gbps(total, time.perf_counter() - t0)


def timed_convert(ckpt: Path, out: Path, cfg, table_bytes: int, threads: int, cold: bool) -> float:
    if cold:
        for p in shards(ckpt):
            drop_file_cache(p)
    t0 = time.perf_counter()
    convert_checkpoint(ckpt, out, cfg, threads=threads, progress=None)
    took = time.perf_counter() - t0
    shutil.rmtree(out)
    return gbps(table_bytes, took)


BASELINE = """
import sys, time
from engram_sglang.core.tablefile import convert_checkpoint
from engram_sglang.core.config import EngramConfig
cfg = EngramConfig.from_dict(__import__("json").loads(sys.argv[3]), source="bench")
t0 = time.perf_counter()
convert_checkpoint(sys.argv[1], sys.argv[2], cfg, progress=False)
print(time.perf_counter() - t0)
"""


def baseline_convert(tree: Path, ckpt: Path, out: Path, cfg, table_bytes: int) -> float:
    for p in shards(ckpt):
        drop_file_cache(p)
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    got = subprocess.run([sys.executable, "-c", BASELINE, str(ckpt), str(out), json.dumps(cfg.hash_fields())],
                         env=env, cwd=tree, check=True, capture_output=True, text=True)
    shutil.rmtree(out)
    return gbps(table_bytes, float(got.stdout.split()[-1]))


def main() -> int:
    import logging

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.5, help="checkpoint size, both layers")
    ap.add_argument("--dir", type=Path, default=OUT / "convert-work", help="where the checkpoint and output go")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--baseline", type=Path, help="another engram_sglang tree to time on the same checkpoint")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(message)s")  # the converts' progress lines

    work = args.dir.resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    need = 2.1 * args.gib * 2**30 + 2 * 2**30
    if free_bytes(work) < need:
        print(f"{work}: {free_bytes(work) / 2**30:.1f} GiB free, this run needs {need / 2**30:.1f} GiB")
        return 2
    ckpt = work / "ckpt"
    try:
        print(f"writing a {args.gib:.1f} GiB checkpoint to {ckpt} ...", flush=True)
        cfg, table_bytes = build_checkpoint(ckpt, args.gib)
        probe = min(4 << 30, int(args.gib * 2**30 / 2))
        limits = {
            "odirect_write_1": odirect_write(work, probe, 1),
            f"odirect_write_{args.threads}": odirect_write(work, probe, args.threads),
            "buffered_write": buffered_write(work, probe),
            "checkpoint_read": read_cold(shards(ckpt)),
            "read_and_write_at_once": read_and_write(work, shards(ckpt), probe),
        }
        limits["odirect_write"] = max(limits["odirect_write_1"], limits[f"odirect_write_{args.threads}"])
        results = []
        shm_free = free_bytes(args.shm) if args.shm.is_dir() else 0
        if shm_free > table_bytes * 1.1:
            read_cold(shards(ckpt))  # now in the page cache: the tmpfs leg measures the CPU, not the disk
            for threads in sorted({1, args.threads}):
                rate = timed_convert(ckpt, args.shm / f"engram-bench-convert-{os.getpid()}", cfg, table_bytes,
                                     threads, cold=False)
                results.append({"leg": f"{threads} thread(s) -> tmpfs (checkpoint cached)", "threads": threads,
                                "GBps": rate})
                limits.setdefault("tmpfs_1thread", rate)
        else:
            limits["tmpfs_skipped"] = (f"{args.shm}: {shm_free / 2**30:.1f} GiB free, "
                                       f"the tables need {table_bytes / 2**30:.1f} GiB")
            print(f"skipping the tmpfs leg: {limits['tmpfs_skipped']}")
        for threads in sorted({1, 2, args.threads}):
            rate = timed_convert(ckpt, work / "tables", cfg, table_bytes, threads, cold=True)
            results.append({"leg": f"{threads} thread(s) -> disk (cold)", "threads": threads, "GBps": rate})
        if args.baseline:
            rate = baseline_convert(args.baseline.resolve(), ckpt, work / "tables", cfg, table_bytes)
            results.append({"leg": f"baseline {args.baseline} -> disk (cold)", "threads": 1, "GBps": rate})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            for p in args.shm.glob("*engram-bench-convert-*"):
                shutil.rmtree(p, ignore_errors=True)

    caps = [limits["odirect_write"], limits["checkpoint_read"]]
    if "tmpfs_1thread" in limits:
        caps.append(2 * limits["tmpfs_1thread"])
    goal = max(0.8 * min(caps), 2 * BEFORE_GBPS)
    same_disk = 0.8 * min(caps + [limits["read_and_write_at_once"]])
    best = max(r["GBps"] for r in results if "disk" in r["leg"] and "baseline" not in r["leg"])
    for r in results:
        r["vs_odirect_write"] = r["GBps"] / limits["odirect_write"]
        r["vs_goal"] = r["GBps"] / goal
    print_table(
        f"tables convert, {table_bytes / 2**30:.2f} GiB of tables, {os.cpu_count()} CPUs: O_DIRECT write "
        f"{limits['odirect_write']:.2f} GB/s (1 writer {limits['odirect_write_1']:.2f}), buffered write "
        f"{limits['buffered_write']:.2f}, checkpoint read (cold) {limits['checkpoint_read']:.2f}, "
        f"both at once {limits['read_and_write_at_once']:.2f}; goal {goal:.2f} GB/s",
        ["leg", "GB/s", "x O_DIRECT write", "x goal", "x read+write at once"],
        [[r["leg"], r["GBps"], r["vs_odirect_write"], r["vs_goal"], r["GBps"] / limits["read_and_write_at_once"]]
         for r in results],
    )
    verdict = "meets" if best >= goal else "misses"
    print(f"\nbest convert to disk {best:.2f} GB/s {verdict} the goal {goal:.2f} GB/s "
          f"(0.8 x min of {', '.join(f'{c:.2f}' for c in caps)}; >= {2 * BEFORE_GBPS:.2f}); "
          f"{best / limits['read_and_write_at_once']:.2f}x the disk's read and write at once "
          f"(0.8x of that and the CPU: {same_disk:.2f} GB/s)")
    write_json("convert", {"args": {k: str(v) for k, v in vars(args).items()}, "table_bytes": table_bytes,
                           "limits": limits, "goal_GBps": goal, "same_disk_goal_GBps": same_disk,
                           "results": results})
    plot(results, limits, goal)
    return 0


def plot(results, limits, goal) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["leg"] for r in results] + ["O_DIRECT write", "buffered write", "checkpoint read (cold)",
                                           "read + write at once"]
    values = [r["GBps"] for r in results] + [limits["odirect_write"], limits["buffered_write"], limits["checkpoint_read"],
                                             limits["read_and_write_at_once"]]
    colors = ["tab:blue"] * len(results) + ["tab:gray"] * 4
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.barh(names, values, color=colors)
    ax.axvline(goal, color="tab:red", ls="--", label=f"goal {goal:.2f} GB/s")
    ax.axvline(BEFORE_GBPS, color="tab:orange", ls=":", label=f"before: {BEFORE_GBPS} GB/s")
    ax.set_xlabel("GB/s (table bytes)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    ax.set_title("tables convert vs same-run disk and CPU limits")
    fig.tight_layout()
    fig.savefig(OUT / "convert.png", dpi=110)
    print(f"wrote {OUT / 'convert.json'} and {OUT / 'convert.png'}")


if __name__ == "__main__":
    sys.exit(main())
