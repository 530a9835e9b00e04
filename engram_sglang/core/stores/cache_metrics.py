"""Prometheus metrics of the hot-row caches (default registry, next to SGLang's), registered
when the first cache opens. Reads and hits are counted between steps from the directory's
device counters: counting them per call would sync the host, and a replayed graph runs no
Python. Labels and gauge aggregation as the stores' (metrics.py)."""

from __future__ import annotations

from typing import Optional

from .metrics import STORE_LABELS, Lazy, store_key


class _CacheMetrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge  # registered when the first cache opens

        labels = STORE_LABELS

        def gauge(name, what):
            return Gauge(name, what, labels, multiprocess_mode="mostrecent")

        self.reads = Counter("engram_cache_reads", "Row reads looked up in the hot-row cache", labels)
        self.hits = Counter("engram_cache_hits", "Row reads the hot-row cache served", labels)
        self.hit_rate = gauge("engram_cache_hit_rate", "Share of row reads the hot-row cache served, since start")
        self.lower = Counter("engram_cache_lower_rows_read",
                             "Rows the cache read from the tier below (distinct per call where that tier dedupes)", labels)
        self.admitted = Counter("engram_cache_admitted_rows", "Rows admitted into the hot-row cache", labels)
        self.bytes = gauge("engram_cache_bytes", "Device bytes of the hot-row cache (rows and directory)")
        self.rows = gauge("engram_cache_rows", "Rows the hot-row cache holds")

    def facts(self, cache) -> None:
        """When the cache opens: its size, and every counter present at 0."""
        key = store_key(cache)
        self.bytes.labels(*key).set(cache.device_bytes)
        self.rows.labels(*key).set(cache.directory.slots)
        self.hit_rate.labels(*key).set(0.0)
        for counter in (self.reads, self.hits, self.lower, self.admitted):
            counter.labels(*key).inc(0)

    def lower_read(self, cache, lower: int) -> None:
        self.lower.labels(*store_key(cache)).inc(lower)

    def maintained(self, cache, reads: int, hits: int, new_reads: int, new_hits: int, admitted: int,
                   lower_misses: Optional[int]) -> None:
        """One maintenance: counts since the last one, and the hit rate since start."""
        key = store_key(cache)
        self.reads.labels(*key).inc(new_reads)
        self.hits.labels(*key).inc(new_hits)
        self.admitted.labels(*key).inc(admitted)
        if lower_misses is not None:
            self.lower.labels(*key).inc(lower_misses)
        self.hit_rate.labels(*key).set(hits / reads if reads else 0.0)


CACHE_METRICS: Lazy[_CacheMetrics] = Lazy(_CacheMetrics)
