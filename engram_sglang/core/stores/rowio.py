"""ctypes binding of the native row reads (kernels/io/engram_rowio.cpp, built by `make rowio`, or on
first use from an installed wheel: engram_sglang/core/nativelibs.py)."""

from __future__ import annotations

import ctypes
import errno
import functools
from typing import Optional

import numpy as np

from .. import nativelibs
from ..errors import EngramError
from ..nativelibs import kernels_dir  # noqa: F401  (tests find the sources beside it)
from . import dram_cache
from .dram_cache import STATE_FIELDS

_LIB_NAME = "libengram_rowio.so"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    try:
        path = nativelibs.locate(_LIB_NAME)  # prebuilt (`make rowio`), or built on first use
    except nativelibs.NativeLibraryError as e:
        raise EngramError(f"native row I/O library: {e}") from None
    lib = ctypes.CDLL(str(path))
    try:
        _bind(lib)
    except AttributeError as e:
        raise EngramError(f"native row I/O library {path} lacks an entry point ({e}): rebuild it (`make rowio`)") \
            from None
    # Structure sizes and the DRAM policy's array format: a library built from other sources
    # would otherwise read this package's arrays the old way (silently wrong counts, or a crash).
    built = [lib.engram_disk_step_layout(k) for k in range(8)]
    ours = [ctypes.sizeof(DiskFile), ctypes.sizeof(DramCacheView), ctypes.sizeof(StepResult), len(STATE_FIELDS),
            dram_cache.POLICY_FORMAT, dram_cache._CAP, dram_cache.SKETCH_DEPTH, dram_cache._CLOCK_BITS]
    if built != ours:
        raise EngramError(f"native row I/O library {path}: its step structures and DRAM policy format {built} "
                          f"differ from this package's {ours}: rebuild it (`make rowio`)")
    return lib


def _bind(lib) -> None:
    """The signatures of kernels/io/engram_rowio_abi.h (tests/kernels/test_native_abi.py checks them
    against it)."""
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.engram_rowio_copy_mapped.argtypes = [p, p, i64, p, i32, ctypes.POINTER(i64)]
    lib.engram_rowio_copy_mapped.restype = i32
    lib.engram_rowio_pread.argtypes = [i32, i64, p, i64, p, i32, i32, ctypes.POINTER(i64)]
    lib.engram_rowio_pread.restype = i32
    lib.engram_rowio_aio.argtypes = [i32, i64, p, i64, p, i32, ctypes.POINTER(i64)]
    lib.engram_rowio_aio.restype = i32
    lib.engram_rowio_last_peak.argtypes, lib.engram_rowio_last_peak.restype = [], i32
    lib.engram_rowio_test_short_enters.argtypes, lib.engram_rowio_test_short_enters.restype = [i32], None
    lib.engram_rowio_test_fail_enters.argtypes, lib.engram_rowio_test_fail_enters.restype = [i32], None
    lib.engram_rowio_uring_buffers.argtypes, lib.engram_rowio_uring_buffers.restype = [ctypes.POINTER(i64)], None
    lib.engram_rowio_engine.argtypes = [i32]
    lib.engram_rowio_engine.restype = i32
    lib.engram_disk_step.argtypes = [ctypes.POINTER(DiskFile), ctypes.POINTER(DramCacheView), p, i64, p, p, p, p, p,
                                     i32, ctypes.POINTER(StepResult)]
    lib.engram_disk_step.restype = i32
    lib.engram_disk_step_decode.argtypes, lib.engram_disk_step_decode.restype = [i32], i32
    lib.engram_disk_step_layout.argtypes = [i32]
    lib.engram_disk_step_layout.restype = i64


# ------------------------------------------------------------------ the native step
# kernels/io/engram_disk_step.h: one call per layer and step (dedupe, DRAM-cache lookup, hits,
# reads of the misses, admission, and on the CPU the decode). The codes and structures are
# kernels/io/engram_rowio_abi.h's (engram_read_mode, engram_step_status, engram_disk_file, ...).
READ_MAPPED, READ_AIO, READ_PREAD, READ_NONE = 0, 1, 2, 3
STEP_OK, STEP_UNREAD, STEP_AIO_UNAVAILABLE = 0, 1, -2


class DiskFile(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int32), ("mode", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("direct", ctypes.c_int32), ("data_offset", ctypes.c_int64), ("base", ctypes.c_void_p),
                ("lo", ctypes.c_int64), ("hi", ctypes.c_int64)]


class DramCacheView(ctypes.Structure):
    """Pointers into a DramRowCache's arrays (valid while the cache is open)."""

    _fields_ = [("rows", ctypes.c_void_p), ("tags", ctypes.c_void_p), ("last", ctypes.c_void_p),
                ("count", ctypes.c_void_p), ("sketch", ctypes.c_void_p), ("state", ctypes.c_void_p),
                ("slots", ctypes.c_int64), ("ways", ctypes.c_int64), ("sets", ctypes.c_int64),
                ("sketch_width", ctypes.c_int64), ("sample", ctypes.c_int64), ("frequency", ctypes.c_int32),
                ("pad_", ctypes.c_int32)]


class StepResult(ctypes.Structure):
    _fields_ = [("unique", ctypes.c_int64), ("misses", ctypes.c_int64), ("error", ctypes.c_int64),
                ("failed", ctypes.c_int64)]


def cache_view(cache) -> DramCacheView:
    """The native view of a DramRowCache (its arrays are never reallocated while it is open)."""
    arrays = (cache.rows, cache.tags, cache.last, cache.count, cache.sketch, cache._state)
    for a in arrays:
        if not a.flags.c_contiguous:
            raise EngramError("DRAM row cache: its arrays must be contiguous for the native step")
    return DramCacheView(*(a.ctypes.data for a in arrays), cache.slots, cache.ways, cache.sets, cache.sketch_width,
                         cache.sample, int(cache.admission == "frequency"), 0)


def disk_step(file: DiskFile, cache: Optional[DramCacheView], ids: np.ndarray, wanted: np.ndarray,
              local: np.ndarray, packed: np.ndarray, missed: np.ndarray, rows_out: Optional[np.ndarray],
              decode_threads: int = 0) -> tuple[int, StepResult]:
    """One native step over int64 ids [n] (contiguous) into the caller's buffers: wanted,
    local, missed int64 [n], packed uint8 [>= max(1, n), 264], rows_out uint16 [n, 256] or
    None (no decode). Returns (status, result); the caller holds the cache's lock."""
    result = StepResult()
    status = library().engram_disk_step(
        ctypes.byref(file), None if cache is None else ctypes.byref(cache), ids.ctypes.data, ids.shape[0],
        wanted.ctypes.data, local.ctypes.data, packed.ctypes.data, missed.ctypes.data,
        None if rows_out is None else rows_out.ctypes.data, decode_threads, ctypes.byref(result))
    if status < 0 and status != STEP_AIO_UNAVAILABLE:
        raise EngramError(f"native disk step: bad arguments (status {status})")
    return status, result


AIO_UNAVAILABLE = -2

# Reads in flight per call, at most (ENGRAM_ROWIO_MAX_THREADS, which the library clamps to too):
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


def read_engine(want: Optional[str] = None) -> str:
    """The engine of this process's O_DIRECT reads (the native step's and aio_read_rows'):
    "io_uring", or "aio" (native AIO: asked for by want="aio" or ENGRAM_IO_ENGINE=aio, or where
    io_uring is unavailable: an old kernel, seccomp, io_uring_disabled). want="auto" goes back
    to io_uring where available."""
    codes = {None: -1, "auto": 0, "aio": 1}
    if want not in codes:
        raise EngramError(f"read engine must be 'auto' or 'aio', got {want!r}")
    return "io_uring" if library().engram_rowio_engine(codes[want]) == 0 else "aio"


def last_reads_in_flight() -> int:
    """The most reads the calling thread's last aio_read_rows had in flight (a test hook)."""
    return int(library().engram_rowio_last_peak())


def short_enters(n: int) -> None:
    """The next n io_uring submissions of more than one read ask the kernel for one fewer, as a
    kernel that takes part of a batch does (a test hook)."""
    library().engram_rowio_test_short_enters(ctypes.c_int(n))


def fail_enters(n: int) -> None:
    """The next n io_uring submissions fail with EIO after the kernel took the reads (a test
    hook: the call abandons its ring with reads in flight)."""
    library().engram_rowio_test_fail_enters(ctypes.c_int(n))


def uring_buffers() -> tuple[int, int, int]:
    """The last io_uring ring set up in this process: (buffer slots, registered slots, errno that
    kept the rest unregistered or 0); (0, 0, 0) before any."""
    out = (ctypes.c_int64 * 3)()
    library().engram_rowio_uring_buffers(out)
    return int(out[0]), int(out[1]), int(out[2])


def io_engine_label() -> str:
    """This process's O_DIRECT read engine for the stats, e.g. "io_uring", "aio", or
    "io_uring (registered buffers: 128 of 256, RLIMIT_MEMLOCK)": slots a memory-lock limit
    kept unregistered are read by plain READ (pages pinned on every read)."""
    engine = read_engine()
    slots, fixed, err = uring_buffers()
    if engine != "io_uring" or slots == 0 or fixed == slots:
        return engine
    why = "RLIMIT_MEMLOCK" if err == errno.ENOMEM else (errno.errorcode.get(err, str(err)) if err else "")
    return f"io_uring (registered buffers: {fixed} of {slots}{', ' + why if why else ''})"


def step_decode(want: Optional[str] = None) -> str:
    """The native step's row decode (a test hook): "avx512" where this CPU has AVX-512 VBMI,
    else "portable"; want="portable" forces the portable one, want="auto" goes back."""
    codes = {None: -1, "auto": 0, "portable": 1}
    if want not in codes:
        raise EngramError(f"step decode must be 'auto' or 'portable', got {want!r}")
    return "avx512" if library().engram_disk_step_decode(codes[want]) == 1 else "portable"


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
