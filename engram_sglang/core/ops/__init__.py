"""The gather-dequant op, its backends and the device probe that picks among them.

`gather_dequant(table, ids, *, out=None, row_range=None, backend="auto")` reads packed Engram
rows by global row id and returns bf16 rows, bit-identical on every backend (torch, triton,
cpu, cuda, hip). `select_backend()` (module `probe`) reads the device once and says which
backend runs and why.
"""

from .gather import gather_dequant, gather_dequant_ref
from .probe import BackendUnavailableError, Choice, DeviceInfo, select_backend

__all__ = [
    "BackendUnavailableError",
    "Choice",
    "DeviceInfo",
    "gather_dequant",
    "gather_dequant_ref",
    "select_backend",
]
