"""A row read that fails after its retries fails only the requests that needed those rows.

The disk tier's reads are made to fail here by replacing the native read calls of
engram_sglang.core.stores.rowio for a chosen set of rows (a unit-level stand-in; the soak
injects faults below the native reader, in the C library calls). Checked at every level:
the store (which rows failed, every other row exact, nothing failed admitted into the DRAM
cache), the runtime (which request slots failed) and the scheduler hook (exactly those
requests aborted with an error finish reason naming the table and errno).
"""

from __future__ import annotations

import errno
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.hashing import EngramLayout, NgramHasher
from engram_sglang.core.rowformat import ROW_VALUES, bf16_bits
from engram_sglang.core.stores import open_store
from engram_sglang.core.stores.base import TableIOError, TableReadFault
from engram_sglang.serving import faults
from engram_sglang.serving.runtime import EngramRuntime
from engram_sglang.serving.settings import ServeSettings
from tests.support.disk_faults import reads_by_the_store, rows_fail_with_eio
from tests.support.fake_streams import RecordingStreams
from tests.support.tables import random_table_dir, small_config

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("tables"), CFG)


@pytest.fixture
def broken(monkeypatch):
    """Rows in the returned set fail with EIO on every read path (mapping, AIO, pread)."""
    return rows_fail_with_eio(monkeypatch, set())


def reference(rows: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    return bf16_bits(rowformat.dequantize(torch.from_numpy(rows[ids.reshape(-1).numpy()])).view(*ids.shape, ROW_VALUES))


OPTIONS = [{}, {"direct": True, "threads": 4}, {"direct": True, "threads": 4, "dram_cache_bytes": 1 << 20}]


@pytest.mark.parametrize("options", OPTIONS, ids=["page-cache", "direct", "direct+dram"])
@pytest.mark.parametrize("how", ["gather", "prefetch", "gpu-prefetch"])
def test_a_failed_read_names_its_rows_and_serves_the_others(tables, rng, broken, options, how):
    root, rows = tables
    stores = open_store(root, "disk", cfg=CFG, retries=1, **options)
    L = CFG.layer_ids[0]
    store = stores[L]
    try:
        if how == "gpu-prefetch":
            store._streams = RecordingStreams()
        ids = torch.randint(0, store.rows, (20, 6), generator=rng)
        bad_ids = sorted({int(ids[3, 1]), int(ids[11, 4])})
        broken.update(bad_ids)
        call = store.gather if how == "gather" else (lambda x: store.prefetch(x).wait())
        with pytest.raises(TableReadFault) as caught:
            call(ids)
        fault = caught.value
        assert fault.failed_ids.tolist() == bad_ids
        assert fault.errno_ == errno.EIO and "Input/output error" in str(fault) and str(store.path) in str(fault)
        needs_bad = np.isin(ids.numpy(), bad_ids)
        got = bf16_bits(fault.rows)
        want = reference(rows[L], ids)
        assert torch.equal(got[torch.from_numpy(~needs_bad)], want[torch.from_numpy(~needs_bad)])
        assert not got[torch.from_numpy(needs_bad)].any()  # +0, and the caller is told
        # The fault clears: the same rows read right (nothing failed was cached).
        broken.clear()
        assert torch.equal(bf16_bits(call(ids)), want)
    finally:
        for s in stores.values():
            s.close()


def test_a_hot_row_cache_over_the_disk_passes_a_fault_up_with_the_other_rows(tables, rng, broken):
    from engram_sglang.core.stores import maintenance

    root, rows = tables
    stores = open_store(root, "disk", cfg=CFG, retries=0, cache_bytes=256 << 10)
    L = CFG.layer_ids[0]
    store = stores[L]
    try:
        ids = torch.randint(0, store.rows, (20, 6), generator=rng)
        broken.add(int(ids[4, 2]))
        with pytest.raises(TableReadFault) as caught:
            store.gather(ids)
        ok = torch.from_numpy(~np.isin(ids.numpy(), list(broken)))
        assert torch.equal(bf16_bits(caught.value.rows)[ok], reference(rows[L], ids)[ok])
        for _ in range(8):  # maintenance admits what was read, never the failed row
            maintenance.between_steps()
        broken.clear()
        assert torch.equal(bf16_bits(store.gather(ids)), reference(rows[L], ids))
    finally:
        for s in stores.values():
            s.close()


def test_runtime_fails_only_the_requests_that_needed_the_rows(tables, rng, broken):
    root, rows = tables
    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    runtime = EngramRuntime(CFG, hasher, ServeSettings(placement="disk", disk_retries=0), root, torch.device("cpu"))
    try:
        parts = [torch.randint(0, CFG.vocab_size, (n,), generator=rng) for n in (5, 7, 4)]
        hash_ids = torch.cat([hasher.hash_sequence(p.tolist()) for p in parts])
        token_req = torch.repeat_interleave(torch.tensor([5, 7, 9]), torch.tensor([5, 7, 4]))
        L = CFG.layer_ids[1]
        col = hash_ids[:, 1]
        # A row only request 7's tokens read.
        mine = set(col[5:12].reshape(-1).tolist()) - set(col[:5].reshape(-1).tolist()) - set(col[12:].reshape(-1).tolist())
        # `broken` breaks a row id in every layer's file: no other layer may read it.
        mine -= set(hash_ids[:, [i for i in range(hash_ids.shape[1]) if i != 1]].reshape(-1).tolist())
        broken.add(min(mine))
        step = runtime.begin(hash_ids, token_req, torch.arange(16), torch.cat(parts), "extend")
        runtime.rows(step, CFG.layer_ids[0])
        got = runtime.rows(step, L)
        runtime.end(step, 0.0, 0.0, 2)
        failed = runtime.take_failed_requests()
        assert list(failed) == [7] and f"engram layer {L}" in failed[7]
        assert runtime.take_failed_requests() == {}
        ok = torch.ones(16, dtype=torch.bool)
        ok[5:12] = False
        assert torch.equal(bf16_bits(got)[ok], reference(rows[L], col)[ok])
        assert runtime.stats()["read_faults"] == 1
    finally:
        runtime.close()


def test_scheduler_aborts_exactly_the_failed_requests(monkeypatch):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    class Runtime:
        stores = {}

        def take_failed_requests(self):
            return {7: "engram layer 3: /t/layer-3.rows: reading 1 of 9 rows failed after 3 tries: Input/output error"}

    monkeypatch.setattr(faults, "active_runtimes", lambda: [Runtime()])
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=i), to_finish=None, finished=lambda: False) for i in (5, 7, 9)]
    assert faults.abort_failed_requests(SimpleNamespace(tp_size=1), SimpleNamespace(reqs=reqs)) == 1
    assert reqs[0].to_finish is None and reqs[2].to_finish is None
    reason = reqs[1].to_finish
    assert isinstance(reason, FINISH_ABORT) and reason.status_code == 500
    assert "Input/output error" in reason.message and "layer-3.rows" in reason.message
    assert reason.err_type == faults.ERROR_TYPE


def test_a_call_that_fails_whole_fails_the_step_not_the_server(tables, rng, monkeypatch):
    """A table file truncated under the open store: every request of the step fails, the
    runtime keeps going."""
    root, _ = tables
    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    runtime = EngramRuntime(CFG, hasher, ServeSettings(placement="disk"), root, torch.device("cpu"))
    try:
        store = runtime.stores[CFG.layer_ids[0]]
        store._read_file = lambda wanted, out=None: (_ for _ in ()).throw(TableIOError("layer file truncated"))
        reads_by_the_store(monkeypatch)
        tokens = torch.randint(0, CFG.vocab_size, (6,), generator=rng)
        step = runtime.begin(hasher.hash_sequence(tokens.tolist()), torch.tensor([2, 2, 2, 4, 4, 4]), torch.arange(6),
                             tokens, "extend")
        rows = runtime.rows(step, CFG.layer_ids[0])
        runtime.end(step, 0.0, 0.0, 1)
        assert not rows.any() and sorted(runtime.take_failed_requests()) == [2, 4]
    finally:
        runtime.close()
