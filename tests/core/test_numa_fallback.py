"""A shared host copy that falls back to a private shard (the shm dir too small) is bound by
the shard's size, not the layer's: with its node's free memory between the two, auto binds
it there (it interleaved a shard the node could hold)."""

from __future__ import annotations

from engram_sglang.core.stores import hostmem, numa, open_store
from tests.core.test_numa import CFG, GIB, NBYTES, fake_sysfs, mbind_calls, table_dir  # noqa: F401


def test_a_private_fallback_is_bound_by_its_own_size(table_dir, tmp_path, monkeypatch, mbind_calls):
    root = fake_sysfs(tmp_path / "sys", free_gib=(100.0, 0.75 * NBYTES / GIB))  # node 1: 3/4 of a layer free
    monkeypatch.setattr(numa, "SYSFS", root)
    monkeypatch.setattr(numa, "mbind_unavailable", lambda: None)
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid: {4})  # a CPU rank on node 1
    monkeypatch.setattr(hostmem, "shm_free_bytes", lambda d: 0)  # /dev/shm too small: private shard
    shm = tmp_path / "shm"
    shm.mkdir()
    store = open_store(table_dir[0], "host", "cpu", cfg=CFG, tp_rank=1, tp_size=2, shared=True, shm_dir=shm)[1]
    try:
        assert not store.shared and store.rows_held * 264 < 0.75 * NBYTES
        assert store.stats()["numa"] == "node1", store.binding.describe()
    finally:
        store.close()
