"""Prometheus metrics of the table stores (served by SGLang's /metrics when it is enabled).

prometheus_client's default registry is the one SGLang exports, so these appear next to
SGLang's own metrics without extra wiring. The collectors are created when the first store
opens, not when this module is imported: SGLang processes that never open a table (the
detokenizer, a process that only imports the package) register nothing, and the registry
sees each collector exactly once per process.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Generic, TypeVar

from ..rowformat import ROW_BYTES

T = TypeVar("T")


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
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        labels = ("layer", "placement")
        self.rows = Counter("engram_rows_served", "Rows returned to the model", labels)
        self.bytes = Counter("engram_bytes_served", "Packed bytes of the rows returned", labels)
        self.unique = Counter("engram_unique_rows_read", "Distinct rows read by deduplicating placements", labels)
        self.read_seconds = Histogram(
            "engram_read_seconds", "Time to read one call's rows from the lower tier", labels,
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0),
        )
        self.read_errors = Counter("engram_read_errors", "Calls that failed after retries", labels)
        self.resident = Gauge("engram_resident_bytes", "Table bytes held in memory", labels)
        self.huge = Gauge("engram_huge_page_coverage", "Share of host table memory on huge pages", labels)
        self.registered = Gauge("engram_registered_bytes", "Host table bytes registered with the GPU", labels)

    @staticmethod
    def _labels(store) -> dict:
        return {"layer": str(store.layer_id), "placement": store.placement}

    @functools.lru_cache(maxsize=None)
    def _hot(self, layer: str, placement: str):
        """The per-call children, looked up once (labels() takes a lock and builds a key)."""
        lab = {"layer": layer, "placement": placement}
        return (self.rows.labels(**lab), self.bytes.labels(**lab), self.unique.labels(**lab),
                self.read_seconds.labels(**lab))

    def served(self, store, n: int, unique: int | None = None) -> None:
        rows, nbytes, uniq, _ = self._hot(str(store.layer_id), store.placement)
        rows.inc(n)
        nbytes.inc(n * ROW_BYTES)
        if unique is not None:
            uniq.inc(unique)

    def read(self, store, unique: int, seconds: float) -> None:
        self._hot(str(store.layer_id), store.placement)[3].observe(seconds)

    def error(self, store) -> None:
        self.read_errors.labels(**self._labels(store)).inc()

    def host_facts(self, store) -> None:
        lab = self._labels(store)
        self.resident.labels(**lab).set(store.resident_bytes)
        self.huge.labels(**lab).set(store.huge.coverage)
        self.registered.labels(**lab).set(store.resident_bytes if store.memory.registered else 0)


METRICS: Lazy[_StoreMetrics] = Lazy(_StoreMetrics)
