"""The disk placement: rows read from the layer file on demand (mmap or O_DIRECT reads), an
optional DRAM row cache in front, staged and decoded by the same op as every placement."""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from ..errors import EngramError
from ..fileio import READ_BACKOFF_S, READ_RETRIES
from ..ops import gather_dequant
from ..rowformat import ROW_BYTES, ROW_VALUES
from ..tablefile import DATA_OFFSET
from . import rowio
from .base import Prefetch, TableIOError, TableReadFault, TableStore
from .disk_step import NativeStep
from .dram_cache import DramRowCache
from .metrics import METRICS
from .staging import StagingPool

logger = logging.getLogger(__name__)

# Distinct rows of a call from which the DRAM-cached disk store overlaps its work on threads.
_OVERLAP_ROWS = 16384
# Read-ahead reads in pieces of this many rows (~25 ms at 85 k IOPS), each admitted when it
# lands: a step that needs rows of the piece in flight waits at most one piece for them
# instead of reading them a second time beside it.
_AHEAD_PIECE_ROWS = 2048
_AHEAD_WAIT_S = 10.0
# A lookup fstats its layer file at most once in this many seconds (a file rewritten in place
# under the store is noticed within it). One fstat is ~1 us; per step and layer file the check
# costs docs/operations.md's figure ("Tables changed under a running server").
_CHANGE_CHECK_S = 0.1


class DiskStore(TableStore):
    """Rows read from the layer file on demand; the table is never held in RAM by us.

    Each call dedupes its ids, reads the unique rows in its shard with `threads` reads in
    flight (through a persistent MADV_RANDOM mapping, so page-cached rows cost a memory
    read; or with `direct=True` by O_DIRECT reads through native AIO, falling back to
    threads of pread where AIO is unavailable), stages them, and decodes with the
    same op as every placement. A failed read is retried through pread (which reports
    the real errno), then raises TableIOError for that call only.

    `dram_cache_bytes` puts a row-granular DRAM cache (DramRowCache) in front of the file:
    hits are copied from it, misses read from the file and admitted. `read_ahead(ids)`
    reads rows into it before the step that needs them (a prefill's next chunk).

    `native_step` (default): each call is one native call (disk_step.py: dedupe, DRAM-cache
    lookup, hits, reads, admission, and on the CPU the decode). False: the numpy path, the
    same-run baseline (bench/disk_step.py); both give the same bits and the same hits.
    """

    placement = "disk"  # (its ids visit the host: needs_host_ids, from the placement table)

    def __init__(self, layer_id, path, rows, row_range, device, backend, *, threads: int = 64, direct: bool = False,
                 retries: int = READ_RETRIES, dram_cache_bytes: int = 0, native_step: bool = True, metric_ranks=None):
        super().__init__(layer_id, path, rows, row_range, device, backend, metric_ranks=metric_ranks)
        if threads < 1:
            raise EngramError(f"disk store: threads must be >= 1, got {threads}")
        if dram_cache_bytes < 0:
            raise EngramError(f"disk store: dram_cache_bytes must be >= 0, got {dram_cache_bytes}")
        self.dram = DramRowCache(dram_cache_bytes, max_rows=self.rows_held) if dram_cache_bytes else None
        self._file_rows = 0  # rows read from the file (cache misses), all calls
        self._published_dram = (0, 0)  # DRAM-cache lookups and hits already in the Prometheus counters
        self._ahead: Optional[ThreadPoolExecutor] = None  # read-ahead
        self._io: Optional[ThreadPoolExecutor] = None  # a call's misses, read while its hits are copied
        self._admitter: Optional[ThreadPoolExecutor] = None
        self._admission: Optional[Future] = None
        self._ahead_rows = 0
        # (sorted ids, landed) of the read-ahead piece being read now; None when none is.
        self._ahead_piece: Optional[tuple[np.ndarray, threading.Event]] = None
        rowio.library()  # fail at start-up, not at the first request, when it is not built
        self.threads, self.direct, self.retries = threads, direct, retries
        self._fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        self._aio = direct  # O_DIRECT reads by native AIO while the kernel allows it
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._map = None
        if not direct:
            self._map = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
            self._map.madvise(mmap.MADV_RANDOM)  # a miss reads its page, not an 8 MiB window
            self._base = np.frombuffer(self._map, dtype=np.uint8).ctypes.data + DATA_OFFSET
        self._read_latencies: deque[float] = deque(maxlen=4096)  # recent calls, for stats()
        self._staging: Optional[StagingPool] = None  # pinned double buffer (GPU prefetch)
        self.native_step = native_step
        self._native = NativeStep(self)
        self._changed: Optional[str] = None  # why the file no longer holds the rows it held (then every lookup fails)
        self._identity = _identity(os.fstat(self._fd))
        self._header = self._header_page()
        self._checked = time.monotonic()
        self._change_lock = threading.Lock()

    @property
    def resident_bytes(self) -> int:
        return 0

    def stats(self) -> dict:
        s = super().stats()
        lat = np.array(self._read_latencies) if self._read_latencies else np.zeros(1)
        s.update(reads=len(self._read_latencies), read_ms_p50=1e3 * float(np.percentile(lat, 50)),
                 read_ms_p99=1e3 * float(np.percentile(lat, 99)), direct=self.direct, threads=self.threads,
                 file_rows_read=self._file_rows, read_ahead_rows=self._ahead_rows)
        if self.direct:  # e.g. "io_uring (registered buffers: 128 of 256, RLIMIT_MEMLOCK)"
            s["io_engine"] = rowio.io_engine_label() if self._aio else "pread"
        if self.dram is not None:
            s.update(self.dram.stats())
        return s

    def maintain(self) -> int:
        """Between steps: the DRAM row cache's lookups and hits since the last call go to the
        Prometheus counters (the native step counts them in the cache's state)."""
        if self.dram is not None:
            lookups, hits = self.dram.lookups, self.dram.hits
            METRICS.dram(self, lookups - self._published_dram[0], hits - self._published_dram[1])
            self._published_dram = (lookups, hits)
        return super().maintain()

    def _gather(self, ids, out):
        # The ids visit the host once per call: the reads need them there (on a GPU,
        # `.to("cpu")` on the caller's stream waits for the kernel that made them).
        flat = self._own_ids(ids.reshape(-1).to("cpu", torch.int64).numpy())
        self._check_unchanged()
        self._await_ahead(flat)
        if self.native_step:
            return self._gather_native(ids, flat, out)
        wanted, local = self._plan(flat)
        fault = None
        try:
            staging = self._timed_read(wanted)
        except TableReadFault as e:
            fault, staging = e, e.packed
        table = torch.from_numpy(staging).to(self.device)
        local = torch.from_numpy(local).view(ids.shape).to(self.device)
        rows = gather_dequant(table, local, out=out, row_range=(0, wanted.shape[0]), backend=self.backend)
        METRICS.served(self, ids.numel(), unique=wanted.shape[0])
        if fault is not None:
            fault.rows = rows
            raise fault
        return rows, wanted.shape[0]

    def _gather_native(self, ids, flat: np.ndarray, out):
        """One native call; on the CPU it decodes into the rows too."""
        n = flat.shape[0]
        local = np.empty(n, np.int64)
        packed = np.empty((max(1, n), ROW_BYTES), np.uint8)
        rows = rows_bits = None
        if self.device.type == "cpu":
            contiguous = out is not None and out.is_contiguous()
            rows = out if contiguous else torch.empty((*ids.shape, ROW_VALUES), dtype=torch.bfloat16)
            rows_bits = rows.view(torch.int16).numpy().reshape(n, ROW_VALUES)
        served = self._native.run(flat, local, packed, rows_bits)
        if served.decoded:
            if out is not None and rows is not out:
                rows = out.copy_(rows)
        else:  # on a GPU; or the misses were read by the store's reader after a failure
            table = torch.from_numpy(packed[: served.unique]).to(self.device)
            index = torch.from_numpy(local).view(ids.shape).to(self.device)
            rows = gather_dequant(table, index, out=out, row_range=(0, served.unique), backend=self.backend)
        METRICS.served(self, ids.numel(), unique=served.unique)
        if served.fault is not None:
            served.fault.rows = rows
            raise served.fault
        return rows, served.unique

    def _own_ids(self, flat: np.ndarray) -> np.ndarray:
        """Host ids with those of other ranks between this shard's ranges (a balanced shard,
        several ranges) made -1: every read path below (the native step's, `_plan`'s, the
        read-ahead's) then keeps the ids inside the span `row_range`, which are this shard's."""
        if self.shard is None:
            return flat
        return np.where(self.shard.holds(flat), flat, -1)

    def _plan(self, flat: np.ndarray, local_out: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """(sorted distinct ids of this shard, staging index of each id). Ids outside the
        shard point one past the staged rows, which the op's row_range turns into +0.0 rows.
        The index work is numpy's: on a decode step's few hundred ids torch's per-op
        overhead dominated."""
        uniq, inverse = np.unique(flat, return_inverse=True)  # sorted: neighbours share pages
        first, end = np.searchsorted(uniq, self.row_range)  # sorted ids: this shard's rows are one slice
        wanted = uniq[first:end]
        local = np.subtract(inverse.reshape(-1), first, out=local_out)
        local[(local < 0) | (local >= wanted.shape[0])] = wanted.shape[0]
        return wanted, local

    def _timed_read(self, wanted: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        t0 = time.perf_counter()
        staging = self.read_packed(wanted, out=out)
        seconds = time.perf_counter() - t0
        self._read_latencies.append(seconds)
        METRICS.read(self, wanted.shape[0], seconds)
        return staging

    # ----------------------------------------------- prefetch on a GPU: host half, stream half
    def _prefetch_host_ids(self, ids: torch.Tensor, streams) -> Prefetch:
        """The caller's stream copies the ids into pinned memory and records an event; a
        worker thread waits for it on the host, reads the packed rows into the slot's pinned
        staging (file I/O only, no stream work); `wait()` copies them to the device and
        decodes them on the consumer's stream."""
        if self._staging is None:
            self._staging = StagingPool(streams)
        slot = self._staging.acquire()
        try:
            n = ids.numel()
            ready = None
            if streams.on_device(ids):
                host_ids = slot.buffer("ids", (n,), torch.int64)
                streams.to_host(ids.reshape(-1), host_ids)  # on the stream that made the ids
                ready = streams.record_event(streams.current())
            else:
                host_ids = ids.reshape(-1).to(torch.int64)
            future = self._worker_thread().submit(self._stage, slot, host_ids, ready, tuple(ids.shape))
        except BaseException:
            self._staging.free(slot)
            raise
        return Prefetch(future=future, finish=self._finish_staged, discard=self._discard_staged)

    def _stage(self, slot, host_ids: torch.Tensor, ready, shape: tuple) -> "_Staged":
        """Worker thread: the packed rows of the ids into pinned staging."""
        try:
            t0 = time.perf_counter()
            if ready is not None:
                self._streams.synchronize_event(ready)  # the ids' copy has landed
            slot.wait_free()  # the GPU no longer copies out of this slot's buffers
            flat = host_ids.numpy()
            if flat.size:
                self._check_ids(int(flat.min()), int(flat.max()))
            flat = self._own_ids(flat)
            self._check_unchanged()
            self._await_ahead(flat)
            local = slot.buffer("local", (flat.shape[0],), torch.int64)
            if self.native_step:
                packed = slot.buffer("packed", (max(1, flat.shape[0]), ROW_BYTES), torch.uint8)
                served = self._native.run(flat, local.numpy(), packed.numpy())
                return _Staged(slot, packed[: max(1, served.unique)], local, shape, served.unique,
                               time.perf_counter() - t0, served.fault)
            wanted, _ = self._plan(flat, local_out=local.numpy())
            # One row at least: a table of no rows has no valid strides (every id is out of range then).
            packed = slot.buffer("packed", (max(1, wanted.shape[0]), ROW_BYTES), torch.uint8)
            fault = None
            try:
                self._timed_read(wanted, out=packed.numpy()[: wanted.shape[0]])
            except TableReadFault as e:  # the rows read are in `packed`, the failed ones +0
                fault = e
            return _Staged(slot, packed, local, shape, int(wanted.shape[0]), time.perf_counter() - t0, fault)
        except BaseException:
            self._staging.free(slot)
            raise

    def _finish_staged(self, staged: "_Staged") -> torch.Tensor:
        """Consumer's thread and stream: copy the staged rows in, decode them there."""
        streams = self._streams
        try:
            table = streams.to_device(staged.packed)
            local = streams.to_device(staged.local)
            copied = streams.record_event(streams.current())
        except BaseException:
            self._staging.free(staged.slot)
            raise
        self._staging.free(staged.slot, copied)
        t0 = time.perf_counter()
        rows = gather_dequant(table, local.view(staged.shape), row_range=(0, staged.unique), backend=self.backend)
        METRICS.served(self, local.numel(), unique=staged.unique)
        self._account(local.numel(), staged.seconds + time.perf_counter() - t0, staged.unique)
        if staged.fault is not None:
            staged.fault.rows = rows
            raise staged.fault
        return rows

    def _discard_staged(self, staged: "_Staged") -> None:
        """A released handle: nothing was queued on a stream, the slot is free as it is."""
        self._staging.free(staged.slot)

    def read_packed(self, wanted: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Packed rows [n, 264] of sorted distinct global row ids (all inside this file),
        from the DRAM cache where it holds them, else from the file (then admitted);
        written into `out` (uint8 [n, 264], e.g. pinned staging) when given."""
        wanted = np.ascontiguousarray(wanted, dtype=np.int64)
        self._check_unchanged()
        self._await_ahead(wanted)
        if self.native_step and wanted.shape[0]:
            into = out is not None and out.flags.c_contiguous  # the native call writes rows back to back
            staging = out if into else np.empty((wanted.shape[0], ROW_BYTES), dtype=np.uint8)
            served = self._native.run(wanted, np.empty(wanted.shape[0], np.int64), staging)
            if out is not None and not into:
                out[...] = staging
                staging = out
            if served.fault is not None:
                raise served.fault
            return staging
        if self.dram is None or wanted.shape[0] == 0:
            staging = self._read_file(wanted, out=out)
            self._file_rows += wanted.shape[0]
            return staging
        if self._admission is not None:  # the previous call's admissions (done by now, normally)
            self._admission.result()
            self._admission = None
        staging = np.empty((wanted.shape[0], ROW_BYTES), dtype=np.uint8) if out is None else out
        # Big calls (prefill chunks) overlap: the misses' reads start first and the hits are
        # copied while they are in flight; admission runs after the call returns. For a
        # decode step's few thousand rows two thread hand-offs cost more than they save
        # (and on a small machine the extra threads take CPU from the model).
        overlap = wanted.shape[0] >= _OVERLAP_ROWS
        reading = None
        with self.dram.lock:
            hit, slot = self.dram.lookup(wanted)
            missed = wanted[~hit]
            if missed.shape[0] and overlap:
                reading = self._worker("_io", "io").submit(self._read_file, missed)
            self.dram.copy_hits(slot, hit, staging)  # under the lock: no admission reuses a slot meanwhile
        if not missed.shape[0]:
            return staging
        fault = None
        try:
            got = reading.result() if reading is not None else self._read_file(missed)
        except TableReadFault as e:  # admit what was read, never the failed rows
            fault, got = e, e.packed
            keep = ~np.isin(missed, e.failed_ids)
            missed, got = missed[keep], got[keep]
            staging[~hit] = e.packed
        else:
            staging[~hit] = got
        self._file_rows += missed.shape[0]
        if fault is not None:
            self._admit(missed, got)
            fault.packed = staging
            raise fault
        if overlap:
            # The next call waits for it only if it is not done.
            self._admission = self._worker("_admitter", "admit").submit(self._admit, missed, got)
        else:
            self._admit(missed, got)
        return staging

    def _admit(self, ids: np.ndarray, rows: np.ndarray, *, new_use: bool = False) -> None:
        with self.dram.lock:
            new = ~self.dram.contains(ids)  # admitted by another thread meanwhile
            if new_use:
                self.dram.begin()  # read ahead: the most recent rows, not those of the last lookup
            self.dram.admit(ids[new], rows[new])

    def _worker(self, attr: str, name: str) -> ThreadPoolExecutor:
        """One lazily started thread of this store (its I/O, its admissions)."""
        pool = getattr(self, attr)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engram-{name}-l{self.layer_id}",
                                      initializer=self._thread_device())
            setattr(self, attr, pool)
        return pool

    @property
    def reads_ahead(self) -> bool:
        return self.dram is not None

    def read_ahead(self, ids: torch.Tensor | np.ndarray) -> Optional[Future]:
        """Start reading the rows of `ids` (any shape; other shards' ids ignored) into the
        DRAM cache, or into the page cache when there is none; returns a Future of the rows
        read, or None when nothing would keep them (O_DIRECT reads and no DRAM cache).
        Reads run on one background thread, in order; a failure is logged, never raised:
        the gather that needs the rows reads them again and reports it."""
        if self.dram is None and self.direct:
            return None
        flat = ids.reshape(-1).to("cpu", torch.int64).numpy() if isinstance(ids, torch.Tensor) else ids.reshape(-1)
        uniq = np.unique(self._own_ids(flat))
        first, end = np.searchsorted(uniq, self.row_range)
        wanted = uniq[first:end].astype(np.int64)
        return self._worker("_ahead", "ahead").submit(self._read_ahead, wanted)

    def _read_ahead(self, wanted: np.ndarray) -> int:
        read = 0
        try:
            for start in range(0, wanted.shape[0], _AHEAD_PIECE_ROWS):
                piece = wanted[start:start + _AHEAD_PIECE_ROWS]
                if self.dram is not None:
                    with self.dram.lock:  # what a step read meanwhile is not read again
                        piece = piece[~self.dram.contains(piece)]
                landed = threading.Event()
                self._ahead_piece = (piece, landed)
                try:
                    got = self._read_file(piece)
                    self._file_rows += piece.shape[0]
                    self._ahead_rows += piece.shape[0]
                    if self.dram is not None:
                        self._admit(piece, got, new_use=True)
                finally:
                    self._ahead_piece = None
                    landed.set()
                read += int(piece.shape[0])
            return read
        except Exception as e:  # noqa: BLE001 - the gather that needs these rows reports it
            logger.warning("engram layer %d: read-ahead of %d rows failed: %s", self.layer_id, wanted.shape[0], e)
            return read

    def _await_ahead(self, ids: np.ndarray) -> None:
        """Before a step's lookup: when the read-ahead piece in flight holds a good share
        of its rows (an eighth of the piece or more: a chunked prefill's next chunk), wait
        for the piece to land in the DRAM cache instead of reading those rows a second time
        beside it; a few rows in common (a decode step in the same batch) are cheaper to read
        again than to wait up to one piece for."""
        current = self._ahead_piece
        if current is None or self.dram is None:
            return
        piece, landed = current
        if not piece.shape[0] or not ids.shape[0]:
            return
        at = np.minimum(np.searchsorted(piece, ids), piece.shape[0] - 1)
        common = np.unique(ids[piece[at] == ids]).shape[0]
        if common and 8 * common >= piece.shape[0]:
            landed.wait(_AHEAD_WAIT_S)  # a stalled disk: read them after all (and report it then)

    def _read_file(self, wanted: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Packed rows [n, 264] of sorted distinct row ids, read from the file (into `out`)."""
        staging = np.empty((wanted.shape[0], ROW_BYTES), dtype=np.uint8) if out is None else out
        if wanted.shape[0] == 0:
            return staging
        size = os.fstat(self._fd).st_size
        last = int(wanted[-1])
        if DATA_OFFSET + (last + 1) * ROW_BYTES > size:
            raise TableIOError(
                f"{self.path}: row {last} lies past the end of the file ({size} bytes): the file was truncated or "
                f"replaced under the open store; restore it and restart"
            )
        if self._map is not None and rowio.copy_mapped(self._base, wanted, staging, self.threads) < 0:
            return staging
        if self._map is None and self._aio:
            err, _ = rowio.aio_read_rows(self._fd, DATA_OFFSET, wanted, staging, self.threads)
            if err == 0:
                return staging
            if err == rowio.AIO_UNAVAILABLE:
                self._aio = False
                logger.warning("engram layer %d: native AIO is unavailable (io_setup failed; raise "
                               "/proc/sys/fs/aio-max-nr?): reading by %d threads of pread instead",
                               self.layer_id, self.threads)
        # The mapping faulted (I/O error or truncation), AIO failed or is unavailable: pread
        # retries and reports why.
        err, failed = 0, -1
        for attempt in range(self.retries + 1):
            err, failed = rowio.pread_rows(self._fd, DATA_OFFSET, wanted, staging, self.threads, self.direct)
            if err == 0:
                return staging
            logger.warning("engram layer %d: reading %s failed (%s), try %d of %d", self.layer_id, self.path,
                           _strerror(err), attempt + 1, self.retries + 1)
            time.sleep(READ_BACKOFF_S * (attempt + 1))  # the back-off every table read uses (core/fileio)
        METRICS.error(self)
        # Which rows fail? One read each (an error path only): the others are served, the
        # requests that needed a failed row are failed by the caller.
        bad = np.zeros(wanted.shape[0], dtype=bool)
        for k in range(wanted.shape[0]):
            e, _ = rowio.pread_rows(self._fd, DATA_OFFSET, wanted[k:k + 1], staging[k:k + 1], 1, self.direct)
            if e != 0:
                bad[k], err = True, e
        staging[bad] = 0
        failed_ids = wanted[bad]
        if not failed_ids.shape[0]:  # the fault went away between the tries and the classification
            return staging
        raise TableReadFault(
            f"{self.path}: reading {failed_ids.shape[0]} of {wanted.shape[0]} rows (first: row {int(failed_ids[0])}) "
            f"failed after {self.retries + 1} tries: {_strerror(err)}",
            failed_ids=failed_ids, errno_=max(err, 0), packed=staging)

    # ------------------------------------------------- a layer file rewritten under the store
    def _check_unchanged(self, *, now: Optional[float] = None) -> None:
        """Every lookup: fail it when the open file was rewritten in place (`cp` over it,
        `rsync --inplace`) since the store opened it. Its rows would be a mix of the old (the
        DRAM cache, the page cache) and the new (fresh reads), so from then on every lookup
        fails, cached rows too (a truncated file's too: `cp` truncates, then writes). One
        fstat per `_CHANGE_CHECK_S`;
        a directory swapped or removed under the store changes only the old inode's link
        count and ctime: its rows are the same, and are served on."""
        if self._changed is None:
            now = time.monotonic() if now is None else now
            if now - self._checked < _CHANGE_CHECK_S or self._fd < 0:
                return
            with self._change_lock:  # the prefetch worker looks too: one look, one ERROR line
                if self._changed is None and now - self._checked >= _CHANGE_CHECK_S:
                    self._checked = now
                    self._look_at_file()
            if self._changed is None:
                return
        raise TableIOError(f"{self._changed}; its rows are no longer served: restart the server on the new tables")

    def _look_at_file(self) -> None:
        seen = _identity(os.fstat(self._fd))
        if seen == self._identity:
            return
        what = self._what_changed(seen)
        self._identity = seen
        if what is None:
            return
        self._changed = f"{self.path} was rewritten in place under the running server ({what})"
        METRICS.error(self)
        logger.error("engram layer %d: %s: every lookup of this layer fails from now on; restart the server on "
                     "the new tables (replace tables by swapping directories, never by writing over the files)",
                     self.layer_id, self._changed)

    def _what_changed(self, seen: tuple) -> Optional[str]:
        """What a changed fstat means: the rows (size, mtime, header page), or None (ctime
        alone: the link count of a swapped or removed directory, a chmod)."""
        size, mtime, _ = self._identity
        if seen[0] != size:
            return f"size {size} -> {seen[0]} bytes"
        if seen[1] != mtime:
            return "modified: mtime changed"
        if self._header_page() != self._header:
            return "header page changed"
        return None

    def _header_page(self) -> bytes:
        """The open file's header page (its identity: layer, rows, config fingerprint), read
        again until it is whole or the file ends; an O_DIRECT descriptor is read through a
        buffered one of the same open file (the path may name another file by now)."""
        fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY) if self.direct else self._fd
        try:
            page = b""
            while len(page) < DATA_OFFSET:
                got = os.pread(fd, DATA_OFFSET - len(page), len(page))
                if not got:
                    break
                page += got
            return page
        finally:
            if fd != self._fd:
                os.close(fd)

    def describe(self) -> str:
        how = (("O_DIRECT native AIO" if self._aio else "O_DIRECT preads") if self.direct
               else "page cache through a persistent mapping")
        cache = ""
        if self.dram is not None:
            cache = (f", DRAM row cache {self.dram.nbytes / 2**30:.2f} GiB ({self.dram.slots:,} rows, "
                     f"{self.dram.slots / max(1, self.rows_held):.1%} of the shard)")
        return f"{super().describe()}, {how}, {self.threads} reads in flight{cache}"

    def close(self) -> None:
        super().close()
        for attr in ("_ahead", "_io", "_admitter"):
            pool = getattr(self, attr)
            if pool is not None:
                pool.shutdown(wait=True)
                setattr(self, attr, None)
        if self.dram is not None:
            self.dram.close()
            self.dram = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclasses.dataclass
class _Staged:
    """What a worker staged for one prefetch: pinned packed rows and each id's staging index."""

    slot: object
    packed: torch.Tensor  # uint8 [max(1, unique), 264], pinned
    local: torch.Tensor  # int64 [n], pinned
    shape: tuple
    unique: int
    seconds: float
    fault: Optional[TableReadFault] = None


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """What a rewrite of the file's rows changes: size, mtime and ctime (ns)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _strerror(err: int) -> str:
    return "short read (the file ends early)" if err < 0 else os.strerror(err)
