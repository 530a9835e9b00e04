"""The native row I/O library's engines (kernels/io/engram_rowio.cpp, engram_uring.h) where they
meet the process around them: a forked child (a data-parallel worker started by fork after the
parent read rows), an io_uring_enter that takes fewer reads than it was given, a setup failure
that is only for now, and registered buffers under a memory-lock limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: the parent reads with the library (its pool grows, its ring or
# AIO context is made), then forks; the child's reads must complete with the right rows. A
# child that hangs is killed after CHILD_TIMEOUT and reported, so the suite never hangs.
# Both preludes below start with it: a table file of `rows` distinct rows (a byte pattern).
TABLE_PRELUDE = """
    import atexit, errno, os, resource, shutil, signal, sys, tempfile, time
    import numpy as np
    from engram_sglang.core.stores import rowio
    from engram_sglang.core.tablefile import DATA_OFFSET
    from engram_sglang.core.rowformat import ROW_BYTES

    def write_table(rows, modulus):
        where = tempfile.mkdtemp()
        atexit.register(shutil.rmtree, where, True)  # forked children leave by os._exit: not theirs
        path = os.path.join(where, "t.rows")
        data = (np.arange(rows * ROW_BYTES, dtype=np.uint64) % modulus).astype(np.uint8).reshape(rows, ROW_BYTES)
        with open(path, "wb") as f:
            f.write(bytes(DATA_OFFSET))
            f.write(data.tobytes())
        return path, data
"""

FORK_PRELUDE = TABLE_PRELUDE + """
    ROWS = 20_000
    path, data = write_table(ROWS, 251)

    def in_child(fn, timeout=20.0):
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(fn())
            except BaseException as e:
                print("child raised", repr(e), flush=True)
                os._exit(99)
        end = time.time() + timeout
        while time.time() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hang"

    def step(fd, mode, request, decode):
        f = rowio.DiskFile(fd, mode, 16, 1, DATA_OFFSET, 0, 0, ROWS)
        n = request.shape[0]
        wanted, local, missed = (np.empty(n, np.int64) for _ in range(3))
        packed = np.zeros((n, ROW_BYTES), np.uint8)
        rows_out = np.empty((n, 256), np.uint16) if decode else None
        status, res = rowio.disk_step(f, None, request, wanted, local, packed, missed, rows_out, 2)
        ok = status == rowio.STEP_OK and np.array_equal(packed[: int(res.unique)], data[request])
        if not ok:
            print("step", status, int(res.error), flush=True)
        return ok
"""

FORK_CASES = {
    # rowio's worker pool (pread, copy_mapped, the step's decode): the child inherits the pool
    # object but none of its threads.
    "pool": """
        rows = np.arange(0, ROWS, 3, dtype=np.int64)
        out = np.empty((rows.shape[0], ROW_BYTES), np.uint8)
        fd = os.open(path, os.O_RDONLY)
        assert rowio.pread_rows(fd, DATA_OFFSET, rows, out, 4, False) == (0, -1)

        def child():
            o = np.empty_like(out)
            return 0 if rowio.pread_rows(fd, DATA_OFFSET, rows, o, 4, False) == (0, -1) and \\
                np.array_equal(o, data[rows]) else 1
    """,
    # The step's CPU decode runs on the pool (541 ids: past the serial bound).
    "step-decode": """
        request = np.arange(0, ROWS, 37, dtype=np.int64)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        assert step(fd, rowio.READ_PREAD, request, True)

        def child():
            return 0 if step(fd, rowio.READ_PREAD, request, True) else 1
    """,
    # Native AIO: the thread's context is the parent's; every read in the child was EINVAL.
    "aio": """
        rows = np.arange(0, ROWS, 40, dtype=np.int64)
        out = np.empty((rows.shape[0], ROW_BYTES), np.uint8)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        assert rowio.read_engine("aio") == "aio"
        assert rowio.aio_read_rows(fd, DATA_OFFSET, rows, out, 16) == (0, -1)

        def child():
            o = np.empty_like(out)
            results = [rowio.aio_read_rows(fd, DATA_OFFSET, rows, o, d) for d in (16, 16, 256)]
            print("child", results, flush=True)
            return 0 if all(r == (0, -1) for r in results) and np.array_equal(o, data[rows]) else 1
    """,
    "step-aio": """
        request = np.arange(0, ROWS, 37, dtype=np.int64)[:100]
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        assert rowio.read_engine("aio") == "aio"
        assert step(fd, rowio.READ_AIO, request, False)

        def child():
            return 0 if all(step(fd, rowio.READ_AIO, request, False) for _ in range(3)) else 1
    """,
    # io_uring: the ring is the parent's (single issuer); the child makes its own, and the
    # parent's still works after.
    "io_uring": """
        rows = np.arange(0, ROWS, 40, dtype=np.int64)
        out = np.empty((rows.shape[0], ROW_BYTES), np.uint8)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        rowio.read_engine("auto")
        assert rowio.aio_read_rows(fd, DATA_OFFSET, rows, out, 256) == (0, -1)

        def child():
            o = np.empty_like(out)
            results = [rowio.aio_read_rows(fd, DATA_OFFSET, rows, o, d) for d in (16, 256)]
            return 0 if all(r == (0, -1) for r in results) and np.array_equal(o, data[rows]) else 1
    """,
}


def run_python(code: str, timeout: int = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full,
                          cwd=ROOT)


@pytest.mark.parametrize("case", list(FORK_CASES))
def test_a_forked_child_reads_rows(case):
    code = f"CASE = {case!r}\n" + textwrap.dedent(FORK_PRELUDE) + textwrap.dedent(FORK_CASES[case]) + textwrap.dedent("""
        got = in_child(child)
        print("child exit", got, flush=True)
        assert got == 0
        if CASE == "io_uring":
            assert rowio.aio_read_rows(fd, DATA_OFFSET, rows, out, 256) == (0, -1)  # the parent's still works
            assert np.array_equal(out, data[rows])
        print("ok")
    """)
    proc = run_python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


# A fresh interpreter with a file of distinct rows, io_uring as the engine (the cases below are
# about io_uring; where the kernel refuses it they print "skip").
URING_PRELUDE = TABLE_PRELUDE + """
    if rowio.read_engine("auto") != "io_uring":
        print("skip: io_uring is unavailable here")
        sys.exit(0)
    ROWS = 40_000
    path, data = write_table(ROWS, 253)
    rows = np.arange(0, ROWS, 40, dtype=np.int64)  # 1000 reads, never merged
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def read(depth):
        out = np.zeros((rows.shape[0], ROW_BYTES), np.uint8)
        got = rowio.aio_read_rows(fd, DATA_OFFSET, rows, out, depth)
        assert got == (0, -1) and np.array_equal(out, data[rows]), (depth, got)

    def rings():
        links = []
        for x in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{x}"))
            except FileNotFoundError:  # listdir's own descriptor, closed by now
                pass
        return links.count("anon_inode:[io_uring]")
"""


def run_uring_case(body: str, timeout: int = 60, prefix: list[str] | None = None) -> str:
    code = textwrap.dedent(URING_PRELUDE) + textwrap.dedent(body) + "\nprint('ok')\n"
    if prefix is None:
        proc = run_python(code, timeout=timeout)
    else:
        full = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=full, cwd="/")
    assert proc.returncode == 0 and ("ok" in proc.stdout or "skip" in proc.stdout), proc.stdout + proc.stderr
    if "skip" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    return proc.stdout


def test_reads_the_kernel_did_not_take_go_with_the_next_enter():
    """io_uring_enter may take fewer reads than it was given (the kernel out of request memory
    mid-batch). They stay in the SQ: they were counted in flight and waited for, but never
    submitted again, so the call waited forever (holding the store's DRAM lock). The test hook
    asks the kernel for one fewer, once and then on every enter; the time limit is the hang."""
    run_uring_case("""
        for short in (1, 3, 10_000):
            for depth in (2, 16, 256):
                rowio.short_enters(short)
                read(depth)
        rowio.short_enters(0)
        read(256)
    """)


def test_a_ring_that_cannot_be_set_up_now_is_tried_again():
    """Out of descriptors (EMFILE) or memory is for now: that call reads by native AIO and the
    next one by io_uring (any setup failure kept the thread on native AIO for good)."""
    out = run_uring_case("""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.dup(0)
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # the ring's descriptor: EMFILE
        read(32)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("rings after EMFILE", rings())
        assert rings() == 0
        read(32)
        print("rings after", rings())
        assert rings() == 1
    """)
    assert "rings after 1" in out


@pytest.mark.skipif(os.geteuid() != 0 or not all(os.path.exists(p) for p in ("/usr/bin/setpriv", "/usr/bin/prlimit")),
                    reason="needs root to drop CAP_IPC_LOCK (setpriv) under an 8 MiB RLIMIT_MEMLOCK (prlimit)")
def test_registered_buffers_under_a_memory_lock_limit():
    """A user without CAP_IPC_LOCK may lock 8 MiB (a common default), less than 256 slots of
    64 KiB: the slots that fit are registered, the rest read by plain READ, and the store's
    stats say so (registration failed silently, all or nothing, before)."""
    out = run_uring_case("""
        read(256)
        slots, fixed, err = rowio.uring_buffers()
        label = rowio.io_engine_label()
        print(slots, fixed, err, label)
        assert slots == 256 and 0 < fixed < 256 and err == errno.ENOMEM, (slots, fixed, err)
        assert label == f"io_uring (registered buffers: {fixed} of 256, RLIMIT_MEMLOCK)"
        read(256)  # the same ring, fixed and plain slots together
    """, prefix=["/usr/bin/prlimit", f"--memlock={8 << 20}", "/usr/bin/setpriv", "--bounding-set=-ipc_lock"])
    assert "registered buffers" in out


def test_an_o_direct_store_names_its_read_engine(tmp_path):
    import torch

    from engram_sglang.core.stores import open_store, rowio
    from tests.support.tables import random_table_dir, small_config

    cfg = small_config(400)
    root, _ = random_table_dir(tmp_path, cfg)
    layer = cfg.layer_ids[0]
    for direct in (True, False):
        stores = open_store(root, "disk", cfg=cfg, direct=direct, threads=4)
        try:
            stores[layer].gather(torch.arange(50))
            s = stores[layer].stats()
            if direct:
                assert s["io_engine"] == rowio.io_engine_label() and s["io_engine"].startswith(rowio.read_engine())
            else:
                assert "io_engine" not in s
        finally:
            for store in stores.values():
                store.close()


def test_a_step_after_a_failed_enter_never_reaps_the_abandoned_ring():
    """An io_uring_enter that fails after the kernel took the reads abandons the ring (its buffers
    are never freed: reads may still land there). The disk step went on pumping it: the next enter
    submitted what the SQ held and reaped completions into slots of a null buffer pointer
    (SIGSEGV, review R5 F1). Now the call comes back unread and the next one reads on a new ring."""
    run_uring_case("""
        # Every row of the file: a long lookup, so reads taken before the failure complete while
        # the step still pumps (1000 scattered rows are looked up before any lands).
        every = np.arange(ROWS, dtype=np.int64)

        def step(decode):
            f = rowio.DiskFile(fd, rowio.READ_AIO, 16, 1, DATA_OFFSET, 0, 0, ROWS)
            n = every.shape[0]
            wanted, local, missed = (np.empty(n, np.int64) for _ in range(3))
            packed = np.zeros((n, ROW_BYTES), np.uint8)
            out = np.empty((n, 256), np.uint16) if decode else None
            status, res = rowio.disk_step(f, None, every, wanted, local, packed, missed, out, 2)
            return status, int(res.error), np.array_equal(packed[: int(res.unique)], data[every])

        for decode in (True, False):
            for fail in (1, 2):
                assert step(decode) == (rowio.STEP_OK, 0, True)
                rowio.fail_enters(fail)
                status, error, _ = step(decode)
                assert (status, error) == (rowio.STEP_UNREAD, errno.EIO), (status, error)
                rowio.fail_enters(0)
                assert step(decode) == (rowio.STEP_OK, 0, True)
                read(256)
    """)


def test_a_forked_child_never_closes_a_descriptor_that_reused_the_rings_number():
    """A child that closed the inherited ring descriptor and opened a file that got its number:
    its first read closed that file (the old ring's `close(fd_)`) and then sent its reads to the
    new ring's own descriptor number, which never answered (review R5 F2)."""
    run_uring_case("""
        read(16)
        ring = rings()
        assert ring == 1
        ring_fd = [int(x) for x in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{x}")
                   and os.readlink(f"/proc/self/fd/{x}") == "anon_inode:[io_uring]"][0]
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # The ring's number closed and reused (e.g. by a worker closing what it did not
                # open, then opening a file): dup2 puts the table file at exactly that number.
                opened = os.open(path, os.O_RDONLY | os.O_DIRECT)
                os.dup2(opened, ring_fd)
                os.close(opened)
                table = ring_fd
                out = np.zeros((rows.shape[0], ROW_BYTES), np.uint8)
                assert rowio.aio_read_rows(table, DATA_OFFSET, rows, out, 16) == (0, -1)
                assert os.path.exists(f"/proc/self/fd/{table}"), "the child's table file was closed"
                assert np.array_equal(out, data[rows])
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        read(16)  # the parent's ring still works
    """, timeout=30)
