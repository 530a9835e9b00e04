"""When SSD pays: the disk placement's exposed read time per decode step, and what it saves.

A decode step of batch B reads, per Engram layer, the step's distinct row ids that neither the
hot-row cache (HBM) nor the DRAM row cache holds; every layer's reads are issued when the
step's ids are hashed (prefetch), so they share the disk: the step's reads take

    t_read = latency + misses (all layers) / IOPS

(one random read's latency for the last reads in flight, then the disk's 4 KiB random-read
rate), and with prefetch they overlap the layers before the first Engram layer (`lead`): the
step exposes `max(0, t_read - lead)`. With decode CUDA graphs kept for the disk tier (staged
rows, docs/architecture.md) the reads end before the replay starts: the step exposes all of
`t_read`.

Misses per step come from a hit-rate curve: a `profile` trace (`engram-sglang profile
--trace FILE`: each stream's row ids in decode-step order) replayed through the stores' own
cache classes (RowDirectory for the hot-row cache, DramRowCache for the DRAM cache, the
sizes the server would give them per layer), the first half of the steps warming the caches.
Without a trace a default curve is used and labelled an assumption.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ..recordfile import RecordFormat, read_record, write_record
from ..rowformat import ROW_BYTES
from .data import GIB, PlannerError, bounded

TRACE = RecordFormat("engram-trace", 1, "trace", PlannerError,
                     " (write one with engram-sglang profile ... --trace FILE)")
TRACE_FORMAT = TRACE.tag
MAX_IOPS = 1e9
MAX_LEAD_MS = 1e6
MAX_BATCH = 1 << 16
MAINTAIN_EVERY = 8  # the hot-row cache's maintenance period (stores/maintenance.py DEFAULT_EVERY)

# Without a trace: the hit rate of a row cache holding a share of a layer's rows, measured on
# real code text (bench/cache.py, layer 1, docs/measurements.md section 6: 0.1% 22.7%, 1%
# 42.3%, 10% 63.9% for the store's policy), and 100% when it holds every row (first reads
# aside), log-interpolated, linear from 0 below 0.1%; the hot-row and DRAM caches counted
# as one cache of their rows together.
DEFAULT_CURVE = ((0.001, 0.227), (0.01, 0.423), (0.1, 0.639), (1.0, 1.0))
DEFAULT_UNIQUE = 0.96  # distinct ids per id in a decode step (bench/tiers.py --part pipeline, batch 256)
DEFAULT_LATENCY_MS = 0.1  # one 4 KiB random read on a datacenter NVMe SSD at low queue depth (assumption)
# Where no disk was measured or given (`plan --rank` only; a single disk plan asks for one):
# one datacenter PCIe Gen4 NVMe SSD per replica at its rated 4 KiB random reads, queue depth 64+
# (an assumption; DGX-class 8-GPU nodes carry 8 such drives).
DEFAULT_IOPS = 1_000_000.0
# A DeepSeek-V4.1-Flash decode step at batch 64 on Hopper-class GPUs (an assumption, not measured
# here: `--step-ms` sets it), and the share of it a disk layout's exposed reads may add and still rank.
DEFAULT_STEP_MS = 20.0
STEP_BUDGET_SHARE = 0.10
MAX_STEP_MS = 1e5


# ------------------------------------------------------------------------ traces
def write_trace(path: str | os.PathLike, fingerprint: str, ids_by_layer: dict[int, np.ndarray], meta: dict) -> Path:
    """A trace file (a record file, recordfile.py): per Engram layer `ids_L` [steps, streams,
    columns] (decode order: step s holds token s of every stream) and `meta` (format, config
    fingerprint)."""
    arrays = {}
    for layer_id, ids in ids_by_layer.items():
        small = ids.size == 0 or int(ids.max()) < 2**31
        arrays[f"ids_{layer_id}"] = ids.astype(np.int32 if small else np.int64)
    return write_record(path, TRACE, arrays, {"fingerprint": fingerprint, **meta})


def read_trace(path: str | os.PathLike, fingerprint: Optional[str] = None) -> tuple[dict[int, np.ndarray], dict]:
    """(layer id -> int64 ids [steps, streams, columns], meta) of a trace file; with
    `fingerprint`, a trace of another Engram config is refused (its ids mean other rows)."""
    with read_record(path, TRACE) as record:
        meta = record.meta
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise PlannerError(f"{record.path}: traced with Engram config {meta.get('fingerprint')}, the model's is "
                               f"{fingerprint}: its row ids mean other n-grams; trace again with this model")
        out = {}
        for L in record.numbered("ids_"):
            where = f"{record.path}: layer {L}"
            shape, dtype = record.header(f"ids_{L}", where)
            if len(shape) != 3 or dtype.kind not in "iu" or shape[0] < 2 or shape[1] < 1:
                raise PlannerError(f"{where}: ids must be integers [steps >= 2, streams, columns], "
                                   f"found {dtype} {list(shape)}")
            ids = record.array(f"ids_{L}", where)
            if ids.size and int(ids.min()) < 0:
                raise PlannerError(f"{where}: row id {int(ids.min())} is negative")
            out[L] = ids.astype(np.int64)
    if not out:
        raise PlannerError(f"{record.path}: the trace holds no layer")
    return out, meta


# ------------------------------------------------------------------------ replay
def _dram_cache(rows: int, nbytes: int):
    """The disk tier's DRAM cache of `nbytes` (the store's class and geometry), at most `rows`
    rows; its row bytes are not kept (one row of memory stands for all: the policy reads
    tags, clocks and counts, never the bytes)."""
    from ..stores.dram_cache import DEFAULT_WAYS, DramRowCache, plan_slots

    if plan_slots(nbytes, DEFAULT_WAYS) < DEFAULT_WAYS:
        return None
    cache = DramRowCache(nbytes, max_rows=rows, huge_pages=False)
    cache.rows = np.lib.stride_tricks.as_strided(np.zeros(ROW_BYTES, np.uint8), (cache.slots, ROW_BYTES), (0, 1))
    return cache


def _hot_cache(rows: int, nbytes: int):
    """The hot-row cache's directory for `nbytes` of HBM (HotRowCache's own sizing), on the CPU."""
    from ..stores.row_directory import RowDirectory, plan_slots, ring_entries

    slots = min(plan_slots(nbytes, 16), max(16, rows // 16 * 16))
    if slots < 16:
        return None
    return RowDirectory(slots, 16, "cpu", ring=ring_entries(nbytes))


def replay(ids: np.ndarray, rows: int, batch: int, dram_bytes: int, hot_bytes: int = 0,
           warm_steps: Optional[int] = None) -> dict[str, Any]:
    """One layer's trace ids [steps, streams, columns], batch `batch` (the first streams),
    through a hot-row cache of `hot_bytes` and a DRAM cache of `dram_bytes` (this layer's
    shares): per measured step (after `warm_steps`, default half) the distinct ids (fetches),
    the hot-cache and DRAM hits among them and the misses the disk reads."""
    import torch

    steps, streams = ids.shape[0], ids.shape[1]
    if batch > streams:
        raise PlannerError(f"--batch {batch} is more than the trace's {streams} streams: trace with "
                           f"engram-sglang profile --streams {batch} (or more)")
    warm = steps // 2 if warm_steps is None else warm_steps
    if isinstance(warm, bool) or not isinstance(warm, int) or not 0 <= warm < steps:
        raise PlannerError(f"--warm-steps must be a whole number from 0 to {steps - 1} (the trace has {steps} steps), "
                           f"got {warm!r}")
    # A cache of more slots than 16 x the rows the trace reads never fills a set (8-16 ways at a
    # load of 1/16 or less), so it holds every row it admits whatever its size: the replay gives
    # it no more slots than that (a DeepSeek-sized DRAM cache would take gigabytes of tags).
    held = min(rows, 16 * int(np.unique(ids[:, :batch]).shape[0]) + 16)
    hot, dram = _hot_cache(held, hot_bytes) if hot_bytes else None, _dram_cache(held, dram_bytes) if dram_bytes else None
    counts = np.zeros((steps - warm, 4), np.int64)  # ids, fetches, hot hits, dram hits
    try:
        for s in range(steps):
            raw = ids[s, :batch].reshape(-1)
            n_ids, n_fetch = raw.shape[0], np.unique(raw).shape[0]
            if hot is not None:
                t = torch.from_numpy(raw)
                hit, _ = hot.lookup(t)
                left = raw[~hit.numpy()]
                if (s + 1) % MAINTAIN_EVERY == 0:
                    hot.maintain()
            else:
                left = raw
            uniq = np.unique(left)
            hot_hits = n_fetch - uniq.shape[0]
            dram_hits = 0
            if dram is not None:
                with dram.lock:
                    hit, _ = dram.lookup(uniq)
                    missed = uniq[~hit]
                    dram.admit(missed, np.zeros((1, ROW_BYTES), np.uint8)[np.zeros(missed.shape[0], np.int64)])
                dram_hits = int(np.count_nonzero(hit))
            if s >= warm:
                counts[s - warm] = (n_ids, n_fetch, hot_hits, dram_hits)
    finally:
        if dram is not None:
            dram.close()
    ids_, fetches, hot_hits, dram_hits = counts.sum(0).tolist()
    n = counts.shape[0]
    misses = fetches - hot_hits - dram_hits
    return {
        "steps": n, "warm_steps": warm, "batch": batch,
        "ids_per_step": ids_ / n, "fetches_per_step": fetches / n,
        "hot_hits_per_step": hot_hits / n, "dram_hits_per_step": dram_hits / n, "misses_per_step": misses / n,
        "hit_rate": 1 - misses / max(1, fetches), "dram_hit_rate": dram_hits / max(1, fetches - hot_hits),
    }


def default_hit_rate(share: float) -> float:
    """The default curve (DEFAULT_CURVE): hit rate of a row cache holding `share` of the rows."""
    if share <= 0:
        return 0.0
    (s0, h0), (s1, h1) = DEFAULT_CURVE[0], DEFAULT_CURVE[-1]
    if share <= s0:
        return h0 * share / s0
    if share >= s1:
        return h1
    for (a, ha), (b, hb) in zip(DEFAULT_CURVE, DEFAULT_CURVE[1:]):
        if share <= b:
            return ha + (hb - ha) * math.log(share / a) / math.log(b / a)
    return h1


# ------------------------------------------------------------------------ disk
def measure_disk(path: str | os.PathLike, seconds: float = 3.0, depth: int = 64) -> dict[str, Any]:
    """4 KiB random-read IOPS at `depth` in flight and one read's latency (depth 1) of the disk
    holding `path` (a regular file, read by O_DIRECT): fio when installed, else the project's
    own O_DIRECT row reads (engram_sglang.core.stores.rowio, the disk tier's reader)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size < (1 << 20):
        raise PlannerError(f"--measure-disk {path}: needs a regular file of at least 1 MiB on the disk to measure "
                           f"(a table's layer-*.rows file will do)")
    if shutil.which("fio"):
        def fio(qd: int, secs: float) -> dict:
            out = subprocess.run(
                ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
                 "--ioengine=libaio", f"--iodepth={qd}", f"--runtime={max(1, int(secs * 1000))}ms", "--time_based", "--readonly",
                 "--output-format=json"], capture_output=True, text=True)
            if out.returncode != 0:
                raise PlannerError(f"--measure-disk {path}: fio failed: "
                                  f"{' '.join((out.stderr or out.stdout).split())[:200]}")
            return json.loads(out.stdout)["jobs"][0]["read"]
        iops = fio(depth, seconds)["iops"]
        lat = fio(1, seconds / 3)["clat_ns"]["mean"] / 1e6
        return {"iops": float(iops), "latency_ms": float(lat), "tool": f"fio libaio 4k O_DIRECT qd{depth} (latency: qd1)"}
    try:
        from ..stores import rowio
    except Exception as e:  # noqa: BLE001 - the native library is not built
        raise PlannerError(f"--measure-disk: fio is not installed and the project's row reader is not built ({e}); "
                           f"install fio or pass --disk-iops") from None
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        rows_in_file = (os.fstat(fd).st_size - 4096) // ROW_BYTES

        def rate(n: int, threads: int, secs: float) -> tuple[float, float]:
            done, calls, t0 = 0, 0, time.perf_counter()
            while time.perf_counter() - t0 < secs:
                rows = np.sort(np.random.default_rng(done).integers(0, rows_in_file, n)).astype(np.int64)
                rowio.pread_rows(fd, 4096, rows, np.empty((n, ROW_BYTES), np.uint8), threads, True)
                done, calls = done + n, calls + 1
            took = time.perf_counter() - t0
            return done / took, took / calls
        iops, _ = rate(8192, depth, seconds)
        _, lat = rate(1, 1, seconds / 3)
        return {"iops": iops, "latency_ms": 1e3 * lat,
                "tool": f"engram O_DIRECT row reads, {depth} threads (fio not installed; latency: one read at a time)"}
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ prediction
def check_disk_inputs(iops: Any, latency_ms: Any, lead_ms: Any, batch: Any, dram_cache_gib: Any,
                      step_ms: Any = None) -> None:
    """One line for any out-of-range disk-plan input."""
    if iops is not None:
        bounded(iops, "--disk-iops", 1, MAX_IOPS)
    if latency_ms is not None:
        bounded(latency_ms, "--disk-latency-ms", 0, MAX_LEAD_MS)
    if lead_ms is not None:
        bounded(lead_ms, "--lead-ms", 0, MAX_LEAD_MS)
    bounded(batch, "--batch", 1, MAX_BATCH, whole=True)
    bounded(dram_cache_gib, "--dram-cache-gib", 0, 1 << 20)
    if step_ms is not None:
        bounded(step_ms, "--step-ms", 1e-3, MAX_STEP_MS)


def step_budget_ms(step_ms: float) -> float:
    """The exposed read time a disk layout may add to a decode step of `step_ms` and still rank."""
    return STEP_BUDGET_SHARE * step_ms


def read_time_ms(misses: float, iops: float, latency_ms: float) -> float:
    """A step's reads: one latency, then the misses at the disk's rate; nothing when no miss."""
    return 0.0 if misses <= 0 else latency_ms + 1e3 * misses / iops


def predict(*, layers: Sequence[int], rows: Sequence[int], columns: int, batch: int, iops: float, latency_ms: float,
            lead_ms: float, dram_bytes: int, hot_bytes: int = 0, trace: Optional[dict[int, np.ndarray]] = None,
            warm_steps: Optional[int] = None) -> dict[str, Any]:
    """The step's misses (all layers) and its read time, exposed with prefetch and staged.
    `dram_bytes` / `hot_bytes`: one rank's caches, all layers, split over layers by rows as
    the stores do (stores.base.split_by_rows)."""
    from ..stores.base import split_by_rows

    per_dram = split_by_rows(dram_bytes, dict(zip(layers, rows)))
    per_hot = split_by_rows(hot_bytes, dict(zip(layers, rows)))
    per_layer = {}
    for L, r in zip(layers, rows):
        if trace is not None:
            if L not in trace:
                raise PlannerError(f"the trace holds layers {sorted(trace)}, not Engram layer {L}")
            if trace[L].shape[2] != columns:
                raise PlannerError(f"the trace's layer {L} has {trace[L].shape[2]} ids per token, the model {columns}")
            if trace[L].size and int(trace[L].max()) >= r:
                raise PlannerError(f"the trace's layer {L} reads row {int(trace[L].max())}, past the table's {r} rows")
            per_layer[L] = replay(trace[L], r, batch, per_dram[L], per_hot[L], warm_steps)
        else:
            from ..stores.dram_cache import DEFAULT_WAYS
            from ..stores.dram_cache import plan_slots as dram_slots
            from ..stores.row_directory import plan_slots as hot_slots

            cached = (dram_slots(per_dram[L], DEFAULT_WAYS) if per_dram[L] else 0) + (hot_slots(per_hot[L], 16) if per_hot[L] else 0)
            hit = default_hit_rate(cached / r)
            fetches = batch * columns * DEFAULT_UNIQUE
            per_layer[L] = {"batch": batch, "ids_per_step": batch * columns, "fetches_per_step": fetches,
                            "misses_per_step": fetches * (1 - hit), "hit_rate": hit, "cache_share": cached / r}
    misses = sum(p["misses_per_step"] for p in per_layer.values())
    t_read = read_time_ms(misses, iops, latency_ms)
    return {
        "batch": batch, "curve": "trace replay" if trace is not None else "default (assumption)",
        "per_layer": {str(L): p for L, p in per_layer.items()},
        "misses_per_step": misses, "read_ms": t_read, "lead_ms": lead_ms,
        "exposed_ms_prefetch": max(0.0, t_read - lead_ms), "exposed_ms_staged_graphs": t_read,
        "dram_cache_bytes": dram_bytes, "hot_cache_bytes": hot_bytes,
    }


def curve(layers: Sequence[int], rows: Sequence[int], columns: int, batch: int, dram_gib: Sequence[float],
          hot_bytes: int, trace: Optional[dict[int, np.ndarray]], warm_steps: Optional[int] = None) -> list[dict]:
    """Misses per step against the DRAM cache size (GiB, one rank): the hit-rate curve."""
    out = []
    for g in dram_gib:
        p = predict(layers=layers, rows=rows, columns=columns, batch=batch, iops=1.0, latency_ms=0.0, lead_ms=0.0,
                    dram_bytes=int(round(g * GIB)), hot_bytes=hot_bytes, trace=trace, warm_steps=warm_steps)
        fetches = sum(v["fetches_per_step"] for v in p["per_layer"].values())
        out.append({"dram_cache_gib": g, "misses_per_step": p["misses_per_step"],
                    "hit_rate": 1 - p["misses_per_step"] / max(1e-9, fetches)})
    return out

