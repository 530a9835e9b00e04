"""What every benchmark shares: same-run machine limits, and writing table + JSON + PNG."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "out"


def memcpy_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Best-of copy bandwidth on one thread in bytes/s, counting bytes read + written."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def torch_copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 3) -> float:
    """torch's own copy on all intra-op threads, bytes read + written per second: the limit
    for gathers that use every core (numpy's copy above runs on one)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def drop_file_cache(path: str | os.PathLike) -> None:
    """Evict one file's pages from the page cache (no root needed, unlike drop_caches)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def machine() -> dict:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[f"{c:,.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def write_json(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return path
