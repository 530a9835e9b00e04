"""ctypes binding of the native row reads (kernels/io/engram_rowio.cpp, built by `make rowio`, or on
first use from an installed wheel: engram_sglang/nativelibs.py)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from .. import nativelibs
from ..errors import EngramError
from ..nativelibs import kernels_dir  # noqa: F401  (tests find the sources beside it)

_LIB_NAME = "libengram_io.so"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    try:
        path = nativelibs.locate(_LIB_NAME)  # prebuilt (`make rowio`), or built on first use
    except nativelibs.NativeLibraryError as e:
        raise EngramError(f"native row I/O library: {e}") from None
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.engram_rowio_copy_mapped.argtypes = [p, p, i64, p, ctypes.c_int, ctypes.POINTER(i64)]
    lib.engram_rowio_copy_mapped.restype = ctypes.c_int
    lib.engram_rowio_pread.argtypes = [ctypes.c_int, i64, p, i64, p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(i64)]
    lib.engram_rowio_pread.restype = ctypes.c_int
    lib.engram_rowio_aio.argtypes = [ctypes.c_int, i64, p, i64, p, ctypes.c_int, ctypes.POINTER(i64)]
    lib.engram_rowio_aio.restype = ctypes.c_int
    return lib


AIO_UNAVAILABLE = -2

# Reads in flight per call, at most (kMaxThreads in engram_rowio.cpp, which clamps to it too):
# a disk gains nothing past a few hundred, and thousands of threads under a memory limit
# fail to start.
MAX_THREADS = 256


def check_threads(threads, where: str = "disk threads") -> int:
    """`threads` if it is a whole number in 1..MAX_THREADS, else one line naming `where`."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise EngramError(f"{where} must be a whole number from 1 to {MAX_THREADS} (reads in flight), got {threads!r}")
    return threads


def aio_read_rows(fd: int, data_offset: int, rows: np.ndarray, out: np.ndarray, depth: int) -> tuple[int, int]:
    """Read ascending rows of an O_DIRECT file by native AIO, `depth` in flight; returns
    (0, -1), (errno or -1 for a short read, failed index) or (AIO_UNAVAILABLE, -1)."""
    failed = ctypes.c_int64(-1)
    err = library().engram_rowio_aio(fd, data_offset, rows.ctypes.data, rows.shape[0], out.ctypes.data, depth,
                                     ctypes.byref(failed))
    return err, failed.value


def copy_mapped(base_address: int, rows: np.ndarray, out: np.ndarray, threads: int) -> int:
    """Copy rows (int64, contiguous) of a mapped table into out [n, 264]; -1 or a faulting index."""
    failed = ctypes.c_int64(-1)
    library().engram_rowio_copy_mapped(
        base_address, rows.ctypes.data, rows.shape[0], out.ctypes.data, threads, ctypes.byref(failed)
    )
    return failed.value


def pread_rows(fd: int, data_offset: int, rows: np.ndarray, out: np.ndarray, threads: int, direct: bool) -> tuple[int, int]:
    """Read rows by pread; returns (0, -1) or (errno or -1 for a short read, failed index)."""
    failed = ctypes.c_int64(-1)
    err = library().engram_rowio_pread(
        fd, data_offset, rows.ctypes.data, rows.shape[0], out.ctypes.data, threads, int(direct), ctypes.byref(failed)
    )
    return err, failed.value
