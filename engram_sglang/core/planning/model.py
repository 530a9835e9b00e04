"""The planner's model: the capacity arithmetic of one model on one GPU SKU (table bytes, HBM
per placement, smallest TP, host DRAM, /dev/shm, host-link time); `plan()` gives the report dict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

from ..config import PLACEMENTS, EngramConfig
from ..hashing import EngramLayout
from ..placement_table import placement as placement_spec
from ..rowformat import BLOCK
from ..shards import column_shards, ranges_rows
from . import disk as disk_model
from . import whole_rows
from .data import (
    GIB,
    MAX_GIB,
    MAX_KV_BYTES,
    MAX_NUMA_NODES,
    MAX_TOKENS,
    MAX_TP,
    ModelFacts,
    PlannerError,
    bounded,
    gpu_sku,
    load_facts,
)
from .graphs import decode_graphs
from .launch import launch

HOST_LAYOUTS = ("shared", "per_rank")
NUMA_MODES = ("auto", "interleave", "off")  # or a node number: --engram-host-numa (stores/numa.py)

# Batches the host-link estimate is quoted for: a decode step of 256 requests and one
# prefill chunk of 8192 tokens, the shapes docs/measurements.md section 4 measures.
DECODE_BATCH = 256
PREFILL_CHUNK = 8192
CACHE_LINE = 64

# SGLang's docker examples give the server itself --shm-size 32g (NCCL and torch IPC buffers);
# a shared host table in /dev/shm comes on top of that.
SGLANG_SHM_GIB = 32

# SGLang 0.5.23 memory_hook defaults behind its reserve (activations, graphs, NCCL): the
# chunked-prefill size and decode CUDA-graph batch it assumes on a large GPU.
SGLANG_CHUNKED_PREFILL = 8192
SGLANG_DECODE_GRAPH_BS = 256


@dataclasses.dataclass
class PlanInputs:
    model: str
    gpu: str
    tp: Optional[int] = None
    placement: str = "host"
    host_layout: str = "shared"
    hot_cache_gib: float = 0.0
    kv_bytes_per_token: Optional[float] = None
    weights_gib: Optional[float] = None
    reserve_gib: Optional[float] = None
    min_kv_tokens: Optional[int] = None
    host_dram_gib: Optional[float] = None
    host_numa: str = "auto"
    numa_nodes: Optional[int] = None
    numa_dram_gib: Optional[float] = None
    # Disk placement: when SSD pays (planning/disk.py).
    disk_iops: Optional[float] = None
    disk_latency_ms: Optional[float] = None
    measure_disk: Optional[str] = None
    dram_cache_gib: float = 0.0
    trace: Optional[str] = None
    lead_ms: Optional[float] = None
    batch: int = 64
    warm_steps: Optional[int] = None
    step_ms: Optional[float] = None  # the decode step the exposed reads are held against (None: disk.py's default)
    iops_source: Optional[str] = None  # where --disk-iops came from, when not the user (plan --rank's default, a measure)
    # Nodes of the deployment (SGLang's --nnodes): TP may span gpus_per_node x nnodes GPUs.
    nnodes: int = 1


def row_bytes(cfg: EngramConfig) -> int:
    """Bytes of one packed row: head_dim fp8 values + one e8m0 scale per BLOCK values."""
    if cfg.head_dim % BLOCK:
        raise PlannerError(f"{cfg.source}: engram_head_dim {cfg.head_dim} is not a multiple of {BLOCK}")
    return cfg.head_dim + cfg.head_dim // BLOCK


def lines_per_row(rb: int) -> float:
    """Mean 64-byte lines a row touches: rows lie end to end from a page-aligned start, so a
    row's offset within its first line cycles with period 64 / gcd(rb, 64)."""
    period = CACHE_LINE // math.gcd(rb, CACHE_LINE)
    spans = [((k * rb) % CACHE_LINE + rb + CACHE_LINE - 1) // CACHE_LINE for k in range(period)]
    return sum(spans) / period


def shard_bytes(rows: Sequence[int], tp: int, rb: int) -> int:
    """The largest rank's table bytes under row-range sharding (rank r holds a contiguous
    1/TP of every layer's rows, so the largest shard has ceil(rows / TP) rows)."""
    return sum(-(-r // tp) for r in rows) * rb


def rank_bytes(ranges_per_layer: Sequence[Sequence[tuple[int, int]]], rb: int) -> int:
    """One rank's table bytes from the row ranges it holds of each layer (`core/shards.py`:
    [shard_range] or column_shards)."""
    return sum(ranges_rows(ranges) for ranges in ranges_per_layer) * rb


def balanced_shard_bytes(bounds_per_layer: Sequence[Sequence[int]], tp: int, rb: int) -> int:
    """The largest rank's table bytes under balanced shards (`column_shards` of each layer's
    column bounds, `EngramLayout.column_bounds`): ranks hold whole columns, so shards differ
    by up to a column's rows, not by one row as contiguous ones (`shard_bytes`)."""
    return max(rank_bytes([column_shards(b, r, tp) for b in bounds_per_layer], rb) for r in range(tp))


def sglang_reserve_bytes(tp: int, hbm_bytes: int) -> int:
    """SGLang 0.5.23's default non-static reserve (srt/arg_groups/memory_hook.py): 512 MiB +
    1.5 MiB per chunked-prefill token + TP/8 GiB + 2 MiB per decode-graph batch slot, at least
    10 GiB on a GPU over 60 GiB."""
    mib = 512 + 1.5 * max(SGLANG_CHUNKED_PREFILL, 2048) + tp / 8 * 1024 + 2 * SGLANG_DECODE_GRAPH_BS
    if hbm_bytes > 60 * GIB:
        mib = max(mib, 10 * 1024)
    return int(mib * (1 << 20))


def valid_tps(heads: Optional[int], limit: int = 64) -> list[int]:
    """TP sizes the attention layers accept: divisors of the head count (any size when the
    head count is unknown; row-range table shards work at every TP)."""
    if heads is None:
        return list(range(1, limit + 1))
    return [t for t in range(1, heads + 1) if heads % t == 0]


def _check_tp(tp: Any, facts: ModelFacts) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlannerError(f"--tp must be a whole number >= 1, got {tp!r}")
    if tp > MAX_TP:
        raise PlannerError(f"--tp must be at most {MAX_TP}, got {tp}")
    heads = facts.attention_heads
    if heads is not None and heads % tp:
        ok = ", ".join(str(t) for t in valid_tps(heads))
        raise PlannerError(
            f"--tp {tp} does not divide {facts.name}'s {heads} attention heads; valid TP sizes: {ok}"
        )
    return tp


class Planner:
    """Capacity arithmetic for one model on one SKU; `plan()` gives the report dict."""

    def __init__(self, inputs: PlanInputs):
        if inputs.placement not in PLACEMENTS:
            raise PlannerError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {inputs.placement!r}")
        if inputs.host_layout not in HOST_LAYOUTS:
            raise PlannerError(f"--host-layout must be one of {', '.join(HOST_LAYOUTS)}, got {inputs.host_layout!r}")
        for name in ("hot_cache_gib", "weights_gib", "reserve_gib", "host_dram_gib", "numa_dram_gib"):
            if getattr(inputs, name) is not None:
                bounded(getattr(inputs, name), f"--{name.replace('_', '-')}", 0, MAX_GIB)
        if inputs.kv_bytes_per_token is not None:
            bounded(inputs.kv_bytes_per_token, "--kv-bytes-per-token", 1, MAX_KV_BYTES)
        self.inputs = inputs
        self.gpu = gpu_sku(inputs.gpu)
        if inputs.numa_nodes is not None:
            bounded(inputs.numa_nodes, "--numa-nodes", 1, MAX_NUMA_NODES, whole=True)
        mode = str(inputs.host_numa)
        if mode not in NUMA_MODES and not (mode.isdigit() and int(mode) < self.numa_nodes):
            raise PlannerError(f"--host-numa must be auto, interleave, off or a node number below the "
                               f"{self.numa_nodes} NUMA nodes, got {inputs.host_numa!r}")
        self.cfg = EngramConfig.resolve(inputs.model)
        self.rows = EngramLayout(self.cfg).num_embeddings
        self.row_bytes = row_bytes(self.cfg)
        facts = load_facts(self.cfg)
        overrides = {}
        if inputs.kv_bytes_per_token is not None:
            # The operator's figure is what one rank's pool spends per token: taken as is.
            overrides.update(kv_bytes_per_token=float(inputs.kv_bytes_per_token), kv_replicated=True, kv_heads=None,
                             kv_bytes_per_token_elsewhere=None)
            facts.sources["kv_bytes_per_token"] = "--kv-bytes-per-token (per rank)"
        if inputs.weights_gib is not None:
            overrides["weight_bytes"] = int(round(inputs.weights_gib * GIB))
            facts.sources["weight_bytes"] = "--weights-gib"
        self.facts = dataclasses.replace(facts, **overrides)
        bounded(inputs.nnodes, "--nnodes", 1, MAX_TP, whole=True)
        if inputs.tp is not None:
            _check_tp(inputs.tp, self.facts)
            gpus = self.gpu.gpus_per_node * inputs.nnodes
            if inputs.tp > gpus:
                raise PlannerError(f"--tp {inputs.tp} needs more GPUs than {inputs.nnodes} node(s) of "
                                   f"{self.gpu.gpus_per_node} {self.gpu.key} have ({gpus}); pass --nnodes or a smaller --tp")
        if inputs.min_kv_tokens is not None and (
            isinstance(inputs.min_kv_tokens, bool) or not isinstance(inputs.min_kv_tokens, int) or inputs.min_kv_tokens < 0
        ):
            raise PlannerError(f"--min-kv-tokens must be a whole number >= 0, got {inputs.min_kv_tokens!r}")
        if inputs.min_kv_tokens is not None and inputs.min_kv_tokens > MAX_TOKENS:
            raise PlannerError(f"--min-kv-tokens must be at most {MAX_TOKENS} (2^40), got {inputs.min_kv_tokens}")
        disk_model.check_disk_inputs(inputs.disk_iops, inputs.disk_latency_ms, inputs.lead_ms, inputs.batch,
                                     inputs.dram_cache_gib, inputs.step_ms)
        disk_only = (inputs.disk_iops is not None or inputs.measure_disk or inputs.dram_cache_gib
                     or inputs.step_ms is not None)
        if inputs.placement != "disk" and (disk_only or (inputs.trace and inputs.placement != "host")):
            raise PlannerError(f"--disk-iops, --measure-disk, --trace, --dram-cache-gib and --step-ms plan the disk placement; got "
                               f"--placement {inputs.placement} (pass --placement disk; --trace also plans the host "
                               f"placement's whole rows vs shard)")

    # ------------------------------------------------------------------ pieces
    @property
    def table_bytes(self) -> int:
        return sum(self.rows) * self.row_bytes

    @property
    def rows_per_token(self) -> int:
        return self.cfg.n_layers * self.cfg.hash_columns

    def min_kv_tokens(self) -> int:
        if self.inputs.min_kv_tokens is not None:
            return self.inputs.min_kv_tokens
        # One request at the full context must fit, else the server cannot honour its own limit.
        return self.facts.context_length or 0

    def kv_per_rank(self, tp: int) -> Optional[float]:
        kv = self.facts.kv_bytes_per_token
        if kv is None or self.facts.kv_replicated:
            return kv
        kv_heads = self.facts.kv_heads
        if kv_heads:
            # GQA: each rank keeps kv_heads / TP heads, at least one (replicated below that).
            return kv * max(1, kv_heads // tp) / kv_heads
        return kv / tp

    def reserve(self, tp: int) -> int:
        if self.inputs.reserve_gib is not None:
            return int(round(self.inputs.reserve_gib * GIB))
        return sglang_reserve_bytes(tp, self.gpu.hbm_bytes)

    def hbm(self, tp: int, placement: str) -> dict[str, Any]:
        """Per-GPU HBM budget at `tp` with tables in `placement`."""
        w = self.facts.weight_bytes
        weights = None if w is None else -(-w // tp)
        tables = self.shard_bytes(tp) if placement == "device" else 0
        hot = int(round(self.inputs.hot_cache_gib * GIB)) if placement_spec(placement).cache_in_front else 0
        reserve = self.reserve(tp)
        fixed = self.facts.kv_fixed_bytes
        free = None if weights is None else self.gpu.hbm_bytes - weights - tables - hot - reserve - fixed
        kv = self.kv_per_rank(tp)
        tokens = None if free is None or kv is None else max(0, int(free // kv))
        freed = 0 if placement == "device" else self.shard_bytes(tp) - hot
        need = None if kv is None else int(math.ceil(self.min_kv_tokens() * kv))
        fits = None if free is None or need is None else free >= need
        return {
            "hbm_bytes": self.gpu.hbm_bytes,
            "weights_bytes": weights,
            "tables_bytes": tables,
            "hot_cache_bytes": hot,
            "reserve_bytes": reserve,
            "kv_fixed_bytes": fixed,
            "free_for_kv_bytes": free,
            "kv_tokens": tokens,
            "hbm_freed_bytes": freed,
            "kv_tokens_gained": None if kv is None else int(max(0, freed) // kv),
            "min_kv_bytes": need,
            "fits": fits,
        }

    def shard_bytes(self, tp: int) -> int:
        """The largest rank's table bytes at `tp`: balanced shards of each layer's columns, as
        open_store serves them (`balanced_shard_bytes`)."""
        layout = EngramLayout(self.cfg)
        return balanced_shard_bytes([layout.column_bounds(i) for i in range(len(self.cfg.layer_ids))], tp,
                                    self.row_bytes)

    def smallest_tp(self, placement: str) -> Optional[int]:
        for tp in valid_tps(self.facts.attention_heads):
            if self.hbm(tp, placement)["fits"]:
                return tp
        return None

    def host_dram(self, tp: int) -> dict[str, Any]:
        """Host DRAM per node for the host placement, one node filled with replicas."""
        per_node = self.gpu.gpus_per_node
        ranks = min(tp, per_node)
        replicas = per_node // tp if tp <= per_node else 1
        gpus_used = ranks * replicas
        shard = self.shard_bytes(tp)
        return {
            "gpus_per_node": per_node,
            "ranks_per_node": ranks,
            "replicas_per_node": replicas,
            "shared_copies": self.numa(tp, "shared")["copies"],  # one per NUMA node with --engram-host-numa auto
            "shared_bytes": self.numa(tp, "shared")["total_bytes"],
            "per_rank_bytes": shard * gpus_used,
            "per_rank_each_bytes": shard,
        }

    @property
    def numa_nodes(self) -> int:
        return self.inputs.numa_nodes or self.gpu.numa_nodes

    def numa(self, tp: int, layout: Optional[str] = None) -> dict[str, Any]:
        """The host tables over the server's NUMA nodes, by stores/numa.py's rule for
        `--engram-host-numa`: auto puts the shared copy on every node whose DRAM holds it (each
        rank maps its GPU's node's copy), else one copy interleaved over all nodes; a private
        copy (per-rank layout) goes to its rank's node."""
        inp, nodes = self.inputs, self.numa_nodes
        dram = (int(round(inp.numa_dram_gib * GIB)) if inp.numa_dram_gib is not None
                else self.gpu.dram_per_numa_node_bytes)
        mode = str(inp.host_numa)
        shared = (layout or inp.host_layout) == "shared"
        one = self.table_bytes if shared else self._all_shards(tp)  # the copy, or every rank's private shard
        copies, per_node = 1, one
        spread = -(-one // nodes)
        if mode == "auto" and nodes > 1 and (dram is None or (one if shared else spread) <= dram):
            layout = "one copy per node" if shared else "each rank's shard on its GPU's node"
            copies, per_node = (nodes, one) if shared else (1, spread)
        elif mode in ("auto", "interleave") and nodes > 1:
            layout = "interleaved over all nodes" + (" (auto: a node's DRAM cannot hold a copy)" if mode == "auto" else "")
            per_node = spread
        elif mode.isdigit():
            layout = f"bound to node {mode}"
        elif nodes == 1:
            layout = "one node"
        else:
            layout = "not bound (first touch: up to all of it on the filling rank's node)"
        return {
            "nodes": nodes,
            "dram_per_node_bytes": dram,
            "mode": mode,
            "layout": layout,
            "copies": copies,
            "copy_bytes": one,
            "per_node_bytes": per_node,
            "total_bytes": copies * one,
            "fits": None if dram is None else per_node <= dram,
        }

    def _all_shards(self, tp: int) -> int:
        """Every rank's private shard on one server (per-rank layout)."""
        return self.host_dram(tp)["per_rank_bytes"]

    def dev_shm(self, copies: int = 1) -> dict[str, Any]:
        need = self.table_bytes * copies if self.inputs.placement == "host" and self.inputs.host_layout == "shared" else 0
        size_g = math.ceil(need / GIB) + SGLANG_SHM_GIB
        return {
            "needed_bytes": need,
            "docker_shm_size": f"{size_g}g",
            "docker_flags": f"--shm-size={size_g}g (or --ipc=host)",
        }

    def host_link(self, tp: int) -> dict[str, Any]:
        lines = lines_per_row(self.row_bytes)
        per_token = self.rows_per_token * lines * CACHE_LINE
        # Shared layout: every rank maps all rows and gathers every row of its tokens; per-rank
        # layout: a rank gathers only the rows of its own shard (~1/TP), then all-reduces.
        share = 1.0 if self.inputs.host_layout == "shared" else 1.0 / tp
        gbps = self.gpu.host_link_gbps
        decode = DECODE_BATCH * per_token * share
        prefill = PREFILL_CHUNK * per_token * share
        return {
            "link": self.gpu.host_link,
            "peak_gbps": gbps,
            "lines_per_row": lines,
            "bytes_per_token": per_token,
            "decode_batch": DECODE_BATCH,
            "decode_step_bytes": int(decode),
            "decode_step_us_at_peak": decode / (gbps * 1e9) * 1e6,
            "prefill_chunk": PREFILL_CHUNK,
            "prefill_chunk_bytes": int(prefill),
            "prefill_chunk_ms_at_peak": prefill / (gbps * 1e9) * 1e3,
        }

    def rows_per_rank(self, tp: int) -> dict[str, Any]:
        """Host placement with one shared copy per node: whole rows per rank (no all-reduce,
        TP-fold host-link bytes) or a shard + all-reduce, per step (planning/whole_rows.py), with
        the hot-row cache (--cache-gib) at each layout's hit rate: the same HBM covers a 1/TP
        shard 1/TP as thinly, so a shard's cache hits more."""
        inp = self.inputs
        hot = int(round(inp.hot_cache_gib * GIB))
        if not hot or tp == 1:
            rates, source = {"whole": 0.0, "sharded": 0.0}, "no hot-row cache" if not hot else "TP 1: one layout"
        elif inp.trace is not None:
            trace, _ = disk_model.read_trace(inp.trace, self.cfg.fingerprint())
            layout = EngramLayout(self.cfg)
            bounds = {L: layout.column_bounds(i) for i, L in enumerate(self.cfg.layer_ids)}
            rates = whole_rows.traced_layout_hit_rates(trace, dict(zip(self.cfg.layer_ids, self.rows)), hot, tp,
                                                       inp.batch, inp.warm_steps, bounds=bounds)
            source = (f"replay of {inp.trace} (first {inp.batch} streams) through the hot-row cache's RowDirectory: "
                      f"whole rows over every id, a shard over rank 0's")
        else:
            rates = whole_rows.layout_hit_rates(hot / self.table_bytes, tp)
            source = ("assumption (no --trace): planning/disk.py's default curve, whole rows at the cache's share of "
                      "the table, a shard at TP x that share")
        out = whole_rows.compare(
            tokens_by_phase={"decode": DECODE_BATCH, "prefill": PREFILL_CHUNK}, layers=self.cfg.n_layers,
            columns=self.cfg.hash_columns, head_dim=self.cfg.head_dim, lines_per_row=lines_per_row(self.row_bytes),
            tp=tp, host_gbps=self.gpu.host_link_gbps, gpu_gbps=self.gpu.gpu_link_gbps, hit_rate=rates["whole"],
            shard_hit_rate=rates["sharded"])
        out["hit_rates"], out["hit_rate_source"] = rates, source
        out["gpu_link"] = self.gpu.gpu_link
        out["gpu_link_gbps"] = self.gpu.gpu_link_gbps
        return out

    def assumptions(self, tp: int) -> list[str]:
        f = self.facts
        out = [
            f"table rows from the config's prime layout; {self.row_bytes} B per packed row "
            f"({self.cfg.head_dim} fp8 + {self.cfg.head_dim // BLOCK} e8m0 scales)",
            "balanced TP shards (core/shards.py column_shards, what the stores serve): the largest rank's rows of "
            "every layer, within a few rows of rows/TP",
            f"HBM per GPU: driver-reported capacity ({self.gpu.name}, configs/gpus.json)",
        ]
        if f.weight_bytes is not None:
            out.append(
                f"non-Engram weights {f.weight_bytes / GIB:.2f} GiB split evenly over TP "
                f"(replicated pieces such as norms add a little): {f.sources.get('weight_bytes', '?')}"
            )
        else:
            out.append("non-Engram weight bytes unknown: pass --weights-gib to get KV room and the smallest TP")
        if f.kv_bytes_per_token is not None:
            where = "per rank, whatever the TP" if f.kv_replicated else "split over TP by KV head"
            out.append(
                f"KV cache {f.kv_bytes_per_token:g} B per token ({where}): {f.sources.get('kv_bytes_per_token', '?')}"
            )
            if f.kv_fixed_bytes:
                out.append(f"KV pools of fixed size {f.kv_fixed_bytes / GIB:.2f} GiB per rank, taken before KV tokens "
                           f"are counted: {f.sources.get('kv_fixed_bytes_per_rank', '?')}")
            other = f.kv_bytes_per_token_elsewhere
            if other is not None and max(other, f.kv_bytes_per_token) > 2 * min(other, f.kv_bytes_per_token):
                out.append(f"another engine's figure differs {max(other, f.kv_bytes_per_token) / min(other, f.kv_bytes_per_token):.1f}x "
                           f"({other:g} B per token: {f.sources.get('kv_bytes_per_token_elsewhere', '?')}); the plan uses "
                           f"{f.kv_bytes_per_token:g} B, the engine it plans for (pass --kv-bytes-per-token for your server's)")
        else:
            out.append("KV bytes per token unknown: pass --kv-bytes-per-token")
        if self.inputs.reserve_gib is None:
            out.append(
                f"runtime reserve {self.reserve(tp) / GIB:.2f} GiB per GPU: SGLang 0.5.23's default rule "
                f"(chunked prefill {SGLANG_CHUNKED_PREFILL}, decode graphs to batch {SGLANG_DECODE_GRAPH_BS}); "
                "--reserve-gib overrides"
            )
        out.append(
            f"'fits' means room for at least {self.min_kv_tokens():,} KV tokens "
            "(one request at the full context; --min-kv-tokens overrides)"
        )
        if f.attention_heads is not None:
            out.append(f"TP must divide the {f.attention_heads} attention heads ({f.sources.get('num_attention_heads', '?')})")
        out.append(
            f"/dev/shm: a shared host table is one {self.table_bytes / GIB:.2f} GiB copy per server (per NUMA node with "
            f"--engram-host-numa auto) in /dev/shm, plus the {SGLANG_SHM_GIB} GiB SGLang's docker examples give the "
            f"server; per-rank tables use anonymous memory"
        )
        dram = self.numa(tp)["dram_per_node_bytes"]
        source = ("--numa-nodes/--numa-dram-gib" if self.inputs.numa_nodes or self.inputs.numa_dram_gib is not None
                  else f"configs/gpus.json: {self.gpu.dram_source or 'no source'}")
        out.append(
            f"NUMA: {self.numa_nodes} node{'s' if self.numa_nodes != 1 else ''} of "
            f"{'unknown DRAM' if dram is None else f'{dram / GIB:.0f} GiB'} each ({source}), GPUs spread evenly over "
            f"them; at start-up auto compares a copy with the node's free memory, not its DRAM"
        )
        out.append(
            f"host link times are at the link's peak ({self.gpu.host_link_gbps:g} GB/s per direction) for "
            f"{lines_per_row(self.row_bytes):g} 64-byte lines per row; measure with bench/tiers.py"
        )
        out.append(
            f"whole rows vs shard: a ring all-reduce of bf16 rows sends 2(TP-1)/TP of them per GPU at the GPU link's "
            f"peak ({self.gpu.gpu_link or 'unknown'}, {self.gpu.gpu_link_gbps or 0:g} GB/s per direction, "
            f"configs/gpus.json) plus {whole_rows.ALLREDUCE_LATENCY_S * 1e6:g} us per all-reduce (assumption); "
            f"a hot-row cache (--cache-gib) hits per layout as --trace replays (whole rows over every id, a shard over "
            f"rank 0's), else as planning/disk.py's default curve at the cache's share of the table (whole) and TP x it "
            f"(sharded), an assumption; measured trade-off in bench/whole_rows.py"
        )
        return out

    def disk(self, tp: int, per: dict[str, dict], smallest: dict[str, Optional[int]]) -> dict[str, Any]:
        """The disk placement's decode step (planning/disk.py) and what it saves: HBM, KV and
        GPUs against device placement, host DRAM against host placement."""
        inp = self.inputs
        trace = None
        if inp.trace is not None:
            trace, _ = disk_model.read_trace(inp.trace, self.cfg.fingerprint())
        if inp.measure_disk:
            measured = disk_model.measure_disk(inp.measure_disk)
            iops, iops_src = measured["iops"], f"measured on {inp.measure_disk} by {measured['tool']}"
            latency = measured["latency_ms"] if inp.disk_latency_ms is None else inp.disk_latency_ms
            lat_src = iops_src if inp.disk_latency_ms is None else "--disk-latency-ms"
        else:
            iops, iops_src = float(inp.disk_iops), inp.iops_source or "--disk-iops"
            latency = disk_model.DEFAULT_LATENCY_MS if inp.disk_latency_ms is None else inp.disk_latency_ms
            lat_src = ("assumption: one 4 KiB random read on a datacenter NVMe SSD at low queue depth; "
                       "--disk-latency-ms or --measure-disk sets it") if inp.disk_latency_ms is None else "--disk-latency-ms"
        if inp.lead_ms is not None:
            lead, lead_src = inp.lead_ms, "--lead-ms"
        elif self.facts.decode_lead_ms is not None:
            lead, lead_src = self.facts.decode_lead_ms, self.facts.sources.get("decode_lead_ms", "model facts")
        else:
            lead, lead_src = 0.0, "unknown for this model: 0 (nothing hidden); pass --lead-ms"
        if inp.step_ms is not None:
            step_ms, step_src = float(inp.step_ms), "--step-ms"
        else:
            step_ms, step_src = disk_model.DEFAULT_STEP_MS, ("assumption: a DeepSeek-V4.1-Flash decode step at batch 64 "
                                                           "on Hopper-class GPUs, not measured; --step-ms sets it")
        hot = per["disk"]["hot_cache_bytes"]
        dram = int(round(inp.dram_cache_gib * GIB))
        # A rank reads its own row-range shard of every layer, with its own caches: by the
        # shard sampling argument (bench/cache.py) its hit rate is the whole table's at TP x
        # its cache, so the whole trace is replayed with the caches of all TP ranks together.
        step = disk_model.predict(layers=self.cfg.layer_ids, rows=self.rows, columns=self.cfg.hash_columns,
                                  batch=inp.batch, iops=iops, latency_ms=latency, lead_ms=lead, dram_bytes=dram * tp,
                                  hot_bytes=hot * tp, trace=trace, warm_steps=inp.warm_steps)
        # The same step at other DRAM cache sizes (per rank): where a bigger cache stops paying.
        sizes = sorted({0.0, *(inp.dram_cache_gib * k for k in (0.25, 0.5, 1, 2, 4))} if inp.dram_cache_gib
                       else {0.0, 1.0, 4.0, 16.0, 64.0})
        sweep = disk_model.curve(self.cfg.layer_ids, self.rows, self.cfg.hash_columns, inp.batch,
                                 [g * tp for g in sizes], hot * tp, trace, inp.warm_steps)
        for g, c in zip(sizes, sweep):
            c["dram_cache_gib"] = g
            c["exposed_ms_prefetch"] = max(0.0, disk_model.read_time_ms(c["misses_per_step"], iops, latency) - lead)
        dram_node = self.host_dram(tp)
        ranks = dram_node["ranks_per_node"] * dram_node["replicas_per_node"]
        # The baseline is the host placement's least DRAM: one shared copy per node (not one per NUMA node).
        host_bytes = self.table_bytes
        disk_dram = dram * ranks
        gpus = {p: (None if smallest[p] is None else smallest[p]) for p in ("device", "disk")}
        return {
            "iops": iops, "iops_source": iops_src, "latency_ms": latency, "latency_source": lat_src,
            "lead_ms": lead, "lead_source": lead_src, "batch": inp.batch,
            "dram_cache_bytes_per_rank": dram, "hot_cache_bytes_per_rank": hot,
            "step": step,
            # The exposed reads against the step they slow: within budget, a disk layout may rank.
            "step_ms": step_ms, "step_source": step_src, "budget_ms": disk_model.step_budget_ms(step_ms),
            "within_budget": step["exposed_ms_prefetch"] <= disk_model.step_budget_ms(step_ms),
            "by_dram_cache": sweep,
            "curve_source": (f"replay of {inp.trace} through RowDirectory (hot-row cache) and DramRowCache "
                             f"(the stores' classes), first {step['per_layer'][str(self.cfg.layer_ids[0])].get('warm_steps')} "
                             f"steps warming" if trace is not None else
                             "assumption (no --trace): a row cache of a share of the rows hits as the store's policy "
                             "did on real code text (bench/cache.py: 0.1% 22.7%, 1% 42.3%, 10% 63.9%; 100% holding every row; "
                             f"log-interpolated), hot-row and DRAM caches as one; {disk_model.DEFAULT_UNIQUE:.0%} of a "
                             "step's ids distinct"),
            "vs_device": {
                "hbm_freed_bytes_per_gpu": per["disk"]["hbm_freed_bytes"],
                "kv_tokens_gained_per_gpu": per["disk"]["kv_tokens_gained"],
                "smallest_tp": gpus,
                "gpus_saved_per_replica": (None if None in gpus.values() else gpus["device"] - gpus["disk"]),
            },
            "vs_host": {
                "host_dram_bytes_per_node": host_bytes,
                "disk_dram_cache_bytes_per_node": disk_dram,
                "dram_saved_bytes_per_node": host_bytes - disk_dram,
                "ranks_per_node": ranks,
            },
        }

    # ------------------------------------------------------------------ report
    def plan(self) -> dict[str, Any]:
        inp = self.inputs
        smallest = {p: self.smallest_tp(p) for p in PLACEMENTS}
        tp = inp.tp if inp.tp is not None else smallest[inp.placement]
        warnings: list[str] = []
        if tp is None:
            if self.facts.weight_bytes is None or self.facts.kv_bytes_per_token is None:
                raise PlannerError(
                    f"{self.facts.name}: cannot pick a TP without its weight and KV sizes; "
                    "pass --tp (and --weights-gib / --kv-bytes-per-token for the HBM budget)"
                )
            raise PlannerError(
                f"{self.facts.name} does not fit on {self.gpu.key} with tables in {inp.placement} "
                f"at any TP up to {valid_tps(self.facts.attention_heads)[-1]}"
            )
        per = {p: self.hbm(tp, p) for p in PLACEMENTS}
        chosen = per[inp.placement]
        if chosen["fits"] is False:
            warnings.append(
                f"TP{tp} with tables in {inp.placement} does not fit on {self.gpu.key}: "
                f"{(chosen['free_for_kv_bytes'] or 0) / GIB:.2f} GiB left for KV, need "
                f"{chosen['min_kv_bytes'] / GIB:.2f} GiB; smallest TP that fits: {smallest[inp.placement]}"
            )
        dram = self.host_dram(tp)
        numa = self.numa(tp)
        if numa["fits"] is False and inp.placement == "host":
            warnings.append(
                f"host tables put {numa['per_node_bytes'] / GIB:.2f} GiB on a NUMA node ({numa['layout']}), more than "
                f"its {numa['dram_per_node_bytes'] / GIB:.2f} GiB of DRAM (--numa-dram-gib sets it)"
            )
        if inp.host_dram_gib is not None and inp.placement == "host":
            need = dram["shared_bytes"] if inp.host_layout == "shared" else dram["per_rank_bytes"]
            if need > inp.host_dram_gib * GIB:
                warnings.append(
                    f"host tables need {need / GIB:.2f} GiB of DRAM per node ({inp.host_layout} layout), "
                    f"more than the {inp.host_dram_gib:g} GiB given"
                )
        shard = self.shard_bytes(tp)
        return {
            "model": {
                "name": self.facts.name,
                "config": self.cfg.source,
                "model_type": self.facts.model_type,
                "engram_layers": list(self.cfg.layer_ids),
                "rows_per_layer": list(self.rows),
                "row_bytes": self.row_bytes,
                "attention_heads": self.facts.attention_heads,
                "context_length": self.facts.context_length,
                "weight_bytes": self.facts.weight_bytes,
                "kv_bytes_per_token": self.facts.kv_bytes_per_token,
                "kv_replicated_across_tp": self.facts.kv_replicated,
                "sources": dict(sorted(self.facts.sources.items())),
            },
            "gpu": dataclasses.asdict(self.gpu),
            "tp": tp,
            "placement": inp.placement,
            "host_layout": inp.host_layout,
            "tables": {
                "total_bytes": self.table_bytes,
                "total_gib": round(self.table_bytes / GIB, 2),
                "per_rank_bytes": shard,
                "per_rank_gib": round(shard / GIB, 2),
            },
            "hbm_per_gpu": per,
            "hbm_freed_bytes": chosen["hbm_freed_bytes"],
            "kv_tokens_gained": chosen["kv_tokens_gained"],
            "smallest_tp": smallest,
            "host_dram_per_node": dram,
            "numa": numa,
            "dev_shm": self.dev_shm(dram["shared_copies"]),
            "disk_bytes_per_node": self.table_bytes if inp.placement == "disk" else 0,
            "host_link": self.host_link(tp),
            "rows_per_rank": self.rows_per_rank(tp),
            "decode_graphs": {p: decode_graphs(self.facts.model_type, p) for p in PLACEMENTS},
            # The disk's decode step needs its IOPS; a capacity-only plan leaves it out (the report says so).
            "disk": self.disk(tp, per, smallest) if inp.placement == "disk" and (
                inp.disk_iops is not None or inp.measure_disk) else None,
            "assumptions": self.assumptions(tp),
            "warnings": warnings,
            "nnodes": inp.nnodes,
            "hot_cache_gib": inp.hot_cache_gib,
        }


def plan(**kwargs: Any) -> dict[str, Any]:
    """The plan as a dict (what `--json` prints); keyword arguments are PlanInputs fields."""
    result = Planner(PlanInputs(**kwargs)).plan()
    result["launch"] = launch(result, result["nnodes"])
    return result

