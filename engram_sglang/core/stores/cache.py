"""A hot-row cache in device memory in front of a host or disk table store.

Real Engram lookups are skewed (docs/measurements.md): a cache of 1-5% of a table's rows
serves about half of the reads. `HotRowCache` holds packed 264-byte rows on the compute
device and decodes hits with the op every placement uses (`gather_dequant`), so its bits
are those of the store it wraps.

The policy is `RowDirectory` (row_directory.py), in two halves with different rules: the
lookup (every call, on the device, fixed shapes, no host sync, no Python state: a host-tier
lookup can be captured in a CUDA graph and replayed, misses read over UVA by the same op)
and the maintenance (admission, eviction, aging, metrics: host syncs). A gather never
maintains; maintenance runs between forward steps, outside any graph, driven by the device
counters so that replays count: `maintenance.between_steps()`, which the serving layer
calls after every forward step, maintains each cache every `maintain_every` steps
(stores/maintenance.py has the cadence and its cost). Standalone users call
`between_steps()` or `maintain()` themselves. Checked on the CPU by tests/support/capture.py (any
host sync or Python state change inside a "captured" call raises) and by replaying a traced
graph of the gather (tests/core/test_capture.py); real CUDA capture runs in bench/gpu_check.py.

Measured against LRU, a static frequency set, an idealized LFU (exact counts, fully
associative, admission every step) and the offline optimum in bench/cache.py: on real
decode traces this directory is within a point of the idealized LFU at every size, above
LRU up to 5% of rows (equal at 10%); the offline optimum is 10-14 points higher up to 2% of
rows, a gap that no frequency policy closes (see the bench's docstring). Maintenance every
call instead of every 8 gains nothing there and costs ~1.6x the CPU time per call.
Pre-warming (`profile=`) fills empty ways with the hottest rows of a profile of other text
(`engram-sglang profile`); they start as rows read once, so traffic decides what stays.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

import numpy as np
import torch

from ..errors import EngramError
from ..rowformat import ROW_BYTES, ROW_VALUES
from . import maintenance
from .base import TableReadFault, TableStore, split_by_rows
from .cache_metrics import CACHE_METRICS
from .row_directory import SLOT_OVERHEAD, RowDirectory, default_sketch_width, plan_slots, ring_entries

__all__ = ["HotRowCache", "RowDirectory", "SLOT_OVERHEAD", "default_sketch_width", "plan_slots", "ring_entries",
           "wrap_stores"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------ store
class HotRowCache(TableStore):
    """A TableStore that serves hot rows from device memory and the rest from `inner`.

    Parameters
    ----------
    inner : the store below (host or disk placement; a device store works, for tests).
    cache_bytes : device bytes for the cache: rows, directory and sketch (see `plan_slots`).
    ways : rows per set.
    maintain_every : steps between two maintenances (aging, admission and eviction, metrics;
        host syncs) when `maintenance.between_steps()` drives them (the serving layer calls
        it after every forward step); 0: only when the caller calls `maintain()`. A gather
        never maintains: it may be a captured graph.
    profile : a profile file (`engram-sglang profile`) to pre-warm from.
    fingerprint : the tables' config fingerprint; a profile made for another config is refused.
    sample_factor, sketch_depth : see RowDirectory.

    Results are bit-identical to `inner`'s: hits are decoded from the cached packed rows
    and misses from the tier below, by the same op.
    """

    def __init__(self, inner: TableStore, cache_bytes: int, *, ways: int = 16,
                 maintain_every: int = maintenance.DEFAULT_EVERY,
                 profile: Optional[str | os.PathLike] = None, fingerprint: Optional[str] = None,
                 sample_factor: float = 100.0, sketch_depth: int = 4):
        super().__init__(inner.layer_id, inner.path, inner.rows, inner.row_ranges, inner.device, inner.backend,
                         metric_ranks=inner.metric_ranks)
        self.agreed_whole = inner.agreed_whole
        self.inner = inner
        self.placement = inner.placement
        self.needs_host_ids = inner.needs_host_ids
        if not self.needs_host_ids and inner.resident_table is None:
            raise EngramError(f"engram layer {self.layer_id}: a hot-row cache reads misses from the store below's "
                              f"resident table or by its host reads; placement {inner.placement} has neither")
        if maintain_every < 0:
            raise EngramError(f"hot-row cache: maintain_every must be >= 0, got {maintain_every}")
        slots = plan_slots(cache_bytes, ways, sketch_depth=sketch_depth)
        if slots < ways:
            raise EngramError(
                f"engram layer {self.layer_id}: a hot-row cache of {cache_bytes:,} bytes holds no full set of {ways} rows "
                f"(each row costs ~{ROW_BYTES + SLOT_OVERHEAD + 8 * sketch_depth} bytes with its directory entry)")
        slots = min(slots, max(ways, self.rows_held // ways * ways))  # no more slots than rows
        self.directory = RowDirectory(slots, ways, self.device, sample_factor=sample_factor, sketch_depth=sketch_depth,
                                      ring=ring_entries(cache_bytes))
        # Row `slots` stays zero and is never decoded for a result (misses take the lower row).
        self.cache_rows = torch.zeros((self.directory.slots + 1, ROW_BYTES), dtype=torch.uint8, device=self.device)
        self.cache_bytes = cache_bytes
        self.maintain_every = maintain_every
        self.profile_path = None
        self.prewarmed = 0
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # disk misses since the last maintenance
        self._lower_rows = 0  # rows read from the tier below (disk: distinct per call)
        self._reported_hits = 0
        self._reported_reads = 0
        self.failed_admissions = 0  # maintenances whose rows could not be read (tier below failed)
        self._cache_lock = threading.RLock()
        if profile is not None:
            self.prewarm(profile, fingerprint)
        CACHE_METRICS.facts(self)

    # ------------------------------------------------------------------ facts
    @property
    def device_bytes(self) -> int:
        return self.cache_rows.numel() + self.directory.nbytes

    @property
    def resident_bytes(self) -> int:
        return self.inner.resident_bytes + self.device_bytes

    def stats(self) -> dict:
        with self._cache_lock:
            d = self.directory
            c = d.counters()
            hits, reads = c["hits"], c["reads"]
            s = super().stats()
            s.update(
                cache_bytes=self.device_bytes, cache_rows=d.slots, cache_ways=d.ways,
                cache_share=d.slots / max(1, self.rows_held),
                cache_lookups=c["lookups"], cache_reads=reads, cache_hits=hits,
                cache_hit_rate=hits / reads if reads else 0.0, cache_admitted=d.admitted,
                cache_maintenances=d.maintenances, cache_agings=d.agings, cache_prewarmed=self.prewarmed,
                cache_failed_admissions=self.failed_admissions,
                lower_rows_read=self._lower_rows if self.needs_host_ids else reads - hits,
                inner=self.inner.stats(),
            )
            return s

    def describe(self) -> str:
        d = self.directory
        warm = f", pre-warmed with {self.prewarmed:,} rows from {self.profile_path}" if self.profile_path else ""
        when = f"every {self.maintain_every} steps" if self.maintain_every else "when maintain() is called"
        return (f"{self.inner.describe()}; hot-row cache {self.device_bytes / 2**30:.2f} GiB on {self.device}: "
                f"{d.slots:,} rows ({d.slots / max(1, self.rows_held):.2%} of the {'table' if self.holds_whole_rows else 'shard'}), "
                f"{d.ways}-way, "
                f"admission {when}{warm}")

    # ------------------------------------------------------------------ reads
    def _gather(self, ids, out):
        from ..ops import gather_dequant

        with self._cache_lock:
            flat = ids.reshape(-1).to(self.device, torch.int64)
            hit, slot = self.directory.lookup(torch.where(self.inner.holds(flat), flat, -1))
            # The dump slot lies outside (0, slots): misses decode to +0 here.
            cached = gather_dequant(self.cache_rows, slot, row_range=(0, self.directory.slots), backend=self.backend)
            fault = None
            if self.needs_host_ids:
                lower, unique, fault = self._lower_from_host(flat, hit)
            else:
                # -1 lies outside every row range: hits cost the tier below no read at all.
                # The resident table as the op reads it (a host store's device address).
                below = self.inner.resident_table
                index, row_range = self.inner.table_index(torch.where(hit, -1, flat))
                lower = gather_dequant(below.table, index, row_range=row_range,
                                       backend=self.backend, table_address=below.address)
                unique = None
            rows = torch.where(hit.unsqueeze(-1), cached, lower).view(*ids.shape, ROW_VALUES)
            if out is not None:
                out.copy_(rows)
                rows = out
            if unique is not None:  # (host-id tiers only: never inside a graph)
                CACHE_METRICS.lower_read(self, unique)
            if fault is not None:  # every other row is exact: the caller fails only who needed these
                fault.rows = rows
                raise fault
            return rows, unique

    def _lower_from_host(self, flat: torch.Tensor, hit: torch.Tensor):
        """Misses of a host-ids tier (disk): read each distinct missed row once, keep the
        packed rows for the next maintenance, decode them with the same op. Returns (rows,
        distinct rows read, the TableReadFault of rows that could not be read, or None):
        those rows are +0 and never kept for admission."""
        from ..ops import gather_dequant

        flat_h, hit_h = flat.cpu(), hit.cpu()
        need = ~hit_h & self.inner.holds(flat_h)
        uniq, inverse = torch.unique(flat_h[need], return_inverse=True)  # sorted: neighbours share pages
        if uniq.numel() == 0:  # all hits (or other shards' rows)
            return torch.zeros((flat.numel(), ROW_VALUES), dtype=torch.bfloat16, device=self.device), 0, None
        fault = None
        try:
            packed = self._read_lower(uniq.numpy())
        except TableReadFault as e:
            fault, packed = e, e.packed
        ok = ~np.isin(uniq.numpy(), fault.failed_ids) if fault is not None else slice(None)
        self._pending.append((uniq.numpy()[ok], packed[ok]))
        self._lower_rows += uniq.numel()
        local = torch.full_like(flat_h, uniq.numel())  # outside (0, n): +0 rows (hits, other shards)
        local[need] = inverse
        table = torch.from_numpy(packed).to(self.device)
        rows = gather_dequant(table, local.to(self.device), row_range=(0, uniq.numel()), backend=self.backend)
        return rows, uniq.numel(), fault

    def _read_lower(self, wanted: np.ndarray) -> np.ndarray:
        """Packed rows [n, 264] of sorted distinct global ids, from the tier below."""
        read = self.inner.read_packed
        return read(np.ascontiguousarray(wanted, dtype=np.int64))

    def _packed(self, ids: torch.Tensor) -> torch.Tensor:
        """Packed rows of `ids` (this shard's, on the device) for admission."""
        if ids.numel() == 0:
            return self.cache_rows[:0]
        below = self.inner.resident_table
        if below is not None:
            local, (first, _) = self.inner.table_index(ids)
            return below.table[(local - first).to(below.table.device)].to(self.device, non_blocking=True)
        ids_h = ids.cpu().numpy()
        out = np.empty((ids_h.shape[0], ROW_BYTES), dtype=np.uint8)
        found = np.zeros(ids_h.shape[0], dtype=bool)
        if self._pending:
            have = np.concatenate([p[0] for p in self._pending])
            rows = np.concatenate([p[1] for p in self._pending])
            order = np.argsort(have, kind="stable")
            have = have[order]
            pos = np.minimum(np.searchsorted(have, ids_h), max(0, have.shape[0] - 1))
            found = have[pos] == ids_h if have.shape[0] else found
            out[found] = rows[order[pos[found]]]
        if not found.all():
            missing = np.unique(ids_h[~found])
            got = self._read_lower(missing)
            out[~found] = got[np.searchsorted(missing, ids_h[~found])]
        return torch.from_numpy(out).to(self.device)

    # ------------------------------------------------------------ maintenance
    def maintain(self) -> int:
        """Between steps (host syncs; never inside a graph capture): admit and evict from
        the misses since the last call, then bring the metrics up to date from the device
        counters (replays included). Returns the rows admitted."""
        with self._cache_lock:
            d = self.directory
            counters = d.counters()
            ids, slots = d.maintain(counters, install=False)
            if ids.numel():
                try:
                    rows = self._packed(ids)
                except EngramError as e:  # the tier below failed: admit nothing this time
                    logger.warning("engram layer %d: hot-row cache admission skipped: %s", self.layer_id, e)
                    self.failed_admissions += 1
                    ids = slots = ids[:0]
                else:
                    # Rows first, then the tags that name them: a failed read never leaves a
                    # tag pointing at a row that is not there.
                    self.cache_rows[slots] = rows
                    d.install(ids, slots)
            self._pending.clear()
            hits, reads = counters["hits"], counters["reads"]
            new_hits, new_reads = hits - self._reported_hits, reads - self._reported_reads
            self._reported_hits, self._reported_reads = hits, reads
            CACHE_METRICS.maintained(self, reads, hits, new_reads, new_hits, ids.numel(),
                                     None if self.needs_host_ids else new_reads - new_hits)
            super().maintain()
            return ids.numel()

    # --------------------------------------------------- the contract, from the store below
    @property
    def reads_ahead(self) -> bool:
        return self.inner.reads_ahead

    @property
    def node_shared(self) -> bool:
        return self.inner.node_shared

    def read_ahead(self, ids):
        return self.inner.read_ahead(ids)

    def read_packed(self, wanted: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        return self.inner.read_packed(wanted, out=out)

    def prewarm(self, profile: str | os.PathLike, fingerprint: Optional[str] = None) -> int:
        """Fill the cache with this layer's hottest profiled rows. Returns the rows added."""
        from ..profile_format import read_profile

        prof = read_profile(profile, fingerprint)
        try:
            ids, counts, _ = prof.layer(self.layer_id)
        finally:
            prof.close()
        if ids.size and int(ids.max()) >= self.rows:
            raise EngramError(f"{profile}: layer {self.layer_id} row {int(ids.max())} is outside the table's "
                              f"{self.rows} rows: the profile was made for another table")
        mine = self.inner.holds(torch.from_numpy(ids)).numpy()
        with self._cache_lock:
            got, slots = self.directory.prewarm(torch.from_numpy(ids[mine]), torch.from_numpy(counts[mine]))
            if got.numel():
                self.cache_rows[slots] = self._packed(got)
            self._pending.clear()
        self.profile_path = str(profile)
        self.prewarmed += got.numel()
        logger.info("engram layer %d: hot-row cache pre-warmed with %d rows from %s", self.layer_id, got.numel(), profile)
        return got.numel()

    def close(self) -> None:
        super().close()
        self.inner.close()


def wrap_stores(stores: dict[int, TableStore], cache_bytes: int, *, profile: Optional[str | os.PathLike] = None,
                fingerprint: Optional[str] = None, **options) -> dict[int, TableStore]:
    """Put a hot-row cache in front of each layer's store, splitting `cache_bytes` (device
    bytes for all layers together) in proportion to the rows each store holds."""
    if cache_bytes <= 0:
        return stores
    budget = split_by_rows(cache_bytes, {L: s.rows_held for L, s in stores.items()})
    out: dict[int, TableStore] = {}
    try:
        for L, store in sorted(stores.items()):
            out[L] = HotRowCache(store, budget[L], profile=profile, fingerprint=fingerprint,
                                 **options)
            logger.info("%s", out[L].describe())
    except BaseException:
        for L, store in stores.items():
            (out.get(L) or store).close()
        raise
    return out
