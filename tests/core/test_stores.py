"""Every placement returns the reference's bits; shards reassemble; faults stay inside one call."""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.planning.model import balanced_shard_bytes, rank_bytes
from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits
from engram_sglang.core.stores import TableIOError, column_shards, disk, hostmem, open_store, rowio, shard_range
from engram_sglang.core.stores.base import ranges_rows
from engram_sglang.core.stores.device import DeviceStore
from engram_sglang.core.stores.disk import DiskStore
from engram_sglang.core.stores.host import HostStore
from engram_sglang.core.tablefile import layer_file_name, write_tables
from tests.support.disk_faults import reads_by_the_store
from tests.support.tables import small_config

# The stores decode through the gather op; until its module exists there is nothing to test.
pytest.importorskip("engram_sglang.core.ops", reason="the gather_dequant op (engram_sglang.core.ops) is not built yet")

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)

# (placement, options): every way a table can be served here.
PLACEMENTS = [
    ("device", {}),
    ("host", {}),
    ("host", {"shared": True}),
    ("disk", {}),
    ("disk", {"direct": True, "threads": 8}),
    ("disk", {"threads": 1}),
    # A DRAM row cache of ~240 rows in front: every call evicts, so slot mix-ups would show.
    ("disk", {"dram_cache_bytes": 64 << 10, "direct": True, "threads": 8}),
]


def edge_rows(gen: torch.Generator, n: int) -> np.ndarray:
    """Random rows whose first 256 rows hold every fp8 code against every scale byte."""
    rows = torch.randint(0, 256, (n, ROW_BYTES), dtype=torch.uint8, generator=gen)
    for r in range(256):
        rows[r, :256] = torch.arange(256, dtype=torch.uint8).roll(r)
        rows[r, 256:] = r
    return rows.numpy()


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tables = {L: edge_rows(gen, LAYOUT.rows(L)) for L in CFG.layer_ids}
    out = write_tables(tmp_path_factory.mktemp("tables") / "t", CFG, tables, progress=False)
    return out, tables


def reference(rows: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    return rowformat.dequantize(torch.from_numpy(rows[ids.reshape(-1).long().numpy()])).view(*ids.shape, 256)


def random_ids(gen, rows: int, shape, dtype=torch.int64) -> torch.Tensor:
    ids = torch.randint(0, rows, shape, generator=gen, dtype=torch.int64)
    flat = ids.view(-1)
    edges = torch.tensor([0, rows - 1, 255])  # first, last, and an all-codes row
    flat[:3] = edges[: flat.numel()]
    if flat.numel() >= 17:
        flat[3:10] = flat[10:17]  # duplicates, as real batches have
    return ids.to(dtype)


def open_placement(table_dir, placement, options, tmp_path, **kw):
    options = dict(options)
    if options.get("shared"):
        options["shm_dir"] = tmp_path  # a private directory instead of the node's /dev/shm
    return open_store(table_dir, placement, cfg=CFG, **kw, **options)


@pytest.mark.parametrize("placement,options", PLACEMENTS, ids=lambda p: str(p))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_every_placement_is_bit_exact(table_dir, tmp_path, rng, placement, options, dtype):
    root, tables = table_dir
    stores = open_placement(root, placement, options, tmp_path)
    try:
        for L, store in stores.items():
            for shape in [(1,), (7, 24), (256, 24)]:
                ids = random_ids(rng, LAYOUT.rows(L), shape, dtype)
                got = store.gather(ids)
                assert got.dtype == torch.bfloat16 and got.shape == (*shape, 256)
                assert torch.equal(bf16_bits(got), bf16_bits(reference(tables[L], ids)))
                assert torch.equal(bf16_bits(store.prefetch(ids).wait()), bf16_bits(got))
            out = torch.empty(5, 256, dtype=torch.bfloat16)
            ids = random_ids(rng, LAYOUT.rows(L), (5,), dtype)
            assert store.gather(ids, out=out) is out
            assert torch.equal(bf16_bits(out), bf16_bits(reference(tables[L], ids)))
            s = store.stats()
            assert s["placement"] == placement and s["rows_served"] > 0 and s["calls"] > 0
            assert store.describe().startswith(f"engram layer {L}: placement {placement}")
    finally:
        for s in stores.values():
            s.close()


# Sharded placements: device, host (private, shared), disk (mapped; O_DIRECT with a DRAM cache).
SHARDED = PLACEMENTS[:4] + PLACEMENTS[6:7]


def held_ranges(L, rank, tp_size, shards):
    """The row ranges rank `rank` must hold: `column_shards` (balanced) or one `shard_range`."""
    if shards == "balanced":
        return column_shards(LAYOUT.column_bounds(LAYOUT.layer_index(L)), rank, tp_size)
    return [shard_range(LAYOUT.rows(L), rank, tp_size)]


def shard_ids(rng, L):
    """Random ids plus the first and last row of every column (so of every range, every rank)."""
    ids = random_ids(rng, LAYOUT.rows(L), (64, 24))
    bounds = LAYOUT.column_bounds(LAYOUT.layer_index(L))
    ids[0, : len(bounds) - 1] = torch.tensor(bounds[:-1])
    ids[1, : len(bounds) - 1] = torch.tensor(bounds[1:]) - 1
    return ids


def sharded_parts(root, tmp_path, ids, L, tp_size, placement, options, shards="balanced", monkeypatch=None,
                  drop=None, **kw):
    """Each rank's rows of `ids` from open_store's shard (checked: +0.0 exactly where the rank
    holds no row), summed as integer bits (exact). `drop` = (rank, range index): that rank
    opens its ranges less that one (a negative control, through open_store's own path)."""
    from engram_sglang.core import stores as stores_mod

    if drop is not None:
        real = stores_mod.rank_ranges

        def dropping(tables, cfg, rank, tp, how):
            held = real(tables, cfg, rank, tp, how)
            if rank == drop[0]:
                held = {layer: r[: drop[1]] + r[drop[1] + 1:] for layer, r in held.items()}
            return held

        monkeypatch.setattr(stores_mod, "rank_ranges", dropping)
    parts = []
    for rank in range(tp_size):
        ranges = held_ranges(L, rank, tp_size, shards)
        stores = open_placement(root, placement, options, tmp_path, tp_rank=rank, tp_size=tp_size, shards=shards,
                                **kw)
        store = stores[L]
        try:
            if drop is None:
                assert store.row_ranges == ranges and not store.holds_whole_rows
                assert store.stats()["row_ranges"] == [list(r) for r in ranges]
                if placement == "device" or (placement == "host" and not store.node_shared and not kw):
                    # a private copy holds just its rows, the ranges one after another
                    assert store.resident_bytes == ranges_rows(ranges) * ROW_BYTES
            part = store.gather(ids)
            if kw.get("cache_bytes"):  # misses admitted: the second call reads hits too
                store.maintain()
                assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(part))
                assert store.directory.counters()["hits"] > 0
            held = torch.zeros_like(ids, dtype=torch.bool)
            for lo, hi in ranges:
                held |= (ids >= lo) & (ids < hi)
            assert (part.view(torch.int16)[~held] == 0).all()  # +0.0 exactly where the rank holds no row
            parts.append(part)
        finally:
            for s in stores.values():
                s.close()
    if drop is not None:
        monkeypatch.undo()
    return torch.stack(parts).view(torch.int16).sum(0).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("placement,options", SHARDED, ids=lambda p: str(p))
@pytest.mark.parametrize("tp_size", [2, 3, 5])  # 5 does not divide the 12 columns: each column split
@pytest.mark.parametrize("shards", ["balanced", "contiguous"])
def test_shards_sum_to_the_full_rows(table_dir, tmp_path, rng, placement, options, tp_size, shards):
    """Rank r holds its row ranges; other ids read +0.0, so the sum over ranks is exact, for
    balanced shards (open_store's default: columns dealt round-robin, several ranges a rank)
    and contiguous ones (one range a rank)."""
    root, tables = table_dir
    L = CFG.layer_ids[0]
    ids = shard_ids(rng, L)
    total = sharded_parts(root, tmp_path, ids, L, tp_size, placement, options, shards)
    want = bf16_bits(reference(tables[L], ids))
    assert torch.equal(bf16_bits(total), want)
    if shards == "balanced" and tp_size == 2:  # the default is balanced
        stores = open_placement(root, placement, options, tmp_path, tp_rank=1, tp_size=2)
        assert stores[L].row_ranges == held_ranges(L, 1, 2, "balanced")
        for s in stores.values():
            s.close()


# A hot-row cache in front of a balanced host or disk shard; the node's shared host copy
# narrowed to a balanced shard (whole rows asked, a peer did not agree: `hold_only`).
BALANCED_CASES = {
    "host-private": ("host", {}, {}),
    "host-shared-narrowed": ("host", {"shared": True, "whole_rows": True}, {"agree": lambda mine: False}),
    "disk": ("disk", {}, {}),
    "disk-dram": PLACEMENTS[6][:1] + (PLACEMENTS[6][1], {}),
    "host-hot-cache": ("host", {}, {"cache_bytes": 256 << 10}),
    "disk-hot-cache": ("disk", {}, {"cache_bytes": 256 << 10}),
    "disk-dram-hot-cache": PLACEMENTS[6][:1] + (PLACEMENTS[6][1], {"cache_bytes": 256 << 10}),
}


@pytest.mark.parametrize("case,tp_size", [(c, 2) for c in sorted(BALANCED_CASES)]
                         + [("host-shared-narrowed", 4), ("disk-dram-hot-cache", 5)])
def test_balanced_shards_of_every_placement_sum_to_the_full_rows(table_dir, tmp_path, rng, monkeypatch, case,
                                                                tp_size):
    """Balanced shards summed over the ranks are the whole rows bit for bit in every sharded
    placement and cache; a rank that drops one of its ranges makes the sum wrong."""
    root, tables = table_dir
    placement, options, kw = BALANCED_CASES[case]
    L = CFG.layer_ids[1]
    ids = shard_ids(rng, L)
    want = bf16_bits(reference(tables[L], ids))
    assert torch.equal(bf16_bits(sharded_parts(root, tmp_path, ids, L, tp_size, placement, options, **kw)), want)
    dropped = sharded_parts(root, tmp_path, ids, L, tp_size, placement, options, monkeypatch=monkeypatch,
                            drop=(0, 0), **kw)
    assert not torch.equal(bf16_bits(dropped), want)


def test_column_shards_deal_every_column_once():
    for L in CFG.layer_ids:
        bounds = LAYOUT.column_bounds(LAYOUT.layer_index(L))
        columns = len(bounds) - 1
        for tp in (1, 2, 3, 4, 5, 8, 16):
            ranks = [column_shards(bounds, r, tp) for r in range(tp)]
            flat = sorted(r for held in ranks for r in held)
            assert flat[0][0] == 0 and flat[-1][1] == bounds[-1]
            assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))  # every row once
            for r, held in enumerate(ranks):
                if columns % tp == 0:  # whole columns, c % tp == rank (adjacent ones merged)
                    starts = [b for b in bounds[:-1] if any(lo <= b < hi for lo, hi in held)]
                    assert starts == [bounds[c] for c in range(r, columns, tp)]
                else:  # piece r of every column: rows even to one row a column
                    for c in range(columns):
                        got = sum(min(hi, bounds[c + 1]) - max(lo, bounds[c]) for lo, hi in held
                                  if lo < bounds[c + 1] and hi > bounds[c])
                        assert got == (lambda a, b: b - a)(*shard_range(bounds[c + 1] - bounds[c], r, tp))
    assert column_shards((0, 10, 20), 2, 4) == [(6, 8), (16, 18)]  # fewer columns than ranks: split too
    assert column_shards((0, 10, 20, 30), 1, 2) == [(5, 10), (15, 20), (25, 30)]  # 3 columns, TP 2
    with pytest.raises(EngramError, match="rank 4 is not in \\[0, 4\\)"):
        column_shards((0, 10, 20), 4, 4)


def test_planner_per_rank_bytes_from_the_ranges():
    bounds = [LAYOUT.column_bounds(LAYOUT.layer_index(L)) for L in CFG.layer_ids]
    total = sum(b[-1] for b in bounds) * ROW_BYTES
    widest = max(b[c + 1] - b[c] for b in bounds for c in range(len(b) - 1))
    for tp in (1, 2, 3, 4, 8):
        per_rank = [rank_bytes([column_shards(b, r, tp) for b in bounds], ROW_BYTES) for r in range(tp)]
        assert sum(per_rank) == total  # every row on one rank
        assert balanced_shard_bytes(bounds, tp, ROW_BYTES) == max(per_rank)
        # whole columns: the largest rank holds at most a column a layer more than the mean
        assert max(per_rank) <= total / tp + len(bounds) * widest * ROW_BYTES
    assert rank_bytes([[shard_range(100, 0, 4)], [(0, 3), (10, 12)]], 264) == (25 + 5) * 264


def layer_path(root, L):
    return root / layer_file_name(L)


@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_balanced_shards_checked_at_open(table_dir, placement):
    root, _ = table_dir
    with pytest.raises(EngramError, match="shards is 'strided'; expected one of contiguous, balanced"):
        open_store(root, placement, cfg=CFG, shards="strided")
    stores = open_store(root, placement, cfg=CFG, tp_rank=1, tp_size=2)
    store = stores[1]
    rows = LAYOUT.rows(1)
    with pytest.raises(EngramError, match=f"layer 1: row id {rows} is outside the table's {rows} rows"):
        store.gather(torch.tensor([0, rows]))  # an id past the table is an error, not another rank's row
    held = ", ".join(f"{lo}..{hi - 1}" for lo, hi in store.row_ranges)
    assert len(store.row_ranges) > 1 and f"rows {held} of {rows}" in store.describe()
    assert store.stats()["row_ranges"] == [list(r) for r in store.row_ranges]
    for s in stores.values():
        s.close()
    store_class = {"device": DeviceStore, "host": HostStore, "disk": DiskStore}[placement]
    with pytest.raises(EngramError, match="must be sorted, disjoint"):
        store_class(1, layer_path(root, 1), LAYOUT.rows(1), [(10, 20), (5, 8)], torch.device("cpu"), "auto")


def test_shard_ranges_cover_every_row_once():
    for rows in (1, 7, 12458, 384006168):
        for tp in (1, 2, 3, 4, 8):
            ranges = [shard_range(rows, r, tp) for r in range(tp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(EngramError, match="rank 4 is not in \\[0, 4\\)"):
        shard_range(10, 4, 4)


def test_out_of_range_ids_raise_with_the_layer(table_dir, tmp_path):
    root, _ = table_dir
    store = open_store(root, "device", cfg=CFG)[1]
    rows = LAYOUT.rows(1)
    with pytest.raises(EngramError, match=f"layer 1: row id {rows} is outside the table's {rows} rows"):
        store.gather(torch.tensor([0, rows]))
    with pytest.raises(EngramError, match="row id -2 is outside"):
        store.gather(torch.tensor([-2]))
    # -1 is no row (a graph padding token's): +0 rows, as another shard's ids.
    assert not store.gather(torch.tensor([-1])).view(torch.int16).any()
    with pytest.raises(EngramError, match="must be int32 or int64"):
        store.gather(torch.tensor([1.0]))


def test_bad_placement_and_options(table_dir):
    root, _ = table_dir
    with pytest.raises(EngramError, match="unknown placement 'ssd'; choose one of device, host, disk"):
        open_store(root, "ssd")
    with pytest.raises(EngramError, match="placement device has no option\\(s\\) threads"):
        open_store(root, "device", threads=4)


# ----------------------------------------------------------------- disk faults
def test_disk_dedupes_and_counts(table_dir):
    root, tables = table_dir
    store = open_store(root, "disk", cfg=CFG)[3]
    ids = torch.tensor([[5, 5, 9], [9, 5, 12]])
    assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(tables[3], ids)))
    s = store.stats()
    assert s["rows_served"] == 6 and s["unique_rows"] == 3 and s["unique_ratio"] == 0.5
    assert s["reads"] == 1 and 0 < s["read_ms_p50"] <= s["read_ms_p99"]


def test_io_errors_are_retried_then_fail_that_call_only(table_dir, monkeypatch, caplog, rng):
    root, tables = table_dir
    store = open_store(root, "disk", cfg=CFG, retries=2)[1]
    ids = random_ids(rng, LAYOUT.rows(1), (16, 24))
    real_pread = rowio.pread_rows
    failures = {"left": 2}

    def flaky_pread(*args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            return errno.EIO, 0
        return real_pread(*args, **kwargs)

    # Injected at the read layer: the mapped copy reports a fault, pread fails twice.
    monkeypatch.setattr(rowio, "copy_mapped", lambda *a, **k: 0)
    monkeypatch.setattr(rowio, "pread_rows", flaky_pread)
    reads_by_the_store(monkeypatch)  # the native step hands its reads to the store's reader
    with caplog.at_level(logging.WARNING):
        assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(tables[1], ids)))
    assert caplog.text.count("Input/output error") == 2
    failures["left"] = 10
    with pytest.raises(TableIOError, match=r"layer-1.rows: reading \d+ of \d+ rows \(first: row \d+\) failed after 3 tries: Input/output error"):
        store.gather(ids)
    monkeypatch.undo()
    # The store keeps serving the next call.
    assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(tables[1], ids)))


def test_file_truncated_under_an_open_store(tmp_path, rng, monkeypatch):
    # Inside the interval between two looks at the file (after one, the store refuses every
    # lookup: tests/core/test_table_change.py) the reads are bounded by the file's size.
    monkeypatch.setattr(disk, "_CHANGE_CHECK_S", float("inf"))
    tables = {L: edge_rows(rng, LAYOUT.rows(L)) for L in CFG.layer_ids}
    root = write_tables(tmp_path / "t", CFG, tables, progress=False)
    store = open_store(root, "disk", cfg=CFG)[1]
    path = root / layer_file_name(1)
    keep = 1000
    os.truncate(path, 4096 + keep * ROW_BYTES)
    with pytest.raises(TableIOError, match=r"row \d+ lies past the end of the file .* truncated or replaced under the open store"):
        store.gather(torch.tensor([3, keep + 5]))
    ids = torch.tensor([0, 3, keep - 1])
    assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(tables[1], ids)))


def test_sigbus_from_a_truncated_mapping_is_an_error_not_a_crash(tmp_path):
    """The mapped copy itself (below the size check): a page past EOF raises SIGBUS, which
    the native guard must turn into a failed index. In a subprocess: a bug here kills it."""
    script = textwrap.dedent(
        f"""
        import faulthandler, mmap, os, numpy as np
        faulthandler.enable()  # installed before our guard, as pytest and SGLang do
        from engram_sglang.core.stores import rowio
        path = {str(tmp_path / 'f.rows')!r}
        with open(path, 'wb') as f:
            f.write(bytes(range(256)) * 64 * 1024)  # 16 MiB
        fd = os.open(path, os.O_RDONLY)
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        base = np.frombuffer(m, dtype=np.uint8).ctypes.data
        os.truncate(path, 4096 * 10)
        rows = np.array([1, 2, 5000, 3], dtype=np.int64)
        out = np.zeros((4, 264), dtype=np.uint8)
        print('failed', rowio.copy_mapped(base, rows, out, 4))
        ok = np.array([1, 2], dtype=np.int64)
        print('ok', rowio.copy_mapped(base, ok, out[:2], 4), bytes(out[0, :4]) == bytes(np.frombuffer(m, np.uint8)[264:268]))
        # Past the copy's prefetch distance (kCopyAhead rows): a row ahead is prefetched, never
        # touched, so the failure is the row itself and every row before it is copied whole.
        rows = np.array([*range(12), 5000, *range(20, 27)], dtype=np.int64)
        out = np.zeros((20, 264), dtype=np.uint8)
        failed = rowio.copy_mapped(base, rows, out, 1)
        mapped = np.frombuffer(m, np.uint8)[:10 * 4096 // 264 * 264].reshape(-1, 264)
        print('ahead', failed, np.array_equal(out[:12], mapped[:12]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "failed 2" in proc.stdout and "ok -1 True" in proc.stdout and "ahead 12 True" in proc.stdout


# ------------------------------------------------------------------ host memory
def test_shared_host_table_is_one_private_file(table_dir, tmp_path, rng):
    root, tables = table_dir
    a = open_store(root, "host", cfg=CFG, shared=True, shm_dir=tmp_path)[1]
    files = sorted(tmp_path.glob("engram-*-layer1.rows"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    mtime = files[0].stat().st_mtime_ns
    b = open_store(root, "host", cfg=CFG, shared=True, shm_dir=tmp_path)[1]
    assert files[0].stat().st_mtime_ns == mtime  # mapped, not filled again
    ids = random_ids(rng, LAYOUT.rows(1), (32, 24))
    assert torch.equal(bf16_bits(a.gather(ids)), bf16_bits(b.gather(ids)))
    assert a.stats()["shared"] and "shared" in a.describe()
    # Refuse a file someone else could have written.
    os.chmod(files[0], 0o644)
    with pytest.raises(EngramError, match="mode 0o644 lets other users read or write it; refusing"):
        open_store(root, "host", cfg=CFG, shared=True, shm_dir=tmp_path)
    os.chmod(files[0], 0o600)
    if os.geteuid() == 0:
        os.chown(files[0], 12345, -1)
        with pytest.raises(EngramError, match="owned by uid 12345, not by this process"):
            open_store(root, "host", cfg=CFG, shared=True, shm_dir=tmp_path)


def test_small_shm_falls_back_to_private_copies_with_a_clear_line(table_dir, tmp_path, monkeypatch, caplog):
    root, _ = table_dir
    # Docker's default /dev/shm is 64 MiB; pretend this one has 1 MiB free.
    monkeypatch.setattr(hostmem, "shm_free_bytes", lambda d: 1 << 20)
    with caplog.at_level(logging.WARNING):
        store = open_store(root, "host", cfg=CFG, shared=True, shm_dir=tmp_path)[1]
    assert "has 0.00 GiB free but the shared table needs" in caplog.text and "--shm-size" in caplog.text
    assert not store.stats()["shared"] and not list(tmp_path.glob("engram-*"))


def test_host_table_reports_huge_pages_from_smaps(table_dir):
    root, _ = table_dir
    store = open_store(root, "host", cfg=CFG)[1]
    report = store.memory.huge_pages_report()
    assert report.mapped_kib * 1024 >= store.resident_bytes  # the mapping was found and is resident
    assert 0.0 <= report.coverage <= 1.0
    assert f"huge pages {report.coverage:.0%}" in store.describe()


def test_open_store_puts_a_hot_row_cache_in_front(table_dir, rng):
    root, tables = table_dir
    stores = open_store(root, "disk", cfg=CFG, cache_bytes=4 << 20)
    ids = random_ids(rng, LAYOUT.rows(1), (64, 24))
    for _ in range(3):  # misses, then admitted rows served from the cache
        got = stores[1].gather(ids)
        stores[1].maintain()
    assert torch.equal(bf16_bits(got), bf16_bits(reference(tables[1], ids)))
    assert stores[1].stats()["cache_hit_rate"] > 0
    with pytest.raises(EngramError, match="placement device already holds the table"):
        open_store(root, "device", cfg=CFG, cache_bytes=1 << 20)
