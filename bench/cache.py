"""Hot-row cache hit rate against cache size: our policy, LRU, a static frequency set and
the offline optimum (Belady), on real code text and real prose, as decode traffic.

Trace: DECODE_BATCH (256) concurrent streams of real text (bench/workload.py), one token
each per decode step, 24 row ids per token per layer. Unit: a *row fetch*, one distinct
row of one step (the batch's repeats of a row are one fetch: a deduping tier reads it
once, and a cache decides per step). Hit rate = fetches whose row is in the cache when
the step starts.

* ours: `engram_sglang.core.stores.cache.RowDirectory`, the code the store runs (16-way sets,
  sketch counts, maintenance every --maintain-every steps as the store does), cold.
* ours, pre-warmed: the same, first filled from the counts of other text of the same kind
  (what `engram-sglang profile` writes).
* LRU: fully associative, exact at step granularity.
* static: the rows most read in other text of the same kind (more code of the standard
  library; for prose, other prose on this machine), never changed.
* Belady: the offline optimum for this trace, exact: after each step keep the rows, among
  those cached and those just read, whose next use is soonest (with bypass: a row need
  not be admitted). No online policy can do better on this trace.
* ideal LFU: what our policy approximates, without its approximations: fully associative,
  exact counts (no sketch, no aging), the top `capacity` rows by (calls read, last read)
  among the cached and the just-read kept after every step (admission every step, bypass).
  An online policy, idealized: how much of the gap to Belady the set-associative,
  sketch-counted, every-8-steps directory leaves.
* hindsight frequency: offline, the `capacity` rows this very trace reads most, held from
  the start; their first reads still miss (as Belady's do). What knowing every row's future
  frequency, but not its timing, buys.

The table is sized so that the trace reads it about --reads-per-row times (0.5 as in
docs/measurements.md: 8M tokens of 24 reads over a 384M-row table); cache sizes are shares
of its rows. The 2-core machine cannot replay every fetch of every policy quickly, so by
default the trace is one of --shard 16 row shards (rows picked by a hash of the id, the
caches 1/16 of the size): every policy, Belady included, is exact on that sampled trace,
and hit rates of a row sample track the whole trace's (SHARDS, Waldspurger et al. FAST'15;
--shard 1 replays everything).

    python -m bench.cache [--kinds code prose] [--layers 0 1] [--shard 16] [--reads-per-row 0.5]
    python -m bench.cache --dram [--sizes 0.01 0.1] [--hot-share 0.005] [--reuse] [--dram-ways 4 8 16 32]

--dram: the disk tier's DRAM row cache (`engram_sglang.core.stores.dram_cache.DramRowCache`, the
code the store runs, 16 ways): its frequency admission against its LRU policy of before (same
geometry) and exact fully associative LRU, on the raw trace and on the trace a hot-row cache
(RowDirectory) of --hot-share of the rows in front leaves over (its misses, per step), beside
the ceilings on the same trace (ideal LFU, hindsight frequency, Belady: as above); and the
CPU time of lookup + admit per decode-sized call (the unsharded trace's 6144 ids a step).
Behind a 0.5% hot-row cache at 1% of the rows (2026-12-01): DRAM 14.5 / LRU 14.3 / ideal LFU
14.5 / hindsight 19.2 / Belady 36.4 (code), 6.6 / 5.2 / 8.9 / 14.4 / 26.6 (prose): the hot-row
cache has taken the frequent rows, and what the optimum gains over LRU there is timing. Tried
there and dropped (idealized, exact counts, fully associative unless said): W-TinyLFU with any
window of 1-99% (code 11.4-14.2, at most LRU: hill climbing cannot pass its best window);
LRU-2; the n-gram order as a prior (code -0.1..-0.4, prose +0.4); the DRAM sketch also
counting the rows the hot-row cache served (-0.1); exclusive caching (the DRAM cache's own
policy with an 8x wider sketch; rows the hot-row cache admits made the first victims in DRAM,
the rows it evicts admitted: at 1% +2.4 over LRU on code, +3.3 on prose, at 10% -3.6 and -1.6;
the demotion alone -6 at 10%); the LRU way as the victim (-1.2). Then (--reuse, idealized:
bench/reuse_policies.py) the policies that exploit timing online, code / prose behind at 1%
over LRU: ARC +0.8 / +1.1, LIRS -0.6 / +2.6, LHD +0.9 / +1.1, S3-FIFO -0.7 / +1.9, the next
arrival predicted from a row's last gap -0.6 / +2.4 (behind the hot-row cache successive gaps
barely correlate: log-gap correlation 0.10 code, -0.01 prose; 0.63 / 0.54 on the raw trace),
and the victim's count halved per 0.5-2 LRU residence times since its last use (8 ways: -5.8
to +0.2). --dram-ways: 16 ways (the default since) +0.4 to +0.6 at 10% over 8, +0.0 to +0.3
at 1%; 32 ways +0.1 to +0.3 more for twice numpy's CPU (bench/dram_ways_cost.py).

Measured (layer 1, shard 1/16; ours / ideal LFU / hindsight / Belady): code 0.1%
22.7/22.8/23.4/33.2, 1% 42.3/42.6/45.2/56.5, 10% 63.9/64.4/66.3/66.3; prose 1%
25.7/25.9/29.8/38.7, 10% 51.0/51.0/60.6/60.6 (LRU: code 10.9/37.3/64.0, prose 16.4/48.7).
Ours is within 0.9 points of ideal LFU at every size: what is left to Belady (10-14
points up to 2%) is timing, not frequency: even knowing every row's future count
(hindsight) gets 0.70-0.80 of Belady below 1%. Variants that changed nothing (+-0.5 points):
maintenance every step instead of every 8; sample factor 30-1000 (10: -2 points at 0.1%);
a 4x wider sketch; 64 ways (4 ways: -1 point); an idealized W-LFU (an LRU window of 1-50%
before exact-LFU admission: 1%: equal, 20-50%: -1 to -4 points); recency-weighted counts
(LRFU); next-use predicted from mean reuse gap (+1.5 at prose 10%, -1 to -2 elsewhere).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import OUT, print_table, write_json
from bench.dram_ways_cost import call_costs
from bench.reuse_policies import POLICIES as REUSE_POLICIES
from bench.workload import DECODE_BATCH, code_corpus, decode_steps, hasher_for, split_streams, tokenized
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores.cache import RowDirectory
from engram_sglang.core.stores.dram_cache import DEFAULT_WAYS, DramRowCache

SIZES = (0.001, 0.005, 0.01, 0.02, 0.05, 0.10)  # shares of the table's rows
INF = np.iinfo(np.int32).max


# ------------------------------------------------------------------------ the trace
def in_shard(ids: torch.Tensor, shard: int) -> torch.Tensor:
    """Rows of shard 0 of `shard`: a 32-bit multiplicative hash below 2^32 / shard."""
    h = ((ids & 0x7FFFFFFF) * 0x9E3779B1) & 0xFFFFFFFF
    return h < (1 << 32) // shard


class Trace:
    """Row fetches of one layer: the distinct ids of each step, in step order.

    ids[offsets[s]:offsets[s+1]] are step s's distinct rows (sorted); next_step[f] is the
    next step that fetches the row of fetch f (INF if none), computed from the end.
    """

    def __init__(self, steps: list[torch.Tensor], rows: int, shard: int = 1):
        self.rows = rows
        if shard > 1:
            # One of `shard` row shards, picked by a hash of the row id (not the cache's set
            # hash): hit rates of a row sample estimate the whole trace's at capacity / shard
            # (SHARDS, Waldspurger et al., FAST'15); every policy sees the same sample.
            steps = [s[in_shard(s, shard)] for s in steps]
        self.shard = shard
        self.raw = [s.reshape(-1) for s in steps]  # per step, with repeats
        uniq = [torch.unique(s).numpy() for s in steps]
        self.reads = sum(s.numel() for s in steps)
        self.offsets = np.zeros(len(uniq) + 1, dtype=np.int64)
        np.cumsum([u.shape[0] for u in uniq], out=self.offsets[1:])
        self.ids = np.concatenate(uniq).astype(np.int64)
        self.step = np.repeat(np.arange(len(uniq), dtype=np.int32), np.diff(self.offsets))
        order = np.argsort(self.ids, kind="stable")  # by row, then by step (already in step order)
        same = self.ids[order[1:]] == self.ids[order[:-1]]
        nxt = np.full(self.ids.shape[0], INF, dtype=np.int32)
        nxt[order[:-1][same]] = self.step[order[1:][same]]
        self.next_step = nxt

    @property
    def steps(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def fetches(self) -> int:
        return self.ids.shape[0]

    def at(self, s: int) -> slice:
        return slice(self.offsets[s], self.offsets[s + 1])

    def distinct(self) -> int:
        return np.unique(self.ids).shape[0]


# ------------------------------------------------------------------------ policies
def lru(trace: Trace, capacity: int) -> int:
    """Hits of a fully associative LRU cache of `capacity` rows (step granularity)."""
    last = np.full(trace.rows, -1, dtype=np.int32)  # step of last use; -1: not cached
    count = hits = 0
    oldest = 0  # every cached row was last used at a step >= oldest
    for s in range(trace.steps):
        ids = trace.ids[trace.at(s)]
        cached = last[ids] >= 0
        h = int(cached.sum())
        hits += h
        count += ids.shape[0] - h
        last[ids] = s
        while count > capacity and oldest < s:
            old = trace.ids[trace.at(oldest)]
            victims = old[last[old] == oldest]
            take = victims[: count - capacity]
            last[take] = -1
            count -= take.shape[0]
            if take.shape[0] == victims.shape[0]:
                oldest += 1
    return hits


def belady(trace: Trace, capacity: int) -> int:
    """Hits of the offline optimum with bypass: keep the rows whose next use is soonest."""
    S = trace.steps
    cached = np.zeros(trace.rows, dtype=bool)
    nxt = np.zeros(trace.rows, dtype=np.int32)
    hist = np.zeros(S + 1, dtype=np.int64)  # cached rows per next-use step; S: never again
    never = np.flatnonzero(trace.next_step == INF)  # fetches whose row is never read again
    never_pos = 0
    count = hits = 0
    for s in range(S):
        sl = trace.at(s)
        ids, nexts = trace.ids[sl], trace.next_step[sl]
        was = cached[ids]
        h = int(was.sum())
        hits += h
        hist[s] -= h
        count += ids.shape[0] - h
        cached[ids] = True
        bucket = np.minimum(nexts, S)
        nxt[ids] = bucket
        hist += np.bincount(bucket, minlength=S + 1)
        excess = count - capacity
        if excess <= 0:
            continue
        # Never read again: evict first (any order).
        end = np.searchsorted(never, trace.offsets[s + 1])
        take = never[never_pos : min(end, never_pos + excess)]
        cached[trace.ids[take]] = False
        never_pos += take.shape[0]
        hist[S] -= take.shape[0]
        count -= take.shape[0]
        excess -= take.shape[0]
        # Then the rows used furthest in the future.
        t = S - 1
        while excess > 0:
            nz = np.flatnonzero(hist[s + 1 : t + 1])
            t = s + 1 + int(nz[-1])
            fut = trace.ids[trace.at(t)]
            victims = fut[cached[fut] & (nxt[fut] == t)]
            take = victims[:excess]
            cached[take] = False
            hist[t] -= take.shape[0]
            count -= take.shape[0]
            excess -= take.shape[0]
            t -= 1
    return hits


def ideal_lfu(trace: Trace, capacity: int) -> int:
    """Hits of exact, fully associative LFU with bypass: after each step keep the top
    `capacity` rows by (calls read, last read) among the cached rows and the step's misses."""
    import heapq

    uniq, dense = np.unique(trace.ids, return_inverse=True)
    count = np.zeros(uniq.shape[0], dtype=np.int64)
    pri = np.full(uniq.shape[0], -1, dtype=np.int64)  # priority of a cached row; -1: not cached
    heap: list[tuple[int, int]] = []  # (priority, row), stale entries skipped lazily
    size = hits = 0
    for s in range(trace.steps):
        d = dense[trace.at(s)]
        cached = pri[d] >= 0
        hits += int(cached.sum())
        count[d] += 1
        p = (count[d] << 32) | s  # unique per (row, step): a stale entry never matches
        pri[d[cached]] = p[cached]
        for q, x in zip(p[cached].tolist(), d[cached].tolist()):
            heapq.heappush(heap, (q, x))
        miss, mp = d[~cached], p[~cached]
        order = np.argsort(-mp, kind="stable")
        for q, x in zip(mp[order].tolist(), miss[order].tolist()):
            if size < capacity:
                heapq.heappush(heap, (q, x))
                pri[x] = q
                size += 1
                continue
            while heap[0][0] != pri[heap[0][1]]:
                heapq.heappop(heap)
            if q <= heap[0][0]:
                break  # the rest are weaker still: bypass
            _, y = heapq.heapreplace(heap, (q, x))
            pri[y], pri[x] = -1, q
    return hits


def hindsight(trace: Trace, capacity: int) -> int:
    """Hits of the `capacity` rows this trace reads most, held throughout; first reads miss."""
    _, counts = np.unique(trace.ids, return_counts=True)
    top = np.sort(counts)[::-1][:capacity]
    return int((top - 1).sum())


def static(trace: Trace, capacity: int, learned: np.ndarray) -> int:
    """Hits of a fixed set: the `capacity` rows read most in other text."""
    member = np.zeros(trace.rows, dtype=bool)
    member[learned[:capacity]] = True
    return int(member[trace.ids].sum())


def ours(trace: Trace, capacity: int, maintain_every: int, profile=None, **options) -> int:
    """Hits of RowDirectory (the store's own policy code) on the trace's raw ids."""
    d = RowDirectory(capacity, **options)
    if profile is not None:
        ids, counts, _ = profile
        d.prewarm(torch.from_numpy(ids), torch.from_numpy(counts))
    hits = 0
    for s in range(trace.steps):
        raw = trace.raw[s]
        hit, _ = d.lookup(raw)
        hits += torch.unique(raw[hit]).numel()  # fetches that hit: the distinct rows
        if (s + 1) % maintain_every == 0:
            d.maintain()
    return hits


def dram(trace: Trace, capacity: int, admission: str, ways: int = DEFAULT_WAYS) -> int:
    """Hits of the disk tier's DramRowCache (the store's code) of `capacity` rows; misses
    admitted after each step as the store does (the rows' bytes do not matter here)."""
    cache = DramRowCache(1 << 62, ways=ways, max_rows=capacity, admission=admission, huge_pages=False)
    try:
        blank = np.zeros((int(np.diff(trace.offsets).max(initial=0)), ROW_BYTES), dtype=np.uint8)
        hits = 0
        for s in range(trace.steps):
            ids = trace.ids[trace.at(s)]
            hit, _ = cache.lookup(ids)
            hits += int(np.count_nonzero(hit))
            missed = ids[~hit]
            cache.admit(missed, blank[: missed.shape[0]])
        return hits
    finally:
        cache.close()


def behind_hot_cache(trace: Trace, capacity: int, maintain_every: int, ways: int) -> Trace:
    """The trace a hot-row cache (RowDirectory of `capacity` rows, cold) in front leaves to
    the tier below: each step's reads that missed it."""
    d = RowDirectory(capacity, ways=ways)
    left = []
    for s in range(trace.steps):
        raw = trace.raw[s]
        hit, _ = d.lookup(raw)
        left.append(raw[~hit])
        if (s + 1) % maintain_every == 0:
            d.maintain()
    out = Trace(left, trace.rows)
    out.shard = trace.shard
    return out


def dram_call_cost(steps: list[np.ndarray], capacity: int, warm: int = 100, rounds: int = 3) -> dict:
    """CPU microseconds of lookup + admit per decode-sized call (one step's distinct ids,
    unsharded), frequency admission and LRU, the same calls, interleaved (a loaded machine
    slows both alike); best of `rounds` passes over the steps after `warm` steps."""
    caches = {a: DramRowCache(1 << 62, max_rows=capacity, admission=a, huge_pages=False) for a in ("frequency", "lru")}
    ids = [np.unique(s) for s in steps]
    blank = np.zeros((max(i.shape[0] for i in ids), ROW_BYTES), dtype=np.uint8)
    best = {a: float("inf") for a in caches}

    def call(cache, u):
        with cache.lock:
            hit, _ = cache.lookup(u)
            missed = u[~hit]
            cache.admit(missed, blank[: missed.shape[0]])

    try:
        for u in ids[:warm]:
            for cache in caches.values():
                call(cache, u)
        for _ in range(rounds):
            took = dict.fromkeys(caches, 0.0)
            for u in ids[warm:]:
                for a, cache in caches.items():
                    t = time.perf_counter()
                    call(cache, u)
                    took[a] += time.perf_counter() - t
            for a in caches:
                best[a] = min(best[a], took[a] / max(1, len(ids) - warm))
        return {"ids_per_call": float(np.mean([i.shape[0] for i in ids[warm:]])),
                **{f"{a}_us": 1e6 * best[a] for a in caches}}
    finally:
        for cache in caches.values():
            cache.close()


# ------------------------------------------------------------------------ workloads
def other_text(kind: str) -> list[str]:
    """Text of the same kind that the trace does not contain (to learn a static set from):
    the next 3M characters of the standard library; vim's help files for prose."""
    if kind == "code":
        return code_corpus(limit_chars=3_000_000, skip_chars=3_000_000)
    texts = [p.read_text(errors="replace") for p in sorted(Path("/usr/share/vim").glob("vim*/doc/*.txt"))]
    if not texts:
        raise SystemExit("no other prose on this machine (vim's help files) to learn a static set from: "
                         "run with --kinds code, or --policies without static and ours_prewarmed")
    return texts


def learned_counts(hasher, tokenizer, texts: list[str], layer_index: int, shard: int):
    """(row ids by count descending, counts, total reads) of one layer over `texts`, each
    hashed whole, restricted to the trace's row shard."""
    ids = torch.cat([hasher.hash_sequence(tokenizer(t)["input_ids"])[:, layer_index].reshape(-1) for t in texts if t])
    ids = ids[in_shard(ids, shard)] if shard > 1 else ids
    rows, counts = torch.unique(ids, return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)
    return rows[order].numpy(), counts[order].numpy(), ids.numel()


POLICIES = ("ours", "ours_prewarmed", "lru", "static", "ideal_lfu", "hindsight", "belady")
LABELS = {"ours": "ours (cold)", "ours_prewarmed": "ours, pre-warmed", "lru": "LRU", "static": "static frequency",
          "ideal_lfu": "ideal LFU (online)", "hindsight": "hindsight frequency (offline)", "belady": "Belady (optimum)"}


def run_kind(kind: str, args) -> list[dict]:
    from engram_sglang.core.hashing import EngramLayout

    t0 = time.perf_counter()
    tokenizer, tokens = tokenized(kind, args.vocab)
    rows_target = int(len(tokens) * 24 / args.reads_per_row)
    cfg, hasher = hasher_for(tokenizer, rows_target, (1, 14))
    streams = split_streams(hasher, tokens)
    steps = len(tokens) // DECODE_BATCH
    need_other = {"static", "ours_prewarmed"} & set(args.policies)
    others = other_text(kind) if need_other else []
    print(f"\n{kind}: {len(tokens):,} tokens in {DECODE_BATCH} streams = {steps:,} decode steps; "
          f"{sum(map(len, others)):,} characters of other {kind} to learn from ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    layout = EngramLayout(cfg)
    results = []
    for li in args.layers:
        layer_id = cfg.layer_ids[li]
        rows = layout.rows(layer_id)
        trace = Trace(decode_steps(streams, li, steps), rows, args.shard)
        learned = learned_counts(hasher, tokenizer, others, li, args.shard) if need_other else None
        distinct = trace.distinct()
        print(f"  layer {layer_id}: {rows:,} rows; shard 1/{args.shard}: {trace.reads:,} reads, {trace.fetches:,} "
              f"fetches ({1 - trace.fetches / trace.reads:.1%} repeats inside a step), {distinct:,} distinct rows "
              f"({distinct * args.shard / rows:.1%} of the table; first reads {distinct / trace.fetches:.1%} of fetches)",
              flush=True)
        for share in args.sizes:
            cap = max(1, int(share * rows / args.shard))
            row = {"kind": kind, "layer": layer_id, "share": share, "capacity": cap, "shard": args.shard,
                   "rows": rows, "fetches": trace.fetches, "reads": trace.reads, "first_reads": distinct, "seconds": {}}
            run = {
                "ours": lambda: ours(trace, cap, args.maintain_every, ways=args.ways),
                "ours_prewarmed": lambda: ours(trace, cap, args.maintain_every, learned, ways=args.ways),
                "lru": lambda: lru(trace, cap),
                "static": lambda: static(trace, cap, learned[0]),
                "ideal_lfu": lambda: ideal_lfu(trace, cap),
                "hindsight": lambda: hindsight(trace, cap),
                "belady": lambda: belady(trace, cap),
            }
            for name in args.policies:
                t = time.perf_counter()
                row[name] = run[name]() / trace.fetches
                row["seconds"][name] = round(time.perf_counter() - t, 2)
            results.append(row)
            print(f"    {share:.1%}: " + ", ".join(f"{n} {row[n]:.1%}" for n in args.policies)
                  + f"  ({sum(row['seconds'].values()):.0f} s)", flush=True)
    return results


DRAM_POLICIES = ("dram", "dram_lru", "lru", "ideal_lfu", "hindsight", "belady")
DRAM_LABELS = {"dram": "DRAM, frequency (new)", "dram_lru": "DRAM, LRU (before)", "lru": "LRU, fully assoc.",
               "ideal_lfu": "ideal LFU (online)", "hindsight": "hindsight freq. (offline)", "belady": "Belady (optimum)"}


def run_dram(kind: str, args) -> list[dict]:
    """The DRAM row cache's policies on the raw trace and behind a hot-row cache."""
    from engram_sglang.core.hashing import EngramLayout

    tokenizer, tokens = tokenized(kind, args.vocab)
    cfg, hasher = hasher_for(tokenizer, int(len(tokens) * 24 / args.reads_per_row), (1, 14))
    streams = split_streams(hasher, tokens)
    steps = len(tokens) // DECODE_BATCH
    layout = EngramLayout(cfg)
    results = []
    for li in args.layers:
        layer_id = cfg.layer_ids[li]
        rows = layout.rows(layer_id)
        all_steps = decode_steps(streams, li, steps)
        raw = Trace(all_steps, rows, args.shard)
        behind = behind_hot_cache(raw, max(1, int(args.hot_share * rows / args.shard)), args.maintain_every, args.ways)
        print(f"\n{kind}, layer {layer_id}: {rows:,} rows, {steps:,} decode steps; shard 1/{args.shard}: "
              f"{raw.fetches:,} fetches, {behind.fetches:,} left by a hot-row cache of {args.hot_share:.1%}", flush=True)
        for trace_name, trace in (("raw", raw), ("behind", behind)):
            for share in args.sizes:
                cap = max(1, int(share * rows / args.shard))
                row = {"kind": kind, "layer": layer_id, "trace": trace_name, "share": share, "capacity": cap,
                       "shard": args.shard, "rows": rows, "fetches": trace.fetches, "hot_share": args.hot_share}
                row["dram"] = dram(trace, cap, "frequency") / trace.fetches
                row["dram_lru"] = dram(trace, cap, "lru") / trace.fetches
                row["lru"] = lru(trace, cap) / trace.fetches
                # The ceilings on the same trace: what any online frequency policy (ideal LFU),
                # knowing each row's count (hindsight) or every future read (Belady) could get.
                row["ideal_lfu"] = ideal_lfu(trace, cap) / trace.fetches
                row["hindsight"] = hindsight(trace, cap) / trace.fetches
                row["belady"] = belady(trace, cap) / trace.fetches
                if args.reuse:  # reuse-distance-aware policies, idealized (bench/reuse_policies.py)
                    for name, policy in REUSE_POLICIES.items():
                        row[name] = policy(trace, cap) / trace.fetches
                for w in args.dram_ways:  # associativity: the same cache at other ways, both admissions
                    row[f"dram_{w}w"] = dram(trace, cap, "frequency", ways=w) / trace.fetches
                    row[f"dram_lru_{w}w"] = dram(trace, cap, "lru", ways=w) / trace.fetches
                results.append(row)
                print(f"    {trace_name} {share:.1%}: " + ", ".join(f"{n} {row[n]:.1%}" for n in DRAM_POLICIES), flush=True)
        # CPU cost per decode-sized call: the unsharded trace (a step's 256 x 24 ids).
        cost = dram_call_cost([s.reshape(-1).numpy() for s in all_steps[: 100 + args.cost_steps]],
                              max(1, int(args.sizes[0] * rows)))
        cost.update(kind=kind, layer=layer_id, share=args.sizes[0], capacity=int(args.sizes[0] * rows))
        results.append({"cost": cost})
        if args.dram_ways:  # what associativity costs per call, at the largest size (CPU only)
            share = max(args.sizes)
            ways_cost = call_costs([s.reshape(-1).numpy() for s in all_steps[: 100 + args.cost_steps]],
                                   max(1, int(share * rows)), args.dram_ways)
            results.append({"ways_cost": {**ways_cost, "kind": kind, "layer": layer_id, "share": share}})
        print(f"    lookup + admit per call of {cost['ids_per_call']:.0f} distinct ids (cache {args.sizes[0]:.1%}): "
              f"frequency {cost['frequency_us']:.0f} us, LRU {cost['lru_us']:.0f} us", flush=True)
    return results


def report_dram(results: list[dict], args) -> int:
    rates = [r for r in results if "cost" not in r and "ways_cost" not in r]
    costs = [r["cost"] for r in results if "cost" in r]
    ways_costs = [r["ways_cost"] for r in results if "ways_cost" in r]
    for kind, layer in sorted({(r["kind"], r["layer"]) for r in rates}):
        body = []
        for r in (r for r in rates if r["kind"] == kind and r["layer"] == layer):
            body.append([r["trace"], f"{r['share']:.1%}", *(f"{r[n]:.1%}" for n in DRAM_POLICIES),
                         f"{100 * (r['dram'] - r['dram_lru']):+.1f}", f"{100 * (r['dram'] - r['lru']):+.1f}",
                         f"{100 * (r['belady'] - r['lru']):+.1f}"])
        print_table(f"{kind}, layer {layer}: DRAM row cache hit rate (row fetches), raw trace and behind a hot-row "
                    f"cache of {args.hot_share:.1%} of the rows (replayed 1/{args.shard})",
                    ["trace", "cache size", *(DRAM_LABELS[n] for n in DRAM_POLICIES), "new - before", "new - LRU",
                     "Belady - LRU"], body)
    print_table("DRAM row cache: CPU per decode-sized call, lookup + admit (same run, interleaved)",
                ["kind", "cache size", "distinct ids", "frequency (new) us", "LRU (before) us", "ratio"],
                [[c["kind"], f"{c['share']:.1%}", f"{c['ids_per_call']:.0f}", f"{c['frequency_us']:.0f}",
                  f"{c['lru_us']:.0f}", f"{c['frequency_us'] / c['lru_us']:.2f}"] for c in costs])
    # Goals: >= LRU + 3 points at 1%, never below LRU at 10% (both LRUs); beside them the
    # ceilings over LRU (no online policy passes Belady's; ideal LFU's is the online frequency one).
    if args.reuse:
        body = [[r["kind"], r["trace"], f"{r['share']:.1%}", *(f"{r[n]:.1%}" for n in ("lru", "dram", *REUSE_POLICIES)),
                 f"{r['belady']:.1%}", f"{100 * (max(r[n] for n in REUSE_POLICIES) - r['lru']):+.1f}"] for r in rates]
        print_table("Reuse-distance-aware policies (idealized, fully associative; bench/reuse_policies.py)",
                    ["kind", "trace", "cache size", "LRU", "DRAM (ours)", *REUSE_POLICIES, "Belady", "best - LRU"], body)
    if args.dram_ways:
        print_table("Associativity: the DRAM row cache at other ways (frequency / LRU admission)",
                    ["kind", "trace", "cache size", "LRU, fully assoc.",
                     *(f"{w} ways" for w in args.dram_ways)],
                    [[r["kind"], r["trace"], f"{r['share']:.1%}", f"{r['lru']:.1%}",
                      *(f"{r[f'dram_{w}w']:.1%} / {r[f'dram_lru_{w}w']:.1%}" for w in args.dram_ways)] for r in rates])
    if ways_costs:
        print_table("Associativity: CPU per decode-sized call, median ms (bench/dram_ways_cost.py; interleaved)",
                    ["kind", "cache size", "distinct ids", "ways", "numpy lookup + admit", "native, all hits (ids)",
                     "native with admissions", "native hit rate"],
                    [[c["kind"], f"{c['share']:.1%}", f"{c['ids_per_call']:.0f}", w, f"{c[w]['numpy_ms']:.2f}",
                      f"{c[w]['native_hits_ms']:.3f} ({c['hit_ids_per_call']:.0f})", f"{c[w]['native_ms']:.3f}",
                      f"{c[w]['native_hit_rate']:.1%}"]
                     for c in ways_costs for w in args.dram_ways])
    checks = {f"{r['kind']} {r['trace']} {r['share']:.1%}": {
        "points_over_dram_lru": 100 * (r["dram"] - r["dram_lru"]), "points_over_lru": 100 * (r["dram"] - r["lru"]),
        **{f"{n}_points_over_lru": 100 * (r[n] - r["lru"]) for n in ("ideal_lfu", "hindsight", "belady")}}
        for r in rates}
    path = write_json(args.name, {"config": vars(args), "unit": "row fetches (distinct rows of a decode step)",
                                  "results": rates, "call_cost": costs, "ways_call_cost": ways_costs, "checks": checks})
    plot_dram(rates, OUT / f"{args.name}.png", args.hot_share)
    print(f"\nwrote {path} and {OUT / f'{args.name}.png'}")
    return 0


def plot_dram(rates: list[dict], path: Path, hot_share: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["kind"], r["layer"], r["trace"]) for r in rates})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (kind, layer, trace) in zip(axes[0], panels):
        rs = [r for r in rates if (r["kind"], r["layer"], r["trace"]) == (kind, layer, trace)]
        x = [100 * r["share"] for r in rs]
        for name, style in zip(DRAM_POLICIES, ("o-", "s-", "^:", "d:", "v:", "k*-")):
            ax.plot(x, [100 * r[name] for r in rs], style, label=DRAM_LABELS[name])
        ax.set_xscale("log")
        ax.set_xlabel("DRAM cache size, % of the table's rows")
        ax.set_ylabel("hit rate, % of row fetches")
        where = "raw trace" if trace == "raw" else f"behind a {hot_share:.1%} hot-row cache"
        ax.set_title(f"{kind}, layer {layer}: {where}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(results: list[dict], policies) -> dict:
    """Goal checks: ours within 10% of Belady at every size; at 1% at least LRU on code."""
    checks = {}
    for r in results:
        key = f"{r['kind']} layer {r['layer']} {r['share']:.1%}"
        if "ours" in r and "belady" in r:
            checks[key] = {"ours_over_belady": r["ours"] / r["belady"] if r["belady"] else 1.0,
                           "points_below_belady": 100 * (r["belady"] - r["ours"])}
            if "lru" in r:
                checks[key]["points_over_lru"] = 100 * (r["ours"] - r["lru"])
            if "ideal_lfu" in r:
                checks[key]["ideal_lfu_over_belady"] = r["ideal_lfu"] / r["belady"] if r["belady"] else 1.0
    return checks


def plot(results: list[dict], policies, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["kind"], r["layer"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    styles = {"ours": "o-", "ours_prewarmed": "o--", "lru": "s-", "static": "^-", "ideal_lfu": "d:",
              "hindsight": "v:", "belady": "k*-"}
    for ax, (kind, layer) in zip(axes[0], panels):
        rs = [r for r in results if r["kind"] == kind and r["layer"] == layer]
        x = [100 * r["share"] for r in rs]
        for name in policies:
            ax.plot(x, [100 * r[name] for r in rs], styles[name], label=LABELS[name])
        ax.axhline(100 * (1 - rs[0]["first_reads"] / rs[0]["fetches"]), color="grey", lw=0.8, ls=":",
                   label="no first reads missed")
        ax.set_xscale("log")
        ax.set_xlabel("cache size, % of the table's rows")
        ax.set_ylabel("hit rate, % of row fetches")
        ax.set_title(f"{kind}, layer {layer}: decode, {DECODE_BATCH} streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["code", "prose"], choices=["code", "prose"])
    p.add_argument("--layers", nargs="+", type=int, default=[0], help="layer indices (0: layer 1, 1: layer 14)")
    p.add_argument("--sizes", nargs="+", type=float, default=list(SIZES), help="cache sizes, shares of the rows")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--shard", type=int, default=16, help="replay one of this many row shards (1: every fetch)")
    p.add_argument("--reads-per-row", type=float, default=0.5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ways", type=int, default=16)
    p.add_argument("--maintain-every", type=int, default=8, help="steps between maintenances (the store's default)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--name", default=None, help="bench/out/NAME.json and NAME.png (default: cache, cache_dram)")
    p.add_argument("--dram", action="store_true", help="the DRAM row cache's policies (sizes default: 1%% and 10%%)")
    p.add_argument("--hot-share", type=float, default=0.005, help="--dram: the hot-row cache in front, share of rows")
    p.add_argument("--cost-steps", type=int, default=200, help="--dram: decode steps timed for the CPU cost per call")
    p.add_argument("--reuse", action="store_true",
                   help="--dram: also ARC, LIRS, LHD, S3-FIFO, next-arrival prediction (idealized; a few minutes)")
    p.add_argument("--dram-ways", nargs="*", type=int, default=[],
                   help="--dram: also the DRAM row cache at these ways (e.g. 4 8 16 32): hit rates, and CPU per "
                        "call at the largest size (rows of each way's caches are all touched: ~2x 264 B x rows x size)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.dram:
        args.name = args.name or "cache_dram"
        if args.sizes == list(SIZES):
            args.sizes = [0.01, 0.10]
        results = []
        for kind in args.kinds:
            results += run_dram(kind, args)
        status = report_dram(results, args)
        print(f"({time.perf_counter() - t0:.0f} s)")
        return status
    args.name = args.name or "cache"
    results = []
    for kind in args.kinds:
        results += run_kind(kind, args)
    checks = summarize(results, args.policies)
    for kind, layer in sorted({(r["kind"], r["layer"]) for r in results}):
        rs = [r for r in results if r["kind"] == kind and r["layer"] == layer]
        header = ["cache size", *(LABELS[n] for n in args.policies)]
        if "ours" in args.policies and "belady" in args.policies:
            header.append("ours / Belady")
        body = []
        for r in rs:
            line = [f"{r['share']:.1%} ({r['capacity'] * r['shard']:,} rows)", *(f"{r[n]:.1%}" for n in args.policies)]
            if "ours / Belady" in header:
                key = f"{kind} layer {layer} {r['share']:.1%}"
                line.append(f"{checks[key]['ours_over_belady']:.2f}")
            body.append(line)
        print_table(f"{kind}, layer {layer}: hit rate (share of row fetches served from the cache), "
                    f"{rs[0]['rows']:,}-row table, {rs[0]['reads'] * rs[0]['shard']:,} reads (replayed 1/{rs[0]['shard']})",
                    header, body)
    payload = {"config": vars(args), "unit": "row fetches (distinct rows of a decode step)", "results": results,
               "checks": checks, "seconds": round(time.perf_counter() - t0, 1)}
    path = write_json(args.name, payload)
    plot(results, args.policies, OUT / f"{args.name}.png")
    print(f"\nwrote {path} and {OUT / f'{args.name}.png'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
