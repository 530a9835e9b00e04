"""The pages this node would give host tables (`engram-sglang plan --rank --node-settings`), and
the choice it recommends: the shared copy's tmpfs `huge=` (with shmem_enabled), THP `enabled`
for a private copy, and free hugetlbfs pages. The verdicts are core/stores/thp.py's (the same
the store logs at start-up); this module only reads /proc/meminfo and words the plan's side.
Pure functions over the files' text, so tests feed fixtures; `probe` reads this host's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from ..stores import thp
from .data import GIB

DEFAULT_SHM_DIR = "/dev/shm"  # --engram-shm-dir's default (serving/settings.py)
HUGETLB_DIR = "/mnt/engram-huge"


def meminfo_bytes(text: str, key: str) -> Optional[int]:
    """A /proc/meminfo field in bytes ("kB" fields times 1024, counts as they are); None if absent."""
    m = re.search(rf"^{re.escape(key)}:\s+(\d+)(\s*kB)?", text or "", re.M)
    if m is None:
        return None
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def node_pages(shm_dir: str, mountinfo: str, shmem_enabled: str, enabled: str, meminfo: str) -> dict[str, Any]:
    """This node's page facts: thp.py's plans for a shared copy in `shm_dir` and for a private
    copy, free hugetlbfs pages (HugePages_Free x Hugepagesize) and DRAM (MemTotal)."""
    shm = thp.shm_dir_pages(shm_dir, mountinfo, shmem_enabled)
    anon = thp.anonymous_pages(enabled)
    free, size = meminfo_bytes(meminfo, "HugePages_Free"), meminfo_bytes(meminfo, "Hugepagesize")
    return {
        "shm_dir": shm_dir, "shm": shm.__dict__, "anon": anon.__dict__,
        "hugetlb_free_bytes": (free or 0) * (size or 0), "hugetlb_page_bytes": size,
        "mem_total_bytes": meminfo_bytes(meminfo, "MemTotal"),
    }


def probe(shm_dir: str = DEFAULT_SHM_DIR) -> dict[str, Any]:
    """node_pages from this host's files (unreadable ones count as empty)."""
    def text(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""
    real = str(Path(shm_dir).resolve())
    return node_pages(real, text("/proc/self/mountinfo") or text("/proc/mounts"), thp.read_knob("shmem_enabled"),
                      thp.read_knob("enabled"), text("/proc/meminfo"))


def label(placement: str, host_layout: str, node: Optional[dict[str, Any]]) -> str:
    """The `pages` column: without node settings today's default (4 KiB until the node is read);
    with them what this node gives the table, and the setting that decides it."""
    if placement == "device":
        return "HBM"
    if placement == "disk":
        return "4K page cache"
    if node is None:
        return "4K shm" if host_layout == "shared" else "4K anon"
    if host_layout == "shared":
        s = node["shm"]
        if s["fstype"] == "hugetlbfs":
            return "2M hugetlbfs"
        why = s["shmem_enabled"] if s["shmem_enabled"] in ("deny", "force") else f"huge={s['huge_option'] or '?'}"
        if s["fstype"] and s["fstype"] != "tmpfs":
            why = s["fstype"]
        return f"{'2M' if s['huge'] else '4K'} shm ({why})"
    a = node["anon"]
    return f"{'2M' if a['huge'] else '4K'} anon ({a['thp_enabled'] or 'no THP'})"


def recommend(node: dict[str, Any], rows: list[dict[str, Any]], table_bytes: int) -> dict[str, str]:
    """{"choice", "why", "fix"} for the host rows' pages on this node: keep a shared copy
    whose mount gives huge pages; else a shared copy on a hugetlbfs mount where the node's free
    huge pages already hold the shared copies (reserved pages are there for this; one copy per
    node as before); else private per-rank copies where THP `enabled` gives them and their DRAM
    (at the best fitting per-rank TP) fits the node; else remount the shm dir with
    huge=within_size."""
    shm, anon, d = node["shm"], node["anon"], node["shm_dir"]
    if shm["huge"]:
        return {"choice": "shared copy", "why": shm["reason"], "fix": ""}
    dram = node.get("mem_total_bytes")
    per_rank = [r for r in rows if r["placement"] == "host" and r["host_layout"] == "per_rank" and r["fits"]
                and (dram is None or r["dram_bytes_per_node"] <= dram)]
    free = node["hugetlb_free_bytes"]
    shared = [r for r in rows if r["placement"] == "host" and r["host_layout"] == "shared" and r["fits"]]
    need = shared[0]["dram_bytes_per_node"] if shared else table_bytes  # a copy per NUMA node where auto makes them
    if free >= need:
        page = f"{(node['hugetlb_page_bytes'] or 0) // 1024 // 1024}M"
        return {"choice": "shared copy on hugetlbfs",
                "why": (f"{shm['memory']} in {d} would give 4 KiB pages ({shm['reason']}); {free / GIB:.0f} GiB of free "
                        f"huge pages hold the shared copies' {need / GIB:.0f} GiB"),
                "fix": (f"mount -t hugetlbfs -o pagesize={page} engram-huge {HUGETLB_DIR}, then "
                        f"--engram-shm-dir {HUGETLB_DIR}")}
    if anon["huge"] and per_rank:
        r = per_rank[0]
        return {"choice": f"per-rank private copies (TP{r['tp']} x DP{r['dp']})",
                "why": (f"the shared copy would be on 4 KiB pages ({shm['reason']}); THP enabled is "
                        f"{anon['thp_enabled']}, which gives private copies 2 MiB pages, and they take "
                        f"{r['dram_bytes_per_node'] / GIB:.0f} GiB of the node's "
                        + (f"{dram / GIB:.0f} GiB" if dram else "DRAM") + " at that TP"),
                "fix": "--engram-host-shared off --engram-huge-pages on (ENGRAM_HOST_SHARED=0)"}
    return {"choice": "shared copy after a remount",
            "why": f"{shm['memory']} in {d} would give 4 KiB pages ({shm['reason']})"
                   + ("" if anon["huge"] else f"; private copies too (THP enabled {anon['thp_enabled'] or 'absent'})"),
            "fix": shm["fix"] or f"give --engram-shm-dir a tmpfs mounted with huge={thp.FIX_HUGE}"}
