"""TableStore: where one Engram layer's packed rows live, behind one call.

The model asks a store for the bf16 rows of row ids and gets them on its compute device;
whether the rows sit in device memory, registered host memory or a file is configuration
(the `placement`), never a code path in the model. Every placement returns the same bits.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from ..errors import EngramError
from ..rowformat import PAYLOAD_BYTES, ROW_BYTES

PLACEMENTS = ("device", "host", "disk")


class TableIOError(EngramError, OSError):
    """Reading rows failed after retries; raised for that call only, the store keeps serving."""


def shard_range(rows: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Row range [lo, hi) that rank `tp_rank` of `tp_size` holds: contiguous, sizes differ by <= 1."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise EngramError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    base, extra = divmod(rows, tp_size)
    lo = tp_rank * base + min(tp_rank, extra)
    return lo, lo + base + (1 if tp_rank < extra else 0)


def split_by_rows(total_bytes: int, held: dict[int, int]) -> dict[int, int]:
    """Bytes per layer of a budget for all layers of a rank, in proportion to the rows each
    layer's store holds (layer id -> rows)."""
    rows = sum(held.values()) or 1
    return {L: total_bytes * n // rows for L, n in held.items()}


class Prefetch:
    """A gather in flight. `wait()` returns its bf16 rows (and re-raises its error)."""

    def __init__(self, future: Optional[Future] = None, rows: Optional[torch.Tensor] = None,
                 event: Optional["torch.cuda.Event"] = None):
        self._future, self._rows, self._event = future, rows, event

    def wait(self) -> torch.Tensor:
        if self._future is not None:
            self._rows, self._future = self._future.result(), None
        if self._event is not None:
            # The consumer's stream waits for the side stream's gather; the host does not.
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None
        return self._rows


class TableStore(ABC):
    """One Engram layer's table in some placement.

    Attributes
    ----------
    layer_id : the Engram layer (a model layer index).
    rows : rows of the whole layer table (global row ids are in [0, rows)).
    row_range : (lo, hi), the rows this store holds; other ids read as +0.0 rows, so a sum
        over tensor-parallel ranks reassembles the full rows exactly.
    device : where gathered bf16 rows are returned.
    """

    placement: str = "?"

    def __init__(self, layer_id: int, path, rows: int, row_range: tuple[int, int], device: torch.device, backend: str):
        self.layer_id, self.path, self.rows = layer_id, path, rows
        self.row_range = row_range
        self.device = torch.device(device)
        from ..ops import probe

        # Resolved once (the probe logs its choice once); an explicit backend that cannot run raises here.
        self.backend = probe.select_backend(self.device, backend).backend
        self._lock = threading.Lock()
        self._served_rows = 0
        self._unique_rows = 0
        self._calls = 0
        self._seconds = 0.0
        self._executor: Optional[ThreadPoolExecutor] = None
        self._side_stream = None

    # ------------------------------------------------------------------ the calls
    def gather(self, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """bf16 rows [*ids.shape, 256] of global row ids (int32 or int64, any shape)."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise EngramError(f"layer {self.layer_id}: row ids must be int32 or int64, got {ids.dtype}")
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (*ids.shape, PAYLOAD_BYTES)):
            raise EngramError(
                f"layer {self.layer_id}: out must be bf16 {(*ids.shape, PAYLOAD_BYTES)}, got {out.dtype} {tuple(out.shape)}"
            )
        if ids.device.type == "cpu" and ids.numel():
            # Device ids are not checked here (a host sync); the kernels read out-of-range
            # ids as zero rows, never out-of-bounds memory.
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.rows:
                bad = lo if lo < 0 else hi
                raise EngramError(f"layer {self.layer_id}: row id {bad} is outside the table's {self.rows} rows")
        t0 = time.perf_counter()
        result, unique = self._gather(ids, out)
        self._account(ids.numel(), time.perf_counter() - t0, unique)
        return result

    def prefetch(self, ids: torch.Tensor) -> Prefetch:
        """Start a gather now; the consumer calls `.wait()` where it needs the rows.

        On a GPU the gather runs on a side stream and the consumer's stream waits on an
        event (capturable in a graph when the placement needs no host work); on the CPU a
        worker thread runs it.
        """
        if self.device.type == "cuda" and not self.needs_host_ids:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=self.device)
            main = torch.cuda.current_stream(self.device)
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                rows = self.gather(ids)
                event = torch.cuda.Event()
                event.record()
            rows.record_stream(main)
            return Prefetch(rows=rows, event=event)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engram-l{self.layer_id}")
        return Prefetch(future=self._executor.submit(self.gather, ids))

    # ------------------------------------------------------------- what placements add
    needs_host_ids = False  # True where the ids must visit the host (the disk tier)

    @abstractmethod
    def _gather(self, ids: torch.Tensor, out: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[int]]:
        """The rows, and the number of distinct rows read when the placement dedupes."""

    @property
    @abstractmethod
    def resident_bytes(self) -> int:
        """Bytes of this layer this store holds in memory (device or host)."""

    def _account(self, n: int, seconds: float, unique: Optional[int] = None) -> None:
        with self._lock:
            self._calls += 1
            self._served_rows += n
            self._unique_rows += n if unique is None else unique
            self._seconds += seconds

    def stats(self) -> dict:
        with self._lock:
            return {
                "layer_id": self.layer_id,
                "placement": self.placement,
                "backend": self.backend,
                "calls": self._calls,
                "rows_served": self._served_rows,
                "bytes_served": self._served_rows * ROW_BYTES,
                "unique_rows": self._unique_rows,
                "unique_ratio": self._unique_rows / self._served_rows if self._served_rows else 1.0,
                "gather_seconds": self._seconds,
                "row_range": list(self.row_range),
                "resident_bytes": self.resident_bytes,
            }

    def describe(self) -> str:
        lo, hi = self.row_range
        return (
            f"engram layer {self.layer_id}: placement {self.placement}, backend {self.backend}, "
            f"rows {lo}..{hi - 1} of {self.rows} ({(hi - lo) * ROW_BYTES / 2**30:.2f} GiB), device {self.device}"
        )

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
