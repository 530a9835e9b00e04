"""Capacity planner: what Engram tables cost in HBM, host DRAM and /dev/shm, and what moving
them off HBM buys, for a model on a GPU SKU at a tensor-parallel size.

`engram-sglang plan --model CONFIG_OR_PRESET --gpu SKU [--tp N] [--placement P] [--json]`

Sources of every figure:
* table bytes: the model's Engram config (rows per layer from the prime layout, packed rows of
  `head_dim` fp8 bytes + one e8m0 scale byte per 32 values: 264 B for DeepSeek-V4.1);
* GPU SKUs: `configs/gpus.json` (driver-reported HBM, host link, vendor, arch);
* model serving facts the config does not carry (non-Engram weight bytes, KV bytes per token,
  attention heads, context length): `configs/models/<model_type>.json`, each with its source;
  a config.json with standard attention fields gives KV bytes and heads by itself;
* runtime reserve: SGLang 0.5.23's own default rule (srt/arg_groups/memory_hook.py).
Every assumption is printed with the plan (and is in `--json` under "assumptions").

The planner lives in `engram_sglang.core.planning` (data: SKUs and model facts; model: the
capacity arithmetic; report: the text); this module is its command line and re-exports
its names.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ..core.errors import EngramError
from ..core.placement_table import PLACEMENT_TABLE, PLACEMENTS
from ..core.planning import disk as disk_model
from ..core.planning import layouts, node_pages
from ..core.planning.data import (
    GIB,
    MAX_GIB,
    MAX_HEADS,
    MAX_KV_BYTES,
    MAX_TOKENS,
    MAX_TP,
    GpuSku,
    ModelFacts,
    PlannerError,
    bounded,
    gpu_sku,
    gpus_file,
    load_facts,
    load_gpus,
)
from ..core.planning.model import (
    CACHE_LINE,
    DECODE_BATCH,
    HOST_LAYOUTS,
    NUMA_MODES,
    PREFILL_CHUNK,
    SGLANG_CHUNKED_PREFILL,
    SGLANG_DECODE_GRAPH_BS,
    SGLANG_SHM_GIB,
    PlanInputs,
    Planner,
    lines_per_row,
    plan,
    row_bytes,
    sglang_reserve_bytes,
    shard_bytes,
    valid_tps,
)
from .planner_report import format_text

# The planning package's names, re-exported, and this module's command line.
__all__ = [
    "GIB",
    "MAX_GIB",
    "MAX_HEADS",
    "MAX_KV_BYTES",
    "MAX_TOKENS",
    "MAX_TP",
    "GpuSku",
    "ModelFacts",
    "PlannerError",
    "bounded",
    "gpu_sku",
    "gpus_file",
    "load_facts",
    "load_gpus",
    "CACHE_LINE",
    "DECODE_BATCH",
    "HOST_LAYOUTS",
    "NUMA_MODES",
    "PLACEMENTS",
    "PREFILL_CHUNK",
    "SGLANG_CHUNKED_PREFILL",
    "SGLANG_DECODE_GRAPH_BS",
    "SGLANG_SHM_GIB",
    "Planner",
    "PlanInputs",
    "lines_per_row",
    "plan",
    "row_bytes",
    "shard_bytes",
    "sglang_reserve_bytes",
    "valid_tps",
    "format_text",
    "add_parser",
    "cmd_plan",
    "main",
]


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; its handler is `cmd_plan`
    (also set as the parser's `func` default)."""
    p = subparsers.add_parser(
        "plan",
        help="plan capacity: table bytes, HBM freed, KV gained, smallest TP, host DRAM, /dev/shm",
        description=(
            "Capacity plan for serving a model's Engram tables on a GPU SKU: table bytes in total "
            "and per rank, HBM freed and KV tokens gained by moving them off HBM, the smallest TP "
            "that fits per placement, host DRAM per node and /dev/shm needed."
        ),
    )
    _add_arguments(p)
    p.set_defaults(func=cmd_plan)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="CONFIG_OR_PRESET",
                   help="preset name (e.g. deepseek-v4.1-flash), a config.json or a model directory")
    p.add_argument("--gpu", required=True, metavar="SKU",
                   help="GPU SKU from configs/gpus.json (H100, H200, B200, B300, GB200, MI300X, MI355X)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: the smallest that fits with the chosen placement)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the deployment spans (SGLang's --nnodes); --tp may be at most GPUs per node x this (default 1)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="where the tables live: " + "; ".join(f"{p.name}, {p.what}" for p in PLACEMENT_TABLE.values())
                   + " (default: host)")
    p.add_argument("--host-layout", choices=HOST_LAYOUTS, default="shared",
                   help="host placement: one copy per node in /dev/shm, or a shard per rank (default: shared)")
    p.add_argument("--hot-cache-gib", "--cache-gib", type=float, default=0.0,
                   help="HBM per GPU given to the hot-row cache with host/disk placement (default: 0)")
    p.add_argument("--kv-bytes-per-token", type=float, default=None,
                   help="override the model's KV cache bytes per token (per rank)")
    p.add_argument("--weights-gib", type=float, default=None,
                   help="override the model's non-Engram weight size (GiB, whole model)")
    p.add_argument("--reserve-gib", type=float, default=None,
                   help="override the runtime reserve per GPU (default: SGLang's own rule)")
    p.add_argument("--min-kv-tokens", type=int, default=None,
                   help="KV tokens a placement must leave room for to 'fit' (default: the context length)")
    p.add_argument("--host-dram-gib", type=float, default=None,
                   help="host DRAM per node; warns when host tables need more")
    p.add_argument("--host-numa", default="auto", metavar="auto|interleave|off|N",
                   help="host placement: --engram-host-numa (default auto: one shared copy per NUMA node whose DRAM "
                        "holds it, else one interleaved copy)")
    p.add_argument("--numa-nodes", type=int, default=None,
                   help="NUMA nodes with CPUs per server (default: the SKU's usual host, configs/gpus.json)")
    p.add_argument("--numa-dram-gib", type=float, default=None,
                   help="DRAM per NUMA node in GiB (default: the SKU's usual host, configs/gpus.json)")
    d = p.add_argument_group("disk placement (--placement disk): the exposed read time per decode step")
    d.add_argument("--disk-iops", type=float, default=None,
                   help="4 KiB random-read IOPS at queue depth 64 the disk gives one replica (a server's disks shared by its "
                        "replicas; or --measure-disk; default: an assumed datacenter NVMe, 1,000,000, labelled)")
    d.add_argument("--measure-disk", default=None, metavar="PATH",
                   help="measure IOPS and one read's latency on the disk holding this file (fio, else the project's "
                        "own O_DIRECT reads)")
    d.add_argument("--disk-latency-ms", type=float, default=None,
                   help=f"one random read's latency (default: measured, else {disk_model.DEFAULT_LATENCY_MS} ms, an assumption)")
    d.add_argument("--dram-cache-gib", type=float, default=0.0,
                   help="DRAM row cache per rank, all layers (--engram-disk-dram-cache-mib / 1024; default 0)")
    d.add_argument("--trace", default=None, metavar="FILE",
                   help="an engram-sglang profile --trace file, replayed through the caches for the hit rate "
                        "(default: an assumed curve, labelled); with --placement host and --cache-gib, each "
                        "layout's hot-row cache hit rate for whole rows vs shard")
    d.add_argument("--lead-ms", type=float, default=None,
                   help="a decode step's time before the first Engram layer, which prefetched reads hide behind "
                        "(default: the model's facts, labelled)")
    d.add_argument("--batch", type=int, default=64, help="decode batch (requests per step; default 64)")
    d.add_argument("--warm-steps", type=int, default=None,
                   help="trace steps that only warm the caches (default: the first half)")
    d.add_argument("--step-ms", type=float, default=None,
                   help=f"a decode step's time, which the exposed reads are held against: a disk layout ranks only "
                        f"while they stay within {disk_model.STEP_BUDGET_SHARE * 100:g}%% of it (default "
                        f"{disk_model.DEFAULT_STEP_MS:g} ms, an assumption)")
    p.add_argument("--rank", action="store_true",
                   help="rank the node's layouts (TP x DP, placement, host layout; disk at "
                        f"{disk_model.DEFAULT_IOPS:,.0f} IOPS unless --disk-iops or --measure-disk) and print the best's "
                        "launch line; --tp and --placement narrow it to that TP or placement")
    p.add_argument("--node-settings", action="store_true",
                   help="with --rank: read this node's huge-page settings (THP enabled and shmem_enabled, the "
                        "--shm-dir mount's huge=, free hugetlbfs pages) for the pages column and recommend a choice")
    p.add_argument("--shm-dir", default=node_pages.DEFAULT_SHM_DIR, metavar="DIR",
                   help="with --node-settings: the server's --engram-shm-dir (default /dev/shm)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(args: argparse.Namespace) -> int:
    """Handler of `engram-sglang plan`: prints the plan; one-line error and exit code 2 on bad input."""
    if getattr(args, "rank", False):
        return _cmd_rank(args)
    if getattr(args, "node_settings", False) or getattr(args, "shm_dir", node_pages.DEFAULT_SHM_DIR) != node_pages.DEFAULT_SHM_DIR:
        print("engram-sglang plan: error: --node-settings and --shm-dir go with --rank", file=sys.stderr)
        return 2
    # A disk plan without --disk-iops or --measure-disk uses the assumed NVMe, labelled, as --rank does.
    disk_default = args.placement == "disk" and args.disk_iops is None and not args.measure_disk
    try:
        result = plan(
            model=args.model,
            gpu=args.gpu,
            tp=args.tp,
            placement=args.placement or "host",
            host_layout=args.host_layout,
            hot_cache_gib=args.hot_cache_gib,
            kv_bytes_per_token=args.kv_bytes_per_token,
            weights_gib=args.weights_gib,
            reserve_gib=args.reserve_gib,
            min_kv_tokens=args.min_kv_tokens,
            host_dram_gib=args.host_dram_gib,
            host_numa=args.host_numa,
            numa_nodes=args.numa_nodes,
            numa_dram_gib=args.numa_dram_gib,
            disk_iops=layouts.DEFAULT_DISK["disk_iops"] if disk_default else args.disk_iops,
            iops_source=layouts.DEFAULT_DISK["iops_source"] if disk_default else None,
            disk_latency_ms=args.disk_latency_ms,
            measure_disk=args.measure_disk,
            dram_cache_gib=args.dram_cache_gib,
            trace=args.trace,
            lead_ms=args.lead_ms,
            batch=args.batch,
            warm_steps=args.warm_steps,
            step_ms=args.step_ms,
            nnodes=args.nnodes,
        )
    except EngramError as e:
        print(f"engram-sglang plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_text(result))
    return 0


def _rank_disk(args: argparse.Namespace) -> dict:
    """The disk rows' inputs: the disk given or measured once (one source for every row), else
    the assumed NVMe (layouts.DEFAULT_DISK)."""
    disk = dict(layouts.DEFAULT_DISK)
    if args.measure_disk:
        m = disk_model.measure_disk(args.measure_disk)
        disk = {"disk_iops": m["iops"], "iops_source": f"measured on {args.measure_disk} by {m['tool']}",
                "disk_latency_ms": m["latency_ms"]}
    elif args.disk_iops is not None:
        disk = {"disk_iops": args.disk_iops, "iops_source": "--disk-iops"}
    if args.disk_latency_ms is not None:
        disk["disk_latency_ms"] = args.disk_latency_ms
    return {**disk, "dram_cache_gib": args.dram_cache_gib, "trace": args.trace, "lead_ms": args.lead_ms,
            "batch": args.batch, "warm_steps": args.warm_steps, "step_ms": args.step_ms}


def _cmd_rank(args: argparse.Namespace) -> int:
    """`plan --rank`: every layout of one node, best first, and the best's launch line; with
    --node-settings the pages this node gives and the choice it recommends."""
    if not args.node_settings and args.shm_dir != node_pages.DEFAULT_SHM_DIR:
        print("engram-sglang plan: error: --shm-dir needs --node-settings", file=sys.stderr)
        return 2
    try:
        sku = gpu_sku(args.gpu)

        def run(**kw):
            return plan(model=args.model, gpu=args.gpu, hot_cache_gib=args.hot_cache_gib,
                        kv_bytes_per_token=args.kv_bytes_per_token, weights_gib=args.weights_gib,
                        reserve_gib=args.reserve_gib, min_kv_tokens=args.min_kv_tokens, **kw)

        first = run(tp=1, placement="host")
        node = node_pages.probe(args.shm_dir) if args.node_settings else None
        tps = valid_tps(first["model"]["attention_heads"])
        if args.tp is not None:  # rank only that TP's layouts
            if args.tp not in tps or sku.gpus_per_node % args.tp:
                raise EngramError(f"--tp {args.tp} with --rank: one node of {args.gpu} ranks TP "
                                  f"{', '.join(str(t) for t in tps if sku.gpus_per_node % t == 0)}")
            tps = [args.tp]
        rows = layouts.rank(run, tps, sku.gpus_per_node, disk=_rank_disk(args), node=node,
                            placements=None if args.placement is None else (args.placement,))
    except EngramError as e:
        print(f"engram-sglang plan: error: {e}", file=sys.stderr)
        return 2
    advice = None if node is None else node_pages.recommend(node, rows, first["tables"]["total_bytes"])
    if args.json:
        print(json.dumps(rows if node is None else {"layouts": rows, "node": node, "recommend": advice}, indent=2))
    else:
        print("\n".join(layouts.format_rows(rows, advice)))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m engram_sglang.tools.planner ...`: the same as `engram-sglang plan ...`."""
    parser = argparse.ArgumentParser(prog="engram-sglang plan", description="Engram capacity planner")
    _add_arguments(parser)
    return cmd_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
