"""The device placement: a layer table (each rank's row shard) in the compute device's memory
(HBM; RAM on a CPU-only machine), read by `gather_dequant` directly."""

from __future__ import annotations

from typing import Optional

import torch

from ..rowformat import ROW_BYTES
from ..tablefile import DATA_OFFSET
from .base import WholeTableStore
from .hostmem import fill_from_file

# A GPU shard is read through a host bounce buffer of this size, so that loading a 47 GiB
# shard (DeepSeek-V4.1-Flash at TP 4) needs 64 MiB of host RAM, not 47 GiB.
UPLOAD_CHUNK_BYTES = 64 << 20


class DeviceStore(WholeTableStore):
    """The rows in the compute device's memory (RAM on a CPU-only machine)."""

    placement = "device"
    # The table as the op reads it is `table` itself (see HostStore.table_address).
    table_address: Optional[int] = None

    def __init__(self, layer_id, path, rows, row_range, device, backend, *, metric_ranks=None):
        """`row_range`: one (lo, hi), or a list of ranges (`column_shards`), held one after another."""
        super().__init__(layer_id, path, rows, row_range, device, backend, metric_ranks=metric_ranks)
        ranges = self.row_ranges
        self.table = torch.empty((self.rows_held, ROW_BYTES), dtype=torch.uint8, device=self.device)
        at = 0
        for lo, hi in ranges:  # each range straight into its slice (no second copy of the shard)
            _load_rows(path, DATA_OFFSET + lo * ROW_BYTES, hi - lo, self.device, out=self.table[at:at + hi - lo])
            at += hi - lo

    @property
    def resident_bytes(self) -> int:
        return self.table.numel()


def _load_rows(path, offset: int, n_rows: int, device: torch.device, bounce: Optional[bool] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """n_rows packed rows of `path` from `offset` as a (n_rows, ROW_BYTES) uint8 tensor on
    `device`: read in place on the CPU; through a bounce buffer of UPLOAD_CHUNK_BYTES on a GPU
    (`bounce`: which, for tests); into `out` (contiguous rows) when given. Short reads read on, transient errors are retried, a failure
    names the file and offset."""
    table = torch.empty((n_rows, ROW_BYTES), dtype=torch.uint8, device=device) if out is None else out
    flat = table.view(-1)
    if not (device.type != "cpu" if bounce is None else bounce):
        fill_from_file(memoryview(flat.numpy()), path, offset, flat.numel(), into="device memory")
        return table
    bounce = torch.empty(min(UPLOAD_CHUNK_BYTES, flat.numel()), dtype=torch.uint8)
    for start in range(0, flat.numel(), bounce.numel()):
        n = min(bounce.numel(), flat.numel() - start)
        fill_from_file(memoryview(bounce.numpy())[:n], path, offset + start, n, into="device memory")
        flat[start:start + n].copy_(bounce[:n])  # synchronous from pageable memory: the bounce is reused next
    return table
