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

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: the parent reads with the library (its pool grows, its ring or
# AIO context is made), then forks; the child's reads must complete with the right rows. A
# child that hangs is killed after CHILD_TIMEOUT and reported, so the suite never hangs.
FORK_PRELUDE = """
    import os, signal, sys, tempfile, time
    import numpy as np
    from engram_sglang.stores import rowio
    from engram_sglang.tablefile import DATA_OFFSET
    from engram_sglang.rowformat import ROW_BYTES

    ROWS = 20_000
    path = os.path.join(tempfile.mkdtemp(), "t.rows")
    data = (np.arange(ROWS * ROW_BYTES, dtype=np.uint64) % 251).astype(np.uint8).reshape(ROWS, ROW_BYTES)
    with open(path, "wb") as f:
        f.write(bytes(DATA_OFFSET))
        f.write(data.tobytes())

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
