"""The disk tier's native step (one native call per layer and step) against the numpy path.

Same bits, same DRAM-cache hits and the same cache state (tags, counts, sketch, clock and
counters) on the same trace; both on the CPU (the native call decodes) and through the GPU
staging path (fake streams: the native call stages packed rows); ids past 2^31 bytes into
a file; a closed store; a real read error injected in libc by the fault shim.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES, ROW_VALUES, bf16_bits
from engram_sglang.core.stores import open_store, rowio
from engram_sglang.core.stores.dram_cache import DramRowCache
from engram_sglang.core.tablefile import DATA_OFFSET
from tests.support.fake_streams import RecordingStreams
from tests.support.tables import held_mask, random_table_dir, small_config

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)
ROOT = Path(__file__).resolve().parents[2]
FAULTS_LIB = ROOT / "build" / "kernels" / "libengram_faults.so"


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("tables"), CFG)


def reference(rows: np.ndarray, ids: torch.Tensor, ranges=None) -> torch.Tensor:
    """bf16 bits of the rows of ids; +0 outside the shard's row `ranges` (None: whole rows)."""
    flat = ids.reshape(-1).numpy()
    out = bf16_bits(rowformat.dequantize(torch.from_numpy(rows[flat])))
    if ranges is not None:
        out[torch.from_numpy(~held_mask(flat, ranges))] = 0
    return out.view(*ids.shape, ROW_VALUES)


def cache_state(store) -> tuple:
    d = store.dram
    return (d.tags.copy(), d.last.copy(), d.count.copy(), d.sketch.copy(), d._state.copy(), d.rows.copy())


def trace(gen: torch.Generator, rows: int, steps: int) -> list[torch.Tensor]:
    """Decode-step-like calls: a popular head (repeats within and across calls), a uniform
    tail, and the first and last row now and then."""
    calls = []
    for k in range(steps):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        hot = torch.randint(0, max(1, rows // 50), (n,), generator=gen)
        cold = torch.randint(0, rows, (n,), generator=gen)
        ids = torch.where(torch.rand(n, generator=gen) < 0.5, hot, cold)
        if k % 5 == 0:
            ids[0], ids[-1] = 0, rows - 1
        calls.append(ids.view(-1, 1) if k % 2 else ids)
    return calls


# (store options, tensor-parallel rank and size): every read mode, with and without a DRAM
# cache, a whole table and a shard (ids outside it read +0).
CASES = {"mapped": ({}, 0, 1), "aio-shard": ({"direct": True, "threads": 4}, 1, 2),
         "mapped+dram-shard": ({"dram_cache_bytes": 40 << 10, "threads": 4}, 0, 2),
         "aio+dram": ({"direct": True, "threads": 8, "dram_cache_bytes": 40 << 10}, 0, 1),
         # O_DIRECT reads go by io_uring where the kernel allows it: this case by native AIO.
         "aio+dram-libaio": ({"direct": True, "threads": 8, "dram_cache_bytes": 40 << 10}, 0, 1),
         # The native step keeps up to NativeStep.depth (256) reads in flight: this case the
         # store's 4, so slots are refilled while the lookup is still adding misses.
         "aio+dram-depth4": ({"direct": True, "threads": 4, "dram_cache_bytes": 40 << 10}, 0, 1),
         # The step decodes by AVX-512 where this CPU has it: this case by the portable decode.
         "aio+dram-portable": ({"direct": True, "threads": 8, "dram_cache_bytes": 40 << 10}, 0, 1)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["cpu", "gpu-staging"])
def test_native_step_equals_the_numpy_path(tables, rng, case, how):
    root, rows = tables
    L = CFG.layer_ids[0]
    options, tp_rank, tp_size = CASES[case]
    if case.endswith("-libaio"):
        assert rowio.read_engine("aio") == "aio"
    if case.endswith("-portable"):
        assert rowio.step_decode("portable") == "portable"
    native = open_store(root, "disk", cfg=CFG, tp_rank=tp_rank, tp_size=tp_size, **options)
    python = open_store(root, "disk", cfg=CFG, tp_rank=tp_rank, tp_size=tp_size, **options)
    try:
        a, b = native[L], python[L]
        b.native_step = False
        if case.endswith("-depth4"):
            a._native.depth = 0
        if how == "gpu-staging":
            a._streams, b._streams = RecordingStreams(), RecordingStreams()
        for ids in trace(rng, a.rows, 40):
            if how == "cpu":
                got, want = a.gather(ids), b.gather(ids)
            else:
                got, want = a.prefetch(ids).wait(), b.prefetch(ids).wait()
            assert torch.equal(bf16_bits(got), bf16_bits(want))
            assert torch.equal(bf16_bits(got), reference(rows[L], ids, a.row_ranges))
        sa, sb = a.stats(), b.stats()
        assert sa["file_rows_read"] == sb["file_rows_read"] and sa["unique_rows"] == sb["unique_rows"]
        if a.dram is not None:
            assert 0 < sa["dram_cache_hit_rate"] < 1 and sa["dram_cache_agings"] > 0  # the trace exercises aging
            for x, y in zip(cache_state(a), cache_state(b)):
                assert np.array_equal(x, y)
            assert {k: v for k, v in sa.items() if k.startswith("dram")} == \
                {k: v for k, v in sb.items() if k.startswith("dram")}
    finally:
        for s in [*native.values(), *python.values()]:
            s.close()
        rowio.read_engine("auto")
        rowio.step_decode("auto")


def test_the_step_decode_is_the_cpus_best():
    """AVX-512 VBMI CPUs decode by the AVX-512 row decode (the host gather's), others portably."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    has = all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512vbmi"))
    assert rowio.step_decode() == ("avx512" if has else "portable")
    assert rowio.step_decode("portable") == "portable"
    assert rowio.step_decode("auto") == ("avx512" if has else "portable")


@pytest.mark.parametrize("engine", ["auto", "aio"])
def test_a_call_keeps_at_most_its_own_depth_in_flight(tmp_path, engine):
    """A thread's ring (or AIO context) is made for the deepest call so far; a shallower call
    after it still keeps at most its own depth in flight (it kept the ring's, 256, before)."""
    path = tmp_path / "sparse.rows"
    with open(path, "wb") as f:
        f.truncate(DATA_OFFSET + 40_000 * ROW_BYTES)
    rows = np.arange(0, 40_000, 40, dtype=np.int64)  # 10 KiB apart: one read each, never merged
    out = np.empty((rows.shape[0], ROW_BYTES), np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        rowio.read_engine(engine)
        for depth, most in ((256, 256), (4, 4), (256, 256), (16, 16)):
            assert rowio.aio_read_rows(fd, DATA_OFFSET, rows, out, depth) == (0, -1)
            assert 1 <= rowio.last_reads_in_flight() <= most
        assert rowio.last_reads_in_flight() == 16 and not out.any()
    finally:
        os.close(fd)
        rowio.read_engine("auto")


@pytest.mark.parametrize("depth", [4, 256])
def test_a_file_truncated_under_reads_already_out(tmp_path, rng, depth):
    """O_DIRECT misses are read while the lookup still runs: when a later miss lies past the
    end of the file, the reads already out are waited for, the step comes back unread
    (short read at its last miss), the hits are copied, and nothing is admitted."""
    n_rows, keep = 4096, 2048
    data = torch.randint(0, 256, (n_rows, ROW_BYTES), dtype=torch.uint8, generator=rng).numpy()
    path = tmp_path / "t.rows"
    with open(path, "wb") as f:
        f.write(bytes(DATA_OFFSET))
        f.write(data.tobytes())
    cache = DramRowCache(1 << 20, huge_pages=False)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        f = rowio.DiskFile(fd, rowio.READ_AIO, depth, 1, DATA_OFFSET, 0, 0, n_rows)
        view = rowio.cache_view(cache)
        hot = np.arange(3000, 3010, dtype=np.int64)  # cached before the file shrinks
        cache.lookup(hot)
        assert cache.admit(hot, data[hot]) == hot.shape[0]
        request = np.concatenate([np.arange(0, 1000, 7), hot, [keep + 1, n_rows - 1]]).astype(np.int64)
        n = request.shape[0]
        os.truncate(path, DATA_OFFSET + keep * ROW_BYTES)
        wanted, local, missed = (np.empty(n, np.int64) for _ in range(3))
        packed = np.zeros((n, ROW_BYTES), np.uint8)
        admitted = cache.admitted
        status, res = rowio.disk_step(f, view, request, wanted, local, packed, missed, None)
        assert status == rowio.STEP_UNREAD and res.error == -1 and res.failed == res.misses - 1
        assert res.misses == n - hot.shape[0] and cache.admitted == admitted
        at = np.searchsorted(wanted[: res.unique], hot)
        assert np.array_equal(packed[at], data[hot])
        # The next call (rows inside the file) reads right: nothing of the last one lingers.
        ok = np.arange(5, 2000, 3, dtype=np.int64)
        wanted, local, missed = (np.empty(ok.shape[0], np.int64) for _ in range(3))
        packed = np.zeros((ok.shape[0], ROW_BYTES), np.uint8)
        status, res = rowio.disk_step(f, view, ok, wanted, local, packed, missed, None)
        assert status == rowio.STEP_OK and np.array_equal(packed[: res.unique], data[ok])
    finally:
        os.close(fd)
        cache.close()


def test_native_step_shares_the_cache_with_read_ahead_and_fills_out(tables, rng):
    """Rows read ahead by the Python side are hits of the native step; `out` is filled."""
    root, rows = tables
    L = CFG.layer_ids[-1]
    store = open_store(root, "disk", cfg=CFG, direct=True, dram_cache_bytes=64 << 20)[L]
    try:
        ids = torch.randint(0, store.rows, (50, 8), generator=rng)
        store.read_ahead(ids).result()
        read = store.stats()["file_rows_read"]
        out = torch.empty((50, 8, ROW_VALUES), dtype=torch.bfloat16)
        assert store.gather(ids, out=out) is out
        assert store.stats()["file_rows_read"] == read and store.dram.hits == torch.unique(ids).numel()
        assert torch.equal(bf16_bits(out), reference(rows[L], ids))
        strided = torch.empty((8, 50, ROW_VALUES), dtype=torch.bfloat16).transpose(0, 1)  # not contiguous
        store.gather(ids, out=strided)
        assert torch.equal(bf16_bits(strided), reference(rows[L], ids))
    finally:
        store.close()


def test_a_closed_store_is_one_clear_error(tables):
    root, _ = tables
    store = open_store(root, "disk", cfg=CFG, dram_cache_bytes=1 << 20)[CFG.layer_ids[0]]
    store.close()
    with pytest.raises(EngramError, match="is closed"):
        store.gather(torch.arange(4))


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "dram"])
@pytest.mark.parametrize("mode", ["mapped", "aio", "pread"])
def test_rows_past_2_gib_into_a_sparse_file(tmp_path, rng, mode, cached):
    """Byte offsets past 2^31 (int64 all the way): a sparse file of 9M rows, a few written."""
    n_rows = 9_000_000  # 2.4 GB of rows, nearly all holes
    ids = np.array([0, 1, 8_134_500, 8_134_501, n_rows - 2, n_rows - 1], dtype=np.int64)
    data = torch.randint(0, 256, (ids.shape[0], ROW_BYTES), dtype=torch.uint8, generator=rng).numpy()
    path = tmp_path / "sparse.rows"
    with open(path, "wb") as f:
        for i, row in zip(ids, data):
            f.seek(DATA_OFFSET + int(i) * ROW_BYTES)
            f.write(row.tobytes())
        f.truncate(DATA_OFFSET + n_rows * ROW_BYTES)
    assert DATA_OFFSET + int(ids[2]) * ROW_BYTES > 2**31
    direct = mode == "aio"
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    import mmap

    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if mode == "mapped" else None
    cache = DramRowCache(1 << 20, huge_pages=False) if cached else None
    try:
        base = np.frombuffer(mapping, np.uint8).ctypes.data + DATA_OFFSET if mapping is not None else 0
        f = rowio.DiskFile(fd, {"mapped": rowio.READ_MAPPED, "aio": rowio.READ_AIO, "pread": rowio.READ_PREAD}[mode],
                           4, int(direct), DATA_OFFSET, base, 0, n_rows)
        view = rowio.cache_view(cache) if cached else None
        request = np.concatenate([ids[::-1], ids, [n_rows + 5, -1]])  # duplicates, unordered, two outside
        n = request.shape[0]
        for attempt in range(2):  # the second: every row a hit when cached
            wanted, local, missed = (np.empty(n, np.int64) for _ in range(3))
            packed = np.zeros((n, ROW_BYTES), np.uint8)
            out = np.empty((n, ROW_VALUES), np.uint16)
            status, res = rowio.disk_step(f, view, request, wanted, local, packed, missed, out)
            assert status == rowio.STEP_OK and res.unique == ids.shape[0]
            assert res.misses == (0 if cached and attempt else ids.shape[0])
            assert np.array_equal(wanted[: res.unique], ids) and np.array_equal(packed[: res.unique], data)
            assert local[-2:].tolist() == [res.unique, res.unique]
            want = bf16_bits(rowformat.dequantize(torch.from_numpy(data[local[:-2]])))
            assert torch.equal(torch.from_numpy(out[:-2].view(np.int16)), want) and not out[-2:].any()
        if cached:
            assert cache.hits == ids.shape[0] and cache.lookups == 2 * ids.shape[0]
    finally:
        if mapping is not None:
            del base
            mapping.close()
        os.close(fd)
        if cache is not None:
            cache.close()


@pytest.mark.skipif(not FAULTS_LIB.is_file(), reason="build/kernels/libengram_faults.so not built (make faults)")
def test_a_real_read_error_inside_the_native_step_is_contained(tables, tmp_path):
    """EIO injected inside libc (pread and AIO events) while the arm file exists: the native
    step's read fails, the store's reader retries and names the rows; the DRAM cache's rows
    are still served; once disarmed the same call reads right."""
    root, _ = tables
    arm = tmp_path / "arm"
    script = textwrap.dedent(f"""
        import errno, os, sys, time, torch
        from tests.support.tables import small_config
        from engram_sglang.core.stores import open_store
        from engram_sglang.core.stores.base import TableReadFault
        L = small_config(400).layer_ids[0]
        store = open_store({str(root)!r}, "disk", cfg=small_config(400), direct=True, retries=1,
                           dram_cache_bytes=1 << 20)[L]
        cached = torch.arange(0, 40)
        good = store.gather(cached)
        open({str(arm)!r}, "w").close()
        time.sleep(0.05)  # the shim looks at the arm file every 20 ms at most
        assert torch.equal(store.gather(cached).view(torch.int16), good.view(torch.int16))  # all hits: no read
        fresh = torch.arange(100, 140)
        try:
            store.gather(fresh)
            raise SystemExit("no fault")
        except TableReadFault as e:
            assert e.errno_ == errno.EIO and sorted(e.failed_ids.tolist()) == list(range(100, 140)), e
            assert not e.rows.any()
        os.unlink({str(arm)!r})
        time.sleep(0.05)
        assert store.gather(fresh).view(torch.int16).any()
        print("contained")
    """)
    env = {**os.environ, "LD_PRELOAD": str(FAULTS_LIB), "ENGRAM_FAULTS_MATCH": ".rows", "ENGRAM_FAULTS_ARM": str(arm),
           "ENGRAM_FAULTS_EIO_PROB": "1", "ENGRAM_FAULTS_EIO_BURST_MS": "600000"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and "contained" in run.stdout, run.stdout + run.stderr


def test_an_unread_step_goes_to_the_store_reader_and_admits_only_good_rows(tables, rng, monkeypatch):
    """The hand-off: the native step leaves misses unread (its status after a failed read),
    the store's reader reads them, the good ones are admitted (the next call hits them)."""
    from tests.support.disk_faults import reads_by_the_store

    root, rows = tables
    L = CFG.layer_ids[0]
    store = open_store(root, "disk", cfg=CFG, direct=True, retries=0, dram_cache_bytes=1 << 20)[L]
    bad = {7}
    real_pread = rowio.pread_rows

    def pread_rows(fd, off, ids, out, threads, direct):
        hit = np.flatnonzero(np.isin(ids, list(bad)))
        return (errno.EIO, int(hit[0])) if hit.size else real_pread(fd, off, ids, out, threads, direct)

    monkeypatch.setattr(rowio, "pread_rows", pread_rows)
    monkeypatch.setattr(rowio, "aio_read_rows", lambda fd, off, ids, out, d: pread_rows(fd, off, ids, out, 1, True))
    reads_by_the_store(monkeypatch)
    try:
        ids = torch.arange(0, 16)
        from engram_sglang.core.stores.base import TableReadFault

        with pytest.raises(TableReadFault) as caught:
            store.gather(ids)
        assert caught.value.failed_ids.tolist() == [7]
        got = bf16_bits(caught.value.rows)
        want = reference(rows[L], ids)
        keep = torch.from_numpy(ids.numpy() != 7)
        assert torch.equal(got[keep], want[keep]) and not got[7].any()
        assert store.dram.contains(np.arange(16)).tolist() == [i != 7 for i in range(16)]
    finally:
        store.close()


def test_the_serving_knob_reaches_the_store(tables):
    """--engram-disk-native-step off (ENGRAM_DISK_NATIVE_STEP) serves by the numpy path."""
    from engram_sglang.serving.settings import ServeSettings

    root, _ = tables
    for value, native in (("off", False), ("on", True)):
        options = ServeSettings.from_env({"ENGRAM_PLACEMENT": "disk", "ENGRAM_DISK_NATIVE_STEP": value}).store_options()
        stores = open_store(root, "disk", cfg=CFG, **options)
        try:
            assert all(s.native_step is native for s in stores.values())
        finally:
            for s in stores.values():
                s.close()


@pytest.mark.parametrize("field", ["POLICY_FORMAT", "_CAP", "SKETCH_DEPTH"])
def test_a_library_built_for_another_policy_format_refuses_to_load(monkeypatch, field):
    """Same structure sizes, other array format (the 8-bit -> 4-bit sketch change kept every
    size): a stale library must not read the new arrays the old way."""
    from engram_sglang.core.stores import dram_cache

    monkeypatch.setattr(dram_cache, field, getattr(dram_cache, field) + 1)
    rowio.library.cache_clear()
    try:
        with pytest.raises(EngramError, match=r"DRAM policy format .* rebuild it \(`make rowio`\)"):
            rowio.library()
    finally:
        monkeypatch.undo()
        rowio.library.cache_clear()
    rowio.library()


def distinct_rows_file(tmp_path, rows: int) -> tuple[Path, np.ndarray]:
    path = tmp_path / "t.rows"
    data = (np.arange(rows * ROW_BYTES, dtype=np.uint64) % 253).astype(np.uint8).reshape(rows, ROW_BYTES)
    with open(path, "wb") as f:
        f.write(bytes(DATA_OFFSET))
        f.write(data.tobytes())
    return path, data


@pytest.mark.parametrize("engine", ["auto", "aio"])
@pytest.mark.parametrize("depth", [4, 256])
def test_failed_reads_then_good_ones(tmp_path, engine, depth):
    """Every read failing (a descriptor opened write-only: EBADF, reported in the completions
    by io_uring, at submission by native AIO), then good reads on the same thread's ring or
    context, three times over: each failed call names the error, each good one reads right."""
    path, data = distinct_rows_file(tmp_path, 40_000)
    rows = np.arange(0, 40_000, 40, dtype=np.int64)  # 1000 separate reads
    out = np.zeros((rows.shape[0], ROW_BYTES), np.uint8)
    bad = os.open(path, os.O_WRONLY | os.O_DIRECT)
    good = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        rowio.read_engine(engine)
        for _ in range(3):
            err, failed = rowio.aio_read_rows(bad, DATA_OFFSET, rows, out, depth)
            assert err == errno.EBADF and 0 <= failed < rows.shape[0], (err, failed)
            assert rowio.aio_read_rows(good, DATA_OFFSET, rows, out, depth) == (0, -1)
            assert np.array_equal(out, data[rows])
            out[:] = 0
    finally:
        os.close(bad)
        os.close(good)
        rowio.read_engine("auto")


@pytest.mark.parametrize("engine", ["auto", "aio"])
def test_a_failed_step_admits_nothing_and_looks_up_as_python(tmp_path, engine):
    """A step whose reads all fail comes back unread with the errno; the DRAM cache holds what
    the numpy path's lookup alone leaves (nothing admitted), and the hits are in place."""
    rows_n = 8000
    path, data = distinct_rows_file(tmp_path, rows_n)
    a, b = DramRowCache(1 << 20, huge_pages=False), DramRowCache(1 << 20, huge_pages=False)
    hot = np.arange(100, 140, dtype=np.int64)
    for c in (a, b):
        c.lookup(hot)
        c.admit(hot, data[hot])
    bad = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        rowio.read_engine(engine)
        f = rowio.DiskFile(bad, rowio.READ_AIO, 256, 1, DATA_OFFSET, 0, 0, rows_n)
        request = np.concatenate([np.arange(0, rows_n, 13), hot, hot[:5]]).astype(np.int64)
        n = request.shape[0]
        wanted, local, missed = (np.empty(n, np.int64) for _ in range(3))
        packed = np.zeros((n, ROW_BYTES), np.uint8)
        rows_out = np.zeros((n, ROW_VALUES), np.uint16)
        status, res = rowio.disk_step(f, rowio.cache_view(a), request, wanted, local, packed, missed, rows_out)
        assert status == rowio.STEP_UNREAD and res.error == errno.EBADF
        b.lookup(np.unique(request))
        for x, y in ((a.tags, b.tags), (a.last, b.last), (a.count, b.count), (a.sketch, b.sketch),
                     (a._state, b._state), (a.rows, b.rows)):
            assert np.array_equal(x, y)
        at = np.searchsorted(wanted[: res.unique], hot)
        assert np.array_equal(packed[at], data[hot])
    finally:
        os.close(bad)
        a.close()
        b.close()
        rowio.read_engine("auto")
