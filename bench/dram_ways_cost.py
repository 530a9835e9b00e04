"""CPU per decode-sized call of the DRAM row cache at several ways (bench/cache.py --dram
--dram-ways): what associativity costs in the numpy policy and in the disk tier's native step.

Per step of the unsharded trace (its ~6k distinct ids), caches of each geometry side by side,
calls interleaved (each step's order of geometries alternates):

* numpy lookup + admit: DramRowCache.lookup then admit of the misses (the numpy path);
* native, every row a hit: the native step (kernels/io/engram_disk_step.h: dedupe of the raw
  ids, lookup, copy of the hits, no decode) once the last steps' rows are all cached, so the
  lookup's probes of a set's tags dominate;
* native with admissions: the same step from a cold cache, misses read by memcpy from an
  anonymous mapping (no disk: only the step's own work), then admitted. The rows' pages of
  source and caches are faulted in before timing (first touches cost more than the policy).

Medians of per-call wall time, in ms.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

import numpy as np

from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import rowio
from engram_sglang.core.stores.dram_cache import DramRowCache


def _interleaved(ways: list[int], i: int) -> list[int]:
    return ways if i % 2 else ways[::-1]


def call_costs(steps: list[np.ndarray], capacity: int, ways: list[int], warm: int = 100, hit_steps: int = 100,
               rounds: int = 3) -> dict:
    uniq = [np.unique(s) for s in steps]
    blank = np.zeros((max(u.shape[0] for u in uniq), ROW_BYTES), np.uint8)
    n = max(s.shape[0] for s in steps)
    wanted, local, missed = (np.empty(n, np.int64) for _ in range(3))
    packed = np.zeros((n, ROW_BYTES), np.uint8)
    out = {w: {"numpy_ms": [], "native_hits_ms": [], "native_ms": []} for w in ways}
    rows = int(max(int(s.max()) for s in steps)) + 1
    caches = {w: DramRowCache(1 << 62, ways=w, max_rows=capacity, huge_pages=False) for w in ways}
    cold = {w: DramRowCache(1 << 62, ways=w, max_rows=capacity, huge_pages=False) for w in ways}
    source = mmap.mmap(-1, rows * ROW_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    src = np.frombuffer(source, np.uint8)
    fd, path = tempfile.mkstemp(prefix="dram_ways_")
    try:
        # The native step checks the table's size on its file; the rows come from `source`.
        os.truncate(path, rows * ROW_BYTES)
        mapped = rowio.DiskFile(fd, rowio.READ_MAPPED, 1, 0, 0, src.ctypes.data, 0, rows)
        none = rowio.DiskFile(fd, rowio.READ_NONE, 1, 0, 0, 0, 0, rows)
        # numpy: lookup + admit, interleaved.
        for i, u in enumerate(uniq):
            for w in _interleaved(ways, i):
                t = time.perf_counter()
                hit, _ = caches[w].lookup(u)
                m = u[~hit]
                caches[w].admit(m, blank[: m.shape[0]])
                if i >= warm:
                    out[w]["numpy_ms"].append(1e3 * (time.perf_counter() - t))
        # native, all hits: the last steps' rows read ahead into every cache, only rows all hold.
        last = uniq[-hit_steps:]
        for c in caches.values():
            for u in last:
                m = u[~c.contains(u)]
                c.begin()
                c.admit(m, blank[: m.shape[0]])
        views = {w: rowio.cache_view(c) for w, c in caches.items()}
        raws = []
        for r, u in zip(steps[-hit_steps:], last):
            held = np.logical_and.reduce([c.contains(u) for c in caches.values()])
            raws.append(r[np.isin(r, u[held])])
        for _ in range(rounds):
            for i, r in enumerate(raws):
                for w in _interleaved(ways, i):
                    t = time.perf_counter()
                    status, res = rowio.disk_step(none, views[w], r, wanted, local, packed, missed, None)
                    out[w]["native_hits_ms"].append(1e3 * (time.perf_counter() - t))
                    assert status == rowio.STEP_OK and res.misses == 0, (status, res.misses)
        # native with admissions, from cold caches; pages faulted in first.
        for r in steps:
            int(src[r * ROW_BYTES].sum())
        for c in cold.values():
            c.rows.fill(0)
        cold_views = {w: rowio.cache_view(c) for w, c in cold.items()}
        for i, r in enumerate(steps):
            for w in _interleaved(ways, i):
                t = time.perf_counter()
                status, _ = rowio.disk_step(mapped, cold_views[w], r, wanted, local, packed, missed, None)
                if i >= warm:
                    out[w]["native_ms"].append(1e3 * (time.perf_counter() - t))
                assert status == rowio.STEP_OK, status
        result = {"ids_per_call": float(np.mean([u.shape[0] for u in uniq[warm:]])),
                  "hit_ids_per_call": float(np.mean([np.unique(r).shape[0] for r in raws]))}
        for w in ways:
            result[w] = {k: float(np.median(v)) for k, v in out[w].items()}
            result[w]["native_hit_rate"] = cold[w].hits / max(1, cold[w].lookups)
        return result
    finally:
        for c in (*caches.values(), *cold.values()):
            c.close()
        del src
        source.close()
        os.close(fd)
        os.unlink(path)
