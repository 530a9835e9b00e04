"""The planner's report as text: the tables `engram-sglang plan` prints (`--json` prints the dict)."""

from __future__ import annotations

from typing import Any, Optional

from ..core.config import PLACEMENTS
from ..core.planning.data import GIB
from ..core.planning.disk import STEP_BUDGET_SHARE


def _fmt_gib(b: Optional[float], signed: bool = False) -> str:
    if b is None:
        return "n/a"
    return f"{'+' if signed and b > 0 else ''}{b / GIB:.2f} GiB"


def _fmt_tokens(n: Optional[int], signed: bool = False) -> str:
    if n is None:
        return "n/a"
    sign = "+" if signed and n > 0 else ""
    if n >= 1_000_000:
        return f"{sign}{n / 1e6:.2f} M"
    if n >= 1_000:
        return f"{sign}{n / 1e3:.1f} k"
    return f"{sign}{n}"


def format_text(p: dict[str, Any]) -> str:
    g, m, t = p["gpu"], p["model"], p["tables"]
    tp = p["tp"]
    lines = [
        f"{m['name']} on {g['key']} ({g['vendor']} {g['arch']}, {g['hbm_bytes'] / GIB:.2f} GiB HBM, "
        f"{g['host_link']} {g['host_link_gbps']:g} GB/s), TP{tp}, tables in {p['placement']}"
        + (f" ({p['host_layout']} layout)" if p["placement"] == "host" else ""),
        "",
        "Engram tables",
        f"  {'total':<34}{_fmt_gib(t['total_bytes']):>14}   "
        f"({len(m['rows_per_layer'])} layers, {sum(m['rows_per_layer']):,} rows x {m['row_bytes']} B)",
        f"  {f'per rank at TP{tp}':<34}{_fmt_gib(t['per_rank_bytes']):>14}   (balanced shards, largest rank)",
        "",
        f"HBM per GPU at TP{tp}{'':<22}{'device':>14}{'host':>14}{'disk':>14}",
    ]
    h = p["hbm_per_gpu"]

    def row(label: str, key: str, fmt=_fmt_gib, **kw: Any) -> str:
        return f"  {label:<38}" + "".join(f"{fmt(h[pl][key], **kw):>14}" for pl in PLACEMENTS)

    kvb = m["kv_bytes_per_token"]
    lines += [
        row("weights (non-Engram)", "weights_bytes"),
        row("Engram tables", "tables_bytes"),
        row("hot-row cache", "hot_cache_bytes"),
        row("runtime reserve", "reserve_bytes"),
        row("left for KV cache", "free_for_kv_bytes"),
        row("HBM freed vs device", "hbm_freed_bytes"),
        row(f"KV tokens ({kvb:g} B/token)" if kvb else "KV tokens", "kv_tokens", fmt=_fmt_tokens),
        row("KV tokens gained", "kv_tokens_gained", fmt=_fmt_tokens, signed=True),
        f"  {'fits (room for min KV)':<38}"
        + "".join(f"{('n/a' if h[pl]['fits'] is None else 'yes' if h[pl]['fits'] else 'NO'):>14}" for pl in PLACEMENTS),
        f"  {'smallest TP that fits':<38}"
        + "".join(f"{(str(p['smallest_tp'][pl]) if p['smallest_tp'][pl] else 'none'):>14}" for pl in PLACEMENTS),
        f"  {'decode CUDA graphs kept':<38}" + "".join(f"{p['decode_graphs'][pl]['kept']:>14}" for pl in PLACEMENTS),
        "",
    ]
    d = p["host_dram_per_node"]
    lines += [
        f"Host DRAM per node for host tables ({d['gpus_per_node']} GPUs, {d['replicas_per_node']} "
        f"replica{'s' if d['replicas_per_node'] != 1 else ''} of TP{tp})",
        f"  {'shared layout (' + str(d['shared_copies']) + ' cop' + ('ies' if d['shared_copies'] != 1 else 'y') + ')':<38}"
        f"{_fmt_gib(d['shared_bytes']):>14}",
        f"  {'per-rank layout (a shard per rank)':<38}{_fmt_gib(d['per_rank_bytes']):>14}",
    ]
    n = p["numa"]
    if p["placement"] == "host":
        of = f" of {_fmt_gib(n['dram_per_node_bytes'])}" if n["dram_per_node_bytes"] is not None else ""
        lines.append(
            f"  {'per NUMA node (' + str(n['nodes']) + ' node' + ('s' if n['nodes'] != 1 else '') + ')':<38}"
            f"{_fmt_gib(n['per_node_bytes']):>14}{of}   --engram-host-numa {n['mode']}: {n['layout']}, "
            + (f"{n['copies']} x {_fmt_gib(n['copy_bytes'])}" if p["host_layout"] == "shared"
               else f"{_fmt_gib(n['total_bytes'])} of shards in all")
        )
    s = p["dev_shm"]
    lines += [
        f"  {'/dev/shm needed':<38}{_fmt_gib(s['needed_bytes']):>14}   docker run {s['docker_flags']}",
    ]
    if p["disk_bytes_per_node"]:
        lines.append(f"  {'table files on local disk':<38}{_fmt_gib(p['disk_bytes_per_node']):>14}")
    hl = p["host_link"]
    lines += [
        "",
        f"Host link ({hl['link']}, {hl['peak_gbps']:g} GB/s peak; {hl['lines_per_row']:g} lines of 64 B per row, "
        f"{p['host_layout']} layout)",
        f"  {'decode step of ' + str(hl['decode_batch']) + ' tokens':<38}"
        f"{hl['decode_step_bytes'] / 1e6:>10.2f} MB   {hl['decode_step_us_at_peak']:.0f} us at peak",
        f"  {'prefill chunk of ' + str(hl['prefill_chunk']) + ' tokens':<38}"
        f"{hl['prefill_chunk_bytes'] / 1e6:>10.2f} MB   {hl['prefill_chunk_ms_at_peak']:.2f} ms at peak",
        *_rows_per_rank(p),
        *_disk(p),
        *_launch(p),
        "",
        "Assumptions",
        *(f"  - {a}" for a in p["assumptions"]),
    ]
    if p["warnings"]:
        lines += ["", "Warnings", *(f"  ! {w}" for w in p["warnings"])]
    return "\n".join(lines)



def _launch(p: dict) -> list[str]:
    """The launch line of the planned layout (core/planning/launch.py)."""
    if "launch" not in p:
        return []
    return ["", f"Launch (TP{p['tp']}, tables in {p['placement']}"
                + (f", {p['host_layout']} layout" if p["placement"] == "host" else "") + ")",
            f"  {p['launch']['command']}"]


def _rows_per_rank(p: dict) -> list[str]:
    """Host placement with a shared copy: whole rows per rank or a shard + all-reduce."""
    r = p["rows_per_rank"]
    if p["placement"] != "host" or p["tp"] == 1:
        return []
    lines = ["", f"Rows per rank, recommended: {r['recommend'] or 'unknown'} (whole rows from one shared copy vs a "
                 f"balanced shard; TP{p['tp']}, {r['gpu_link'] or 'GPU link'} "
                 f"{r['gpu_link_gbps'] or 0:g} GB/s)"]
    for phase, v in r["phases"].items():
        removed = v["allreduce_seconds_removed"]
        lines.append(f"  {phase + ' (' + str(v['tokens']) + ' tokens)':<38}all-reduce -{v['collective_bytes_removed'] / 1e6:.2f} MB"
                     f"{'' if removed is None else f' ({removed * 1e6:,.0f} us)'}, host link "
                     f"+{v['host_bytes_added'] / 1e6:.2f} MB ({v['host_seconds_added'] * 1e6:,.0f} us) per GPU")
    if any(r["hit_rates"].values()):
        lines.append(f"  hot-row cache hits: whole {r['hit_rates']['whole']:.1%}, sharded {r['hit_rates']['sharded']:.1%} "
                     f"({r['hit_rate_source']})")
    lines.append(f"  recommend: {r['recommend'] or 'unknown'} ({r['reason']})")
    if p["host_layout"] != "shared" and r["recommend"] == "whole":
        lines.append("  (whole rows need the shared layout: --engram-host-shared on)")
    return lines


def _staged_line(graphs: dict, st: dict) -> str:
    """The disk step with decode graphs kept (staged), or why they are off (core/planning/graphs.py)."""
    if graphs["kept"] == "no":
        return f"  {'decode CUDA graphs':<38}{'off':>10}      ({graphs['why']})"
    return (f"  {'exposed, staged CUDA graphs':<38}{st['exposed_ms_staged_graphs']:>10.2f} ms   (reads end before the "
            f"replay; {graphs['why']})")


def _disk(p: dict) -> list[str]:
    """Disk placement: the decode step's reads and what the placement saves."""
    d = p.get("disk")
    if not d:
        return ["", "Disk placement: pass --disk-iops N or --measure-disk PATH for the decode step's reads"] \
            if p["placement"] == "disk" else []
    st, dev, host = d["step"], d["vs_device"], d["vs_host"]
    hit = " / ".join(f"L{L} {v['hit_rate']:.1%}" for L, v in st["per_layer"].items())
    saved = dev["gpus_saved_per_replica"]
    return [
        "",
        f"Disk placement: decode step of batch {d['batch']} (TP{p['tp']}; caches per rank: DRAM "
        f"{_fmt_gib(d['dram_cache_bytes_per_rank'])}, HBM hot rows {_fmt_gib(d['hot_cache_bytes_per_rank'])})",
        f"  {'hit rate (hot + DRAM caches)':<38}{hit}   ({st['curve']})",
        f"  {'disk reads per step (all layers)':<38}{st['misses_per_step']:>10,.0f}   at {d['iops'] / 1e3:,.1f} k IOPS, "
        f"{d['latency_ms']:.3g} ms latency",
        f"  {'read time per step':<38}{st['read_ms']:>10.2f} ms",
        f"  {'exposed, prefetch (lead ' + format(d['lead_ms'], 'g') + ' ms hidden)':<38}"
        f"{st['exposed_ms_prefetch']:>10.2f} ms",
        _staged_line(p["decode_graphs"]["disk"], st),
        f"  {'step budget (exposed, prefetch)':<38}{d['budget_ms']:>10.2f} ms   "
        f"{'within' if d['within_budget'] else 'OVER'}: {STEP_BUDGET_SHARE:.0%} of a {d['step_ms']:g} ms decode step "
        f"(plan --rank ranks a disk layout only within it)",
        f"  {'DRAM cache per rank, GiB':<38}" + "".join(f"{c['dram_cache_gib']:>9g}" for c in d["by_dram_cache"]),
        f"  {'  hit rate':<38}" + "".join(f"{c['hit_rate']:>9.1%}" for c in d["by_dram_cache"]),
        f"  {'  exposed ms, prefetch':<38}" + "".join(f"{c['exposed_ms_prefetch']:>9.2f}" for c in d["by_dram_cache"]),
        f"  {'vs device: HBM freed per GPU':<38}{_fmt_gib(dev['hbm_freed_bytes_per_gpu']):>14}   KV tokens "
        f"{_fmt_tokens(dev['kv_tokens_gained_per_gpu'], signed=True)} per GPU; smallest TP device "
        f"{dev['smallest_tp']['device'] or 'none'} vs disk {dev['smallest_tp']['disk'] or 'none'}"
        + ("" if saved is None else f": {saved} GPU{'s' if abs(saved) != 1 else ''} saved per replica"),
        f"  {'vs host: DRAM per node':<38}{_fmt_gib(host['dram_saved_bytes_per_node']):>14}   saved "
        f"({_fmt_gib(host['host_dram_bytes_per_node'])}, one shared copy of the host tables, vs {host['ranks_per_node']} ranks' DRAM caches "
        f"{_fmt_gib(host['disk_dram_cache_bytes_per_node'])})",
        f"  IOPS: {d['iops_source']}; latency: {d['latency_source']}",
        f"  lead: {d['lead_source']}",
        f"  step: {d['step_source']}",
        f"  hit rates: {d['curve_source']}",
    ]
