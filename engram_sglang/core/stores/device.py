"""The device placement: a layer table (each rank's row shard) in the compute device's memory
(HBM; RAM on a CPU-only machine), read by `gather_dequant` directly."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..errors import EngramError
from ..rowformat import ROW_BYTES
from ..tablefile import DATA_OFFSET
from .base import WholeTableStore


class DeviceStore(WholeTableStore):
    """The rows in the compute device's memory (RAM on a CPU-only machine)."""

    placement = "device"
    # The table as the op reads it is `table` itself (see HostStore.table_address).
    table_address: Optional[int] = None

    def __init__(self, layer_id, path, rows, row_range, device, backend):
        super().__init__(layer_id, path, rows, row_range, device, backend)
        lo, hi = row_range
        rows_np = np.fromfile(path, dtype=np.uint8, count=(hi - lo) * ROW_BYTES, offset=DATA_OFFSET + lo * ROW_BYTES)
        if rows_np.size != (hi - lo) * ROW_BYTES:
            raise EngramError(f"{path}: ended early while loading rows {lo}..{hi - 1} (truncated?)")
        self.table = torch.from_numpy(rows_np.reshape(hi - lo, ROW_BYTES)).to(self.device)

    @property
    def resident_bytes(self) -> int:
        return self.table.numel()
