"""Short reads and transient I/O errors: a header page and the host load read on where a read
stopped, try a transient error again, and fail in one line naming the file (fileio's policy)."""

from __future__ import annotations

import errno
import mmap
import os
import re
import time

import pytest
import torch

from engram_sglang.core import fileio
from engram_sglang.core.errors import TableFormatError
from engram_sglang.core.stores import TableIOError, hostmem
from engram_sglang.core.tablefile import DATA_OFFSET, layer_file_name, open_tables, write_tables
from tests.support.tables import small_config

CFG = small_config(300)
_real_pread, _real_preadv = os.pread, os.preadv


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda s: None)  # the back-off: these tests need not wait


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    from engram_sglang import EngramLayout

    layout, gen = EngramLayout(CFG), torch.Generator().manual_seed(7)
    tables = {L: torch.randint(0, 256, (layout.rows(L), 264), dtype=torch.uint8, generator=gen).numpy()
              for L in CFG.layer_ids}
    return write_tables(tmp_path_factory.mktemp("t") / "t", CFG, tables, progress=False)


def short_pread(step: int):
    calls = []

    def pread(fd, n, offset):
        calls.append(n)
        return _real_pread(fd, min(n, step), offset)
    return pread, calls


def failing(real, errs: list[int]):
    """`real`, raising OSError(errs.pop(0)) while errs lasts."""
    def f(*a):
        if errs:
            e = errs.pop(0)
            raise OSError(e, os.strerror(e))
        return real(*a)
    return f


# ---------------------------------------------------------------- pread_full / retry_transient
def test_pread_full_reads_on_after_short_reads_and_stops_at_eof(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 10)
    pread, calls = short_pread(100)
    monkeypatch.setattr(os, "pread", pread)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert fileio.pread_full(fd, 2000, 60) == (bytes(range(256)) * 10)[60:2060]
        assert len(calls) == 20
        assert fileio.pread_full(fd, 5000, 2500) == (bytes(range(256)) * 10)[2500:]  # EOF first: fewer
    finally:
        os.close(fd)


def test_transient_errors_are_tried_again_and_others_are_not(monkeypatch):
    errs = [errno.EIO, errno.EAGAIN]
    assert fileio.retry_transient(failing(lambda: "ok", errs)) == "ok" and not errs
    with pytest.raises(OSError) as e:
        fileio.retry_transient(failing(lambda: "ok", [errno.EIO] * 3))
    assert e.value.tries == fileio.READ_RETRIES + 1 and fileio.tries_text(e.value) == "after 3 tries"
    errs = [errno.EACCES, errno.EIO]
    with pytest.raises(PermissionError) as e:  # not transient: one try, the next error never reached
        fileio.retry_transient(failing(lambda: "ok", errs))
    assert e.value.tries == 1 and errs == [errno.EIO]


# ---------------------------------------------------------------- the layer file's header page
def test_header_page_read_in_short_reads_opens(table, monkeypatch):
    pread, calls = short_pread(100)
    monkeypatch.setattr(os, "pread", pread)
    open_tables(table)
    assert len(calls) >= len(CFG.layer_ids) * (DATA_OFFSET // 100)


def test_header_page_transient_eio_then_success(table, monkeypatch):
    monkeypatch.setattr(os, "pread", failing(_real_pread, [errno.EIO, errno.EIO]))
    open_tables(table)


def test_header_page_permanent_eio_is_one_line_naming_the_file(table, monkeypatch):
    monkeypatch.setattr(os, "pread", failing(_real_pread, [errno.EIO] * 10))
    with pytest.raises(TableFormatError) as e:
        open_tables(table)
    msg = str(e.value)
    assert "\n" not in msg and layer_file_name(CFG.layer_ids[0]) in msg
    assert "cannot read the header page (Input/output error, after 3 tries)" in msg


# ---------------------------------------------------------------- the host load's fill
def fill(table, nbytes=None, offset=DATA_OFFSET):
    path = table / layer_file_name(CFG.layer_ids[0])
    nbytes = nbytes if nbytes is not None else os.path.getsize(path) - offset
    m = mmap.mmap(-1, nbytes)
    try:
        hostmem.fill_from_file(m, path, offset, nbytes)
        return bytes(m), path.read_bytes()[offset:offset + nbytes]
    finally:
        m.close()


def short_preadv(step: int):
    calls = []

    def preadv(fd, bufs, offset):
        calls.append(offset)
        with memoryview(bufs[0])[:step] as b:
            return _real_preadv(fd, [b], offset)
    return preadv, calls


def test_fill_reads_on_after_short_reads(table, monkeypatch):
    preadv, calls = short_preadv(100_000)
    monkeypatch.setattr(os, "preadv", preadv)
    got, want = fill(table)
    assert got == want and len(calls) == -(-len(want) // 100_000)


def test_fill_tries_transient_errors_again(table, monkeypatch):
    errs = [errno.EIO, errno.EINTR]
    monkeypatch.setattr(os, "preadv", failing(_real_preadv, errs))
    got, want = fill(table)
    assert got == want and not errs


def test_fill_permanent_eio_is_one_line_with_file_offset_bytes_and_tries(table, monkeypatch):
    monkeypatch.setattr(os, "preadv", failing(_real_preadv, [errno.EIO] * 10))
    with pytest.raises(TableIOError) as e:
        fill(table, nbytes=5000)
    msg = str(e.value)
    assert "\n" not in msg and layer_file_name(CFG.layer_ids[0]) in msg
    assert f"reading 5,000 bytes at offset {DATA_OFFSET:,} into host memory failed after 3 tries " \
           "(Input/output error)" in msg


def test_fill_permission_error_is_not_retried(table, monkeypatch):
    errs = [errno.EACCES, errno.EIO]
    monkeypatch.setattr(os, "preadv", failing(_real_preadv, errs))
    with pytest.raises(TableIOError, match=r"failed after 1 try \(Permission denied\)"):
        fill(table, nbytes=5000)
    assert errs == [errno.EIO]


def test_fill_of_a_truncated_file_ends_early(table, tmp_path):
    src = table / layer_file_name(CFG.layer_ids[0])
    size = os.path.getsize(src)
    cut = tmp_path / layer_file_name(CFG.layer_ids[0])
    cut.write_bytes(src.read_bytes()[: size - 1000])
    m = mmap.mmap(-1, size - DATA_OFFSET)
    try:
        with pytest.raises(TableIOError, match=re.escape(f"{cut}: the file ends early at byte {size - 1000:,} of {size:,} ")):
            hostmem.fill_from_file(m, cut, DATA_OFFSET, size - DATA_OFFSET)
    finally:
        m.close()


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_host_placement_load_fails_in_one_line_and_leaves_no_copy(table, tmp_path, monkeypatch, shared):
    from engram_sglang.core.stores import open_store

    monkeypatch.setattr(os, "preadv", failing(_real_preadv, [errno.EIO] * 100))
    with pytest.raises(TableIOError) as e:
        open_store(table, "host", cfg=CFG, shared=shared, shm_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "into host memory failed after 3 tries (Input/output error)" in msg
    # No table file, not even a half-filled temporary one: only the shared copy's sidecars.
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith((".lock", ".users"))]


# ---------------------------------------------------------------- the device placement's load
def test_device_placement_load_tries_transient_errors_again_and_is_exact(table, monkeypatch):
    from engram_sglang.core.stores import open_store

    errs = [errno.EIO, errno.EAGAIN]  # READ_RETRIES more tries after the first
    monkeypatch.setattr(os, "preadv", failing(_real_preadv, errs))
    L = CFG.layer_ids[0]
    store = open_store(table, "device", cfg=CFG)[L]
    assert not errs  # every error was met and tried again
    want = (table / layer_file_name(L)).read_bytes()[DATA_OFFSET:]
    assert store.table.numpy().tobytes() == want


def test_device_placement_load_eio_is_one_line_not_ended_early(table, monkeypatch):
    from engram_sglang.core.stores import open_store

    monkeypatch.setattr(os, "preadv", failing(_real_preadv, [errno.EIO] * 100))
    with pytest.raises(TableIOError) as e:
        open_store(table, "device", cfg=CFG)
    msg = str(e.value)
    assert "\n" not in msg and layer_file_name(CFG.layer_ids[0]) in msg
    assert "into device memory failed after 3 tries (Input/output error)" in msg and "ends early" not in msg


def test_device_upload_through_the_bounce_buffer_is_exact_in_every_chunk(table, monkeypatch):
    """The GPU path's chunked upload, run on the CPU (bounce=True): chunks not a multiple of a
    row, the last one short, short reads below it."""
    from engram_sglang.core.stores import device

    monkeypatch.setattr(device, "UPLOAD_CHUNK_BYTES", 10_007)
    preadv, calls = short_preadv(4_000)
    monkeypatch.setattr(os, "preadv", preadv)
    L = CFG.layer_ids[0]
    want = (table / layer_file_name(L)).read_bytes()[DATA_OFFSET:]
    got = device._load_rows(table / layer_file_name(L), DATA_OFFSET, len(want) // 264, torch.device("cpu"), bounce=True)
    assert got.shape == (len(want) // 264, 264) and got.numpy().tobytes() == want
    assert len(calls) >= len(want) // 10_007
