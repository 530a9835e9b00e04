"""Reuse-distance-aware cache policies, idealized, for `bench/cache.py --dram --reuse`.

Behind a hot-row cache the DRAM row cache's frequency admission barely beats LRU, while
Belady's optimum is 21-22 points above it at 1% of the rows: the optimum's headroom is
*timing* (docs/measurements.md section 6). These are the published policies that exploit
timing online, run on the same step-granular traces as bench/cache.py's (a step's distinct
rows, in order; hits decided when the step starts, then its misses admitted, as the disk
store does): fully associative, exact, unbounded metadata unless said, so each is the
ceiling of what a set-associative version of it could get here.

* ARC (Megiddo & Modha, FAST'03): recency list T1 and frequency list T2, ghosts B1/B2 of
  what each evicted, the split between them adapted by ghost hits.
* LIRS (Jiang & Zhang, SIGMETRICS'02): rows of small inter-reference recency (LIR) stay;
  the others (HIR) pass through a small resident queue (hir_share of the cache); the
  recency stack keeps up to stack_mult x capacity non-resident HIR entries.
* LHD (Beckmann et al., NSDI'18): evict, of `cands` random cached rows, the one of least
  hit density (expected hits over expected remaining time in the cache), learned online
  per class (row's read count: 1, 2, 3-4, 5+) and age (steps since its last read).
* S3-FIFO (Yang et al., SOSP'23): a small FIFO for new rows (small_share of the cache), a
  main FIFO with 2-bit frequencies (reinsertion), a ghost FIFO of the rows the small one
  evicted (those go to the main one when read again); evictions only when the cache is full.
* next arrival: each row's next read predicted at its last read + its last inter-arrival
  gap (first reads: first_gap); a row past its predicted arrival is as far out as it is
  overdue. Evict, of `cands` random cached rows, the furthest predicted; a missed row takes
  its place only when predicted sooner.

Each asserts, every step, that it holds no more than `capacity` rows.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np


def _steps(trace) -> list[list[int]]:
    ids, off = trace.ids.tolist(), trace.offsets.tolist()
    return [ids[off[s]:off[s + 1]] for s in range(len(off) - 1)]


def arc(trace, capacity: int) -> int:
    c = capacity
    t1, t2, b1, b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
    p = hits = 0

    def replace(x) -> None:
        if len(t1) + len(t2) < c:
            return
        if t1 and (len(t1) > p or (x in b2 and len(t1) == p)):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for ids in _steps(trace):
        missed = []
        for x in ids:
            if x in t1:
                del t1[x]
                t2[x] = None
                hits += 1
            elif x in t2:
                t2.move_to_end(x)
                hits += 1
            else:
                missed.append(x)
        for x in missed:
            if x in b1:
                p = min(c, p + max(len(b2) // max(len(b1), 1), 1))
                replace(x)
                del b1[x]
                t2[x] = None
            elif x in b2:
                p = max(0, p - max(len(b1) // max(len(b2), 1), 1))
                replace(x)
                del b2[x]
                t2[x] = None
            else:
                l1 = len(t1) + len(b1)
                if l1 == c:
                    if len(t1) < c:
                        b1.popitem(last=False)
                        replace(x)
                    else:
                        t1.popitem(last=False)
                elif l1 + len(t2) + len(b2) >= c:
                    if l1 + len(t2) + len(b2) == 2 * c:
                        b2.popitem(last=False)
                    replace(x)
                t1[x] = None
        assert len(t1) + len(t2) <= c
    return hits


def lirs(trace, capacity: int, hir_share: float = 0.01, stack_mult: int = 3) -> int:
    lhirs = max(1, int(capacity * hir_share))
    llirs = capacity - lhirs
    stack = OrderedDict()  # recency stack S: LIR rows, resident and non-resident HIR rows
    queue = OrderedDict()  # resident HIR rows, oldest first
    gone = OrderedDict()  # non-resident HIR rows in the stack, oldest first
    lir: set[int] = set()
    hits = 0

    def prune() -> None:  # the stack's bottom is always a LIR row
        while stack:
            y = next(iter(stack))
            if y in lir:
                break
            stack.popitem(last=False)
            gone.pop(y, None)

    def demote_bottom() -> None:  # the bottom LIR row becomes a resident HIR row
        y = stack.popitem(last=False)[0]
        lir.discard(y)
        queue[y] = None
        prune()

    for ids in _steps(trace):
        missed = []
        for x in ids:
            if x in lir:
                hits += 1
                stack.move_to_end(x)
                prune()
            elif x in queue:
                hits += 1
                if x in stack:  # reread within the LIR rows' recency: it becomes LIR
                    stack.move_to_end(x)
                    del queue[x]
                    lir.add(x)
                    demote_bottom()
                else:
                    stack[x] = None
                    queue.move_to_end(x)
            else:
                missed.append(x)
        for x in missed:
            if len(lir) < llirs:
                lir.add(x)
                stack[x] = None
                stack.move_to_end(x)
                continue
            if len(queue) >= lhirs:
                y = queue.popitem(last=False)[0]
                if y in stack:
                    gone[y] = None
            if x in stack:  # a non-resident HIR row read again soon enough: LIR
                gone.pop(x, None)
                stack.move_to_end(x)
                lir.add(x)
                demote_bottom()
            else:
                stack[x] = None
                queue[x] = None
            while len(gone) > stack_mult * capacity:
                del stack[gone.popitem(last=False)[0]]
        assert len(lir) + len(queue) <= capacity
    return hits


def lhd(trace, capacity: int, cands: int = 32, age_unit: int = 8, ages: int = 128, decay: float = 0.9,
        seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    classes = 4
    hit_ages, evict_ages = np.zeros((classes, ages)), np.zeros((classes, ages))
    new_hits, new_evicts = np.zeros((classes, ages)), np.zeros((classes, ages))
    density = np.zeros((classes, ages))
    density[:, 0] = 1.0

    def cls(n: int) -> int:
        return 0 if n <= 1 else 1 if n == 2 else 2 if n <= 4 else 3

    def learn() -> np.ndarray:
        # Hit density at age a: hits expected after a over the time expected in the cache after a.
        later_hits = np.cumsum(hit_ages[:, ::-1], 1)[:, ::-1]
        ending = np.cumsum((hit_ages + evict_ages)[:, ::-1], 1)[:, ::-1]
        time_left = np.cumsum(ending[:, ::-1], 1)[:, ::-1]
        return np.where(time_left > 0, later_hits / np.maximum(time_left, 1e-9), 0.0)

    slots: list[int] = []
    where: dict[int, int] = {}
    last: dict[int, int] = {}
    reads: dict[int, int] = {}
    seen: dict[int, int] = {}
    hits = events = 0
    period = max(1, capacity // 2)
    for s, ids in enumerate(_steps(trace)):
        missed = []
        for x in ids:
            n = seen.get(x, 0) + 1
            seen[x] = n
            if x in where:
                hits += 1
                new_hits[cls(reads[x]), min(ages - 1, (s - last[x]) // age_unit)] += 1
                events += 1
                last[x], reads[x] = s, n
            else:
                missed.append((x, n))
        for x, n in missed:
            if len(slots) < capacity:
                where[x] = len(slots)
                slots.append(x)
                last[x], reads[x] = s, n
                continue
            best, best_density = -1, float("inf")
            for j in rng.integers(0, len(slots), cands).tolist():
                y = slots[j]
                if last[y] == s:
                    continue
                d = density[cls(reads[y]), min(ages - 1, (s - last[y]) // age_unit)]
                if d < best_density:
                    best, best_density = j, d
            if best < 0 or density[cls(n), 0] < best_density:
                continue  # bypass: the new row is worth less than the victim
            y = slots[best]
            new_evicts[cls(reads[y]), min(ages - 1, (s - last[y]) // age_unit)] += 1
            events += 1
            del where[y], last[y], reads[y]
            slots[best] = x
            where[x] = best
            last[x], reads[x] = s, n
        if events >= period:
            hit_ages = decay * hit_ages + new_hits
            evict_ages = decay * evict_ages + new_evicts
            new_hits[:] = 0
            new_evicts[:] = 0
            events = 0
            density = learn()
        assert len(slots) <= capacity
    return hits


def s3fifo(trace, capacity: int, small_share: float = 0.1, max_freq: int = 3) -> int:
    small_cap = max(1, int(capacity * small_share))
    small, main = deque(), deque()
    freq: dict[int, int] = {}
    ghost = OrderedDict()
    hits = 0

    def evict() -> None:  # the cache is full: one row out (rows read again move on instead)
        while True:
            if len(small) >= small_cap or not main:
                y = small.popleft()
                if freq[y] > 0:  # read again while in the small queue: into the main one
                    freq[y] = 0
                    main.append(y)
                    continue
                del freq[y]
                ghost[y] = None
                if len(ghost) > capacity:
                    ghost.popitem(last=False)
                return
            y = main.popleft()
            if freq[y] > 0:
                freq[y] -= 1
                main.append(y)
                continue
            del freq[y]
            return

    for ids in _steps(trace):
        missed = []
        for x in ids:
            if x in freq:
                hits += 1
                freq[x] = min(max_freq, freq[x] + 1)
            else:
                missed.append(x)
        for x in missed:
            if len(small) + len(main) >= capacity:
                evict()
            if x in ghost:
                del ghost[x]
                main.append(x)
            else:
                small.append(x)
            freq[x] = 0
        assert len(small) + len(main) <= capacity
    return hits


def next_arrival(trace, capacity: int, first_gap: int = 1000, overdue: float = 2.0, cands: int = 32,
                 seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    slots: list[int] = []
    where: dict[int, int] = {}
    last: dict[int, int] = {}
    gap: dict[int, int] = {}
    hits = 0

    def predicted(y: int, s: int) -> float:
        p = last[y] + gap.get(y, first_gap)
        return p if p >= s else s + overdue * (s - p)

    for s, ids in enumerate(_steps(trace)):
        missed = []
        for x in ids:
            if x in last:
                gap[x] = s - last[x]
            last[x] = s
            if x in where:
                hits += 1
            else:
                missed.append(x)
        for x in missed:
            if len(slots) < capacity:
                where[x] = len(slots)
                slots.append(x)
                continue
            best, furthest = -1, -1.0
            for j in rng.integers(0, len(slots), cands).tolist():
                y = slots[j]
                if last[y] != s and predicted(y, s) > furthest:
                    best, furthest = j, predicted(y, s)
            if best < 0 or predicted(x, s) >= furthest:
                continue
            del where[slots[best]]
            slots[best] = x
            where[x] = best
        assert len(slots) <= capacity
    return hits


POLICIES = {"arc": arc, "lirs": lirs, "lhd": lhd, "s3fifo": s3fifo, "next_arrival": next_arrival}
