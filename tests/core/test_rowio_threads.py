"""The row reader's threads are bounded: settings and open_store refuse more than
rowio.MAX_THREADS in one line, and the native reader clamps a larger request itself (2000
threads under a memory limit once aborted the process inside native code)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.core.stores import open_store, rowio
from engram_sglang.serving.settings import MAX_DISK_THREADS


def test_the_bound_is_one_number_everywhere():
    assert MAX_DISK_THREADS == rowio.MAX_THREADS == 256
    io = rowio.kernels_dir().parents[1] / "kernels" / "io"
    assert "#define ENGRAM_ROWIO_MAX_THREADS 256\n" in (io / "engram_rowio_abi.h").read_text()
    assert "constexpr int kMaxThreads = ENGRAM_ROWIO_MAX_THREADS;" in (io / "engram_rowio.cpp").read_text()


@pytest.mark.parametrize("threads", [0, -1, 257, 2000, True, 8.0, "8", None])
def test_open_store_refuses_a_thread_count_out_of_bounds(tmp_path, threads):
    # Refused before the table directory is even read.
    with pytest.raises(EngramError, match=r"disk placement option threads must be a whole number from 1 to 256 "
                                          rf"\(reads in flight\), got {threads!r}"):
        open_store(tmp_path / "nowhere", "disk", threads=threads)


def test_native_reads_clamp_their_threads(tmp_path):
    """A direct call asking for 5000 threads starts at most 255 helpers and reads every row."""
    rows = 3000
    code = textwrap.dedent(f"""
        import os, numpy as np
        from engram_sglang.core.stores import rowio
        data = np.random.default_rng(1).integers(0, 256, ({rows}, 264), dtype=np.uint8)
        path = {str(tmp_path / "rows.bin")!r}
        with open(path, "wb") as f:
            f.write(b"\\0" * 4096 + data.tobytes())
        fd = os.open(path, os.O_RDONLY)
        before = len(os.listdir("/proc/self/task"))
        ids = np.arange({rows}, dtype=np.int64)
        out = np.empty(({rows}, 264), dtype=np.uint8)
        assert rowio.pread_rows(fd, 4096, ids, out, 5000, False) == (0, -1)
        assert np.array_equal(out, data)
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        out[:] = 0
        assert rowio.copy_mapped(mm.ctypes.data + 4096, ids, out, 5000) == -1
        assert np.array_equal(out, data)
        print(len(os.listdir("/proc/self/task")) - before)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 0 < int(proc.stdout.strip()) <= rowio.MAX_THREADS - 1
