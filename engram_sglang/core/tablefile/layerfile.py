"""Writing one layer file: its header page, then its rows in checksum chunks (`chunk_rows`
rows each), several chunks in flight on a thread pool.

A chunk is filled, hashed and written at its own offset by one worker, so chunks finish in
any order and the file and its checksums come out the same as one thread's. The work
releases the GIL: numpy's copies, os.pread/os.pwrite, xxhash over a large buffer. A source
with `fill` (a checkpoint's tensors, an array) is filled by the workers too; an iterable of
chunks is consumed in order by the caller's thread and only hashed and written by them.

Where the filesystem takes it and the chunk is page-aligned (2^18 rows of 264 B are), the
rows are written with O_DIRECT: buffered writes of 189 GiB run at the page cache's
write-back rate (a fraction of the disk's) and push everything else out of memory. The last
chunk is padded to the page for that and the file cut to its size after."""

from __future__ import annotations

import errno
import json
import mmap
import os
import queue
from concurrent.futures import Executor, Future, wait
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

import numpy as np
import torch
import xxhash

from ..errors import TableFormatError
from ..rowformat import ROW_BYTES
from .fileformat import _HEADER, _MAGIC, DATA_OFFSET, VERSION, RowSource
from .progress import Progress

FILE_MODE = 0o644
ALIGN = 4096  # O_DIRECT: buffer, offset and length multiples of the logical block (<= a page)


@runtime_checkable
class RowFill(Protocol):
    """A row source any thread can read any range of: fill(lo, out) writes rows
    [lo, lo + len(out)) into the uint8 [n, 264] array `out`."""

    rows: int

    def fill(self, lo: int, out: np.ndarray) -> None: ...


class ArrayFill:
    """An array or tensor [R, 264] (a memory map is fine) as a RowFill."""

    def __init__(self, a):
        byte = a.dtype == (torch.uint8 if isinstance(a, torch.Tensor) else np.uint8)
        if a.ndim != 2 or a.shape[1] != ROW_BYTES or not byte:
            raise TableFormatError(f"row chunks must be uint8 [n, {ROW_BYTES}], got {a.dtype} {tuple(a.shape)}")
        self.a, self.rows = a, a.shape[0]

    def fill(self, lo: int, out: np.ndarray) -> None:
        part = self.a[lo : lo + out.shape[0]]
        out[:] = part.numpy() if isinstance(part, torch.Tensor) else part


def as_source(source: RowSource):
    """A RowFill for arrays, tensors and fills; an iterable of chunks as it is."""
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return ArrayFill(source)
    return source


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (anonymous memory: O_DIRECT wants the alignment)."""
    return np.frombuffer(mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN)), np.uint8)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "the write wrote nothing")
        view, offset = view[n:], offset + n


class _File:
    """The layer's .tmp file: a buffered descriptor, and an O_DIRECT one where it opens."""

    def __init__(self, path: Path, direct: bool):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        self.dfd = None
        if direct:
            try:
                self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:  # EINVAL: the filesystem has no O_DIRECT (tmpfs before 6.6, some FUSE)
                pass
        self.use_direct = self.dfd is not None

    def write(self, buf: np.ndarray, nbytes: int, offset: int) -> None:
        if self.use_direct and offset % ALIGN == 0:
            try:
                return _pwrite_all(self.dfd, memoryview(buf)[: -(-nbytes // ALIGN) * ALIGN], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:  # a larger alignment than ALIGN: buffered from here on
                    raise
                self.use_direct = False
        _pwrite_all(self.fd, memoryview(buf)[:nbytes], offset)

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd is not None:
                os.close(fd)


def write_layer(path: Path, layer_id: int, cfg, expected: int, source: RowSource, chunk_rows: int,
                progress, *, pool: Optional[Executor] = None, threads: int = 1, direct: bool = True) -> list[str]:
    """Write `path` (through `path`.tmp, renamed when complete and synced); returns the
    xxh3 checksum of each `chunk_rows` rows. `progress`: a Progress, or True/False/None for
    a bar of this file's own. `pool`: the workers (`threads` of them), None for this thread."""
    own = not isinstance(progress, Progress)
    if own:
        progress = Progress(expected * ROW_BYTES, path.name, progress)
    tmp = path.with_name(path.name + ".tmp")
    header = json.dumps(
        {"layer_id": layer_id, "rows": expected, "row_bytes": ROW_BYTES, "config_fingerprint": cfg.fingerprint()}
    ).encode()
    page = (_HEADER.pack(_MAGIC, VERSION, len(header)) + header).ljust(DATA_OFFSET, b"\0")
    f = _File(tmp, direct and chunk_rows * ROW_BYTES % ALIGN == 0)
    ok = False
    try:
        os.fchmod(f.fd, FILE_MODE)
        _pwrite_all(f.fd, memoryview(page), 0)
        checksums = _write_rows(f, as_source(source), path, layer_id, expected, chunk_rows, progress, pool, threads)
        os.ftruncate(f.fd, DATA_OFFSET + expected * ROW_BYTES)  # the last chunk's O_DIRECT padding
        os.fsync(f.fd)
        f.close()
        os.replace(tmp, path)
        ok = True
    finally:
        if not ok:
            f.close()
            tmp.unlink(missing_ok=True)
        if own:
            progress.close(ok)
    return checksums


def _write_rows(f: _File, source, path, layer_id, expected, chunk_rows, progress, pool, threads) -> list[str]:
    n_chunks = -(-expected // chunk_rows)
    checksums: list[Optional[str]] = [None] * n_chunks
    buffers: queue.SimpleQueue = queue.SimpleQueue()  # at most this many chunks in memory
    for _ in range(threads + 1 if pool is not None else 1):
        buffers.put(_aligned(min(chunk_rows, expected) * ROW_BYTES))
    futures: list[Future] = []

    def chunk(k: int, n: int, buf: np.ndarray, fill) -> None:
        try:
            rows = buf[: n * ROW_BYTES].reshape(n, ROW_BYTES)
            if fill is not None:
                fill(k * chunk_rows, rows)
            checksums[k] = xxhash.xxh3_64(memoryview(rows).cast("B")).hexdigest()
            f.write(buf, n * ROW_BYTES, DATA_OFFSET + k * chunk_rows * ROW_BYTES)
            progress.update(n * ROW_BYTES)
        finally:
            buffers.put(buf)

    def take() -> np.ndarray:
        buf = buffers.get()  # waits for a worker to finish a chunk
        failed = next((x for x in futures if x.done() and x.exception() is not None), None)
        if failed is not None:
            buffers.put(buf)
            failed.result()
        return buf

    def submit(k: int, n: int, buf: np.ndarray, fill=None) -> None:
        if pool is None:
            chunk(k, n, buf, fill)
        else:
            futures.append(pool.submit(chunk, k, n, buf, fill))

    try:
        if isinstance(source, RowFill):
            if source.rows != expected:
                more = source.rows > expected
                raise TableFormatError(f"{path}: layer {layer_id} got "
                                       + (f"more than the {expected} rows its layout has" if more else
                                          f"{source.rows} rows, its layout has {expected}"))
            for k in range(n_chunks):
                submit(k, min(chunk_rows, expected - k * chunk_rows), take(), source.fill)
        else:
            _consume(source, path, layer_id, expected, chunk_rows, take, submit)
    except BaseException:
        for x in futures:
            x.cancel()
        raise
    finally:
        wait(futures)  # nothing may still write into the file when it is closed or removed
    for x in futures:
        x.result()
    return checksums


def _consume(source, path, layer_id, expected, chunk_rows, take, submit) -> None:
    """An iterable of chunks of any sizes, regrouped into checksum chunks in order."""
    k, filled, buf, written = 0, 0, None, 0
    for piece in source:
        piece = _as_rows(piece)
        if written + piece.shape[0] > expected:
            raise TableFormatError(f"{path}: layer {layer_id} got more than the {expected} rows its layout has")
        lo = 0
        while lo < piece.shape[0]:
            if buf is None:
                buf, filled = take(), 0
            n = min(piece.shape[0] - lo, chunk_rows - filled)
            buf[filled * ROW_BYTES : (filled + n) * ROW_BYTES].reshape(n, ROW_BYTES)[:] = piece[lo : lo + n]
            lo, filled = lo + n, filled + n
            if filled == chunk_rows:
                submit(k, filled, buf)
                k, buf = k + 1, None
        written += piece.shape[0]
    if written != expected:
        raise TableFormatError(f"{path}: layer {layer_id} got {written} rows, its layout has {expected}")
    if buf is not None:
        submit(k, filled, buf)


def _as_rows(chunk) -> np.ndarray:
    a = chunk.contiguous().numpy() if isinstance(chunk, torch.Tensor) else np.asarray(chunk)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != ROW_BYTES:
        raise TableFormatError(f"row chunks must be uint8 [n, {ROW_BYTES}], got {a.dtype} {a.shape}")
    return a
