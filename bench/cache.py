"""Hot-row cache hit rate against cache size: our policy, LRU, a static frequency set and
the offline optimum (Belady), on real code text and real prose, as decode traffic.

Trace: DECODE_BATCH (256) concurrent streams of real text (bench/workload.py), one token
each per decode step, 24 row ids per token per layer. Unit: a *row fetch*, one distinct
row of one step (the batch's repeats of a row are one fetch: a deduping tier reads it
once, and a cache decides per step). Hit rate = fetches whose row is in the cache when
the step starts.

* ours: `engram_sglang.stores.cache.RowDirectory`, the code the store runs (set-
  associative, sketch frequencies, maintenance every --maintain-every steps), cold.
* ours, pre-warmed: the same, first filled from a profile of other text of the same kind.
* LRU: fully associative, exact at step granularity.
* static: the rows most read in other text of the same kind (more code of the standard
  library; for prose, other prose on this machine), never changed.
* Belady: the offline optimum for this trace, exact: after each step keep the rows, among
  those cached and those just read, whose next use is soonest (with bypass: a row need
  not be admitted). No online policy can do better on this trace.

The table is sized so that the trace reads it about --reads-per-row times (0.5 as in
docs/measurements.md: 8M tokens of 24 reads over a 384M-row table); cache sizes are shares
of its rows.

    python bench/cache.py [--kinds code prose] [--layers 1] [--reads-per-row 0.5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, print_table, write_json  # noqa: E402
from workload import DECODE_BATCH, code_corpus, decode_steps, hasher_for, split_streams, tokenized  # noqa: E402

from engram_sglang.stores.cache import RowDirectory  # noqa: E402

SIZES = (0.001, 0.005, 0.01, 0.02, 0.05, 0.10)  # shares of the table's rows
INF = np.iinfo(np.int32).max


# ------------------------------------------------------------------------ the trace
class Trace:
    """Row fetches of one layer: the distinct ids of each step, in step order.

    ids[offsets[s]:offsets[s+1]] are step s's distinct rows (sorted); next_step[f] is the
    next step that fetches the row of fetch f (INF if none), computed from the end.
    """

    def __init__(self, steps: list[torch.Tensor], rows: int):
        self.rows = rows
        self.raw = steps  # [256, 24] per step, with repeats
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


def static(trace: Trace, capacity: int, learned: np.ndarray) -> int:
    """Hits of a fixed set: the `capacity` rows read most in other text."""
    member = np.zeros(trace.rows, dtype=bool)
    member[learned[:capacity]] = True
    return int(member[trace.ids].sum())


def ours(trace: Trace, capacity: int, maintain_every: int, ways: int, profile=None) -> int:
    """Hits of RowDirectory (the store's own policy code) on the trace's raw ids."""
    d = RowDirectory(capacity, ways=ways)
    if profile is not None:
        ids, counts, total = profile
        d.prewarm(torch.from_numpy(ids), torch.from_numpy(counts), total)
    hits = 0
    for s in range(trace.steps):
        u = torch.from_numpy(trace.ids[trace.at(s)])
        hits += int(d.find(u)[0].sum())
        d.lookup(trace.raw[s])
        if (s + 1) % maintain_every == 0:
            d.maintain()
    return hits


# ------------------------------------------------------------------------ workloads
def other_text(kind: str) -> list[str]:
    """Text of the same kind that the trace does not contain (to learn a static set from)."""
    if kind == "code":
        return code_corpus(limit_chars=3_000_000, skip_chars=3_000_000)
    vim = sorted(Path("/usr/share/vim").glob("vim*/doc/*.txt"))
    texts = [p.read_text(errors="replace") for p in vim]
    if not texts:
        raise SystemExit("no other prose on this machine (vim's help files): run with --kinds code")
    return texts


def learned_counts(hasher, tokenizer, texts: list[str], layer_index: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(row ids by count descending, counts, total reads) of one layer over `texts`."""
    ids = torch.cat([hasher.hash_sequence(tokenizer(t)["input_ids"])[:, layer_index].reshape(-1) for t in texts if t])
    rows, counts = torch.unique(ids, return_counts=True)
    order = torch.argsort(counts, descending=True, stable=True)
    return rows[order].numpy(), counts[order].numpy(), ids.numel()


def run_kind(kind: str, args) -> list[dict]:
    t0 = time.perf_counter()
    tokenizer, tokens = tokenized(kind, args.vocab)
    per_layer_reads = len(tokens) * 24
    rows_target = int(per_layer_reads / args.reads_per_row)
    cfg, hasher = hasher_for(tokenizer, rows_target, (1, 14))
    streams = split_streams(hasher, tokens)
    steps = len(tokens) // DECODE_BATCH
    others = other_text(kind)
    print(f"{kind}: {len(tokens):,} tokens in {DECODE_BATCH} streams, {steps} decode steps; "
          f"{sum(map(len, others)):,} chars of other {kind} to learn from ({time.perf_counter() - t0:.0f} s)", flush=True)
    from engram_sglang.hashing import EngramLayout

    layout = EngramLayout(cfg)
    results = []
    for li in args.layers:
        layer_id = cfg.layer_ids[li]
        rows = layout.rows(layer_id)
        trace = Trace(decode_steps(streams, li, steps), rows)
        learned = learned_counts(hasher, tokenizer, others, li)
        print(f"  layer {layer_id}: {rows:,} rows, {trace.reads:,} reads, {trace.fetches:,} fetches "
              f"({1 - trace.fetches / trace.reads:.1%} repeats inside a step), {trace.distinct():,} distinct rows "
              f"({trace.distinct() / rows:.1%} of the table)", flush=True)
        for share in args.sizes:
            cap = max(1, int(share * rows))
            row = {"kind": kind, "layer": layer_id, "share": share, "capacity": cap, "rows": rows,
                   "fetches": trace.fetches, "reads": trace.reads, "seconds": {}}
            policies = {
                "ours": lambda: ours(trace, cap, args.maintain_every, args.ways),
                "ours_prewarmed": lambda: ours(trace, cap, args.maintain_every, args.ways, learned),
                "lru": lambda: lru(trace, cap),
                "static": lambda: static(trace, cap, learned[0]),
                "belady": lambda: belady(trace, cap),
            }
            for name, fn in policies.items():
                if name not in args.policies:
                    continue
                t = time.perf_counter()
                row[name] = fn() / trace.fetches
                row["seconds"][name] = time.perf_counter() - t
            results.append(row)
            print("   ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "seconds"},
                  {k: round(v, 1) for k, v in row["seconds"].items()}, flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", default=["code", "prose"], choices=["code", "prose"])
    p.add_argument("--layers", nargs="+", type=int, default=[0], help="layer indices (0: layer 1, 1: layer 14)")
    p.add_argument("--sizes", nargs="+", type=float, default=list(SIZES), help="cache sizes, shares of the rows")
    p.add_argument("--policies", nargs="+", default=["ours", "ours_prewarmed", "lru", "static", "belady"])
    p.add_argument("--reads-per-row", type=float, default=0.5)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ways", type=int, default=16)
    p.add_argument("--maintain-every", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for kind in args.kinds:
        results += run_kind(kind, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
