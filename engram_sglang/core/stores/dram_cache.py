"""A DRAM row cache in front of a disk table: packed rows, sized in bytes, row granular.

The kernel's page cache is a DRAM cache too, but at 4 KiB pages: a random 264-byte row
brings 15 neighbours nobody asked for, so per byte of RAM it holds ~15x fewer useful rows
than a row-granular cache (docs/measurements.md). With this cache the disk store reads by
O_DIRECT (the page cache would only hold the same rows twice) and this cache decides what
stays in memory.

Set-associative (`ways` rows per set, the set from a hash of the row id). Every miss's row
has just been read, so admitting it costs one row copy; whether it should displace a row is
TinyLFU-style admission, as the hot-row cache does (row_directory.py): a count-min sketch
counts the calls that read each row, a missed row takes the way of its set's weakest row
(fewest calls, then least recently used) only when read in as many calls or more, so a
one-off read (most 4-grams) never evicts a row read twice (a hot 2-gram). On real decode
traces (bench/cache.py --dram) it beats LRU by 5.0-7.0 points at 1% of the rows; behind a
hot-row cache, which takes the frequent rows first, by 0.4-1.4 only: what is left there to
gain is timing (Belady's), not frequency, and no published policy that reads timing online
(ARC, LIRS, LHD, S3-FIFO, a predicted next arrival) gets it either (docs/measurements.md
section 6). All index work is numpy over a call's sorted unique ids (a decode step's few
thousand): no per-row Python. The disk store's native step (stores/disk_step.py) runs the
same policy, ported to C++ in kernels/io/engram_dram_policy.h, on this cache's own arrays
and scalars (`_state`), so both see one cache and give the same hits on the same calls
(tests/core/test_disk_step.py).

Also the landing place of read-ahead (`DiskStore.read_ahead`): rows read before the step
that needs them, so a prefill chunk's reads overlap the previous chunk's compute.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

from ..errors import EngramError
from ..rowformat import ROW_BYTES

_MIX_1, _MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer
# Odd 64-bit multipliers, one per sketch row (each row indexes by another hash of the id).
_SKETCH_MULTS = np.array([0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3],
                         dtype=np.uint64)
SKETCH_DEPTH = _SKETCH_MULTS.shape[0]
# 4-bit counters per sketch row per slot, two to a byte: the sketch's 8 bytes a slot hold twice
# as many counters as uint8 ones would. At 1% of the rows the narrower sketch counted one-offs'
# collisions (bench/cache.py --dram: +0.6 to +1.4 points at the same bytes); a count above 15
# tells nothing more (such rows are far above any one-off).
SKETCH_PER_SLOT = 4
SAMPLE_FACTOR = 10  # the sketch halves once per this many x slots rows looked up
ADMISSIONS = ("frequency", "lru")
# Rows per set. 16 over 8: +0.4 to +0.6 points of hits at 10% of the rows (code, prose, raw and
# behind a hot-row cache; code's raw trace then equal to fully associative LRU, 8 ways 0.4
# below), +0.0 to +0.3 at 1%: ~1% fewer disk reads at 10%. CPU of a 6k-id call: native step
# +3-8% with every row a hit (the tags' second cache line is prefetched with the first), +8-14%
# admitting from a cold cache, numpy +18-28% (bench/cache.py --dram --dram-ways; docs/
# measurements.md section 6). 32 ways: +0.1 to +0.3 more, numpy's CPU 1.7x 8 ways'.
DEFAULT_WAYS = 16
# Host bytes per slot besides its row: tag (int64), last use (int64), count (uint8) and its
# share of the count-min sketch (frequency admission).
SLOT_OVERHEAD = 8 + 8 + 1 + SKETCH_DEPTH * SKETCH_PER_SLOT // 2
_CAP = 15  # counts saturate here (4-bit counters)
# The arrays' format, checked against the native policy's (kPolicyFormat in
# kernels/io/engram_dram_policy.h) when its library loads: bump both with any change to it.
POLICY_FORMAT = 2
# Sketch rows 2k and 2k+1 share plane k of `width` bytes: row 2k in the low nibbles, 2k+1 in the
# high ones. So a row's update is one gather and one maximum.at over its bytes (the other nibble
# only rides along), as cheap as with uint8 counters.
_SHIFTS = np.array([4 * (d & 1) for d in range(SKETCH_DEPTH)], dtype=np.uint8)[:, None]
_CLOCK_BITS = 48  # a way's rank under frequency admission: count << 48 | clock of its last use
_USED_NOW = np.iinfo(np.int64).max  # ... and a way this call used ranks last (it stays)


# The scalars of a cache live in one int64 array (DramRowCache._state), in this order, so that the
# disk tier's native step (kernels/io/engram_dram_policy.h, the same indices) runs the same
# policy on the same state: a call served natively and a read-ahead admitted here see each other.
STATE_FIELDS = ("_clock", "_since_aging", "agings", "_ahead", "lookups", "hits", "admitted", "rejected")


class _StateField:
    """An attribute that is one element of the owner's `_state` array."""

    def __init__(self, index: int, kind: type):
        self.index, self.kind = index, kind

    def __get__(self, obj, owner=None):
        return self if obj is None else self.kind(obj._state[self.index])

    def __set__(self, obj, value) -> None:
        obj._state[self.index] = value


def _mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of int64 ids: every output bit depends on every id bit. A bare
    multiplicative hash kept the id's structure: a row sample picked by another multiplicative
    hash (bench/cache.py's shards) crowded into a few sets, LRU hit rates fell 3-4x."""
    z = ids.astype(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def plan_slots(nbytes: int, ways: int) -> int:
    """Rows a cache of `nbytes` host bytes holds (rows, tags, counts, sketch), whole sets only."""
    return int(nbytes // (ROW_BYTES + SLOT_OVERHEAD) // ways * ways)


class DramRowCache:
    """Packed rows of one layer file in host memory.

    Parameters
    ----------
    nbytes : host bytes for rows, tags and counts.
    ways : rows per set (a row may live in any way of its set).
    max_rows : no more slots than this (the rows of the shard: a bigger cache is waste).
    huge_pages : advise transparent huge pages for the rows (a hit costs one TLB miss less).
    admission : "frequency" (default): a missed row replaces its set's weakest row (fewest
        calls, then least recently used) only when it was read in as many calls or more
        (TinyLFU-style, counted by a count-min sketch); "lru": the least recently used row,
        always (the policy before, kept as bench/cache.py's same-run baseline).

    Thread-safe: one lock around lookups and admissions (the store's prefetch thread,
    read-ahead and direct calls may overlap).
    """

    _clock, _since_aging, agings = _StateField(0, int), _StateField(1, int), _StateField(2, int)
    _ahead = _StateField(3, bool)  # begin() was called since the last lookup: the next admission reads ahead
    lookups, hits, admitted, rejected = (_StateField(i, int) for i in range(4, 8))

    def __init__(self, nbytes: int, *, ways: int = DEFAULT_WAYS, max_rows: int | None = None, huge_pages: bool = True,
                 admission: str = "frequency"):
        if ways < 1:
            raise EngramError(f"DRAM row cache: ways must be >= 1, got {ways}")
        if admission not in ADMISSIONS:
            raise EngramError(f"DRAM row cache: admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        slots = plan_slots(nbytes, ways)
        if max_rows is not None:
            slots = min(slots, -(-max_rows // ways) * ways)
        if slots < ways:
            raise EngramError(
                f"DRAM row cache of {nbytes:,} bytes holds no full set of {ways} rows "
                f"(each row costs {ROW_BYTES + SLOT_OVERHEAD} bytes): give it at least "
                f"{ways * (ROW_BYTES + SLOT_OVERHEAD):,} bytes or 0 for none")
        self.ways, self.slots, self.sets = ways, slots, slots // ways
        self.admission = admission
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
        # Frequency admission: a count-min sketch of "calls that read the row" (conservative
        # update, 4-bit saturating counters, two rows to a plane of bytes: _SHIFTS), halved once
        # per `sample` rows looked up so counts follow the text being served; count[slot] is the
        # sketch's estimate at the row's last read.
        self.count = np.zeros(slots, dtype=np.uint8)
        self.sketch_width = SKETCH_PER_SLOT * slots  # counters per sketch row (even: whole bytes)
        self.sketch = np.zeros(SKETCH_DEPTH * self.sketch_width // 2, dtype=np.uint8)
        self._sketch_base = (np.arange(SKETCH_DEPTH, dtype=np.uint64) // np.uint64(2) * np.uint64(self.sketch_width))[:, None]
        self.sample = SAMPLE_FACTOR * slots
        self._state = np.zeros(len(STATE_FIELDS), dtype=np.int64)  # clock, counters: see STATE_FIELDS
        self._ways = np.arange(ways, dtype=np.int64)
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.slots * (ROW_BYTES + SLOT_OVERHEAD)

    def set_of(self, ids: np.ndarray) -> np.ndarray:
        """Set index of each id (the high bits of a mixed 64-bit hash, range-reduced)."""
        h = _mix64(ids) >> np.uint64(32)
        return ((h * np.uint64(self.sets)) >> np.uint64(32)).astype(np.int64)

    def _sketch_index(self, ids: np.ndarray) -> np.ndarray:
        """Sketch bytes [depth, n] of each id's counters: row d from the high 32 bits of the id
        times its own multiplier, range-reduced to the width (no power-of-two width needed),
        in plane d // 2."""
        h = (_mix64(ids)[None, :] * _SKETCH_MULTS[:, None]) >> np.uint64(32)
        return (((h * np.uint64(self.sketch_width)) >> np.uint64(32)) + self._sketch_base).astype(np.intp)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Calls that read each id lately (uint8, <= 15; never below its halved true count)."""
        return ((self.sketch[self._sketch_index(ids)] >> _SHIFTS) & 15).min(0)

    def _count(self, ids: np.ndarray) -> np.ndarray:
        """Record one read of each distinct id: conservative update (only counters at the
        row's minimum rise, to its count + 1, saturating). Returns the new counts."""
        where = self._sketch_index(ids)
        count = ((self.sketch[where] >> _SHIFTS) & 15).min(0)
        count = count + (count < _CAP).astype(np.uint8)
        for d in range(SKETCH_DEPTH):  # a row at a time: the other nibble of its bytes stays as it is
            byte, shift = where[d], 4 * (d & 1)
            # maximum.at: a counter keeps the higher of its value and the count, and of the
            # counts of two ids of a call that share it.
            np.maximum.at(self.sketch, byte, (self.sketch[byte] & (0xF0 >> shift)) | (count << shift))
        self._since_aging += ids.shape[0]
        if self._since_aging >= self.sample:
            self._age()
        return count

    def _age(self) -> None:
        """Halve every count (the sketch's and the slots'): old popularity fades."""
        np.right_shift(self.sketch, 1, out=self.sketch)
        np.bitwise_and(self.sketch, 0x77, out=self.sketch)  # each nibble halved on its own
        np.right_shift(self.count, 1, out=self.count)
        self._since_aging = 0
        self.agings += 1

    def begin(self) -> None:
        """A new use: rows admitted from now on are the most recent. An admission right after
        `begin()` (no lookup in between) is of rows read ahead: known to be needed next, they
        take their ways whatever their counts."""
        self._clock += 1
        self._ahead = True

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hit [n] bool, slot [n] int64; -1 for a miss) of distinct row ids; marks hits used
        and counts the reads. Call with `lock` held, together with `copy_hits` (an admission
        could reuse the slot)."""
        self._clock += 1
        self._ahead = False
        hit, slot = self._find(ids)
        used = slot[hit]
        self.last[used] = self._clock
        if self.admission == "frequency" and ids.shape[0]:
            self.count[used] = self._count(ids)[hit]
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
        """Put rows [m, 264] of distinct ids (none cached) in; each may take its set's weakest
        way (LRU: least recently used; frequency: fewest calls, then least recently used),
        never one used by this call. With frequency admission a row takes it only when read
        in as many calls as the row there, or more (ties: the newer row); a row read once
        never evicts a row read twice. Rows read ahead (see `begin`) always take it. Returns
        the rows admitted. Call with `lock` held."""
        ahead, self._ahead = self._ahead, False
        if ids.shape[0] == 0:
            return 0
        sets = self.set_of(ids)
        frequency = self.admission == "frequency"
        count = self.estimate(ids) if frequency else None
        if frequency and not ahead:
            # The most read misses of a set first: they meet its weakest ways.
            order = np.lexsort((-count.astype(np.int16), sets))
        else:
            order = np.argsort(sets, kind="stable")
        sets, ids, rows_order = sets[order], ids[order], order
        # The i-th miss of a set takes the set's i-th weakest way.
        rank = np.arange(sets.shape[0]) - np.searchsorted(sets, sets)
        fits = rank < self.ways
        sets, ids, rows_order, rank = sets[fits], ids[fits], rows_order[fits], rank[fits]
        ways = sets[:, None] * self.ways + self._ways
        # Ways weakest first: least recently used (LRU); fewest calls, then least recently
        # used (frequency: +0.7 to +2 points over the LRU way as the victim, bench/cache.py).
        last = self.last[ways]
        key = last if not frequency else np.where(
            last < self._clock, (self.count[ways].astype(np.int64) << _CLOCK_BITS) | last, _USED_NOW)
        by_age = np.argsort(key, axis=1, kind="stable")
        slot = ways[np.arange(ways.shape[0]), by_age[np.arange(ways.shape[0]), rank]]
        free = (self.last[slot] < self._clock) | (self.tags[slot] < 0)  # rows this use hit stay
        if frequency:
            count = count[rows_order]
            if not ahead:
                won = (self.tags[slot] < 0) | (count >= self.count[slot])
                self.rejected += int(np.count_nonzero(free & ~won))
                free &= won
            else:
                count = np.maximum(count, 1)  # read ahead for a coming read: as a row read once
            count = count[free]
        slot, ids, rows_order = slot[free], ids[free], rows_order[free]
        self.tags[slot] = ids
        self.last[slot] = self._clock
        if frequency:
            self.count[slot] = count
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
                "dram_cache_admitted": self.admitted, "dram_cache_admission": self.admission,
                "dram_cache_rejected": self.rejected, "dram_cache_agings": self.agings}

    def close(self) -> None:
        self.rows = None
        try:
            self._map.close()
        except BufferError:
            pass
