"""A layer file rewritten in place under an open disk store (`cp` over it, `rsync --inplace`:
same size, same inode) is noticed: from then on every lookup of that layer fails as a
truncated file's does, cached rows too (never a mix of old and new rows). A directory swapped
or removed under the store keeps serving the old rows exactly. Host and device placements
hold their rows from start-up: an in-place rewrite does not change what they serve."""

from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.rowformat import ROW_BYTES, bf16_bits
from engram_sglang.core.stores import TableIOError, disk, open_store
from engram_sglang.core.tablefile import DATA_OFFSET, layer_file_name, write_tables
from tests.support.tables import small_config

pytest.importorskip("engram_sglang.core.ops", reason="the gather_dequant op (engram_sglang.core.ops) is not built yet")

CFG = small_config(400)
LAYER = CFG.layer_ids[0]
DISK = [{}, {"direct": True, "threads": 8, "dram_cache_bytes": 1 << 20}, {"native_step": False}]


@pytest.fixture
def tables(tmp_path, rng):
    from engram_sglang.core.hashing import EngramLayout

    layout = EngramLayout(CFG)
    rows = {L: torch.randint(0, 256, (layout.rows(L), ROW_BYTES), dtype=torch.uint8, generator=rng).numpy()
            for L in CFG.layer_ids}
    return write_tables(tmp_path / "t", CFG, rows, progress=False), rows


def reference(rows: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    return rowformat.dequantize(torch.from_numpy(rows[ids.reshape(-1).long().numpy()])).view(*ids.shape, 256)


def rewrite_in_place(path, rows: np.ndarray) -> None:
    """What `cp new old` does: the same inode, truncated and written again, same size."""
    with open(path, "r+b") as f:
        f.seek(DATA_OFFSET)
        f.write(rows.tobytes())


def next_check(monkeypatch) -> None:
    """The rate limit's interval has passed (tests do not sleep for it)."""
    monkeypatch.setattr(disk, "_CHANGE_CHECK_S", 0.0)


@pytest.mark.parametrize("options", DISK, ids=["mapped", "direct-dram", "numpy"])
def test_rewritten_in_place_fails_every_lookup(tables, rng, monkeypatch, caplog, options):
    root, rows = tables
    store = open_store(root, "disk", cfg=CFG, **options)[LAYER]
    cached, fresh = torch.tensor([1, 5, 9]), torch.tensor([20, 40, 60])
    assert torch.equal(bf16_bits(store.gather(cached)), bf16_bits(reference(rows[LAYER], cached)))
    new = rows[LAYER].copy()
    new[:] ^= 0x5A  # every row differs
    time.sleep(0.002)  # a later mtime on filesystems of coarse timestamps
    rewrite_in_place(root / layer_file_name(LAYER), new)
    next_check(monkeypatch)
    with caplog.at_level(logging.ERROR):
        for ids in (fresh, cached, fresh):  # new rows, rows held from before: none are served
            with pytest.raises(TableIOError, match=r"layer-\d+\.rows was rewritten in place under the running "
                                                   r"server \(modified: mtime changed\).*restart the server"):
                store.gather(ids)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "swapping directories" in errors[0].getMessage()
    # The other layers' files are unchanged: their stores serve on.
    other = open_store(root, "disk", cfg=CFG, **options)
    for L, s in other.items():
        if L != LAYER:
            assert torch.equal(bf16_bits(s.gather(fresh)), bf16_bits(reference(rows[L], fresh)))
        s.close()
    store.close()


def test_a_changed_header_with_the_mtime_restored_is_noticed(tables, monkeypatch):
    root, rows = tables
    path = root / layer_file_name(LAYER)
    store = open_store(root, "disk", cfg=CFG)[LAYER]
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(64)
        f.write(b"\x00")  # one byte of the header page
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # `rsync --inplace -t` restores it
    next_check(monkeypatch)
    with pytest.raises(TableIOError, match=r"header page changed"):
        store.gather(torch.tensor([3]))
    store.close()


def test_truncated_after_a_look_fails_rows_below_the_cut_too(tables, monkeypatch):
    """`cp` truncates the file, then writes it: the rows below the cut are not the old ones."""
    root, rows = tables
    store = open_store(root, "disk", cfg=CFG)[LAYER]
    path = root / layer_file_name(LAYER)
    size = os.path.getsize(path)
    os.truncate(path, DATA_OFFSET + 100 * ROW_BYTES)
    next_check(monkeypatch)
    with pytest.raises(TableIOError, match=rf"rewritten in place .*\(size {size} -> {DATA_OFFSET + 100 * ROW_BYTES} bytes\)"):
        store.gather(torch.tensor([1, 2]))
    store.close()


def test_checked_at_most_once_per_interval(tables, monkeypatch):
    root, rows = tables
    store = open_store(root, "disk", cfg=CFG)[LAYER]
    calls = []
    real = os.fstat
    monkeypatch.setattr(disk.os, "fstat", lambda fd: calls.append(fd) or real(fd))
    start = time.monotonic()
    for _ in range(50):
        store.gather(torch.tensor([2, 7]))
    ticks = int((time.monotonic() - start) / disk._CHANGE_CHECK_S) + 1
    assert len([fd for fd in calls if fd == store._fd]) <= ticks
    store.close()


def test_a_swapped_or_removed_directory_keeps_serving(tables, tmp_path, monkeypatch):
    """Negative control: the old inode's link count and ctime change, its rows do not."""
    root, rows = tables
    store = open_store(root, "disk", cfg=CFG)[LAYER]
    ids = torch.tensor([0, 11, 77])
    assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[LAYER], ids)))
    os.rename(root, tmp_path / "old")
    shutil.copytree(tmp_path / "old", root)  # the new tables in place of the old directory
    rewrite_in_place(root / layer_file_name(LAYER), rows[LAYER] ^ 0x33)  # a new file: not ours
    shutil.rmtree(tmp_path / "old")
    next_check(monkeypatch)
    for _ in range(2):
        assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[LAYER], ids)))
    store.close()


@pytest.mark.parametrize("placement, options", [("host", {}), ("host", {"shared": True}), ("device", {})],
                         ids=["host", "host-shared", "device"])
def test_host_and_device_placements_serve_what_they_loaded(tables, tmp_path, placement, options):
    root, rows = tables
    if options.get("shared"):
        options = {**options, "shm_dir": tmp_path}  # a private directory instead of the node's /dev/shm
    store = open_store(root, placement, cfg=CFG, **options)[LAYER]
    rewrite_in_place(root / layer_file_name(LAYER), rows[LAYER] ^ 0x5A)
    ids = torch.tensor([0, 11, 77])
    assert torch.equal(bf16_bits(store.gather(ids)), bf16_bits(reference(rows[LAYER], ids)))
    store.close()
