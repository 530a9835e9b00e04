"""A node's layouts ranked: every TP x DP that fills one node, each placement and host layout, with
KV tokens, DRAM and /dev/shm per node; the best is the one `engram-sglang plan --rank` launches."""

from __future__ import annotations

from typing import Any, Callable

from .data import GIB


def page_and_graphs(placement: str, host_layout: str, graphs: dict[str, Any]) -> dict[str, str]:
    """Page size / huge pages of the tables (today's facts: host tables in 4 KiB pages of
    /dev/shm or anonymous memory, until the node's huge-page settings are read) and whether
    decode CUDA graphs are kept (`graphs`: the plan's `decode_graphs` entry, planning/graphs.py)."""
    pages = {"device": "HBM", "disk": "4K page cache"}.get(placement)
    if pages is None:
        pages = "4K shm" if host_layout == "shared" else "4K anon"
    return {"pages": pages, "decode_graphs": graphs["kept"]}


def candidates(tps: list[int], gpus_per_node: int) -> list[tuple[int, str, str]]:
    """(TP, placement, host layout) for every TP that divides the node's GPUs."""
    out = []
    for tp in tps:
        if tp <= gpus_per_node and gpus_per_node % tp == 0:
            out += [(tp, "device", "shared"), (tp, "host", "shared"), (tp, "host", "per_rank")]
    return out


def rank(run: Callable[..., dict[str, Any]], tps: list[int], gpus_per_node: int) -> list[dict[str, Any]]:
    """Each candidate's row, best first: fits, then KV tokens per node, then the least DRAM per node.
    `run(tp=, placement=, host_layout=)` is the plan of one candidate."""
    rows = []
    for tp, placement, layout in candidates(tps, gpus_per_node):
        p = run(tp=tp, placement=placement, host_layout=layout)
        h = p["hbm_per_gpu"][placement]
        dp = gpus_per_node // tp
        d = p["host_dram_per_node"]
        dram = 0 if placement != "host" else d["shared_bytes"] if layout == "shared" else d["per_rank_bytes"]
        rows.append({
            "tp": tp, "dp": dp, "placement": placement,
            "host_layout": layout if placement == "host" else None,
            "numa": p["numa"]["layout"] if placement == "host" else None,
            "hot_cache_gib": p["hot_cache_gib"],
            "fits": bool(h["fits"]) and not p["warnings"],
            "kv_tokens_per_node": (h["kv_tokens"] or 0) * dp,
            "dram_bytes_per_node": dram,
            "dev_shm_bytes": p["dev_shm"]["needed_bytes"],
            **page_and_graphs(placement, layout, p["decode_graphs"][placement]),
            "launch": p["launch"],
        })
    rows.sort(key=lambda r: (not r["fits"], -r["kv_tokens_per_node"], r["dram_bytes_per_node"]))
    return rows


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The ranked table and the best layout's launch line."""
    head = f"  {'#':>2} {'TPxDP':>6} {'placement':<10}{'layout':<9}{'NUMA':<12}{'fits':<5}{'KV tok/node':>13}" \
           f"{'DRAM GiB':>10}{'shm GiB':>9}  {'pages':<14}{'graphs':<7}"
    lines = ["Layouts for one node, best first", head]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"  {i:>2} {str(r['tp']) + 'x' + str(r['dp']):>6} {r['placement']:<10}{r['host_layout'] or '-':<9}"
            f"{(r['numa'] or '-')[:11]:<12}{'yes' if r['fits'] else 'NO':<5}{r['kv_tokens_per_node']:>13,}"
            f"{r['dram_bytes_per_node'] / GIB:>10.2f}{r['dev_shm_bytes'] / GIB:>9.2f}  {r['pages']:<14}{r['decode_graphs']:<7}"
        )
    if rows:
        b = rows[0]
        lines += ["", f"Launch the best (TP{b['tp']} x DP{b['dp']}, {b['placement']}"
                      + (f", {b['host_layout']} layout" if b["host_layout"] else "") + "; one such server per replica, each on its own GPUs):",
                  f"  {b['launch']['command']}"]
    return lines
