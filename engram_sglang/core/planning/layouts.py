"""A node's layouts ranked: every TP x DP that fills one node, each placement and host layout, with
KV tokens, DRAM and /dev/shm per node; the best is the one `engram-sglang plan --rank` launches."""

from __future__ import annotations

from typing import Any, Callable, Optional

from . import disk as disk_model
from . import node_pages
from .data import GIB

# The disk rows' disk where none is given or measured (planning/disk.py's assumption, labelled).
DEFAULT_DISK = {"disk_iops": disk_model.DEFAULT_IOPS, "iops_source": (
    "assumption: one datacenter PCIe Gen4 NVMe SSD per replica at its rated 4 KiB random reads, queue depth "
    "64+ (planning/disk.py DEFAULT_IOPS); --disk-iops or --measure-disk sets it")}


def page_and_graphs(placement: str, host_layout: str, graphs: dict[str, Any],
                    node: Optional[dict[str, Any]] = None) -> dict[str, str]:
    """Page size / huge pages of the tables (planning/node_pages.py: 4 KiB for host tables until
    the node's huge-page settings are read, then what this node gives) and whether decode CUDA
    graphs are kept (`graphs`: the plan's `decode_graphs` entry, planning/graphs.py)."""
    return {"pages": node_pages.label(placement, host_layout, node), "decode_graphs": graphs["kept"],
            "decode_graphs_why": graphs["why"]}


def candidates(tps: list[int], gpus_per_node: int) -> list[tuple[int, str, str]]:
    """(TP, placement, host layout) for every TP that divides the node's GPUs."""
    out = []
    for tp in tps:
        if tp <= gpus_per_node and gpus_per_node % tp == 0:
            out += [(tp, "device", "shared"), (tp, "host", "shared"), (tp, "host", "per_rank"), (tp, "disk", "shared")]
    return out


def disk_step(p: dict[str, Any]) -> dict[str, Any]:
    """A disk row's decode step: exposed read time eager (prefetch: what the launch line gives,
    decode graphs off) and staged (decode graphs kept: all of the reads), the figures assumed,
    and whether the eager time is within the step budget (planning/disk.py)."""
    d, st = p["disk"], p["disk"]["step"]
    keys = ("iops", "iops_source", "latency_ms", "latency_source", "lead_ms", "lead_source", "batch",
            "step_ms", "step_source", "budget_ms", "within_budget")
    return {**{k: d[k] for k in keys}, "dram_cache_gib": d["dram_cache_bytes_per_rank"] / GIB,
            "exposed_ms": st["exposed_ms_prefetch"], "exposed_ms_staged": st["exposed_ms_staged_graphs"],
            "read_ms": st["read_ms"], "misses_per_step": st["misses_per_step"]}


def rank(run: Callable[..., dict[str, Any]], tps: list[int], gpus_per_node: int, *,
         disk: Optional[dict[str, Any]] = None, node: Optional[dict[str, Any]] = None,
         placements: Optional[tuple[str, ...]] = None) -> list[dict[str, Any]]:
    """Each candidate's row, best first: fits (a disk row only with its exposed read time within
    the step budget), then KV tokens per node, then at equal KV a table in memory before one on
    disk (no reads to expose), then the least DRAM per node. `run(tp=, placement=, host_layout=)`
    is the plan of one candidate; a disk one is also given `disk` (PlanInputs' disk fields: by
    default disk.py's assumed NVMe) for its decode step. `placements`: only those (all by default)."""
    disk = DEFAULT_DISK if disk is None else disk
    rows = []
    for tp, placement, layout in candidates(tps, gpus_per_node):
        if placements is not None and placement not in placements:
            continue
        p = run(tp=tp, placement=placement, host_layout=layout, **(disk if placement == "disk" else {}))
        h = p["hbm_per_gpu"][placement]
        dp = gpus_per_node // tp
        d = p["host_dram_per_node"]
        if placement == "host":
            dram = d["shared_bytes"] if layout == "shared" else d["per_rank_bytes"]
        elif placement == "disk":
            dram = p["disk"]["vs_host"]["disk_dram_cache_bytes_per_node"]
        else:
            dram = 0
        step = disk_step(p) if placement == "disk" else None
        rows.append({
            "tp": tp, "dp": dp, "placement": placement,
            "host_layout": layout if placement == "host" else None,
            "numa": p["numa"]["layout"] if placement == "host" else None,
            "hot_cache_gib": p["hot_cache_gib"],
            "fits": bool(h["fits"]) and not p["warnings"] and (step is None or step["within_budget"]),
            "kv_tokens_per_node": (h["kv_tokens"] or 0) * dp,
            "dram_bytes_per_node": dram,
            "dev_shm_bytes": p["dev_shm"]["needed_bytes"],
            **page_and_graphs(placement, layout, p["decode_graphs"][placement], node),
            "disk_step": step,
            "launch": p["launch"],
        })
    rows.sort(key=lambda r: (not r["fits"], -r["kv_tokens_per_node"], r["placement"] == "disk", r["dram_bytes_per_node"]))
    return rows


def _disk_ms(r: dict[str, Any]) -> str:
    st = r["disk_step"]
    return "-" if st is None else f"{st['exposed_ms']:.2f}/{st['exposed_ms_staged']:.2f}"


def legend(rows: list[dict[str, Any]]) -> list[str]:
    """What the columns assume: the disk rows' figures and each placement's decode graphs."""
    lines = []
    disk = next((r["disk_step"] for r in rows if r["disk_step"]), None)
    if disk is not None:
        lines += [
            f"disk ms: exposed read time per decode step, eager/staged (eager: decode graphs off, reads hidden behind "
            f"the {disk['lead_ms']:g} ms lead, what the launch line gives; staged: --engram-disk-graphs on "
            f"--disable-overlap-schedule, all of the reads before each replay), batch {disk['batch']}, "
            f"DRAM row cache {disk['dram_cache_gib']:g} GiB per rank (--dram-cache-gib; default 0, as "
            f"--engram-disk-dram-cache-mib's), hot-row cache as --cache-gib",
            f"  disk: {disk['iops']:,.0f} IOPS per replica ({disk['iops_source']}); "
            f"{disk['latency_ms']:g} ms a read ({disk['latency_source']})",
            f"  lead: {disk['lead_source']}",
            f"  a disk row fits only where its eager exposed time is within the step budget: "
            f"{disk['budget_ms']:g} ms, {disk_model.STEP_BUDGET_SHARE:.0%} of a {disk['step_ms']:g} ms decode step "
            f"({disk['step_source']}); at equal KV tokens a table in memory ranks first",
        ]
    seen = {}
    for r in rows:
        seen.setdefault(r["placement"], (r["decode_graphs"], r["decode_graphs_why"]))
    lines += ["graphs: decode CUDA graphs kept for this model (planning/graphs.py):"]
    lines += [f"  {pl}: {kept}: {why}" for pl, (kept, why) in seen.items()]
    return lines


def format_rows(rows: list[dict[str, Any]], advice: Optional[dict[str, str]] = None) -> list[str]:
    """The ranked table, its legend, the pages advice (with node settings) and the best layout's launch line."""
    head = f"  {'#':>2} {'TPxDP':>6} {'placement':<10}{'layout':<9}{'NUMA':<12}{'fits':<5}{'KV tok/node':>13}" \
           f"{'DRAM GiB':>10}{'shm GiB':>9}  {'pages':<22}{'graphs':<7}{'disk ms':>11}"
    lines = ["Layouts for one node, best first", head]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"  {i:>2} {str(r['tp']) + 'x' + str(r['dp']):>6} {r['placement']:<10}{r['host_layout'] or '-':<9}"
            f"{(r['numa'] or '-')[:11]:<12}{'yes' if r['fits'] else 'NO':<5}{r['kv_tokens_per_node']:>13,}"
            f"{r['dram_bytes_per_node'] / GIB:>10.2f}{r['dev_shm_bytes'] / GIB:>9.2f}  {r['pages']:<22}"
            f"{r['decode_graphs']:<7}{_disk_ms(r):>11}"
        )
    lines += ["", *legend(rows)]
    if advice is not None:
        lines += ["", f"Pages on this node: {advice['choice']}: {advice['why']}"]
        if advice["fix"]:
            lines.append(f"  fix: {advice['fix']}")
    if rows:
        b = rows[0]
        lines += ["", f"Launch the best (TP{b['tp']} x DP{b['dp']}, {b['placement']}"
                      + (f", {b['host_layout']} layout" if b["host_layout"] else "") + "; one such server per replica, each on its own GPUs):",
                  f"  {b['launch']['command']}"]
    return lines
