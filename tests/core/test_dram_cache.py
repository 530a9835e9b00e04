"""The disk tier's DRAM row cache: bit-exact, LRU within a set, and read-ahead that saves reads."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.errors import EngramConfigError, EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits
from engram_sglang.core.stores import open_store
from engram_sglang.core.stores.dram_cache import SLOT_OVERHEAD, DramRowCache, plan_slots
from engram_sglang.core.tablefile import write_tables
from engram_sglang.serving.settings import ServeSettings
from tests.support.disk_faults import reads_by_the_store
from tests.support.tables import small_config

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rows = {L: rng.integers(0, 256, (LAYOUT.rows(L), ROW_BYTES), dtype=np.uint8) for L in CFG.layer_ids}
    return write_tables(tmp_path_factory.mktemp("t") / "t", CFG, rows, progress=False), rows


def reference(rows: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    return rowformat.dequantize(torch.from_numpy(rows[ids.reshape(-1).numpy()])).view(*ids.shape, 256)


def rows_of(ids: np.ndarray) -> np.ndarray:
    """A recognisable packed row per id (its id's bytes repeated)."""
    return np.repeat(ids.astype("<i8").view(np.uint8).reshape(-1, 8), ROW_BYTES // 8, axis=1)


def test_lookup_returns_what_was_admitted_and_lru_evicts_within_a_set():
    cache = DramRowCache(plan_slots(1, 1) + 4 * 16 * (ROW_BYTES + SLOT_OVERHEAD), ways=4, admission="lru")
    assert cache.slots == 64 and cache.sets == 16
    ids = np.arange(0, 5000, dtype=np.int64)
    one_set = ids[cache.set_of(ids) == 3][:6]  # six ids of one four-way set
    with cache.lock:
        hit, _ = cache.lookup(one_set[:4])
        assert not hit.any()
        assert cache.admit(one_set[:4], rows_of(one_set[:4])) == 4
        hit, slot = cache.lookup(one_set[[0, 2]])  # 0 and 2 are now the recently used ones
        assert hit.all()
        out = np.zeros((2, ROW_BYTES), np.uint8)
        cache.copy_hits(slot, hit, out)
        assert np.array_equal(out, rows_of(one_set[[0, 2]]))
        cache.lookup(np.array([], np.int64))  # a later call: 0 and 2 are no longer protected
        assert cache.admit(one_set[4:6], rows_of(one_set[4:6])) == 2  # evicts 1 and 3, the LRU ways
    assert cache.contains(one_set).tolist() == [True, False, True, False, True, True]


def test_rows_hit_by_the_same_call_are_never_evicted_and_a_set_takes_at_most_its_ways():
    cache = DramRowCache(8 * 2 * (ROW_BYTES + SLOT_OVERHEAD), ways=2)
    ids = np.arange(0, 5000, dtype=np.int64)
    s0 = ids[cache.set_of(ids) == 0][:5]
    with cache.lock:
        cache.lookup(s0[:1])
        cache.admit(s0[:1], rows_of(s0[:1]))
        hit, _ = cache.lookup(s0[:1])  # hit in this call
        assert hit.all()
        # Four misses of the same set: one free way, and the hit row stays.
        assert cache.admit(s0[1:5], rows_of(s0[1:5])) == 1
    assert cache.contains(s0[:1]).all() and cache.contains(s0[1:5]).sum() == 1


def test_too_small_a_cache_is_one_clear_error():
    with pytest.raises(EngramError, match="holds no full set"):
        DramRowCache(100)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "threads"])
def test_disk_store_with_a_dram_cache_is_bit_exact_and_reads_each_row_once(tables, rng, monkeypatch, overlap):
    from engram_sglang.core.stores import disk

    monkeypatch.setattr(disk, "_OVERLAP_ROWS", 1 if overlap else 1 << 30)
    root, rows = tables
    L = CFG.layer_ids[0]
    store = open_store(root, "disk", cfg=CFG, direct=True, threads=8, dram_cache_bytes=16 << 20)[L]
    try:
        ids = torch.randint(0, LAYOUT.rows(L), (64, 24), generator=rng)
        ids[0, :2] = torch.tensor([0, LAYOUT.rows(L) - 1])  # first and last row
        first = store.gather(ids)
        read = store.stats()["file_rows_read"]
        assert read == torch.unique(ids).numel()
        again = store.gather(ids.flip(0))
        assert store.stats()["file_rows_read"] == read  # every row from DRAM
        assert torch.equal(bf16_bits(first), bf16_bits(reference(rows[L], ids)))
        assert torch.equal(bf16_bits(again), bf16_bits(reference(rows[L], ids.flip(0))))
        s = store.stats()
        assert s["dram_cache_hit_rate"] == pytest.approx(0.5) and s["dram_cache_rows"] > 2 * 64 * 24
        assert "DRAM row cache" in store.describe()
    finally:
        store.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "threads"])
def test_a_tiny_cache_under_heavy_eviction_stays_bit_exact(tables, rng, monkeypatch, overlap):
    """Both ways of serving a call: inline (decode-sized) and with the misses read on the
    I/O thread while hits are copied, admission afterwards (prefill-sized)."""
    from engram_sglang.core.stores import disk

    monkeypatch.setattr(disk, "_OVERLAP_ROWS", 1 if overlap else 1 << 30)
    root, rows = tables
    for L, store in open_store(root, "disk", cfg=CFG, dram_cache_bytes=24 << 10, threads=4).items():
        try:
            for _ in range(30):
                ids = torch.randint(0, min(600, LAYOUT.rows(L)), (int(torch.randint(1, 200, (1,), generator=rng)),),
                                    generator=rng)
                assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[L], ids)))
            assert 0 < store.stats()["dram_cache_hit_rate"] < 1
        finally:
            store.close()


def test_read_ahead_fills_the_cache_so_the_gather_reads_nothing(tables, rng):
    root, rows = tables
    L = CFG.layer_ids[-1]
    store = open_store(root, "disk", cfg=CFG, direct=True, dram_cache_bytes=64 << 20)[L]
    try:
        ids = torch.randint(0, LAYOUT.rows(L), (300, 24), generator=rng)
        uniq = torch.unique(ids).numpy()
        assert store.read_ahead(ids).result() == uniq.shape[0]
        # A set that drew more of these rows than it has ways keeps only `ways` of them.
        left_out = int((~store.dram.contains(uniq)).sum())
        assert left_out <= uniq.shape[0] // 100
        before = store.stats()["file_rows_read"]
        got = store.gather(ids)
        assert store.stats()["file_rows_read"] == before + left_out  # read ahead: only those read now
        assert torch.equal(bf16_bits(got), bf16_bits(reference(rows[L], ids)))
        assert store.read_ahead(ids).result() <= uniq.shape[0] // 100  # cached already (but full sets)
    finally:
        store.close()
    plain = open_store(root, "disk", cfg=CFG, direct=True)[L]
    try:
        assert plain.read_ahead(torch.zeros(3, dtype=torch.int64)) is None  # nothing would keep the rows
    finally:
        plain.close()


def test_a_failed_read_ahead_is_logged_and_the_gather_still_reports_it(tables, monkeypatch, caplog):
    from engram_sglang.core.stores import rowio
    from engram_sglang.core.stores.base import TableIOError

    root, _ = tables
    L = CFG.layer_ids[0]
    store = open_store(root, "disk", cfg=CFG, direct=True, retries=0, dram_cache_bytes=1 << 20)[L]
    monkeypatch.setattr(rowio, "pread_rows", lambda *a, **k: (5, 0))  # EIO on every read
    monkeypatch.setattr(rowio, "aio_read_rows", lambda *a, **k: (5, 0))
    reads_by_the_store(monkeypatch)
    try:
        ids = torch.arange(10)
        assert store.read_ahead(ids).result() == 0
        assert "read-ahead of 10 rows failed" in caplog.text
        with pytest.raises(TableIOError, match="Input/output error"):
            store.gather(ids)
    finally:
        store.close()


@pytest.mark.parametrize("native_step", [True, False])
def test_a_step_waits_for_the_read_ahead_piece_in_flight_instead_of_reading_its_rows_again(tables, rng, native_step):
    """A chunked prefill's next chunk is read ahead; its step arrives while the read is still
    in flight (a slow disk). The step must not read those rows a second time beside it."""
    import threading

    root, rows = tables
    L = CFG.layer_ids[-1]
    store = open_store(root, "disk", cfg=CFG, direct=True, dram_cache_bytes=64 << 20, native_step=native_step)[L]
    started, release = threading.Event(), threading.Event()
    real = store._read_file

    def slow_read(wanted, out=None):  # the read-ahead's reads (the native step reads in C)
        if threading.current_thread().name.startswith("engram-ahead"):
            started.set()
            release.wait(10)
        return real(wanted, out)

    store._read_file = slow_read
    try:
        ids = torch.from_numpy(rng_choice(rng, LAYOUT.rows(L), 400)).view(100, 4)
        ahead = store.read_ahead(ids)
        assert started.wait(10)
        got = {}
        step = threading.Thread(target=lambda: got.update(rows=store.gather(ids)))
        step.start()
        step.join(0.5)
        assert step.is_alive(), "the step did not wait for the read-ahead piece holding its rows"
        release.set()
        step.join(10)
        assert ahead.result(10) == 400
        assert store.stats()["file_rows_read"] == 400  # each row once: by the read-ahead
        assert torch.equal(bf16_bits(got["rows"]), bf16_bits(reference(rows[L], ids)))

        # A step with only a few rows in common (a decode step beside the prefill) reads them
        # itself rather than wait for the whole piece.
        release.clear()
        started.clear()
        more = torch.from_numpy(rng_choice(rng, LAYOUT.rows(L), 800, exclude=ids.numpy()))
        ahead = store.read_ahead(more)
        assert started.wait(10)
        few = more[:3]
        assert torch.equal(bf16_bits(store.gather(few)), bf16_bits(reference(rows[L], few)))
        release.set()
        assert ahead.result(10) <= 800
    finally:
        release.set()
        store.close()


def rng_choice(rng: torch.Generator, n: int, k: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """k distinct row ids in [0, n), none of `exclude`, drawn from the test's generator."""
    pool = torch.randperm(n, generator=rng).numpy()
    if exclude is not None:
        pool = pool[~np.isin(pool, exclude)]
    return pool[:k].astype(np.int64)


def test_the_dram_cache_splits_over_layers_and_shards(tables):
    root, _ = tables
    stores = open_store(root, "disk", cfg=CFG, dram_cache_bytes=2 << 20, tp_rank=1, tp_size=2)
    try:
        total = sum(s.dram.nbytes for s in stores.values())
        assert 0.9 * (2 << 20) <= total <= 2 << 20 or all(
            s.dram.slots >= s.rows_held for s in stores.values())
    finally:
        for s in stores.values():
            s.close()


def test_hot_row_cache_over_a_dram_cached_disk_store_is_bit_exact(tables, rng):
    root, rows = tables
    stores = open_store(root, "disk", cfg=CFG, direct=True, dram_cache_bytes=256 << 10, cache_bytes=256 << 10)
    try:
        for L, store in stores.items():
            for _ in range(12):
                ids = torch.randint(0, LAYOUT.rows(L), (32, 24), generator=rng)
                assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[L], ids)))
    finally:
        for s in stores.values():
            s.close()


def test_settings_knob():
    s = ServeSettings.from_env({"ENGRAM_PLACEMENT": "disk", "ENGRAM_DISK_DRAM_CACHE_MIB": "512"})
    assert s.store_options()["dram_cache_bytes"] == 512 << 20
    with pytest.raises(EngramConfigError, match="needs placement disk"):
        ServeSettings.from_env({"ENGRAM_PLACEMENT": "host", "ENGRAM_DISK_DRAM_CACHE_MIB": "1"}).store_options()
    with pytest.raises(EngramConfigError, match="must be >= 0"):
        ServeSettings.from_env({"ENGRAM_DISK_DRAM_CACHE_MIB": "-1"})


def test_direct_reads_go_by_native_aio_and_fall_back_to_pread(tables, rng, monkeypatch, caplog):
    from engram_sglang.core.stores import rowio

    root, rows = tables
    L = CFG.layer_ids[0]
    store = open_store(root, "disk", cfg=CFG, direct=True, threads=16)[L]
    store.native_step = False  # the store's own reader (the native step's, tests/core/test_disk_step.py)
    try:
        assert "native AIO" in store.describe()
        calls = []
        real_aio, real_pread = rowio.aio_read_rows, rowio.pread_rows
        monkeypatch.setattr(rowio, "aio_read_rows", lambda *a, **k: calls.append("aio") or real_aio(*a, **k))
        monkeypatch.setattr(rowio, "pread_rows", lambda *a, **k: calls.append("pread") or real_pread(*a, **k))
        ids = torch.randint(0, LAYOUT.rows(L), (200, 24), generator=rng)
        ids[0, 0] = LAYOUT.rows(L) - 1  # the last row: the file's last page is partial
        assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[L], ids)))
        assert calls == ["aio"]
        # An AIO error is retried by pread, which serves the call.
        monkeypatch.setattr(rowio, "aio_read_rows", lambda *a, **k: calls.append("aio") or (5, 3))
        assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[L], ids)))
        assert calls[1:] == ["aio", "pread"]
        # No AIO on this kernel: one warning, then pread only.
        monkeypatch.setattr(rowio, "aio_read_rows", lambda *a, **k: calls.append("aio") or (rowio.AIO_UNAVAILABLE, -1))
        store.gather(ids)
        store.gather(ids)
        assert calls[3:] == ["aio", "pread", "pread"] and "native AIO is unavailable" in caplog.text
    finally:
        store.close()


def test_native_aio_reads_every_row_of_random_requests(tmp_path, rng):
    """Merged extents (neighbouring rows), single rows, and the partial last page."""
    from engram_sglang.core.stores import rowio
    from engram_sglang.core.tablefile import DATA_OFFSET

    n_rows = 50_000
    data = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng))).integers(
        0, 256, (n_rows, ROW_BYTES), dtype=np.uint8)
    path = tmp_path / "rows"
    path.write_bytes(b"\0" * DATA_OFFSET + data.tobytes())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for size in (1, 7, 500, 20_000):
            want = np.unique(torch.randint(0, n_rows, (size,), generator=rng).numpy()).astype(np.int64)
            want[-1] = n_rows - 1
            want = np.unique(want)
            out = np.zeros((want.shape[0], ROW_BYTES), np.uint8)
            assert rowio.aio_read_rows(fd, DATA_OFFSET, want, out, 32) == (0, -1)
            assert np.array_equal(out, data[want])
        past = np.array([n_rows + 20], dtype=np.int64)  # past the end: a short read, named
        out = np.zeros((1, ROW_BYTES), np.uint8)
        assert rowio.aio_read_rows(fd, DATA_OFFSET, past, out, 4) == (-1, 0)
    finally:
        os.close(fd)


def test_scheduler_read_ahead_hashes_the_next_chunk_with_its_history(tables, rng, caplog, monkeypatch):
    """What the plugin does before SGLang runs a batch holding a chunked prompt: the next
    chunk's row ids, hashed with the tokens before it, land in every layer's DRAM cache."""
    from array import array
    from types import SimpleNamespace

    from engram_sglang.core.hashing import NgramHasher
    from engram_sglang.serving import readahead
    from engram_sglang.serving.readahead import read_ahead_next_chunk
    from engram_sglang.serving.runtime import EngramRuntime

    monkeypatch.setattr(readahead, "_failed_once", False)
    root, _ = tables
    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    settings = ServeSettings(placement="disk", disk_direct=True, disk_dram_cache_mib=8)
    runtime = EngramRuntime(CFG, hasher, settings, root, torch.device("cpu"))
    try:
        assert runtime.reads_ahead
        tokens = torch.randint(0, CFG.vocab_size, (100,), generator=rng).tolist()
        req = SimpleNamespace(full_untruncated_fill_ids=array("q", tokens), extend_end=40)
        scheduler = SimpleNamespace(chunked_req=req, chunked_prefill_size=32)
        extend = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True))
        assert read_ahead_next_chunk(scheduler, extend) == 32
        whole = hasher.hash_sequence(tokens)
        no_history = hasher.hash_sequence(tokens[40:72], start=40)
        assert not torch.equal(no_history[:3], whole[40:43])  # the history matters
        for L, i in runtime.layer_index.items():
            store = runtime.stores[L]
            store.read_ahead(np.zeros(0, np.int64)).result()  # one thread, in order: the chunk is in
            want = np.unique(whole[40:72, i].numpy())
            assert store.dram.contains(want).mean() > 0.9  # (set conflicts may drop a few)
            past = np.setdiff1d(np.unique(whole[:40, i].numpy()), want)
            assert store.dram.contains(past).mean() < 0.1
        # Nothing to read ahead: no chunked request, a decode batch, the last chunk.
        decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False))
        assert read_ahead_next_chunk(scheduler, decode) == 0
        assert read_ahead_next_chunk(SimpleNamespace(chunked_req=None, chunked_prefill_size=32), extend) == 0
        req.extend_end = 100
        assert read_ahead_next_chunk(scheduler, extend) == 0
        # A broken request is logged once and never fails the batch.
        req.full_untruncated_fill_ids = None
        assert read_ahead_next_chunk(scheduler, extend) == 0
        assert "prefill read-ahead failed" in caplog.text
    finally:
        runtime.close()


def _set_ids(cache: DramRowCache, set_index: int, n: int) -> np.ndarray:
    ids = np.arange(0, 200_000, dtype=np.int64)
    return ids[cache.set_of(ids) == set_index][:n]


def _read(cache: DramRowCache, ids: np.ndarray) -> int:
    """One call as the store makes it: look up, admit the misses; returns the rows admitted."""
    with cache.lock:
        hit, _ = cache.lookup(ids)
        return cache.admit(ids[~hit], rows_of(ids[~hit]))


def test_a_row_read_once_never_evicts_a_row_read_twice_but_lru_does():
    for admission in ("frequency", "lru"):
        cache = DramRowCache(8 * 4 * (ROW_BYTES + SLOT_OVERHEAD), ways=4, admission=admission)
        ids = _set_ids(cache, 5, 6)
        hot, once = ids[:4], ids[4:]
        assert _read(cache, hot) == 4 and _read(cache, hot) == 0  # read twice, all cached
        admitted = _read(cache, once[:1])
        if admission == "lru":
            assert admitted == 1 and cache.contains(hot).sum() == 3
            continue
        assert admitted == 0 and cache.contains(hot).all() and cache.stats()["dram_cache_rejected"] == 1
        # Its second read ties with the rows read twice: the newer row takes the weakest way
        # (fewest reads, then least recently used: hot[0], as LRU would pick).
        assert _read(cache, once[:1]) == 1
        assert cache.contains(ids).tolist() == [False, True, True, True, True, False]
        # Read ahead: known to be needed next, admitted whatever its count.
        with cache.lock:
            cache.begin()
            assert cache.admit(once[1:], rows_of(once[1:])) == 1
        assert cache.contains(once).all()


def test_counts_age_so_a_row_popular_long_ago_can_be_displaced():
    cache = DramRowCache(8 * 2 * (ROW_BYTES + SLOT_OVERHEAD), ways=2)
    assert cache.sample == 10 * cache.slots == 160
    ids = _set_ids(cache, 1, 3)
    old, new = ids[:2], ids[2:]
    for _ in range(4):
        _read(cache, old)
    assert cache.estimate(old).tolist() == [4, 4] and cache.agings == 0
    assert _read(cache, new) == 0  # count 1 against 4
    # 151 more reads (of a few rows of other sets; few: a sketch this narrow would otherwise
    # count collisions) reach the sample of 160 reads: every count halves.
    others = np.arange(10**6, 10**6 + 100, dtype=np.int64)
    others = others[cache.set_of(others) != 1][:8]
    for _ in range(18):
        _read(cache, others)
    assert cache.agings == 0
    _read(cache, others[:7])
    assert cache.agings == 1
    assert cache.estimate(old).tolist() == [2, 2] and cache.count[cache._find(old)[1]].tolist() == [2, 2]
    # Its count halved too (1 -> 0): two more reads make it 2 against 2 (not 4): the newer row wins.
    assert _read(cache, new) == 0 and cache.estimate(new).tolist() == [1]
    assert _read(cache, new) == 1
    assert cache.contains(new).all() and cache.contains(old).sum() == 1


def test_frequency_admission_beats_lru_on_a_skewed_trace():
    """Zipf-distributed popular rows mixed with one-off reads (as 2-grams and 4-grams are):
    LRU lets the one-offs flush the popular rows, frequency admission keeps them."""
    rates = {}
    for admission in ("frequency", "lru"):
        cache = DramRowCache(1 << 30, ways=8, max_rows=2048, admission=admission, huge_pages=False)
        rng = np.random.default_rng(7)
        hits = looked = 0
        fresh = 1 << 40
        for step in range(300):
            popular = rng.zipf(1.2, 300) % 50_000
            one_off = np.arange(fresh, fresh + 200)
            fresh += 200
            ids = np.unique(np.concatenate([popular, one_off]).astype(np.int64))
            with cache.lock:
                hit, _ = cache.lookup(ids)
                cache.admit(ids[~hit], np.zeros((int((~hit).sum()), ROW_BYTES), np.uint8))
            if step >= 50:
                hits, looked = hits + int(hit.sum()), looked + ids.shape[0]
        rates[admission] = hits / looked
        cache.close()
    assert rates["frequency"] >= rates["lru"] + 0.03, rates


def test_the_native_step_counts_as_the_numpy_path_up_to_saturation_and_through_agings(tables):
    """The sketch's 4-bit counters, two to a byte, in engram_dram_policy.h and dram_cache.py:
    rows read in every call saturate at 15 (both nibbles of a byte), agings halve each nibble
    on its own, and the two paths keep the same cache state after every call."""
    root, rows = tables
    L = CFG.layer_ids[0]
    native = open_store(root, "disk", cfg=CFG, dram_cache_bytes=40 << 10)[L]
    python = open_store(root, "disk", cfg=CFG, dram_cache_bytes=40 << 10)[L]
    python.native_step = False
    gen = np.random.default_rng(3)
    hot = gen.choice(native.rows, 24, replace=False)
    try:
        top = 0
        for k in range(120):
            n = 8 if k < 60 else 150  # few ids a call first (counts climb before an aging), then many
            ids = np.concatenate([hot, gen.integers(0, native.rows, n)])
            gen.shuffle(ids)
            ids = torch.from_numpy(ids)
            assert torch.equal(bf16_bits(native.gather(ids)), bf16_bits(python.gather(ids)))
            a, b = native.dram, python.dram
            for x, y in zip((a.tags, a.last, a.count, a.sketch, a._state), (b.tags, b.last, b.count, b.sketch, b._state)):
                assert np.array_equal(x, y), k
            top = max(top, int(a.count.max()))
        assert top == 15 and native.dram.agings >= 3
        nibbles = np.concatenate([native.dram.sketch & 15, native.dram.sketch >> 4])
        assert nibbles.max() <= 15 and (native.dram.sketch >> 4).any() and (native.dram.sketch & 15).any()
        assert torch.equal(bf16_bits(native.gather(torch.from_numpy(hot))), bf16_bits(reference(rows[L], torch.from_numpy(hot))))
    finally:
        native.close()
        python.close()


def test_the_packed_sketch_counts_as_unpacked_4_bit_counters_would():
    """Two counters to a byte (sketch rows 2k and 2k+1 share plane k): raising, saturating or
    halving one never touches its neighbour. Reference: one uint8 per counter, capped at 15,
    np.maximum.at (the plain algorithm)."""
    from engram_sglang.core.stores.dram_cache import SKETCH_DEPTH

    cache = DramRowCache(8 * 2 * (ROW_BYTES + SLOT_OVERHEAD), ways=2)
    width = cache.sketch_width
    ref = np.zeros((SKETCH_DEPTH, width), dtype=np.uint8)  # row d, counter p
    gen = np.random.default_rng(5)
    top = 0
    for _ in range(300):
        # Three ids in every call (they saturate between agings), a few others: shared counters.
        ids = np.unique(np.concatenate([[1, 2, 3], gen.integers(0, 40, 4)]))
        where = cache._sketch_index(ids) - np.arange(SKETCH_DEPTH)[:, None] // 2 * width  # counter in its row
        where = where + np.arange(SKETCH_DEPTH)[:, None] * width  # ... in ref, flat
        ref = ref.reshape(-1)
        want = ref[where].min(0)
        want = want + (want < 15).astype(np.uint8)
        np.maximum.at(ref, where.reshape(-1), np.broadcast_to(want, where.shape).reshape(-1))
        agings = cache.agings
        assert np.array_equal(cache._count(ids), want)
        if cache.agings > agings:
            ref >>= 1
        ref = ref.reshape(SKETCH_DEPTH, width)
        planes = cache.sketch.reshape(SKETCH_DEPTH // 2, width)
        assert np.array_equal(np.stack([planes & 15, planes >> 4], axis=1).reshape(SKETCH_DEPTH, width), ref)
        top = max(top, int(ref.max()))
    assert cache.agings > 2 and top == 15
