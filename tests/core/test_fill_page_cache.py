"""The host placement's fill drops from the page cache only the pages its own reads brought
in: pages another process had cached (a disk-tier server reading the same layer files) stay,
else that server's reads go to the device (the demo's disk server lost ~1/3 of its tokens/s to
this: the host server's fill, started beside it, evicted its table files). Needs a filesystem
with a page cache (not tmpfs): skipped where DONTNEED cannot evict."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from engram_sglang.core import fileio
from engram_sglang.core.stores import hostmem

PAGES = 2048  # 8 MiB


@pytest.fixture
def layer_file(tmp_path):
    path = tmp_path / "layer.rows"
    data = np.random.default_rng().integers(0, 256, PAGES * mmap.PAGESIZE + 1000, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    FILES[path] = data  # what a fill must give, known without reading the file (which caches it)
    yield path, fd
    os.close(fd)
    del FILES[path]


FILES = {}


def resident(fd) -> np.ndarray:
    return fileio.resident_pages(fd, 0, os.fstat(fd).st_size)


def evict(fd):
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def cache(fd, offset=0, nbytes=None):
    nbytes = os.fstat(fd).st_size - offset if nbytes is None else nbytes
    os.pread(fd, nbytes, offset)


def fill(path, offset=mmap.PAGESIZE):
    nbytes = os.path.getsize(path) - offset
    m = mmap.mmap(-1, nbytes)
    try:
        hostmem.fill_from_file(m, path, offset, nbytes)
        assert bytes(m) == FILES[path][offset:]
    finally:
        m.close()


def test_resident_pages_says_what_is_cached(layer_file):
    _, fd = layer_file
    evict(fd)
    if resident(fd).mean() > 0.05:
        pytest.skip("this filesystem keeps pages DONTNEED drops (tmpfs?): nothing to measure")
    cache(fd, 0, 100 * mmap.PAGESIZE)
    got = resident(fd)
    assert got.shape == (PAGES + 1,) and got[:100].all() and got[100:].mean() < 0.5
    cache(fd)
    assert resident(fd).all()
    # Part of a page at either end counts the page; an unaligned offset starts at its page.
    assert fileio.resident_pages(fd, 10, mmap.PAGESIZE).shape == (2,)


def test_a_fill_of_a_cached_file_leaves_it_cached(layer_file):
    path, fd = layer_file
    cache(fd)
    assert resident(fd).all()
    fill(path)
    assert resident(fd).all()  # the old fill dropped all of it


def test_a_fill_drops_what_it_read_in_and_keeps_what_was_there(layer_file):
    path, fd = layer_file
    evict(fd)
    if resident(fd).mean() > 0.05:
        pytest.skip("this filesystem keeps pages DONTNEED drops (tmpfs?): nothing to measure")
    half = PAGES // 2
    cache(fd, half * mmap.PAGESIZE, 256 * mmap.PAGESIZE)  # another reader's pages, mid-file
    fill(path)
    after = resident(fd)
    assert after[half:half + 256].all()  # kept
    assert after[1:half].mean() < 0.05 and after[half + 256:].mean() < 0.05  # the fill's own: dropped


def test_only_runs_nobody_had_cached_are_dropped(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n)))
    P = mmap.PAGESIZE
    was = np.array([0, 0, 1, 1, 0, 1, 0, 0], dtype=bool)  # pages of [base, base + 8 pages)
    fileio.drop_pages_not_in(3, 100 * P, 8 * P, 100 * P, was)
    assert calls == [(100 * P, 2 * P), (104 * P, P), (106 * P, 2 * P)]
    calls.clear()
    fileio.drop_pages_not_in(3, 102 * P + 7, 4 * P, 100 * P, was)  # a chunk from mid-page: clipped to it
    assert calls == [(104 * P, P), (106 * P, 7)]
    calls.clear()
    fileio.drop_pages_not_in(3, 100 * P, 8 * P, 100 * P, None)  # residency unknown: the whole range
    assert calls == [(100 * P, 8 * P)]
