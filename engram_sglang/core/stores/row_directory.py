"""The hot-row cache's policy: which table rows it holds, and which it should hold next.

`RowDirectory` has two halves with different rules:

* the lookup (every call, on the critical path): set-associative tags compared on the
  device; a count-min sketch, the hit slots' counts and clocks and a ring of missed ids
  updated in place. Fixed shapes, no host sync, no Python state: a lookup captured in a
  CUDA graph and replayed does what an eager one does.
* the maintenance (between steps, never inside a graph: stores/maintenance.py): per set,
  keep the `ways` rows of highest (count, last read) among the residents and the rows that
  missed. A row that missed takes the way of the set's weakest resident only when it was
  read in more calls, or in as many but more recently (TinyLFU-style admission: a one-off
  read, as most 4-grams are, never displaces a row read twice). Counts are "calls that read
  the row", halved once per `sample_factor` x slots reads (checked at maintenance, from a
  device counter), so they follow the text being served.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import EngramError
from ..rowformat import ROW_BYTES
from . import maintenance

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

    def counters(self) -> dict:
        """lookups, reads and hits so far, from the device counters in one read (a host
        sync: between steps only, never inside a graph capture)."""
        if maintenance.capturing():
            raise EngramError("hot-row cache: its counters are device values (a host sync): read them between "
                              "steps, not inside a CUDA-graph capture")
        lookups, reads, hits, ring_pos = torch.stack((self._clock, self._reads, self._hits, self._ring_pos)).tolist()
        return {"lookups": lookups, "reads": reads, "hits": hits, "ring_pos": ring_pos}

    @property
    def hits(self) -> int:
        """Reads found in the cache so far (a host sync: for stats, not the hot path)."""
        return self.counters()["hits"]

    @property
    def reads(self) -> int:
        """Reads looked up so far, ids < 0 included (a host sync)."""
        return self.counters()["reads"]

    @property
    def lookups(self) -> int:
        """Lookups so far (a host sync)."""
        return self.counters()["lookups"]

    def _age(self, reads: int) -> int:
        """Halve the sketch and the recorded counts once per `sample` reads since the last
        aging (part of maintenance; `reads` from `counters()`). Returns the halvings done."""
        due = (reads - self._aged_at) // self.sample
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
    def maintain(self, counters: Optional[dict] = None, *, install: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Age the counts when due, then admit and evict from the misses since the last
        call (host syncs: between steps only).

        Returns (ids, slots), int64 on the device: the rows to copy into those slots. With
        `install` the tags already name them (copy before the next lookup); without, call
        `install(ids, slots)` once the rows are copied (a caller whose read of the rows may
        fail). `counters`: this maintenance's `counters()`, when the caller read them.
        """
        counters = counters or self.counters()
        self._age(counters["reads"])
        end = counters["ring_pos"]
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
        if install:
            self.install(ids, slots)
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

    def install(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Name `ids` in `slots` (from `maintain`): counts from the sketch, read now."""
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
