"""Whole rows or a shard per rank, for the host placement with one shared copy per node.

Whole rows (every rank maps the node's copy and reads every row of its own tokens): no
all-reduce of the Engram rows, but each GPU's host-link bytes grow TP-fold. Sharded (each
rank reads the rows of its 1/TP of the table, +0 elsewhere): 1/TP of the host-link bytes,
then an all-reduce of the rows [tokens, columns, head_dim] in bf16 per Engram layer over the
GPU-to-GPU link. Per step, decode (DECODE_BATCH tokens) and one prefill chunk (PREFILL_CHUNK):

* collective bytes removed per GPU: a ring all-reduce sends (and receives) 2 (TP-1)/TP of
  the payload per GPU;
* host-link bytes added per GPU: every 64-byte line of the rows the rank did not read before
  ((1 - 1/TP) of its tokens' rows), less what a hot-row cache serves (`hit_rate`);
* time at each link's peak, plus ALLREDUCE_LATENCY_S per all-reduce (one per Engram layer).

The recommendation is the smaller time at decode and prefill alike; where they disagree,
decode's (the steady state). Both sides are at peak, with no credit for overlap: the host
reads of a step are issued at its start and overlap the layers before each Engram layer,
while the all-reduce sits on the layer's critical path, so "whole" where the times are
close is the safer side of the estimate (the reason says so).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

# One all-reduce's fixed cost inside an NVLink/xGMI island (launch + synchronization of a
# small message). Assumption: NCCL's all-reduce latency within one node is ~10 us for small
# messages (nccl-tests, 8 GPUs); measure with nccl-tests' all_reduce_perf on the server.
ALLREDUCE_LATENCY_S = 10e-6
BF16_BYTES = 2
CACHE_LINE = 64


def step_bytes(*, tokens: int, layers: int, columns: int, head_dim: int, lines_per_row: float, tp: int,
               hit_rate: float = 0.0, shard_hit_rate: Optional[float] = None) -> dict[str, float]:
    """Per GPU, one step of `tokens` tokens: all-reduce payload and ring bytes removed by whole
    rows, host-link bytes of whole rows and of a shard, and the bytes whole rows add.
    `hit_rate` is the hot-row cache's hit rate with whole rows, `shard_hit_rate` with a shard
    (the same HBM covers 1/TP of the table, so it hits more; default: `hit_rate`)."""
    shard_hit = hit_rate if shard_hit_rate is None else shard_hit_rate
    payload = tokens * layers * columns * head_dim * BF16_BYTES
    ring = 2 * (tp - 1) / tp * payload if tp > 1 else 0.0
    raw = tokens * layers * columns * lines_per_row * CACHE_LINE
    whole = raw * (1.0 - hit_rate)
    shard = raw / tp * (1.0 - shard_hit)
    return {"allreduce_payload_bytes": payload, "collective_bytes_removed": ring,
            "host_bytes_whole": whole, "host_bytes_shard": shard, "host_bytes_added": whole - shard}


def compare(*, tokens_by_phase: dict[str, int], layers: int, columns: int, head_dim: int, lines_per_row: float,
            tp: int, host_gbps: float, gpu_gbps: Optional[float], hit_rate: float = 0.0,
            shard_hit_rate: Optional[float] = None) -> dict[str, Any]:
    """Bytes and times per phase and the recommendation ("whole" or "sharded") with its reason;
    hit rates as in `step_bytes`."""
    shard_hit = hit_rate if shard_hit_rate is None else shard_hit_rate
    phases = {}
    for phase, tokens in tokens_by_phase.items():
        b = step_bytes(tokens=tokens, layers=layers, columns=columns, head_dim=head_dim,
                       lines_per_row=lines_per_row, tp=tp, hit_rate=hit_rate, shard_hit_rate=shard_hit)
        added_s = b["host_bytes_added"] / (host_gbps * 1e9)
        removed_s = None
        if tp > 1 and gpu_gbps:
            removed_s = layers * ALLREDUCE_LATENCY_S + b["collective_bytes_removed"] / (gpu_gbps * 1e9)
        phases[phase] = {"tokens": tokens, **{k: int(v) for k, v in b.items()},
                         "host_seconds_added": added_s, "allreduce_seconds_removed": removed_s}
    if tp == 1:
        return {"phases": phases, "recommend": "whole", "reason": "TP 1: one rank holds every row, nothing to sum"}
    if not gpu_gbps:
        return {"phases": phases, "recommend": None,
                "reason": "no GPU-to-GPU link bandwidth for this SKU (configs/gpus.json gpu_link_gbps)"}
    wins = {p: ("whole" if v["host_seconds_added"] <= v["allreduce_seconds_removed"] else "sharded")
            for p, v in phases.items()}
    pick = wins.get("decode", next(iter(wins.values())))
    parts = [f"{p}: +{v['host_seconds_added'] * 1e6:,.0f} us on the host link vs -{v['allreduce_seconds_removed'] * 1e6:,.0f} "
             f"us of all-reduce" for p, v in phases.items()]
    split = "" if len(set(wins.values())) == 1 else f" (phases disagree: {', '.join(f'{p} {w}' for p, w in wins.items())}; decode decides)"
    hits = (f"{hit_rate:.0%} hot-cache hits" if shard_hit == hit_rate else
            f"hot-cache hits {hit_rate:.0%} whole, {shard_hit:.0%} sharded")
    reason = (f"{'; '.join(parts)} per step at peak, TP{tp}, {hits}{split}; "
              f"host reads overlap the layers before each Engram layer, the all-reduce does not")
    return {"phases": phases, "recommend": pick, "reason": reason}


def layout_hit_rates(cache_share: float, tp: int, curve: Optional[Callable[[float], float]] = None) -> dict[str, float]:
    """Hot-row cache hit rates of the two layouts at the same HBM per GPU, a cache of
    `cache_share` of a layer's rows: whole rows spread it over the whole table, a shard over
    its 1/TP (the cache then holds TP x the share of the rows its rank reads). `curve` maps a
    cached share to a hit rate: a trace replay's, else planning/disk.py's default (measured on
    real code text, an assumption for other text)."""
    if curve is None:
        from .disk import default_hit_rate as curve
    return {"whole": curve(cache_share), "sharded": curve(min(1.0, cache_share * tp))}


def sku_for_device(device_name: str, gpus: dict) -> Optional[Any]:
    """The configs/gpus.json SKU a device name (torch.cuda.get_device_name) names: the SKU key
    as a word of it ("NVIDIA H200" -> H200; "NVIDIA GB200" is GB200, not B200). The file's
    SKUs are NVLink/xGMI servers: a PCIe card (no GPU-to-GPU link of theirs) matches none."""
    if "pcie" in device_name.lower():
        return None
    for key, sku in gpus.items():
        if re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", device_name.lower()):
            return sku
    return None


def replay_hits(steps, directory, shard=None, warm_steps: int = 0, maintain_every: int = 8) -> float:
    """Hit rate of a hot-row cache's RowDirectory (`directory`, cold) over one layer's ids per
    decode step (`steps`: [steps, ...] ids), maintained every `maintain_every` steps as the
    store does: with `shard` (one (lo, hi), or a list of ranges: a balanced shard) only that
    rank's ids reach it, the others look up as -1
    as HotRowCache's do, and the rate is over the shard's reads; the first `warm_steps` steps
    only warm it."""
    import torch

    from ..shards import as_ranges

    hits = reads = 0
    for s, ids in enumerate(steps):
        flat = torch.as_tensor(ids).reshape(-1)
        n = flat.numel()
        if shard is not None:
            mine = torch.zeros_like(flat, dtype=torch.bool)
            for lo, hi in as_ranges(shard):
                mine |= (flat >= lo) & (flat < hi)
            flat = torch.where(mine, flat, -1)
            n = int(mine.sum())
        hit, _ = directory.lookup(flat)
        if s >= warm_steps:
            hits += int(hit.sum())
            reads += n
        if (s + 1) % maintain_every == 0:
            directory.maintain()
    return hits / max(1, reads)


def traced_layout_hit_rates(trace: dict, rows: dict, hot_bytes: int, tp: int, batch: int,
                            warm_steps: Optional[int] = None, bounds: Optional[dict] = None) -> dict[str, float]:
    """Each layout's hit rate on a `profile --trace` (layer id -> ids [steps, streams,
    columns], the first `batch` streams), a hot-row cache of `hot_bytes` per GPU split over
    the layers by rows as HotRowCache splits it and sized as it sizes itself: whole rows, one
    directory per layer over every id; sharded, over rank 0's shard of each layer (its
    balanced shard, `column_shards`, where `bounds` gives each layer's column bounds, as the
    stores serve; else the contiguous `shard_range`). Reads of all layers together; the
    first half of the steps warm the caches unless `warm_steps`."""
    from ..shards import column_shards, ranges_rows
    from ..stores.base import shard_range, split_by_rows
    from .disk import _hot_cache

    share = split_by_rows(hot_bytes, rows)
    out = {}
    for layout in ("whole", "sharded"):
        hits = reads = 0.0
        for L, ids in trace.items():
            if L not in rows:
                continue
            steps = ids[:, :batch]
            warm = steps.shape[0] // 2 if warm_steps is None else warm_steps
            shard = None
            if layout == "sharded":
                shard = column_shards(bounds[L], 0, tp) if bounds is not None else [shard_range(rows[L], 0, tp)]
            held = rows[L] if shard is None else ranges_rows(shard)
            counted = steps[warm:]
            n = counted.size if shard is None else sum(int(((counted >= lo) & (counted < hi)).sum()) for lo, hi in shard)
            reads += n
            directory = _hot_cache(held, share[L])
            if directory is not None:  # None: too small a cache for one set, no hits
                hits += replay_hits(steps, directory, shard, warm) * n
        out[layout] = hits / reads if reads else 0.0
    return out
