"""Reading the small files a user hands us (configs, manifests, headers) without trusting them.

A FIFO, socket or device named where a file belongs would block a plain `open` + `read`
forever (a FIFO waits for a writer) or stream without end; a huge file would be read into
memory whole. Every such file is opened non-blocking, checked to be a regular file, and
read up to a stated bound, or refused with one line naming it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Type

from .errors import EngramError

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


def inside(root: Path, path: Path) -> bool:
    """Does `path`, all symlinks resolved, lie directly in directory `root` (resolved)?"""
    return Path(os.path.realpath(path)).parent == Path(os.path.realpath(root))
