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

from typing import Any, Optional

# One all-reduce's fixed cost inside an NVLink/xGMI island (launch + synchronization of a
# small message). Assumption: NCCL's all-reduce latency within one node is ~10 us for small
# messages (nccl-tests, 8 GPUs); measure with nccl-tests' all_reduce_perf on the server.
ALLREDUCE_LATENCY_S = 10e-6
BF16_BYTES = 2
CACHE_LINE = 64


def step_bytes(*, tokens: int, layers: int, columns: int, head_dim: int, lines_per_row: float, tp: int,
               hit_rate: float = 0.0) -> dict[str, float]:
    """Per GPU, one step of `tokens` tokens: all-reduce payload and ring bytes removed by whole
    rows, host-link bytes of whole rows and of a shard, and the bytes whole rows add."""
    payload = tokens * layers * columns * head_dim * BF16_BYTES
    ring = 2 * (tp - 1) / tp * payload if tp > 1 else 0.0
    whole = tokens * layers * columns * lines_per_row * CACHE_LINE * (1.0 - hit_rate)
    shard = whole / tp
    return {"allreduce_payload_bytes": payload, "collective_bytes_removed": ring,
            "host_bytes_whole": whole, "host_bytes_shard": shard, "host_bytes_added": whole - shard}


def compare(*, tokens_by_phase: dict[str, int], layers: int, columns: int, head_dim: int, lines_per_row: float,
            tp: int, host_gbps: float, gpu_gbps: Optional[float], hit_rate: float = 0.0) -> dict[str, Any]:
    """Bytes and times per phase and the recommendation ("whole" or "sharded") with its reason."""
    phases = {}
    for phase, tokens in tokens_by_phase.items():
        b = step_bytes(tokens=tokens, layers=layers, columns=columns, head_dim=head_dim,
                       lines_per_row=lines_per_row, tp=tp, hit_rate=hit_rate)
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
    reason = (f"{'; '.join(parts)} per step at peak, TP{tp}, {hit_rate:.0%} hot-cache hits{split}; "
              f"host reads overlap the layers before each Engram layer, the all-reduce does not")
    return {"phases": phases, "recommend": pick, "reason": reason}
