"""Table placements behind one TableStore: `open_store(table_dir, placement, ...)`."""

from __future__ import annotations

import logging
import os
from typing import Callable, Mapping, Optional

import torch

from ..config import EngramConfig
from ..errors import EngramError
from ..hashing import EngramLayout
from ..placement_table import PLACEMENTS, WHOLE
from ..placement_table import placement as placement_spec
from ..tablefile import open_tables
from . import rowio
from .base import Prefetch, TableIOError, TableStore, column_shards, ranges_rows, shard_range, split_by_rows
from .cache import HotRowCache, wrap_stores
from .metrics import METRICS, rank_values

logger = logging.getLogger(__name__)


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
    agree: Optional[Callable[[bool], bool]] = None,
    shards: str = "balanced",
    ranks: Optional[Mapping[str, int]] = None,
    **options,
) -> dict[int, TableStore]:
    """Open every layer of a table directory in one placement: layer id -> TableStore.

    Parameters
    ----------
    placement : a placement of the table in placement_table.py: "device" (device memory),
        "host" (host memory read over UVA) or "disk"; it names the store class and its options.
    cfg : when given, the tables must have been built for it.
    tp_rank, tp_size : this rank holds its shard of each layer (`shards`); other ids read as
        +0.0 rows, so a sum over ranks reassembles them exactly.
        Except where the placement table says a rank holds whole rows (host with `shared`:
        one copy per node that every rank maps) and the caller can do without the sum:
    agree : given by a caller that skips the all-reduce where every store holds whole rows
        (`TableStore.holds_whole_rows`); called once with this rank's answer, it returns
        the answer of all ranks of the group (true only if true on every rank: a rank whose
        shared copy fell back to a private shard makes every rank keep its shard). None
        (the default) at tp_size > 1: every rank holds a shard, as the caller sums them.
    shards : how the ranks split a layer: "balanced" (the default, what serving uses:
        `column_shards`, the layout's columns dealt round-robin, a list of row ranges per rank,
        the table format unchanged; every rank then reads about as many distinct rows a step,
        bench/shard_balance.py) or "contiguous" (`shard_range`, one range per rank: kept for
        comparisons). Every placement serves both.
    backend : gather backend ("auto" lets the device probe choose).
    ranks : the `tp_rank`, `dp_rank`, `pp_rank` labels of the stores' Prometheus series
        (the runtime passes SGLang's ranks); by default `tp_rank` above, DP and PP rank 0.
    cache_bytes : device bytes (all layers of this rank) of a hot-row cache in front of a
        host or disk placement; 0 for none. `cache_profile` pre-warms it from an
        `engram-sglang profile` file; `cache_options`: ways, maintain_every, sample_factor,
        sketch_depth.
    options : placement options (the placement table's): host `shared` (True; or "require": raise
        where the shm dir cannot hold the copy, no private fallback), `shm_dir`, `huge_pages`,
        `keep` (the node's shared copy outlives the last server), `numa` (auto, interleave, off
        or a node number: stores/numa.py), `whole_rows` (with
        `shared` and `agree`: whole rows per rank; default on); disk `threads`,
        `direct`, `retries`, `dram_cache_bytes` (host bytes, all layers of this rank, of a
        row cache in front of the files, split like `cache_bytes`).

    A placement that cannot be honoured raises; it never falls back to another tier.
    """
    spec = placement_spec(placement)
    if cache_bytes and not spec.cache_in_front:
        raise EngramError(f"placement {placement} already holds the table in device memory: a hot-row cache serves "
                          f"{' or '.join(p for p in PLACEMENTS if placement_spec(p).cache_in_front)}")
    unknown = set(options) - spec.option_names
    if unknown:
        allowed = ", ".join(sorted(spec.option_names)) or "none"
        raise EngramError(f"placement {placement} has no option(s) {', '.join(sorted(unknown))} (options: {allowed})")
    if "threads" in options:
        rowio.check_threads(options["threads"], "disk placement option threads")
    if shards not in SHARDS:
        raise EngramError(f"shards is {shards!r}; expected one of {', '.join(SHARDS)}")
    whole = spec.rows_held(options) == WHOLE and (tp_size == 1 or agree is not None)
    store_class = spec.store_class()
    metric_ranks = rank_values(ranks, tp_rank)
    tables = open_tables(table_dir, cfg)
    METRICS.get()  # the stores' Prometheus collectors register here, once per process
    held = rank_ranges(tables, cfg, tp_rank, tp_size, shards)
    dram = split_by_rows(options.pop("dram_cache_bytes", 0), {L: ranges_rows(r) for L, r in held.items()})
    stores: dict[int, TableStore] = {}
    asked = False  # whether this rank has called `agree` (every rank must, exactly once)
    try:
        for layer_id, info in sorted(tables.layers.items()):
            if dram[layer_id]:
                options["dram_cache_bytes"] = dram[layer_id]
            if "shared" in spec.option_names:  # a node's shared copy is named by and checked against these
                options.update(checksums=info.checksums, chunk_rows=int(tables.manifest["chunk_rows"]))
            if "whole_rows" in spec.option_names:
                options["whole_rows"] = whole
            store = store_class(layer_id, info.path, info.rows, held[layer_id], torch.device(device), backend,
                                metric_ranks=metric_ranks, **options)
            stores[layer_id] = store
        agreed = tp_size == 1 and whole
        if tp_size > 1 and agree is not None:
            asked = True
            agreed = agree(bool(stores) and all(s.holds_whole_rows for s in stores.values()))
        if tp_size > 1 and not agreed:
            for layer_id, store in stores.items():
                store.hold_only(held[layer_id])
        for store in stores.values():
            logger.info("%s", store.describe())
        warning = store_class.start_up_warning(list(stores.values()))
        for line in warning.splitlines():  # once for all layers (e.g. host tables a GPU reads on 4 KiB pages)
            logger.warning("%s", line)
    except BaseException:
        if tp_size > 1 and agree is not None and not asked:
            agree(False)  # the other ranks wait in it: they must not hang on this rank's error
        for store in stores.values():
            store.close()
        raise
    if tp_size > 1:
        for store in stores.values():
            store.agreed_whole = bool(agreed)
    for store in stores.values():
        METRICS.opened(store)  # its counters at 0 from now on
    if cache_bytes:
        stores = wrap_stores(stores, cache_bytes, profile=cache_profile, fingerprint=tables.fingerprint,
                             **(cache_options or {}))
    return stores


SHARDS = ("contiguous", "balanced")


def rank_ranges(tables, cfg: Optional[EngramConfig], tp_rank: int, tp_size: int,
                shards: str = "balanced") -> dict[int, list[tuple[int, int]]]:
    """Layer id -> the row ranges rank `tp_rank` of `tp_size` holds of each layer of `tables`
    (open_tables): [shard_range] for contiguous shards, `column_shards` of the tables' layout
    (their manifest's config, or `cfg`) for balanced ones."""
    if shards == "contiguous" or tp_size == 1:
        return {L: [shard_range(info.rows, tp_rank, tp_size)] for L, info in tables.layers.items()}
    layout = EngramLayout(cfg if cfg is not None else tables.config)
    return {L: column_shards(layout.column_bounds(layout.layer_index(L)), tp_rank, tp_size)
            for L in tables.layers}


__all__ = ["HotRowCache", "PLACEMENTS", "Prefetch", "SHARDS", "TableIOError", "TableStore", "column_shards",
           "open_store", "rank_ranges", "shard_range"]


# The placements' store classes, imported on first use (each pulls in its own dependencies).
_STORE_CLASSES = {"DeviceStore": ".device", "HostStore": ".host", "DiskStore": ".disk"}


def __getattr__(name: str):
    if name in _STORE_CLASSES:
        import importlib

        return getattr(importlib.import_module(_STORE_CLASSES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
