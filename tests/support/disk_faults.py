"""Read faults injected at the level of engram_sglang.core.stores.rowio's Python calls.

The tests that fail reads by replacing rowio's read functions (copy_mapped, aio_read_rows,
pread_rows) reach the disk store's own reader; its native step reads inside one C call,
which they cannot reach. `reads_by_the_store(monkeypatch, when)` makes the native step
hand its misses to the store's reader (read mode READ_NONE: what it does after a failed
read) for the calls `when(ids)` picks, so those tests go through the native step too.
(The LD_PRELOAD shim of tests/e2e/test_e2e_faults.py fails reads below both, in libc.)
"""

from __future__ import annotations

import errno
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


def rows_fail_with_eio(monkeypatch, bad: set) -> set:
    """Reads of the global rows in `bad` (the caller fills it, now or later) fail with EIO on
    every read path of the disk store (mapping, AIO, pread, the native step's misses); returns
    `bad`. `monkeypatch`: pytest's, or a `pytest.MonkeyPatch()` of a spawned rank."""
    real_pread, real_copy, real_aio = rowio.pread_rows, rowio.copy_mapped, rowio.aio_read_rows

    def pread_rows(fd, off, rows, out, threads, direct):
        hit = np.flatnonzero(np.isin(rows, list(bad)))
        if hit.size:
            return errno.EIO, int(hit[0])
        return real_pread(fd, off, rows, out, threads, direct)

    def copy_mapped(base, rows, out, threads):  # a faulting index sends the store to pread
        hit = np.flatnonzero(np.isin(rows, list(bad)))
        return int(hit[0]) if hit.size else real_copy(base, rows, out, threads)

    def aio_read_rows(fd, off, rows, out, depth):
        hit = np.flatnonzero(np.isin(rows, list(bad)))
        return (errno.EIO, int(hit[0])) if hit.size else real_aio(fd, off, rows, out, depth)

    monkeypatch.setattr(rowio, "pread_rows", pread_rows)
    monkeypatch.setattr(rowio, "copy_mapped", copy_mapped)
    monkeypatch.setattr(rowio, "aio_read_rows", aio_read_rows)
    reads_by_the_store(monkeypatch, lambda ids: bool(np.isin(ids, list(bad)).any()))  # the native step's misses
    return bad
