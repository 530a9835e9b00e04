"""Read faults injected at the level of engram_sglang.core.stores.rowio's Python calls.

The tests that fail reads by replacing rowio's read functions (copy_mapped, aio_read_rows,
pread_rows) reach the disk store's own reader; its native step reads inside one C call,
which they cannot reach. `reads_by_the_store(monkeypatch, when)` makes the native step
hand its misses to the store's reader (read mode READ_NONE: what it does after a failed
read) for the calls `when(ids)` picks, so those tests go through the native step too.
(The LD_PRELOAD shim of tests/e2e/test_e2e_faults.py fails reads below both, in libc.)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from engram_sglang.core.stores import rowio


def reads_by_the_store(monkeypatch, when: Callable[[np.ndarray], bool] = lambda ids: True) -> None:
    real = rowio.disk_step

    def disk_step(file, cache, ids, *args, **kwargs):
        if when(ids):
            mode, file.mode = file.mode, rowio.READ_NONE
            try:
                return real(file, cache, ids, *args, **kwargs)
            finally:
                file.mode = mode
        return real(file, cache, ids, *args, **kwargs)

    monkeypatch.setattr(rowio, "disk_step", disk_step)
