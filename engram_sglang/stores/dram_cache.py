"""A DRAM row cache in front of a disk table: packed rows, sized in bytes, row granular.

The kernel's page cache is a DRAM cache too, but at 4 KiB pages: a random 264-byte row
brings 15 neighbours nobody asked for, so per byte of RAM it holds ~15x fewer useful rows
than a row-granular cache (docs/measurements.md). With this cache the disk store reads by
O_DIRECT (the page cache would only hold the same rows twice) and this cache decides what
stays in memory.

Set-associative (`ways` rows per set, the set from a hash of the row id) with LRU inside a
set: real lookups are skewed enough that LRU keeps the hot 2-grams (bench/cache.py), and
every miss's row has just been read, so admitting it costs one row copy. All index work is
numpy over a call's sorted unique ids (a decode step's few thousand): no per-row Python.

Also the landing place of read-ahead (`DiskStore.read_ahead`): rows read before the step
that needs them, so a prefill chunk's reads overlap the previous chunk's compute.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

from ..errors import EngramError
from ..rowformat import ROW_BYTES

_SET_MULT = np.uint64(0x9E3779B97F4A7C15)  # 64-bit golden-ratio multiplier
# Host bytes per slot besides its row: tag (int64) and last use (int64).
SLOT_OVERHEAD = 16


def plan_slots(nbytes: int, ways: int) -> int:
    """Rows a cache of `nbytes` host bytes holds (rows and their tags), whole sets only."""
    return int(nbytes // (ROW_BYTES + SLOT_OVERHEAD) // ways * ways)


class DramRowCache:
    """Packed rows of one layer file in host memory.

    Parameters
    ----------
    nbytes : host bytes for rows and tags.
    ways : rows per set (a row may live in any way of its set).
    max_rows : no more slots than this (the rows of the shard: a bigger cache is waste).
    huge_pages : advise transparent huge pages for the rows (a hit costs one TLB miss less).

    Thread-safe: one lock around lookups and admissions (the store's prefetch thread,
    read-ahead and direct calls may overlap).
    """

    def __init__(self, nbytes: int, *, ways: int = 8, max_rows: int | None = None, huge_pages: bool = True):
        if ways < 1:
            raise EngramError(f"DRAM row cache: ways must be >= 1, got {ways}")
        slots = plan_slots(nbytes, ways)
        if max_rows is not None:
            slots = min(slots, -(-max_rows // ways) * ways)
        if slots < ways:
            raise EngramError(
                f"DRAM row cache of {nbytes:,} bytes holds no full set of {ways} rows "
                f"(each row costs {ROW_BYTES + SLOT_OVERHEAD} bytes): give it at least "
                f"{ways * (ROW_BYTES + SLOT_OVERHEAD):,} bytes or 0 for none")
        self.ways, self.slots, self.sets = ways, slots, slots // ways
        # Anonymous mapping (not numpy's allocator) so huge pages can be advised before the
        # first touch; pages are only backed as rows are admitted.
        self._map = mmap.mmap(-1, slots * ROW_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, ROW_BYTES)
        self.tags = np.full(slots, -1, dtype=np.int64)
        self.last = np.zeros(slots, dtype=np.int64)  # clock of the last use; 0 = never
        self._ways = np.arange(ways, dtype=np.int64)
        self._clock = 0
        self.lock = threading.Lock()
        self.lookups = self.hits = self.admitted = 0

    @property
    def nbytes(self) -> int:
        return self.slots * (ROW_BYTES + SLOT_OVERHEAD)

    def set_of(self, ids: np.ndarray) -> np.ndarray:
        """Set index of each id (the high bits of a 64-bit multiplicative hash, range-reduced)."""
        h = (ids.astype(np.uint64) * _SET_MULT) >> np.uint64(32)
        return ((h * np.uint64(self.sets)) >> np.uint64(32)).astype(np.int64)

    def begin(self) -> None:
        """A new use: rows looked up or admitted from now on are the most recent."""
        self._clock += 1

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hit [n] bool, slot [n] int64; -1 for a miss) of distinct row ids; marks hits used.
        Call with `lock` held, together with `copy_hits` (an admission could reuse the slot)."""
        self.begin()
        hit, slot = self._find(ids)
        self.last[slot[hit]] = self._clock
        self.lookups += ids.shape[0]
        self.hits += int(np.count_nonzero(hit))
        return hit, slot

    def copy_hits(self, slot: np.ndarray, hit: np.ndarray, out: np.ndarray) -> None:
        """out[i] = cached row of slot[i] where hit[i] (out: [n, 264] uint8)."""
        where = np.flatnonzero(hit)
        if where.shape[0]:
            # numpy, one thread: a decode step's few hundred rows take ~0.1 ms; torch's
            # index_select woke its thread pool and took 5 ms on a busy 2-core machine.
            out[where] = self.rows[slot[where]]

    def admit(self, ids: np.ndarray, rows: np.ndarray) -> int:
        """Put rows [m, 264] of distinct ids (none cached) in; each takes its set's least
        recently used way, never one used by this call. Returns the rows admitted.
        Call with `lock` held."""
        if ids.shape[0] == 0:
            return 0
        sets = self.set_of(ids)
        order = np.argsort(sets, kind="stable")
        sets, ids, rows_order = sets[order], ids[order], order
        # The i-th miss of a set takes the set's i-th least recently used way.
        rank = np.arange(sets.shape[0]) - np.searchsorted(sets, sets)
        fits = rank < self.ways
        sets, ids, rows_order, rank = sets[fits], ids[fits], rows_order[fits], rank[fits]
        ways = sets[:, None] * self.ways + self._ways
        by_age = np.argsort(self.last[ways], axis=1, kind="stable")
        slot = ways[np.arange(ways.shape[0]), by_age[np.arange(ways.shape[0]), rank]]
        free = (self.last[slot] < self._clock) | (self.tags[slot] < 0)  # rows this use hit stay
        slot, ids, rows_order = slot[free], ids[free], rows_order[free]
        self.tags[slot] = ids
        self.last[slot] = self._clock
        self.rows[slot] = rows[rows_order]
        self.admitted += slot.shape[0]
        return int(slot.shape[0])

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Which ids are cached (no side effects; for tests and read-ahead filtering)."""
        return self._find(ids)[0]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hit, slot or -1) of each id: its set's ways compared with it."""
        base = self.set_of(ids) * self.ways
        eq = self.tags[base[:, None] + self._ways] == ids[:, None]
        hit = eq.any(1)
        return hit, np.where(hit, base + eq.argmax(1), -1)

    def stats(self) -> dict:
        return {"dram_cache_bytes": self.nbytes, "dram_cache_rows": self.slots, "dram_cache_ways": self.ways,
                "dram_cache_lookups": self.lookups, "dram_cache_hits": self.hits,
                "dram_cache_hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "dram_cache_admitted": self.admitted}

    def close(self) -> None:
        self.rows = None
        try:
            self._map.close()
        except BufferError:
            pass
