"""Reading the small files a user hands us (configs, manifests, headers) without trusting them.

A FIFO, socket or device named where a file belongs would block a plain `open` + `read`
forever (a FIFO waits for a writer) or stream without end; a huge file would be read into
memory whole. Every such file is opened non-blocking, checked to be a regular file, and
read up to a stated bound, or refused with one line naming it.

A read of a file we expect to be there (a header page, rows loaded into host memory) is read
again where it stopped after a short read, and tried again after a transient error with the
disk tier's back-off (pread_full, retry_transient).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Type, TypeVar

if TYPE_CHECKING:
    import numpy as np

from .errors import EngramError

T = TypeVar("T")

# A failed read is tried this many more times, after READ_BACKOFF_S * (try number) seconds:
# the disk tier's default (stores/disk.py) and the host load's policy.
READ_RETRIES = 2
READ_BACKOFF_S = 0.01
# Errors a later try may not see (a flaky device or path, an interrupted or would-block read);
# a missing file or a refused permission will not go away by trying again.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EINTR, errno.EAGAIN})

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, error: Type[EngramError] = EngramError, what: str = "file") -> int:
    """A read-only descriptor of `path`, which must be a regular file (symlinks followed).

    Opened O_NONBLOCK so that a FIFO never blocks the open; the flag is cleared again for a
    regular file (it means nothing there). FileNotFoundError passes through for the caller
    to word; every other refusal raises `error` with one line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot open the {what} ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: the {what} is {kind_of(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, limit: int, error: Type[EngramError] = EngramError,
                 what: str = "file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes (see open_regular)."""
    fd = open_regular(path, error, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{path}: the {what} is {size:,} bytes; at most {limit:,} are expected")
        chunks, got = [], 0
        while True:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
            if got > limit:  # grew while we read
                raise error(f"{path}: the {what} is over {limit:,} bytes; at most {limit:,} are expected")
        return b"".join(chunks)
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror})") from None
    finally:
        os.close(fd)


def retry_transient(read: Callable[[], T], retries: int = READ_RETRIES) -> T:
    """read(), tried again after a transient OSError up to `retries` more times with the back-off.

    The last OSError is raised with `.tries` set to the number of tries it took (1 for an
    error that is not transient), for the caller's one line ("after N tries")."""
    for attempt in range(retries + 1):
        try:
            return read()
        except OSError as e:
            if e.errno not in TRANSIENT_ERRNOS or attempt == retries:
                e.tries = attempt + 1
                raise
            time.sleep(READ_BACKOFF_S * (attempt + 1))
    raise AssertionError("unreachable")


def pread_full(fd: int, n: int, offset: int, retries: int = READ_RETRIES) -> bytes:
    """`n` bytes of `fd` from `offset`, fewer only where the file ends first.

    A short read reads again from where it stopped; a transient error is tried again
    (retry_transient). Raises the last OSError (with `.tries`)."""
    chunks, got = [], 0
    while got < n:
        b = retry_transient(lambda: os.pread(fd, n - got, offset + got), retries)
        if not b:
            break  # end of file
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def tries_text(e: OSError) -> str:
    """ "after N tries" for an OSError that retry_transient raised."""
    n = getattr(e, "tries", 1)
    return f"after {n} {'try' if n == 1 else 'tries'}"


def inside(root: Path, path: Path) -> bool:
    """Does `path`, all symlinks resolved, lie directly in directory `root` (resolved)?"""
    return Path(os.path.realpath(path)).parent == Path(os.path.realpath(root))


# ------------------------------------------------------------------ page cache
PAGE = mmap.PAGESIZE


def resident_pages(fd: int, offset: int, nbytes: int) -> Optional[np.ndarray]:
    """Which pages of [offset, offset + nbytes) of `fd` are in the page cache now (mincore on a
    mapping that is never touched: nothing is read), one bool per page from the page that holds
    `offset`; None where the kernel cannot say (the caller then assumes none)."""
    import ctypes

    import numpy as np

    if nbytes <= 0:
        return np.zeros(0, dtype=bool)
    start = offset - offset % PAGE
    length = offset + nbytes - start
    try:
        m = mmap.mmap(fd, length, offset=start, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    try:
        view = np.frombuffer(m, dtype=np.uint8)
        vec = np.zeros(-(-length // PAGE), dtype=np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(length),
                          vec.ctypes.data_as(ctypes.c_void_p)) == 0
        del view  # the mapping closes only without views
    finally:
        m.close()
    return (vec & 1).astype(bool) if ok else None


def drop_pages_not_in(fd: int, offset: int, nbytes: int, base: int, resident: Optional[np.ndarray]) -> None:
    """Drop [offset, offset + nbytes) of `fd` from the page cache, except the pages `resident`
    (resident_pages(fd, base, ...)) says were cached before: another process (a disk-tier
    server on the same files, a second fill) is reading those, and evicting them would send its
    reads to the device."""
    import numpy as np

    if resident is None:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return
    first = base - base % PAGE
    lo, hi = (offset - first) // PAGE, -(-(offset + nbytes - first) // PAGE)
    keep = resident[lo:hi]
    if not keep.any():
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return
    # Runs of pages nobody had cached: [starts[k], ends[k]) in page numbers.
    edges = np.diff(np.concatenate(([True], keep, [True])).astype(np.int8))
    for a, b in zip(np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)):
        run_lo, run_hi = max(first + (lo + a) * PAGE, offset), min(first + (lo + b) * PAGE, offset + nbytes)
        os.posix_fadvise(fd, run_lo, run_hi - run_lo, os.POSIX_FADV_DONTNEED)
