"""The disk store's native step: one native call per layer and step (kernels/io/engram_disk_step.h).

The call dedupes the ids, looks them up in the DRAM row cache (its own arrays: the policy is
dram_cache.py's, ported in kernels/io/engram_dram_policy.h), copies the hits, reads the misses
as the store reads (mapping, O_DIRECT by io_uring or native AIO: issued first, the hits' work
done while they are in flight; or pread), admits them, and where the compute device
is the CPU decodes the rows too; no Python per row. Python only hands over ids and buffers.

A read the native call could not finish (an I/O error, a truncated file, no AIO on this
kernel) comes back with the hits copied and the misses listed; the store's own reader
(`DiskStore._read_file`: retries, pread's errno, which rows failed) reads them here, admits
what it read and reports a TableReadFault as the Python path does.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

from ..errors import EngramError
from ..tablefile import DATA_OFFSET
from . import rowio
from .base import TableReadFault
from .metrics import METRICS


@dataclasses.dataclass
class Served:
    """What one step put into the caller's buffers."""

    unique: int  # distinct ids of the shard: rows [0, unique) of `packed`
    decoded: bool  # rows_out holds the bf16 rows (else the caller decodes `packed`)
    fault: Optional[TableReadFault] = None  # rows that failed (their packed rows are +0)


class NativeStep:
    """Bound to one DiskStore: its file and its DRAM cache, as the native call sees them."""

    # O_DIRECT reads a step keeps in flight, at least: all of a small step's misses at once, not
    # rounds of the store's `threads` (64). On this VM's disk 256 in flight read ~5-10% more
    # rows/s than 64 and cost ~20% less CPU a read (fewer wake-ups); docs/measurements.md,
    # section 5. Never more reads out than the step's misses; 0 keeps the store's `threads`.
    depth = 256

    def __init__(self, store):
        self.store = store
        lo, hi = store.row_range
        base = store._base if store._map is not None else 0
        self._file = rowio.DiskFile(store._fd, rowio.READ_MAPPED, store.threads, int(store.direct), DATA_OFFSET,
                                    base, lo, hi)
        self._cache = rowio.cache_view(store.dram) if store.dram is not None else None

    def run(self, flat: np.ndarray, local: np.ndarray, packed: np.ndarray,
            rows_out: Optional[np.ndarray] = None) -> Served:
        """Rows of int64 ids `flat` [n]: each id's staging index into `local` [n] (unique for
        ids outside the shard), the packed rows into `packed` [>= max(1, n), 264], and with
        `rows_out` (uint16 [n, 256], contiguous) their bf16 bits when the call succeeds."""
        store = self.store
        if store._fd < 0:  # the mapping and the cache's arrays are gone with it
            raise EngramError(f"layer {store.layer_id}: {store.path} is closed: this store serves no more calls")
        n = flat.shape[0]
        flat = np.ascontiguousarray(flat, dtype=np.int64)
        wanted = np.empty(n, np.int64)
        missed = np.empty(n, np.int64)
        f = self._file
        f.mode = rowio.READ_MAPPED if store._map is not None else rowio.READ_AIO if store._aio else rowio.READ_PREAD
        f.threads = max(store.threads, self.depth) if f.mode == rowio.READ_AIO else store.threads
        t0 = time.perf_counter()
        if store.dram is None:
            status, res = rowio.disk_step(f, None, flat, wanted, local, packed, missed, rows_out)
        else:
            with store.dram.lock:  # read-ahead admits from another thread
                status, res = rowio.disk_step(f, self._cache, flat, wanted, local, packed, missed, rows_out)
        unique, misses = int(res.unique), int(res.misses)
        fault = None
        if status != rowio.STEP_OK:
            fault = self._read_misses(wanted[missed[:misses]], missed[:misses], packed)
            if fault is not None:
                fault.packed = packed[:unique]
                misses -= fault.failed_ids.shape[0]
        store._file_rows += misses
        seconds = time.perf_counter() - t0
        store._read_latencies.append(seconds)
        METRICS.read(store, unique, seconds)
        return Served(unique, status == rowio.STEP_OK and rows_out is not None, fault)

    def _read_misses(self, ids: np.ndarray, where: np.ndarray, packed: np.ndarray) -> Optional[TableReadFault]:
        """The misses the native call left unread, by the store's reader (TableIOError passes up)."""
        store = self.store
        fault = None
        try:
            got = store._read_file(ids)
        except TableReadFault as e:  # admit what was read, never the failed rows
            fault, got = e, e.packed
        packed[where] = got
        if store.dram is not None:
            keep = slice(None) if fault is None else ~np.isin(ids, fault.failed_ids)
            store._admit(ids[keep], got[keep])
        return fault
