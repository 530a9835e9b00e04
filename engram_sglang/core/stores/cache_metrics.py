"""Prometheus metrics of the hot-row caches (default registry, next to SGLang's), registered
when the first cache opens. Reads and hits are counted between steps from the directory's
device counters: counting them per call would sync the host, and a replayed graph runs no
Python."""

from __future__ import annotations

from typing import Optional

from .metrics import Lazy


class _CacheMetrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge  # registered when the first cache opens

        labels = ("layer", "placement")
        self.reads = Counter("engram_cache_reads", "Row reads looked up in the hot-row cache", labels)
        self.hits = Counter("engram_cache_hits", "Row reads the hot-row cache served", labels)
        self.hit_rate = Gauge("engram_cache_hit_rate", "Share of row reads the hot-row cache served, since start", labels)
        self.lower = Counter("engram_cache_lower_rows_read",
                             "Rows the cache read from the tier below (distinct per call where that tier dedupes)", labels)
        self.admitted = Counter("engram_cache_admitted_rows", "Rows admitted into the hot-row cache", labels)
        self.bytes = Gauge("engram_cache_bytes", "Device bytes of the hot-row cache (rows and directory)", labels)
        self.rows = Gauge("engram_cache_rows", "Rows the hot-row cache holds", labels)

    @staticmethod
    def _labels(cache) -> dict:
        return {"layer": str(cache.layer_id), "placement": cache.placement}

    def facts(self, cache) -> None:
        lab = self._labels(cache)
        self.bytes.labels(**lab).set(cache.device_bytes)
        self.rows.labels(**lab).set(cache.directory.slots)

    def lower_read(self, cache, lower: int) -> None:
        self.lower.labels(**self._labels(cache)).inc(lower)

    def maintained(self, cache, reads: int, hits: int, new_reads: int, new_hits: int, admitted: int,
                   lower_misses: Optional[int]) -> None:
        """One maintenance: counts since the last one, and the hit rate since start."""
        lab = self._labels(cache)
        self.reads.labels(**lab).inc(new_reads)
        self.hits.labels(**lab).inc(new_hits)
        self.admitted.labels(**lab).inc(admitted)
        if lower_misses is not None:
            self.lower.labels(**lab).inc(lower_misses)
        self.hit_rate.labels(**lab).set(hits / reads if reads else 0.0)


CACHE_METRICS: Lazy[_CacheMetrics] = Lazy(_CacheMetrics)
