"""A hot-row cache in device memory in front of a host or disk table store.

Real Engram lookups are skewed (docs/measurements.md): a cache of 1-5% of a table's rows
serves about half of the reads. `HotRowCache` holds packed 264-byte rows on the compute
device and decodes hits with the op every placement uses (`gather_dequant`), so its bits
are those of the store it wraps.

Two halves with different rules:

* the lookup (`RowDirectory.lookup`, every call, on the critical path): set-associative
  tags compared on the device; a count-min sketch, the hit slots' counts and clocks and a
  ring of missed ids updated in place. Fixed shapes, no host sync: a host-tier lookup can
  be captured in a graph (misses are read over UVA by the same op, hits never are).
* the maintenance (`RowDirectory.maintain`, every `maintain_every` calls, or whenever the
  scheduler calls `HotRowCache.maintain()` between steps): per set, keep the `ways` rows of
  highest (count, last read) among the residents and the rows that missed. A row that
  missed takes the way of the set's weakest resident only when it was read in more calls,
  or in as many but more recently (TinyLFU-style admission: a one-off read, as most
  4-grams are, never displaces a row read twice). Counts are "calls that read the row",
  halved once per `sample_factor` x slots reads (checked at maintenance, from a device
  counter), so they follow the text being served.

Graph replay: the lookup changes no Python state (its counters - lookups, reads, hits, the
ring's write position - are device tensors advanced in place) and maintenance never rebinds
a tensor, so a lookup captured in a CUDA graph and replayed behaves as an eager one. The
store's own cadence (`maintain_every`) counts eager calls; under replay the scheduler calls
`HotRowCache.maintain()` between steps (maintain_every=0). Checked on the CPU only (tests
run the lookup on an object that refuses attribute writes); real capture is not tested here.

Measured against LRU, a static frequency set, an idealized LFU (exact counts, fully
associative, admission every step) and the offline optimum in bench/cache.py: on real
decode traces this directory is within a point of the idealized LFU at every size, above
LRU up to 5% of rows (equal at 10%); the offline optimum is 10-14 points higher up to 2% of
rows, a gap that no frequency policy closes (see the bench's docstring). Maintenance every
call instead of every 8 gains nothing there and costs ~1.6x the CPU time per call.
Pre-warming (`profile=`) fills empty ways with the hottest rows of a profile of other text
(`engram-sglang profile`); they start as rows read once, so traffic decides what stays.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Optional

import numpy as np
import torch

from ..errors import EngramError
from ..rowformat import PAYLOAD_BYTES, ROW_BYTES
from .base import TableStore, split_by_rows
from .metrics import Lazy

logger = logging.getLogger(__name__)

_MASK32 = 0xFFFFFFFF
# Odd 32-bit multipliers: the set index, and the two hashes the sketch rows derive from.
_SET_MULT = 2654435761
_SKETCH_MULT_A = 0x85EBCA6B
_SKETCH_MULT_B = 0xC2B2AE35
_CLOCK_BITS = 40  # priority = count << 40 | clock of the last read (2^40 calls)
_CLOCK_MASK = (1 << _CLOCK_BITS) - 1
# Device bytes per slot besides its row: tag (int64), count (int32), last read (int64).
SLOT_OVERHEAD = 8 + 4 + 8


def _mix32(ids: torch.Tensor, mult: int) -> torch.Tensor:
    """32-bit multiplicative hash of int64 ids (their low 31 bits)."""
    x = ids & 0x7FFFFFFF
    x = x ^ (x >> 15)
    return (x * mult) & _MASK32


class RowDirectory:
    """Which table rows a hot-row cache holds, and which it should hold next.

    Parameters
    ----------
    slots : rows the cache holds (rounded down to a multiple of `ways`).
    ways : rows per set; a row id may live in any way of its one set.
    device : where the tags, the sketch and the clocks live (the cache's device).
    sketch_width : uint8 counters per sketch row, a power of two (default: the smallest
        >= 8 x slots: narrower sketches admit cold rows on inflated counts).
    sketch_depth : sketch rows; a count is the minimum over them.
    sample_factor : the sketch halves once per `sample_factor` x slots reads (aging, applied
        by the next maintenance).
    ring : missed ids remembered between two maintenances (the newest survive).

    Ids < 0 are never cached, counted or admitted (the store passes rows of other shards so).
    Slot `slots` (one past the last) is a dump: fixed-shape writes for misses land there.
    """

    CAP = 255  # counts saturate here (uint8 counters)

    def __init__(self, slots: int, ways: int = 16, device: str | torch.device = "cpu", *,
                 sketch_width: Optional[int] = None, sketch_depth: int = 4, sample_factor: float = 100.0,
                 ring: int = 1 << 17):
        if slots < 1:
            raise EngramError(f"hot-row cache: needs at least one slot, got {slots}")
        if not 1 <= sketch_depth <= 8:
            raise EngramError(f"hot-row cache: sketch_depth must be in 1..8, got {sketch_depth}")
        self.device = dev = torch.device(device)
        self.ways = max(1, min(ways, slots))
        self.sets = slots // self.ways
        self.slots = self.sets * self.ways
        self.dump = self.slots
        width = sketch_width or default_sketch_width(self.slots)
        if width < 2 or width & (width - 1) or width > 1 << 32:
            raise EngramError(f"hot-row cache: sketch_width must be a power of two in [2, 2^32], got {width}")
        self.sketch_width, self.sketch_depth = width, sketch_depth
        self._sketch_shift = 32 - int(math.log2(width))
        self.sample = max(1, int(sample_factor * self.slots))
        self.tags = torch.full((self.slots + 1,), -1, dtype=torch.int64, device=dev)
        self.count = torch.zeros(self.slots + 1, dtype=torch.int32, device=dev)  # count at the last read
        self.last = torch.zeros(self.slots + 1, dtype=torch.int64, device=dev)  # clock of the last read
        self.sketch = torch.zeros(sketch_depth * width, dtype=torch.uint8, device=dev)
        self._depth = torch.arange(sketch_depth, device=dev, dtype=torch.int64).view(-1, 1)
        self.ring = torch.full((ring,), -1, dtype=torch.int64, device=dev)
        self.ring_count = torch.zeros(ring, dtype=torch.int32, device=dev)
        self._ring_pos = torch.zeros((), dtype=torch.int64, device=dev)  # written up to (device)
        self._ring_read = 0  # read up to by the last maintenance (host)
        # Device counters: the lookup advances them in place, so a replayed graph of it
        # counts like an eager call. Read them (a sync) for stats and in maintenance only.
        self._clock = torch.zeros((), dtype=torch.int64, device=dev)  # lookups so far
        self._reads = torch.zeros((), dtype=torch.int64, device=dev)
        self._hits = torch.zeros((), dtype=torch.int64, device=dev)
        self._way_index = torch.arange(self.ways, device=dev, dtype=torch.int64)
        # Host-side state, changed by maintenance and pre-warming only (never by a lookup).
        self._aged_at = 0  # reads at the last aging
        self.agings = 0
        self.admitted = 0
        self.maintenances = 0

    @property
    def nbytes(self) -> int:
        """Device bytes of the directory (tags, counts, clocks, sketch, ring)."""
        return sum(t.numel() * t.element_size() for t in (self.tags, self.count, self.last, self.sketch,
                                                          self.ring, self.ring_count))

    # ------------------------------------------------------------------ hashing
    def set_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Set index of each id (Lemire's range reduction of a 32-bit hash)."""
        return (_mix32(ids, _SET_MULT) * self.sets) >> 32

    def _sketch_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Flat sketch positions [depth, n]: row d uses h1 + d * h2 (double hashing), from
        the high bits (a multiplicative hash's low bits depend on the id's low bits only)."""
        h1 = _mix32(ids, _SKETCH_MULT_A) >> self._sketch_shift
        h2 = (_mix32(ids, _SKETCH_MULT_B) >> self._sketch_shift) | 1
        return ((h1 + self._depth * h2) & (self.sketch_width - 1)) + self._depth * self.sketch_width

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Recent count of calls that read each id (never below the true decayed count)."""
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int32, device=self.device)
        return self.sketch[self._sketch_index(ids)].amin(0).to(torch.int32)

    def _priority(self, count: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """What a set keeps the highest of: the count, then the clock of the last read."""
        return (count.to(torch.int64) << _CLOCK_BITS) | (last & _CLOCK_MASK)

    # ------------------------------------------------------------------- lookup
    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hit [n] bool, slot [n]) of flat int64 ids; a miss's slot is the dump. No side effects."""
        base = self.set_of(ids) * self.ways
        eq = self.tags[base.unsqueeze(-1) + self._way_index] == ids.unsqueeze(-1)  # [n, ways]
        hit = eq.any(-1) & (ids >= 0)  # (empty ways hold -1)
        slot = torch.where(hit, base + eq.to(torch.uint8).argmax(-1), self.dump)
        return hit, slot

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`find`, and record the reads: sketch counts; count and clock of the hit slots;
        the missed ids and their counts, for the next maintenance.

        Device ops of fixed shapes only (no host sync), and no Python state changes: every
        effect is an in-place write to the directory's tensors, so a captured graph of it
        replays exactly what an eager call does. Aging is decided in `maintain`.
        """
        ids = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        n = ids.numel()
        hit, slot = self.find(ids)
        if n == 0:
            return hit, slot
        where = self._sketch_index(ids)
        # Conservative update: raise the row's counters to its count + 1 (saturating);
        # higher counters (collisions) stay. A count is the number of calls that read
        # the row, and narrow counters cannot overflow. Ids < 0 write 0: a no-op.
        count = (self.sketch[where].amin(0).to(torch.int32) + 1).clamp_max_(self.CAP)
        count = torch.where(ids >= 0, count, 0)
        self.sketch.scatter_reduce_(0, where.reshape(-1), count.to(torch.uint8).expand(self.sketch_depth, n).reshape(-1),
                                    reduce="amax")
        self.last.index_put_((slot,), self._clock.expand(n))
        self.count.index_put_((slot,), count)
        # Misses go to the ring (hits and ids < 0 write -1); the newest `ring` survive.
        size = self.ring.numel()
        keep = min(n, size)
        pos = (self._ring_pos + torch.arange(keep, device=self.device)) % size
        self.ring.index_put_((pos,), torch.where(hit | (ids < 0), -1, ids)[n - keep:])
        self.ring_count.index_put_((pos,), count[n - keep:])
        self._ring_pos.add_(keep)
        self._hits.add_(hit.sum())
        self._reads.add_(n)
        self._clock.add_(1)
        return hit, slot

    @property
    def hits(self) -> int:
        """Reads found in the cache so far (a host sync: for stats, not the hot path)."""
        return int(self._hits)

    @property
    def reads(self) -> int:
        """Reads looked up so far, ids < 0 included (a host sync)."""
        return int(self._reads)

    @property
    def lookups(self) -> int:
        """Lookups so far (a host sync)."""
        return int(self._clock)

    def _age(self) -> int:
        """Halve the sketch and the recorded counts once per `sample` reads since the last
        aging (a host sync; part of maintenance). Returns the halvings done."""
        due = (self.reads - self._aged_at) // self.sample
        if due <= 0:
            return 0
        for t in (self.sketch, self.count, self.ring_count):  # counts <= 255: 8 halvings clear them
            if due >= 8:
                t.zero_()
            else:
                t.bitwise_right_shift_(due)
        self._aged_at += due * self.sample
        self.agings += due
        return due

    # -------------------------------------------------------------- maintenance
    def maintain(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Age the counts when due, then admit and evict from the misses since the last
        call (a host sync).

        Returns (ids, slots), int64 on the device: the rows to copy into those slots. The
        tags already name them: copy before the next lookup.
        """
        self._age()
        end = int(self._ring_pos)
        size = self.ring.numel()
        if end - self._ring_read >= size:
            part = slice(None)  # wrapped: every entry is new
        else:
            part = torch.arange(self._ring_read, end, device=self.device) % size
        self._ring_read = end
        cand, count = self.ring[part], self.ring_count[part]
        valid = cand >= 0
        cand, count = cand[valid], count[valid]
        self.maintenances += 1
        if cand.numel() == 0:
            return cand, cand
        cand, inverse = torch.unique(cand, return_inverse=True)
        best = torch.zeros(cand.shape, dtype=torch.int32, device=self.device)
        best.scatter_reduce_(0, inverse, count, reduce="amax")
        hit, _ = self.find(cand)  # pre-warmed meanwhile: nothing to do
        cand, best = cand[~hit], best[~hit]
        ids, slots = self._merge(cand, self._priority(best, (self._clock - 1).expand(best.shape)))
        self._install(ids, slots)
        return ids, slots

    def _resident_priority(self, slot: torch.Tensor) -> torch.Tensor:
        return torch.where(self.tags[slot] >= 0, self._priority(self.count[slot], self.last[slot]), -1)

    def _merge(self, cand: torch.Tensor, cand_pri: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per set, keep the `ways` highest priorities among residents and candidates
        (equal priorities keep the resident). Returns (admitted ids, freed slots), paired
        set by set."""
        W = self.ways
        if cand.numel() == 0:
            return cand, cand
        cand_set = self.set_of(cand)
        # Cheap filter first: a candidate must beat its set's weakest resident.
        way_slots = (cand_set.unsqueeze(-1) * W + self._way_index).reshape(-1)
        strong = cand_pri > self._resident_priority(way_slots).view(-1, W).amin(-1)
        cand, cand_set, cand_pri = cand[strong], cand_set[strong], cand_pri[strong]
        if cand.numel() == 0:
            return cand, cand
        sets = torch.unique(cand_set)
        res_slot = (sets.unsqueeze(-1) * W + self._way_index).reshape(-1)
        n_res = res_slot.numel()
        set_key = torch.cat([sets.repeat_interleave(W), cand_set])
        pri = torch.cat([self._resident_priority(res_slot), cand_pri])
        resident = torch.zeros(set_key.shape, dtype=torch.uint8, device=self.device)
        resident[:n_res] = 1
        # Lexicographic (set, -priority, resident first): stable sorts, least significant first.
        order = torch.argsort(resident, descending=True, stable=True)
        order = order[torch.argsort(pri[order], descending=True, stable=True)]
        order = order[torch.argsort(set_key[order], stable=True)]
        s_set = set_key[order]
        keep = torch.arange(order.numel(), device=self.device) - torch.searchsorted(s_set, s_set) < W
        is_res = resident[order].bool()
        # Both lists are in set order and each set frees as many ways as it admits.
        admit = order[keep & ~is_res] - n_res
        freed = order[~keep & is_res]
        return cand[admit], res_slot[freed]

    def _install(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.tags[slots] = ids
        self.last[slots] = self._clock
        self.count[slots] = self.estimate(ids)
        self.admitted += ids.numel()

    def prewarm(self, ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill empty ways with profiled rows, the most read first in each set. They start
        as rows read once (count 1, read before any lookup): the profile only picks what
        fills the cache; traffic decides what stays. Higher seeded counts made wrong
        guesses sticky and cost up to 16 points of hit rate in bench/cache.py.
        Returns (ids, slots)."""
        ids = ids.reshape(-1).to(self.device, torch.int64)
        counts = counts.reshape(-1).to(self.device, torch.int64)
        live = ids >= 0
        ids, counts = ids[live], counts[live]
        hit, _ = self.find(ids)
        ids, counts = ids[~hit], counts[~hit]
        if ids.numel() == 0:
            return ids, ids
        W = self.ways
        sets = self.set_of(ids)
        order = torch.argsort(counts, descending=True, stable=True)
        order = order[torch.argsort(sets[order], stable=True)]
        s_set = sets[order]
        rank = torch.arange(order.numel(), device=self.device) - torch.searchsorted(s_set, s_set)
        empty = self.tags[: self.slots].view(self.sets, W) < 0
        free_ways = torch.argsort((~empty).to(torch.uint8), dim=1, stable=True)  # empty ways first
        fits = rank < empty.sum(1)[s_set]
        chosen = order[fits]
        slots = s_set[fits] * W + free_ways[s_set[fits], rank[fits]]
        ids = ids[chosen]
        where = self._sketch_index(ids)
        self.sketch.scatter_reduce_(0, where.reshape(-1), torch.ones_like(where, dtype=torch.uint8).reshape(-1),
                                    reduce="amax")
        self.tags[slots] = ids
        self.last[slots] = (self._clock - 1).clamp_min(0)
        self.count[slots] = 1
        self.admitted += ids.numel()
        return ids, slots

    def resident_ids(self) -> torch.Tensor:
        t = self.tags[: self.slots]
        return t[t >= 0]


def default_sketch_width(slots: int) -> int:
    """The power of two >= 8 x slots (4x cost up to 1.7 points of hit rate at 0.1% of rows)."""
    return 1 << max(4, math.ceil(math.log2(max(1, 8 * slots))))


def ring_entries(cache_bytes: int) -> int:
    """Missed ids remembered between maintenances: 2^17 (1.5 MiB), at most 1/8 of the budget."""
    return int(min(1 << 17, max(1024, cache_bytes // 8 // 12)))


def plan_slots(cache_bytes: int, ways: int = 16, sketch_depth: int = 4) -> int:
    """Rows a cache of `cache_bytes` device bytes holds with its directory: each slot costs
    its row and directory entry, the sketch 8-16 x depth bytes per slot (a power-of-two
    width), the ring of missed ids is fixed."""
    room = cache_bytes - ring_entries(cache_bytes) * 12 - (ROW_BYTES + SLOT_OVERHEAD)  # (+ the dump slot)
    # For each sketch width 2^k, the slots that fit beside it (and need no wider sketch).
    slots = max(min((room - (1 << k) * sketch_depth) // (ROW_BYTES + SLOT_OVERHEAD), (1 << k) // 8)
                for k in range(4, 48))
    return int(max(0, slots) // ways * ways)


# ---------------------------------------------------------------------- metrics
class _CacheMetrics:
    """Prometheus metrics of the hot-row caches (default registry, next to SGLang's).
    Reads and hits are counted at maintenance from the directory's device counters
    (counting them per call would sync the host, and a replayed graph runs no Python)."""

    def __init__(self):
        from prometheus_client import Counter, Gauge  # registered when the first cache opens

        labels = ("layer", "placement")
        self.reads = Counter("engram_cache_reads", "Row reads looked up in the hot-row cache", labels)
        self.hits = Counter("engram_cache_hits", "Row reads the hot-row cache served", labels)
        self.hit_rate = Gauge("engram_cache_hit_rate", "Share of row reads the hot-row cache served, since start", labels)
        self.lower = Counter("engram_cache_lower_rows_read",
                             "Rows the cache read from the tier below (distinct per call where that tier dedupes)", labels)
        self.admitted = Counter("engram_cache_admitted_rows", "Rows admitted into the hot-row cache", labels)
        self.bytes = Gauge("engram_cache_bytes", "Device bytes of the hot-row cache (rows and directory)", labels)
        self.rows = Gauge("engram_cache_rows", "Rows the hot-row cache holds", labels)

    @staticmethod
    def _labels(cache) -> dict:
        return {"layer": str(cache.layer_id), "placement": cache.placement}

    def facts(self, cache) -> None:
        lab = self._labels(cache)
        self.bytes.labels(**lab).set(cache.device_bytes)
        self.rows.labels(**lab).set(cache.directory.slots)

    def lower_read(self, cache, lower: int) -> None:
        self.lower.labels(**self._labels(cache)).inc(lower)

    def maintained(self, cache, new_reads: int, new_hits: int, admitted: int, lower_misses: Optional[int]) -> None:
        lab = self._labels(cache)
        self.reads.labels(**lab).inc(new_reads)
        self.hits.labels(**lab).inc(new_hits)
        self.admitted.labels(**lab).inc(admitted)
        if lower_misses is not None:
            self.lower.labels(**lab).inc(lower_misses)
        d = cache.directory
        self.hit_rate.labels(**lab).set(d.hits / d.reads if d.reads else 0.0)


CACHE_METRICS: Lazy[_CacheMetrics] = Lazy(_CacheMetrics)


# ------------------------------------------------------------------------ store
class HotRowCache(TableStore):
    """A TableStore that serves hot rows from device memory and the rest from `inner`.

    Parameters
    ----------
    inner : the store below (host or disk placement; a device store works, for tests).
    cache_bytes : device bytes for the cache: rows, directory and sketch (see `plan_slots`).
    ways : rows per set.
    maintain_every : eager calls between two maintenances (aging, admission and eviction;
        a host sync); 0: only when the caller calls `maintain()` (e.g. the scheduler, between
        steps: needed when the lookup runs as a replayed CUDA graph, which runs no Python).
    profile : a profile file (`engram-sglang profile`) to pre-warm from.
    fingerprint : the tables' config fingerprint; a profile made for another config is refused.
    sample_factor, sketch_depth : see RowDirectory.

    Results are bit-identical to `inner`'s: hits are decoded from the cached packed rows
    and misses from the tier below, by the same op.
    """

    def __init__(self, inner: TableStore, cache_bytes: int, *, ways: int = 16, maintain_every: int = 8,
                 profile: Optional[str | os.PathLike] = None, fingerprint: Optional[str] = None,
                 sample_factor: float = 100.0, sketch_depth: int = 4):
        super().__init__(inner.layer_id, inner.path, inner.rows, inner.row_range, inner.device, inner.backend)
        self.inner = inner
        self.placement = inner.placement
        self.needs_host_ids = inner.needs_host_ids
        if maintain_every < 0:
            raise EngramError(f"hot-row cache: maintain_every must be >= 0, got {maintain_every}")
        slots = plan_slots(cache_bytes, ways, sketch_depth=sketch_depth)
        if slots < ways:
            raise EngramError(
                f"engram layer {self.layer_id}: a hot-row cache of {cache_bytes:,} bytes holds no full set of {ways} rows "
                f"(each row costs ~{ROW_BYTES + SLOT_OVERHEAD + 8 * sketch_depth} bytes with its directory entry)")
        lo, hi = self.row_range
        slots = min(slots, max(ways, (hi - lo) // ways * ways))  # no more slots than rows
        self.directory = RowDirectory(slots, ways, self.device, sample_factor=sample_factor, sketch_depth=sketch_depth,
                                      ring=ring_entries(cache_bytes))
        # Row `slots` stays zero and is never decoded for a result (misses take the lower row).
        self.cache_rows = torch.zeros((self.directory.slots + 1, ROW_BYTES), dtype=torch.uint8, device=self.device)
        self.cache_bytes = cache_bytes
        self.maintain_every = maintain_every
        self.profile_path = None
        self.prewarmed = 0
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # disk misses since the last maintenance
        self._lower_rows = 0  # rows read from the tier below (disk: distinct per call)
        self._reported_hits = 0
        self._reported_reads = 0
        self._eager_calls = 0  # eager calls, for the maintenance cadence (a replayed graph does not count)
        self._cache_lock = threading.RLock()
        if profile is not None:
            self.prewarm(profile, fingerprint)
        CACHE_METRICS.facts(self)

    # ------------------------------------------------------------------ facts
    @property
    def device_bytes(self) -> int:
        return self.cache_rows.numel() + self.directory.nbytes

    @property
    def resident_bytes(self) -> int:
        return self.inner.resident_bytes + self.device_bytes

    def stats(self) -> dict:
        with self._cache_lock:
            d = self.directory
            hits, reads = d.hits, d.reads
            s = super().stats()
            s.update(
                cache_bytes=self.device_bytes, cache_rows=d.slots, cache_ways=d.ways,
                cache_share=d.slots / max(1, self.row_range[1] - self.row_range[0]),
                cache_lookups=d.lookups, cache_reads=reads, cache_hits=hits,
                cache_hit_rate=hits / reads if reads else 0.0, cache_admitted=d.admitted,
                cache_maintenances=d.maintenances, cache_agings=d.agings, cache_prewarmed=self.prewarmed,
                lower_rows_read=self._lower_rows if self.needs_host_ids else reads - hits,
                inner=self.inner.stats(),
            )
            return s

    def describe(self) -> str:
        d = self.directory
        lo, hi = self.row_range
        warm = f", pre-warmed with {self.prewarmed:,} rows from {self.profile_path}" if self.profile_path else ""
        when = f"every {self.maintain_every} calls" if self.maintain_every else "when maintain() is called"
        return (f"{self.inner.describe()}; hot-row cache {self.device_bytes / 2**30:.2f} GiB on {self.device}: "
                f"{d.slots:,} rows ({d.slots / max(1, hi - lo):.2%} of the shard), {d.ways}-way, "
                f"admission {when}{warm}")

    # ------------------------------------------------------------------ reads
    def _gather(self, ids, out):
        from ..ops import gather_dequant

        with self._cache_lock:
            flat = ids.reshape(-1).to(self.device, torch.int64)
            lo, hi = self.row_range
            hit, slot = self.directory.lookup(torch.where((flat >= lo) & (flat < hi), flat, -1))
            # The dump slot lies outside (0, slots): misses decode to +0 here.
            cached = gather_dequant(self.cache_rows, slot, row_range=(0, self.directory.slots), backend=self.backend)
            if self.needs_host_ids:
                lower, unique = self._lower_from_host(flat, hit)
            else:
                # -1 lies outside every row range: hits cost the tier below no read at all.
                # table_address: the table as the op reads it (a host store's device address).
                lower = gather_dequant(self.inner.table, torch.where(hit, -1, flat), row_range=self.inner.row_range,
                                       backend=self.backend, table_address=self.inner.table_address)
                unique = None
            rows = torch.where(hit.unsqueeze(-1), cached, lower).view(*ids.shape, PAYLOAD_BYTES)
            if out is not None:
                out.copy_(rows)
                rows = out
            if unique is not None:
                CACHE_METRICS.lower_read(self, unique)
            self._eager_calls += 1
            if self.maintain_every and self._eager_calls % self.maintain_every == 0:
                self.maintain()
            return rows, unique

    def _lower_from_host(self, flat: torch.Tensor, hit: torch.Tensor):
        """Misses of a host-ids tier (disk): read each distinct missed row once, keep the
        packed rows for the next maintenance, decode them with the same op."""
        from ..ops import gather_dequant

        flat_h, hit_h = flat.cpu(), hit.cpu()
        lo, hi = self.row_range
        need = ~hit_h & (flat_h >= lo) & (flat_h < hi)
        uniq, inverse = torch.unique(flat_h[need], return_inverse=True)  # sorted: neighbours share pages
        if uniq.numel() == 0:  # all hits (or other shards' rows)
            return torch.zeros((flat.numel(), PAYLOAD_BYTES), dtype=torch.bfloat16, device=self.device), 0
        packed = self._read_lower(uniq.numpy())
        self._pending.append((uniq.numpy(), packed))
        self._lower_rows += uniq.numel()
        local = torch.full_like(flat_h, uniq.numel())  # outside (0, n): +0 rows (hits, other shards)
        local[need] = inverse
        table = torch.from_numpy(packed).to(self.device)
        return gather_dequant(table, local.to(self.device), row_range=(0, uniq.numel()), backend=self.backend), uniq.numel()

    def _read_lower(self, wanted: np.ndarray) -> np.ndarray:
        """Packed rows [n, 264] of sorted distinct global ids, from the tier below."""
        read = self.inner.read_packed
        return read(np.ascontiguousarray(wanted, dtype=np.int64))

    def _packed(self, ids: torch.Tensor) -> torch.Tensor:
        """Packed rows of `ids` (this shard's, on the device) for admission."""
        if ids.numel() == 0:
            return self.cache_rows[:0]
        lo = self.row_range[0]
        table = getattr(self.inner, "table", None)
        if table is not None:
            local = (ids - lo).to(table.device)
            return table[local].to(self.device, non_blocking=True)
        ids_h = ids.cpu().numpy()
        out = np.empty((ids_h.shape[0], ROW_BYTES), dtype=np.uint8)
        found = np.zeros(ids_h.shape[0], dtype=bool)
        if self._pending:
            have = np.concatenate([p[0] for p in self._pending])
            rows = np.concatenate([p[1] for p in self._pending])
            order = np.argsort(have, kind="stable")
            have = have[order]
            pos = np.minimum(np.searchsorted(have, ids_h), max(0, have.shape[0] - 1))
            found = have[pos] == ids_h if have.shape[0] else found
            out[found] = rows[order[pos[found]]]
        if not found.all():
            missing = np.unique(ids_h[~found])
            got = self._read_lower(missing)
            out[~found] = got[np.searchsorted(missing, ids_h[~found])]
        return torch.from_numpy(out).to(self.device)

    # ------------------------------------------------------------ maintenance
    def maintain(self) -> int:
        """Apply admissions and evictions decided from the misses since the last call.
        Returns the rows admitted. A host sync: call it off the critical path."""
        with self._cache_lock:
            ids, slots = self.directory.maintain()
            if ids.numel():
                self.cache_rows[slots] = self._packed(ids)
            self._pending.clear()
            d = self.directory
            hits, reads = d.hits, d.reads
            new_hits, new_reads = hits - self._reported_hits, reads - self._reported_reads
            self._reported_hits, self._reported_reads = hits, reads
            CACHE_METRICS.maintained(self, new_reads, new_hits, ids.numel(),
                                     None if self.needs_host_ids else new_reads - new_hits)
            return ids.numel()

    def prewarm(self, profile: str | os.PathLike, fingerprint: Optional[str] = None) -> int:
        """Fill the cache with this layer's hottest profiled rows. Returns the rows added."""
        from ..profiling import read_profile

        prof = read_profile(profile, fingerprint)
        ids, counts, _ = prof.layer(self.layer_id)
        lo, hi = self.row_range
        if ids.size and int(ids.max()) >= self.rows:
            raise EngramError(f"{profile}: layer {self.layer_id} row {int(ids.max())} is outside the table's "
                              f"{self.rows} rows: the profile was made for another table")
        mine = (ids >= lo) & (ids < hi)
        with self._cache_lock:
            got, slots = self.directory.prewarm(torch.from_numpy(ids[mine]), torch.from_numpy(counts[mine]))
            if got.numel():
                self.cache_rows[slots] = self._packed(got)
            self._pending.clear()
        self.profile_path = str(profile)
        self.prewarmed += got.numel()
        logger.info("engram layer %d: hot-row cache pre-warmed with %d rows from %s", self.layer_id, got.numel(), profile)
        return got.numel()

    def close(self) -> None:
        super().close()
        self.inner.close()


def wrap_stores(stores: dict[int, TableStore], cache_bytes: int, *, profile: Optional[str | os.PathLike] = None,
                fingerprint: Optional[str] = None, **options) -> dict[int, TableStore]:
    """Put a hot-row cache in front of each layer's store, splitting `cache_bytes` (device
    bytes for all layers together) in proportion to the rows each store holds."""
    if cache_bytes <= 0:
        return stores
    budget = split_by_rows(cache_bytes, {L: s.row_range[1] - s.row_range[0] for L, s in stores.items()})
    out: dict[int, TableStore] = {}
    try:
        for L, store in sorted(stores.items()):
            out[L] = HotRowCache(store, budget[L], profile=profile, fingerprint=fingerprint,
                                 **options)
            logger.info("%s", out[L].describe())
    except BaseException:
        for L, store in stores.items():
            (out.get(L) or store).close()
        raise
    return out
