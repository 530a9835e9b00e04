"""The placements of a layer table, as data: the one table that the serving settings (flag
choices, store options), `open_store` (class, allowed options), the CUDA-graph policy, the
planner and the CLI read. A placement added here appears in all of them.

No torch here: the serving flags load without it, so each store class is named and imported
only when a store opens (`Placement.store_class()`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping, Optional

from .errors import EngramError

WHOLE, SHARD = "whole", "shard"
# How a placement serves attention data/context parallelism, where the TP ranks hold different
# tokens (`Placement.attention_rows`): whole rows from the node's shared copy, whole rows read
# from the table files, or shards whose ranks exchange ids (serving/row_exchange.py).
SHARED_COPY, FROM_FILES, EXCHANGE = "shared-copy", "files", "exchange"
ATTENTION_ROWS_WHAT = {
    SHARED_COPY: "every rank reads whole rows of its own tokens from the node's shared copy (no collective)",
    FROM_FILES: "every rank reads whole rows of its own tokens from the table files into its own caches "
                "(no collective; a row several ranks need is read once per rank)",
    EXCHANGE: "each rank keeps its shard: the ranks exchange their ids per layer and each rank's rows come "
              "back through an exact int32 reduce-scatter",
}


@dataclasses.dataclass(frozen=True)
class PlacementOption:
    """One `open_store` option of a placement and the serving knob (`--engram-KNOB`) it comes from.

    scale : multiplies the knob's value (MiB knobs give byte options).
    only_when_set : passed only when the knob is set (its store default is "off").
    default : the store's value when the option is not given.
    """

    name: str
    knob: str
    scale: int = 1
    only_when_set: bool = False
    default: Any = None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one Engram layer's rows live.

    name : the `--engram-placement` value.
    store_class_path : "module:Class" of its TableStore, under engram_sglang.core.stores.
    options : the `open_store` options it takes.
    ids_visit_host : each step's row ids go to the host, which reads the rows.
    capturable : a step reading it can be captured in a CUDA graph and replayed.
    whole_rows_with : the options under which (all of them on) every tensor-parallel rank
        holds the whole rows of the layer (one copy per node that every rank maps), so no
        rank needs another's rows and no all-reduce is needed; (): each rank holds a shard.
    cache_in_front : a hot-row cache in device memory may sit in front of it.
    what : one line for help texts.
    whole_from_files : where the id exchange cannot serve ranks that hold different tokens
        (`attention_rows`'s `exchange_refused`), a rank may instead open the whole layer, read
        its own tokens' rows from the table files and hold no copy of them (only its caches),
        with no collective (the disk tier; elsewhere its shards + exchange read fewer rows on
        the slowest rank: docs/measurements.md section 13).
    """

    name: str
    store_class_path: str
    options: tuple[PlacementOption, ...]
    ids_visit_host: bool
    capturable: bool
    whole_rows_with: tuple[str, ...]
    cache_in_front: bool
    what: str
    whole_from_files: bool = False

    def __post_init__(self):
        if self.capturable and self.ids_visit_host:  # a replay re-runs kernels, never host reads
            raise EngramError(f"placement {self.name}: a placement whose ids visit the host cannot be capturable")
        if not set(self.whole_rows_with) <= self.option_names:
            raise EngramError(f"placement {self.name}: whole_rows_with {self.whole_rows_with!r} are not all its options")

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset(o.name for o in self.options)

    def rows_held(self, options: Mapping[str, Any]) -> str:
        """WHOLE or SHARD: what each tensor-parallel rank holds with these options."""
        defaults = {o.name: o.default for o in self.options}
        on = [options.get(name, defaults[name]) for name in self.whole_rows_with]
        return WHOLE if on and all(on) else SHARD

    def attention_rows(self, options: Mapping[str, Any], exchange_refused: Optional[str] = None) -> str:
        """SHARED_COPY, FROM_FILES or EXCHANGE: how these options serve ranks of one TP group
        that hold different tokens (attention DP/CP). Whole rows where each rank can have them
        without a copy of its own; shards + id exchange otherwise (device, private host, disk).
        `exchange_refused` (why the exchange cannot serve this server, e.g. staged disk graphs):
        whole rows from the files where the placement can read them so, else still EXCHANGE
        (the caller refuses it with that reason)."""
        if self.rows_held(options) == WHOLE:
            return SHARED_COPY
        return FROM_FILES if exchange_refused and self.whole_from_files else EXCHANGE

    def store_class(self):
        """The TableStore class (imports torch and the stores)."""
        module, _, name = self.store_class_path.partition(":")
        return getattr(importlib.import_module(module, __package__), name)


PLACEMENT_TABLE: dict[str, Placement] = {p.name: p for p in (
    Placement("device", ".stores.device:DeviceStore", (), ids_visit_host=False, capturable=True,
              whole_rows_with=(), cache_in_front=False,
              what="device memory (each rank holds a row shard in its HBM)"),
    Placement("host", ".stores.host:HostStore",
              (PlacementOption("shared", "host-shared"), PlacementOption("shm_dir", "shm-dir"),
               PlacementOption("huge_pages", "huge-pages"), PlacementOption("keep", "host-keep", only_when_set=True),
               PlacementOption("numa", "host-numa"), PlacementOption("whole_rows", "host-whole-rows", default=True)),
              ids_visit_host=False, capturable=True, whole_rows_with=("shared", "whole_rows"), cache_in_front=True,
              what="host memory read over UVA (shared: one copy per node, every rank reads whole rows)"),
    Placement("disk", ".stores.disk:DiskStore",
              (PlacementOption("threads", "disk-threads"), PlacementOption("direct", "disk-direct"),
               PlacementOption("retries", "disk-retries"),
               PlacementOption("native_step", "disk-native-step", default=True),
               PlacementOption("dram_cache_bytes", "disk-dram-cache-mib", scale=1 << 20, only_when_set=True)),
              ids_visit_host=True, capturable=False, whole_rows_with=(), cache_in_front=True,
              what="the table files, read on the host per step (each rank reads its row shard)",
              whole_from_files=True),
)}

# The placement names, in the table's order.
PLACEMENTS: tuple[str, ...] = tuple(PLACEMENT_TABLE)


def placement(name: str) -> Placement:
    """The table's entry for `name`; one line naming the choices otherwise."""
    try:
        return PLACEMENT_TABLE[name]
    except (KeyError, TypeError):
        raise EngramError(f"unknown placement {name!r}; choose one of {', '.join(PLACEMENT_TABLE)}") from None
