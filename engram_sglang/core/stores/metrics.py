"""Prometheus metrics of the table stores and of the runtime's steps (served by SGLang's
/metrics when it is enabled; docs/operations.md lists them).

prometheus_client's default registry is the one SGLang exports, so these appear next to
SGLang's own metrics without extra wiring. The collectors are created when the first store
opens, not when this module is imported: SGLang processes that never open a table (the
detokenizer, a process that only imports the package) register nothing, and the registry
sees each collector exactly once per process.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Generic, Mapping, Optional, TypeVar

from ..rowformat import ROW_BYTES

T = TypeVar("T")

# Which rank a series is of: SGLang's tensor-, data- and pipeline-parallel ranks.
RANKS = ("tp_rank", "dp_rank", "pp_rank")
STORE_LABELS = ("layer", "placement", *RANKS)
STEP_LABELS = ("placement", *RANKS)


def rank_values(ranks: Optional[Mapping[str, int]] = None, tp_rank: int = 0) -> tuple[str, ...]:
    """The RANKS label values: `ranks` where it names them (the runtime passes SGLang's), else
    `tp_rank` of the stores' own arguments and rank 0."""
    got = {"tp_rank": tp_rank, "dp_rank": 0, "pp_rank": 0, **(ranks or {})}
    return tuple(str(int(got[name])) for name in RANKS)


def store_key(store) -> tuple[str, ...]:
    """The STORE_LABELS values of a store."""
    return (str(store.layer_id), store.placement, *store.metric_ranks)


class Lazy(Generic[T]):
    """`factory()` built on first use, once per process (thread-safe); attributes forward to it.

    `get()` builds it explicitly (open_store does, so metrics exist from the moment a store
    opens); any attribute access builds it too, so a store made without open_store still counts.
    """

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._factory()
                value = self._value
        return value

    @property
    def built(self) -> bool:
        return self._value is not None

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


class _StoreMetrics:
    """The stores' and the runtime's collectors. Every series carries the rank labels: SGLang
    serves /metrics through prometheus_client's multiprocess collector, which sums counters
    and histograms over processes, so without them the ranks' series would add up into one;
    gauges keep one value per label set ("mostrecent") instead of one per process `pid`,
    which changes at every restart."""

    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        labels, step = STORE_LABELS, STEP_LABELS

        def gauge(name, what, names=labels):
            return Gauge(name, what, names, multiprocess_mode="mostrecent")

        self.rows = Counter("engram_rows_served", "Rows returned to the model", labels)
        self.bytes = Counter("engram_bytes_served", "Packed bytes of the rows returned", labels)
        self.unique = Counter("engram_unique_rows_read", "Distinct rows read by deduplicating placements", labels)
        self.read_seconds = Histogram(
            "engram_read_seconds", "Time to read one call's rows from the lower tier", labels,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0),
        )
        self.read_errors = Counter("engram_read_errors", "Calls that failed after retries", labels)
        self.dram_lookups = Counter("engram_dram_cache_lookups", "Distinct rows looked up in the disk tier's DRAM "
                                    "row cache", labels)
        self.dram_hits = Counter("engram_dram_cache_hits", "Rows the disk tier's DRAM row cache served", labels)
        self.resident = gauge("engram_resident_bytes", "Table bytes held in memory")
        self.huge = gauge("engram_huge_page_coverage", "Share of host table memory on huge pages")
        self.registered = gauge("engram_registered_bytes", "Host table bytes registered with the GPU")
        # The runtime's (one per rank, all layers): serving/runtime.py.
        self.faults = Counter("engram_read_faults", "Table reads that failed a step's requests (after retries)", step)
        self.step_wait = Histogram(
            "engram_step_wait_seconds", "Time one forward step waited for its Engram rows", step,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0),
        )
        self.info = gauge("engram_build_info", "1 per rank: the plugin version and the tables it serves",
                          (*step, "version", "table_identity", "table_fingerprint"))

    @functools.lru_cache(maxsize=None)
    def _hot(self, key: tuple):
        """The per-call children, looked up once (labels() takes a lock and builds a key)."""
        return (self.rows.labels(*key), self.bytes.labels(*key), self.unique.labels(*key),
                self.read_seconds.labels(*key))

    def opened(self, store) -> None:
        """Every counter of `store` present at 0 from the moment it opens (an alert on errors
        sees a series before the first error, not a series that appears with it)."""
        key = store_key(store)
        self._hot(key)
        self.read_errors.labels(*key).inc(0)
        if getattr(store, "dram", None) is not None:
            self.dram_lookups.labels(*key).inc(0)
            self.dram_hits.labels(*key).inc(0)

    def served(self, store, n: int, unique: int | None = None) -> None:
        rows, nbytes, uniq, _ = self._hot(store_key(store))
        rows.inc(n)
        nbytes.inc(n * ROW_BYTES)
        if unique is not None:
            uniq.inc(unique)

    def read(self, store, unique: int, seconds: float) -> None:
        self._hot(store_key(store))[3].observe(seconds)

    def error(self, store) -> None:
        self.read_errors.labels(*store_key(store)).inc()

    def dram(self, store, lookups: int, hits: int) -> None:
        """Lookups and hits of a disk store's DRAM row cache since the last call (between steps)."""
        key = store_key(store)
        self.dram_lookups.labels(*key).inc(lookups)
        self.dram_hits.labels(*key).inc(hits)

    def host_facts(self, store) -> None:
        key = store_key(store)
        self.resident.labels(*key).set(store.resident_bytes)
        self.huge.labels(*key).set(store.huge.coverage)
        self.registered.labels(*key).set(store.resident_bytes if store.memory.registered else 0)

    # ------------------------------------------------------------------ the runtime's
    @functools.lru_cache(maxsize=None)
    def step(self, key: tuple):
        """(read-fault counter, step-wait histogram) of a runtime's labels (STEP_LABELS
        values), both present from the first call: the runtime makes it when it opens."""
        faults = self.faults.labels(*key)
        faults.inc(0)
        return faults, self.step_wait.labels(*key)

    def build_info(self, key: tuple, version: str, table_identity: str, table_fingerprint: str) -> None:
        self.info.labels(*key, version, table_identity, table_fingerprint).set(1)


METRICS: Lazy[_StoreMetrics] = Lazy(_StoreMetrics)
