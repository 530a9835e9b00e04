"""TableStore: where one Engram layer's packed rows live, behind one call.

The model asks a store for the bf16 rows of row ids and gets them on its compute device;
whether the rows sit in device memory, registered host memory or a file is configuration
(the `placement`), never a code path in the model. Every placement returns the same bits.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np
import torch

from ..errors import EngramError
from ..ops import gather_dequant
from ..placement_table import PLACEMENTS  # noqa: F401  (re-exported)
from ..placement_table import placement as placement_spec
from ..rowformat import ROW_BYTES, ROW_VALUES
from ..shards import as_ranges, column_shards, ranges_rows, shard_range  # noqa: F401  (re-exported)
from . import maintenance
from . import streams as streams_mod

logger = logging.getLogger(__name__)


class TableIOError(EngramError, OSError):
    """Reading rows failed after retries; raised for that call only, the store keeps serving."""


class TableReadFault(TableIOError):
    """Some rows of a call could not be read after retries; every other row was.

    failed_ids : sorted global row ids that failed (their rows are +0 in `packed`/`rows`).
    packed : uint8 [n, 264] the call's packed rows (set by the tier that read them).
    rows : the call's bf16 rows (set by the store that decoded them): exact for every id
        not in `failed_ids`, so a caller can finish the batch and fail only the requests
        whose tokens needed a failed row (never serve those rows as if they were real).
    """

    def __init__(self, message: str, *, failed_ids, errno_: int = 0, packed=None, rows=None):
        super().__init__(message)
        self.failed_ids, self.errno_, self.packed, self.rows = failed_ids, errno_, packed, rows


class RowRanges:
    """The rows a shard holds as a list of global row ranges [(lo, hi), ...] (sorted, disjoint,
    inside [0, rows)). `compact` (a copy of just these rows): row i of the shard's table is its
    i-th held global row, the ranges laid out one after another. Not compact (a view of a copy
    that holds more rows, the node's shared copy): the table is the rows of the span
    [ranges[0][0], ranges[-1][1]) in place, other ranks' rows between the ranges included.
    `to_local(ids)` maps global ids to table rows, -1 (a +0.0 row) for ids the shard does not
    hold. One range is the plain `row_range` case."""

    def __init__(self, ranges, rows: int, what: str = "shard", *, compact: bool = True):
        ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        end = 0
        for lo, hi in ranges:
            if not end <= lo <= hi <= rows:
                raise EngramError(f"{what}: row ranges {ranges} must be sorted, disjoint and inside [0, {rows}), "
                                  f"found ({lo}, {hi}) after row {end}")
            end = hi
        self.ranges, self.rows, self.compact = tuple(ranges), rows, compact
        self.held = ranges_rows(ranges)
        self.span = (ranges[0][0], ranges[-1][1]) if ranges else (0, 0)
        self.table_rows = self.held if compact else self.span[1] - self.span[0]  # rows of the table the op reads
        self._lo = torch.tensor([lo for lo, _ in ranges] or [0], dtype=torch.int64)
        self._hi = torch.tensor([hi for _, hi in ranges] or [0], dtype=torch.int64)
        starts = np.cumsum([0, *(hi - lo for lo, hi in ranges)])[:-1] if compact else \
            [lo - self.span[0] for lo, _ in ranges]
        self._base = torch.tensor(list(starts) or [0], dtype=torch.int64)
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on(self, device) -> "RowRanges":
        """Keep the bounds on `device` too (a store does so when it opens): a call there then
        copies nothing from the host, which a CUDA-graph capture would refuse."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # keyed as the ids' device will be
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cpu" and device not in self._on:
            self._on[device] = tuple(t.to(device) for t in (self._lo, self._hi, self._base))
        return self

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        """Table rows (int64, ids' device) of global ids; -1 where the shard holds no such row.
        Device ops only (no host sync; capturable once `on(device)` was called)."""
        lo, hi, base = self._on.get(ids.device) or (t.to(ids.device) for t in (self._lo, self._hi, self._base))
        ids = ids.to(torch.int64)
        k = (torch.searchsorted(lo, ids.contiguous(), right=True) - 1).clamp_(min=0)
        inside = (ids >= lo[k]) & (ids < hi[k])
        return torch.where(inside, ids - lo[k] + base[k], torch.full_like(ids, -1))

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Host ids (numpy) this shard holds: a bool mask."""
        lo, hi = self._lo.numpy(), self._hi.numpy()
        k = np.maximum(np.searchsorted(lo, ids, side="right") - 1, 0)
        return (ids >= lo[k]) & (ids < hi[k])


def split_by_rows(total_bytes: int, held: dict[int, int]) -> dict[int, int]:
    """Bytes per layer of a budget for all layers of a rank, in proportion to the rows each
    layer's store holds (layer id -> rows)."""
    rows = sum(held.values()) or 1
    return {L: total_bytes * n // rows for L, n in held.items()}


class Prefetch:
    """A gather in flight. The consumer calls `wait()` for its rows (re-raising the gather's
    error), or `release()` when it will not use them. Every handle gets one of the two:
    `release()` orders the gather's side-stream work before what the consumer's stream does
    next (a dropped handle would leave it unordered with the next step, and a captured graph
    with an unjoined stream). `Prefetch.dropped` counts handles collected without either.

    Three kinds: `rows` + `event` (a side stream on a GPU: the consumer's stream waits on
    the event, the host does not); `future` (a worker thread); `future` + `finish` (a worker
    thread staged host data, `finish` copies and decodes it on the consumer's stream).
    """

    dropped = 0

    def __init__(self, *, rows: Optional[torch.Tensor] = None, event=None, streams=None,
                 future: Optional[Future] = None, finish: Optional[Callable] = None,
                 discard: Optional[Callable] = None):
        self._rows, self._event, self._streams = rows, event, streams
        self._future, self._finish, self._discard = future, finish, discard
        self._done = False

    def wait(self) -> torch.Tensor:
        if self._done:
            if self._rows is None:
                raise EngramError("this prefetch was released; its rows are gone")
            return self._rows
        self._done = True
        rows = self._rows
        if self._future is not None:
            future, self._future = self._future, None
            rows = future.result()
        if self._finish is not None:
            rows = self._finish(rows)  # on the consumer's stream
        elif self._event is not None:
            # The consumer's stream waits for the side stream's gather, and the allocator
            # keeps the rows (made on the side stream) until the consumer's use is done.
            current = self._streams.current()
            self._streams.wait_event(current, self._event)
            self._streams.record_stream(rows, current)
        self._rows, self._event = rows, None
        return rows

    def release(self) -> None:
        """Order the gather before the consumer stream's next work without using its rows."""
        if self._done:
            return
        self._done = True
        if self._future is not None:
            future, self._future = self._future, None
            try:
                staged = future.result()
            except Exception as e:  # noqa: BLE001 - nobody needs these rows; the error is not theirs
                logger.debug("a released prefetch failed: %s", e)
            else:
                if self._discard is not None:
                    self._discard(staged)
        elif self._event is not None:
            self._streams.wait_event(self._streams.current(), self._event)
        self._rows = self._event = None

    @property
    def done(self) -> bool:
        return self._done

    def __del__(self):
        if not self._done:
            Prefetch.dropped += 1


@dataclasses.dataclass(frozen=True)
class ResidentTable:
    """A store's packed rows [hi - lo, 264] (a shard's: `TableStore.table_index`) as the gather op reads them: `table` itself, or
    the device address `address` of its first row where that is set (host memory registered
    with the GPU)."""

    table: torch.Tensor
    address: Optional[int] = None


class TableStore(ABC):
    """One Engram layer's table in some placement.

    Attributes
    ----------
    layer_id : the Engram layer (a model layer index).
    rows : rows of the whole layer table (global row ids are in [0, rows)).
    row_range : (lo, hi), the span of the rows this store holds; other ids read as +0.0 rows,
        so a sum over tensor-parallel ranks reassembles the full rows exactly. (0, rows) where
        the store holds whole rows (`holds_whole_rows`), which then need no sum. A balanced
        shard (`column_shards`) holds several ranges: `row_ranges` lists them, `shard` maps
        ids to its table (the span then includes other ranks' rows between the ranges).
    device : where gathered bf16 rows are returned.

    What a cache in front or the runtime may ask of any store (the contract; the defaults
    here are those of a store that has none of it):

    * `needs_host_ids` : each call's ids visit the host (from the placement table);
    * `resident_table` : the packed rows held in memory, or None;
    * `read_packed(ids)` : packed rows of sorted distinct ids, as host arrays;
    * `reads_ahead`, `read_ahead(ids)` : whether and how rows are read before the step
      that needs them;
    * `holds_whole_rows`, `hold_only(row_range)` : whole rows or a shard, and narrowing
      whole rows to a shard (when not every rank of a group holds whole rows);
    * `node_shared` : the rows are the node's one shared copy, not this process's own.
    """

    placement: str = "?"
    needs_host_ids = False  # set from the placement table for each placement's class

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "placement" in vars(cls):  # a placement's own class: what the table says of it
            cls.needs_host_ids = placement_spec(cls.placement).ids_visit_host

    # The rank labels of this store's Prometheus series (metrics.RANKS values; open_store
    # passes the runtime's ranks).
    metric_ranks: tuple[str, ...] = ("0", "0", "0")

    def __init__(self, layer_id: int, path, rows: int, row_range, device: torch.device, backend: str,
                 *, metric_ranks: Optional[tuple[str, ...]] = None):
        """`row_range`: one (lo, hi), or a list of ranges (a balanced shard, `column_shards`)."""
        self.layer_id, self.path, self.rows = layer_id, path, rows
        if metric_ranks is not None:
            self.metric_ranks = tuple(metric_ranks)
        ranges = as_ranges(row_range)
        self.device = torch.device(device)
        if len(ranges) > 1:  # held one after another (a store whose table is laid out otherwise says so)
            self.shard = RowRanges(ranges, rows, f"{path}: layer {layer_id} shard").on(self.device)
        self.row_range = self.shard.span if self.shard is not None else ranges[0]
        from ..ops import probe

        # Resolved once (the probe logs its choice once); an explicit backend that cannot run raises here.
        self.backend = probe.select_backend(self.device, backend).backend
        self._lock = threading.Lock()
        # Calls and rows served, counted on the device (in place, by the gather itself) so
        # that a replayed CUDA graph counts like an eager call; read between steps only.
        self._counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._published_rows = 0  # rows already added to the Prometheus counter
        # Host-side figures: distinct rows read (stores that read on the host, which are
        # never captured) and host seconds of eager calls.
        self._unique_rows = 0
        self._seconds = 0.0
        self._executor: Optional[ThreadPoolExecutor] = None
        self._side_stream = None
        # The GPU's stream operations (None on the CPU); tests swap in a recording fake.
        self._streams = streams_mod.for_device(self.device)
        maintenance.register(self)

    # ------------------------------------------------------------------ the calls
    def gather(self, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """bf16 rows [*ids.shape, 256] of global row ids (int32 or int64, any shape)."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise EngramError(f"layer {self.layer_id}: row ids must be int32 or int64, got {ids.dtype}")
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (*ids.shape, ROW_VALUES)):
            raise EngramError(
                f"layer {self.layer_id}: out must be bf16 {(*ids.shape, ROW_VALUES)}, got {out.dtype} {tuple(out.shape)}"
            )
        if ids.device.type == "cpu" and ids.numel() and not maintenance.capturing():
            # Device ids are not checked here (a host sync), nor inside a capture; the
            # kernels read out-of-range ids as zero rows, never out-of-bounds memory.
            self._check_ids(int(ids.min()), int(ids.max()))
        t0 = time.perf_counter()
        result, unique = self._gather(ids, out)
        self._account(ids.numel(), time.perf_counter() - t0, unique)
        return result

    def _check_ids(self, lo: int, hi: int) -> None:
        """Ids read on the host must lie in the table: [lo, hi] are their min and max. -1 is no
        row (a CUDA-graph padding token's, serving/runtime.py): it reads +0, as another shard's."""
        if lo < -1 or hi >= self.rows:
            raise EngramError(f"layer {self.layer_id}: row id {lo if lo < 0 else hi} is outside the table's "
                              f"{self.rows} rows")

    def prefetch(self, ids: torch.Tensor) -> Prefetch:
        """Start a gather now; the consumer calls `.wait()` where it needs the rows (or
        `.release()` when it will not).

        On a GPU the gather runs on a side stream that first waits for the caller's stream
        (where the ids were made) and the consumer's stream waits on an event: capturable in
        a graph when the placement needs no host work. Stores whose ids must visit the host
        (disk) read on a worker thread into pinned staging and copy/decode on the consumer's
        stream (`_prefetch_host_ids`). On the CPU a worker thread runs the gather.
        """
        streams = self._streams
        if streams is None:
            return Prefetch(future=self._worker_thread().submit(self.gather, ids))
        if self.needs_host_ids:
            return self._prefetch_host_ids(ids, streams)
        main = streams.current()
        if self._side_stream is None:
            self._side_stream = streams.new_stream()
        side = self._side_stream
        streams.wait_stream(side, main)
        with streams.use(side):
            rows = self.gather(ids)
            event = streams.record_event(side)
        streams.record_stream(ids, side)  # made on the caller's stream, read on the side stream
        return Prefetch(rows=rows, event=event, streams=streams)

    def _prefetch_host_ids(self, ids: torch.Tensor, streams) -> Prefetch:
        """A host-reading store that cannot split its work into a host half and a stream
        half gathers in the caller's thread, on its stream: ordered, not overlapped."""
        return Prefetch(rows=self.gather(ids))

    def _worker_thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engram-l{self.layer_id}",
                                                initializer=self._thread_device())
        return self._executor

    def _thread_device(self) -> Optional[Callable[[], None]]:
        """Every worker thread's initializer: the store's device first. A new thread's current
        device is 0, where its first CUDA call (an event wait, a pinned allocation) would make a
        context of several hundred MiB on rank k > 0. None on the CPU (no CUDA)."""
        return self._streams.set_device if self._streams is not None else None

    # ------------------------------------------------------------- what placements add
    @abstractmethod
    def _gather(self, ids: torch.Tensor, out: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[int]]:
        """The rows, and the number of distinct rows read when the placement dedupes."""

    @property
    @abstractmethod
    def resident_bytes(self) -> int:
        """Bytes of this layer this store holds in memory (device or host)."""

    # ------------------------------------------------------------- the contract
    @property
    def resident_table(self) -> Optional[ResidentTable]:
        """The rows of `row_range`, packed, as the gather op reads them; None where the rows
        are not held in memory (a file)."""
        return None

    def read_packed(self, wanted: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Packed rows [n, 264] of sorted distinct global row ids inside `row_range`, as a host
        array (into `out` when given). This default reads them from the resident table."""
        resident = self.resident_table
        if resident is None:
            raise EngramError(f"layer {self.layer_id}: placement {self.placement} holds no packed rows to read")
        wanted = torch.from_numpy(np.asarray(wanted, dtype=np.int64))
        local, (first, _) = self.table_index(wanted)
        rows = resident.table[(local - first).to(resident.table.device)].cpu().numpy()
        if out is None:
            return rows
        out[...] = rows
        return out

    @property
    def reads_ahead(self) -> bool:
        """Whether `read_ahead` keeps rows for a later step (a disk store with a DRAM cache)."""
        return False

    def read_ahead(self, ids) -> Optional[Future]:
        """Start reading the rows of `ids` for a later step; None where nothing would keep them."""
        return None

    @property
    def node_shared(self) -> bool:
        """Whether the rows are the node's one shared copy (every rank maps it), not this process's."""
        return False

    # A shard of several row ranges (`column_shards`), where the placement serves one; None:
    # the store holds the one range `row_range`.
    shard: Optional[RowRanges] = None

    @property
    def row_ranges(self) -> list[tuple[int, int]]:
        """The rows this store holds as a list of ranges ([row_range] unless it holds several)."""
        return list(self.shard.ranges) if self.shard is not None else [tuple(self.row_range)]

    @property
    def rows_held(self) -> int:
        """Rows this store holds (those of `row_ranges`)."""
        return self.shard.held if self.shard is not None else self.row_range[1] - self.row_range[0]

    def holds(self, ids: torch.Tensor) -> torch.Tensor:
        """Which global ids (a tensor, any device) this store holds: device ops, no host sync."""
        if self.shard is not None:
            return self.shard.to_local(ids) >= 0
        lo, hi = self.row_range
        return (ids >= lo) & (ids < hi)

    def table_index(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """(index, row_range) with which `gather_dequant` reads this store's resident table
        for global ids: the ids and `row_range` for one range; for several, table rows (-1
        where not held: +0.0) and the table's rows. Device ops, no host sync (capturable)."""
        if self.shard is not None:
            return self.shard.to_local(ids), (0, self.shard.table_rows)
        return ids, tuple(self.row_range)

    # What the tensor-parallel ranks agreed in open_store (True: every rank holds whole rows;
    # False: shards, summed), so that a shard that happens to span its layer (a layer of one
    # row) is not taken for whole rows on one rank while the others sum. None: not asked.
    agreed_whole: Optional[bool] = None

    @property
    def holds_whole_rows(self) -> bool:
        """Whether this store holds every row of the layer (no tensor-parallel sum needed)."""
        if self.agreed_whole is not None:
            return self.agreed_whole
        return self.row_ranges == [(0, self.rows)]

    def hold_only(self, row_range) -> None:
        """Serve only `row_range` (one (lo, hi), or a list of ranges) from now on (other ids read
        as +0.0 rows), before the first call. Stores that hold only their rows cannot widen or
        move them."""
        wanted = as_ranges(row_range)
        if wanted != self.row_ranges:
            raise EngramError(f"layer {self.layer_id}: placement {self.placement} holds rows {self.row_ranges}, "
                              f"it cannot serve {wanted} instead")

    def _account(self, n: int, seconds: float, unique: Optional[int] = None) -> None:
        """One call served: calls and rows on the device, in place (a replay counts too);
        the host figures of eager calls (a replay runs no Python)."""
        self._counts[0].add_(1)
        self._counts[1].add_(n)
        if maintenance.capturing():
            return
        with self._lock:
            self._unique_rows += n if unique is None else unique
            self._seconds += seconds

    def counts(self) -> tuple[int, int]:
        """(calls, rows served) so far, replays included: a host sync, between steps only."""
        if maintenance.capturing():
            raise EngramError(f"layer {self.layer_id}: store counters are device values (a host sync): read them "
                              "between steps, not inside a CUDA-graph capture")
        calls, rows = self._counts.tolist()
        return calls, rows

    # ------------------------------------------------------- between steps
    maintain_every = maintenance.DEFAULT_EVERY  # steps between two maintenances; 0: only when called

    _steps_seen = 0

    def between_steps(self, step: int) -> None:
        """Called by `maintenance.between_steps()` once per forward step, outside any graph:
        maintains every `maintain_every` steps since this store opened (the stores of a
        model open together, so their maintenances fall on the same steps)."""
        self._steps_seen += 1
        if self.maintain_every and self._steps_seen % self.maintain_every == 0:
            self.maintain()

    def maintain(self) -> int:
        """Host work between steps (a sync): the rows served since the last call go to the
        Prometheus counter. Stores that read on the host count there per call instead.
        Returns the rows admitted into a cache (none here)."""
        if not self.needs_host_ids:
            from .metrics import METRICS

            rows = self._rows_served_without_blocking()
            if rows is not None:
                METRICS.served(self, rows - self._published_rows)
                self._published_rows = rows
        return 0

    _counts_copy = None  # (pinned host copy of _counts, its event) in flight since the last maintain

    def _rows_served_without_blocking(self) -> Optional[int]:
        """Rows served as of an earlier maintenance, never waiting on the forward stream (a
        `.tolist()` here would stall the scheduler every 8th step): the device counters go to
        pinned host memory behind an event, read at a later maintenance once it has passed
        (None until then). On the CPU they are host values already."""
        streams = self._streams
        if streams is None:
            return self.counts()[1]
        rows = None
        if self._counts_copy is not None:
            host, event = self._counts_copy
            if not streams.event_done(event):
                return None
            rows = int(host.numpy()[1])
        host = self._counts_copy[0] if self._counts_copy is not None else streams.pinned_empty(
            self._counts.shape, self._counts.dtype)
        streams.to_host(self._counts, host)
        self._counts_copy = (host, streams.record_event(streams.current()))
        return rows

    def stats(self) -> dict:
        calls, rows = self.counts()
        with self._lock:
            unique = self._unique_rows if self.needs_host_ids else rows
            return {
                "layer_id": self.layer_id,
                "placement": self.placement,
                "backend": self.backend,
                "calls": calls,
                "rows_served": rows,
                "bytes_served": rows * ROW_BYTES,
                "unique_rows": unique,
                "unique_ratio": unique / rows if rows else 1.0,
                "gather_seconds": self._seconds,
                "row_range": list(self.row_range),
                "row_ranges": [list(r) for r in self.row_ranges],
                "rows_held": "whole" if self.holds_whole_rows else "shard",
                "resident_bytes": self.resident_bytes,
            }

    @classmethod
    def start_up_warning(cls, stores: list["TableStore"]) -> str:
        """What the start-up log gives at WARNING for these stores of this class (opened
        together by open_store): one record per line of it, "" for none."""
        return ""

    def describe(self) -> str:
        held = ", ".join(f"{lo}..{hi - 1}" for lo, hi in self.row_ranges)
        return (
            f"engram layer {self.layer_id}: placement {self.placement}, backend {self.backend}, "
            f"rows {held} of {self.rows} ({ranges_rows(self.row_ranges) * ROW_BYTES / 2**30:.2f} GiB), "
            f"device {self.device}"
        )

    def close(self) -> None:
        maintenance.unregister(self)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class WholeTableStore(TableStore):
    """A store holding its whole shard as one packed table `table`, which the op reads
    directly, or by `table_address` where that is set (a host table registered with the GPU)."""

    table: torch.Tensor
    table_address: Optional[int] = None

    def _gather(self, ids, out):
        # Several ranges: global ids to table rows (-1: not held, +0.0).
        ids, row_range = self.table_index(ids.to(self.device))
        rows = gather_dequant(self.table, ids, out=out, row_range=row_range,
                              backend=self.backend, table_address=self.table_address)
        return rows, None  # (rows served reach the metrics between steps: TableStore.maintain)

    @property
    def resident_table(self) -> ResidentTable:
        return ResidentTable(self.table, self.table_address)
