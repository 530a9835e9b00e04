"""Table placements behind one TableStore: `open_store(table_dir, placement, ...)`."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..config import EngramConfig
from ..errors import EngramError
from ..tablefile import open_tables
from .base import PLACEMENTS, Prefetch, TableIOError, TableStore, shard_range, split_by_rows
from .cache import HotRowCache, wrap_stores
from .metrics import METRICS
from . import rowio
from .placements import DeviceStore, DiskStore, HostStore

logger = logging.getLogger(__name__)

_CLASSES = {"device": DeviceStore, "host": HostStore, "disk": DiskStore}
_OPTIONS = {
    "device": set(),
    "host": {"shared", "shm_dir", "huge_pages", "keep"},
    "disk": {"threads", "direct", "retries", "dram_cache_bytes"},
}


def open_store(
    table_dir: str | os.PathLike,
    placement: str,
    device: str | torch.device = "cpu",
    *,
    cfg: Optional[EngramConfig] = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    backend: str = "auto",
    cache_bytes: int = 0,
    cache_profile: Optional[str | os.PathLike] = None,
    cache_options: Optional[dict] = None,
    **options,
) -> dict[int, TableStore]:
    """Open every layer of a table directory in one placement: layer id -> TableStore.

    Parameters
    ----------
    placement : "device" (device memory), "host" (host memory read over UVA) or "disk".
    cfg : when given, the tables must have been built for it.
    tp_rank, tp_size : this rank holds rows `shard_range(rows, tp_rank, tp_size)` of each
        layer; other ids read as +0.0 rows, so a sum over ranks reassembles them exactly.
    backend : gather backend ("auto" lets the device probe choose).
    cache_bytes : device bytes (all layers of this rank) of a hot-row cache in front of a
        host or disk placement; 0 for none. `cache_profile` pre-warms it from an
        `engram-sglang profile` file; `cache_options`: ways, maintain_every, sample_factor,
        sketch_depth.
    options : placement options: host `shared`, `shm_dir`, `huge_pages`, `keep` (the node's
        shared copy outlives the last server); disk `threads`,
        `direct`, `retries`, `dram_cache_bytes` (host bytes, all layers of this rank, of a
        row cache in front of the files, split like `cache_bytes`).

    A placement that cannot be honoured raises; it never falls back to another tier.
    """
    if placement not in _CLASSES:
        raise EngramError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if cache_bytes and placement == "device":
        raise EngramError("placement device already holds the table in device memory: a hot-row cache serves host or disk")
    unknown = set(options) - _OPTIONS[placement]
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[placement])) or "none"
        raise EngramError(f"placement {placement} has no option(s) {', '.join(sorted(unknown))} (options: {allowed})")
    if "threads" in options:
        rowio.check_threads(options["threads"], "disk placement option threads")
    tables = open_tables(table_dir, cfg)
    METRICS.get()  # the stores' Prometheus collectors register here, once per process
    dram = split_by_rows(options.pop("dram_cache_bytes", 0),
                         {L: len(range(*shard_range(info.rows, tp_rank, tp_size))) for L, info in tables.layers.items()})
    stores: dict[int, TableStore] = {}
    try:
        for layer_id, info in sorted(tables.layers.items()):
            row_range = shard_range(info.rows, tp_rank, tp_size)
            if dram[layer_id]:
                options["dram_cache_bytes"] = dram[layer_id]
            if placement == "host":  # a shared copy is named by and checked against these
                options.update(checksums=info.checksums, chunk_rows=int(tables.manifest["chunk_rows"]))
            store = _CLASSES[placement](layer_id, info.path, info.rows, row_range, torch.device(device), backend, **options)
            stores[layer_id] = store
            logger.info("%s", store.describe())
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    if cache_bytes:
        stores = wrap_stores(stores, cache_bytes, profile=cache_profile, fingerprint=tables.fingerprint,
                             **(cache_options or {}))
    return stores


__all__ = ["HotRowCache", "PLACEMENTS", "Prefetch", "TableIOError", "TableStore", "open_store", "shard_range"]
