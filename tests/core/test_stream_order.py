"""Stream discipline of the GPU code paths, proven on the CPU with a recording fake.

No GPU here: `tests/support/fake_streams.py` stands in for torch.cuda's streams and events (a mock
of what cannot exist on this machine) and makes ordering mistakes visible: a device-to-host
copy's destination holds poison until its event is waited for, and a pinned buffer
rewritten while its host-to-device copy is still queued is reported as a hazard. What only
a GPU can show (real streams, real capture) is `make gpu-check`'s.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout, NgramHasher
from engram_sglang.core.rowformat import ROW_VALUES, bf16_bits
from engram_sglang.core.stores import Prefetch, open_store
from engram_sglang.core.stores.staging import StagingSlot
from engram_sglang.core.tablefile import write_tables
from engram_sglang.serving.runtime import EngramRuntime
from engram_sglang.serving.settings import ServeSettings
from tests.support.fake_streams import RecordingStreams
from tests.support.tables import held_mask, random_rows, small_config

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)
DISK = [
    {},
    {"direct": True, "threads": 4},
    {"direct": True, "threads": 4, "dram_cache_bytes": 64 << 10},  # every call evicts
]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    rows = random_rows(CFG)
    for L in CFG.layer_ids:  # edge codes: fp8 NaNs, scale bytes 0 and 0xFF, first and last row
        rows[L][0, :256], rows[L][0, 256:] = 0x7F, 0
        rows[L][-1, :256], rows[L][-1, 256:] = 0xFF, 0xFF
    return write_tables(tmp_path_factory.mktemp("tables") / "t", CFG, rows, progress=False), rows


def expected(rows: np.ndarray, ids: torch.Tensor, ranges=None) -> torch.Tensor:
    """bf16 bits of the rows of ids; +0 outside the shard's row `ranges` (None: whole rows)."""
    flat = ids.reshape(-1)
    live = held_mask(flat, [(0, rows.shape[0])] if ranges is None else ranges)
    out = rowformat.dequantize(torch.from_numpy(rows[flat.clamp(0, rows.shape[0] - 1).numpy()]))
    out[~live] = 0
    return bf16_bits(out.view(*ids.shape, ROW_VALUES))


def step_ids(gen: torch.Generator, rows: int, n: int) -> torch.Tensor:
    ids = torch.randint(0, rows, (n, 6), generator=gen)
    ids[0, 0], ids[-1, -1] = 0, rows - 1
    return ids


def with_fake(stores) -> RecordingStreams:
    fake = RecordingStreams()
    for s in stores.values():
        s._streams = fake
    return fake


@pytest.mark.parametrize("options", DISK, ids=["page-cache", "direct", "direct+dram"])
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_disk_prefetch_on_a_gpu_orders_ids_staging_and_decode(tables, rng, options, tp):
    """Finding 2: the worker waits for the ids' copy, touches no stream, writes staging only
    once the GPU is done copying out of it; the copy in and the decode run on the consumer's
    stream; bits equal the reference over many steps with a lagging GPU."""
    root, rows = tables
    stores = open_store(root, "disk", cfg=CFG, tp_rank=tp[0], tp_size=tp[1], **options)
    fake = with_fake(stores)
    consumer = fake.new_stream()
    try:
        L = CFG.layer_ids[0]
        store = stores[L]
        for step in range(24):
            ids = step_ids(rng, store.rows, 1 + step % 5 * 7)
            handle = store.prefetch(ids)  # on the forward (default) stream
            with fake.use(consumer):
                got = handle.wait()
            assert torch.equal(bf16_bits(got), expected(rows[L], ids, store.row_ranges)), f"step {step}"
            if step % 7 == 6:
                fake.flush(consumer)  # the GPU catches up only now and then
        fake.flush()
        assert fake.hazards == []
        workers = {e[1] for e in fake.log if e[1] != threading.current_thread().name}
        assert workers, "the reads ran on a worker thread"
        assert {e[0] for e in fake.log if e[1] in workers} <= {"set_device", "synchronize_event", "pinned_empty"}
        assert all(e[2] is consumer for e in fake.ops("to_device"))
        assert all(e[2] is fake.default for e in fake.ops("to_host"))
        assert store.stats()["calls"] == 24
    finally:
        for s in stores.values():
            s.close()


def test_disk_prefetch_without_waiting_for_the_ids_reads_garbage(tables, rng):
    """Negative control: skip the host wait on the ids' copy and the worker sees poison."""
    root, _ = tables
    stores = open_store(root, "disk", cfg=CFG)
    fake = with_fake(stores)
    fake.skip_event_sync = True
    try:
        with pytest.raises(EngramError, match="outside the table"):
            stores[CFG.layer_ids[0]].prefetch(step_ids(rng, LAYOUT.rows(CFG.layer_ids[0]), 8)).wait()
    finally:
        for s in stores.values():
            s.close()


def test_disk_prefetch_reusing_staging_too_early_is_a_hazard(tables, rng, monkeypatch):
    """Negative control: a worker that does not wait for the slot's copy-out event rewrites
    a pinned buffer whose host-to-device copy is still queued."""
    root, _ = tables
    stores = open_store(root, "disk", cfg=CFG)
    fake = with_fake(stores)
    consumer = fake.new_stream()
    monkeypatch.setattr(StagingSlot, "wait_free", lambda self: None)
    try:
        store = stores[CFG.layer_ids[0]]
        for _ in range(8):
            handle = store.prefetch(step_ids(rng, store.rows, 16))
            with fake.use(consumer):
                handle.wait()
        fake.flush()
        assert fake.hazards
    finally:
        for s in stores.values():
            s.close()


@pytest.mark.parametrize("placement", ["device", "host"])
def test_side_stream_prefetch_is_ordered_both_ways(tables, rng, placement):
    """Finding 4: the side stream waits for the caller's stream, the ids are kept alive for
    the side stream (record_stream), the consumer waits on the event and keeps the rows."""
    root, rows = tables
    stores = open_store(root, placement, cfg=CFG)
    fake = with_fake(stores)
    consumer = fake.new_stream()
    try:
        L = CFG.layer_ids[1]
        ids = step_ids(rng, LAYOUT.rows(L), 9)
        handle = stores[L].prefetch(ids)
        side = fake.ops("new_stream")[-1][2]
        with fake.use(consumer):
            got = handle.wait()
        assert torch.equal(bf16_bits(got), expected(rows[L], ids))
        ops = [(e[0], *e[2:]) for e in fake.log]
        event = fake.ops("record_event")[0][3]
        assert ops.index(("wait_stream", side, fake.default)) < ops.index(("record_event", side, event))
        assert ("record_stream", ids.data_ptr(), side) in ops
        assert ("wait_event", consumer, event) in ops
        assert ("record_stream", got.data_ptr(), consumer) in ops
    finally:
        for s in stores.values():
            s.close()


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_release_orders_a_handle_nobody_waits_for(tables, rng, placement):
    root, _ = tables
    stores = open_store(root, placement, cfg=CFG)
    fake = with_fake(stores)
    dropped = Prefetch.dropped
    try:
        store = stores[CFG.layer_ids[0]]
        handle = store.prefetch(step_ids(rng, store.rows, 4))
        handle.release()
        handle.release()  # idempotent
        assert handle.done
        with pytest.raises(EngramError, match="released"):
            handle.wait()
        if placement == "host":
            assert fake.ops("wait_event")[-1][2] is fake.default
        else:  # the slot is free again: the next two prefetches use pooled slots
            for _ in range(2):
                store.prefetch(step_ids(rng, store.rows, 4)).wait()
            assert store._staging.temporaries == 0
        del handle
        assert Prefetch.dropped == dropped
    finally:
        for s in stores.values():
            s.close()


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_runtime_waits_or_releases_every_handle(tables, rng, placement):
    """Every prefetch handle of a step is waited on or released by the runtime: a layer that
    did not run, and a step whose forward raised before end()."""
    root, rows = tables
    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    runtime = EngramRuntime(CFG, hasher, ServeSettings(placement=placement), root, torch.device("cpu"))
    fake = with_fake(runtime.stores)
    dropped = Prefetch.dropped
    try:
        tokens = torch.randint(0, CFG.vocab_size, (12,), generator=rng)
        hash_ids = hasher.hash_sequence(tokens.tolist())
        args = (hash_ids, torch.zeros(12, dtype=torch.int64), torch.arange(12), tokens, "extend")
        step = runtime.begin(*args)
        handles = dict(step.handles)
        first = CFG.layer_ids[0]
        got = runtime.rows(step, first)
        assert torch.equal(bf16_bits(got), expected(rows[first], hash_ids[:, 0]))
        runtime.end(step, 0.0, 0.0, 1)  # the second layer never asked
        assert all(h.done for h in handles.values())
        abandoned = runtime.begin(*args)  # this forward raises before end() ...
        left = dict(abandoned.handles)
        runtime.begin(*args)  # ... and the next step orders what it left
        assert all(h.done for h in left.values())
        runtime.close()
        assert Prefetch.dropped == dropped
        assert fake.hazards == []
    finally:
        runtime.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_runtime_begin_rows_end_pass_the_capture_fixture(tables, rng, prefetch):
    """Runtime begin/rows/end as a captured decode step runs them (host placement, the GPU's
    side-stream prefetch through the recording fake): no host sync, no Python state of the
    runtime or its stores changes; eager steps before and after stay exact."""
    from engram_sglang.core.stores import maintenance
    from tests.support.capture import capture

    root, rows = tables
    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    runtime = EngramRuntime(CFG, hasher, ServeSettings(placement="host", prefetch=prefetch), root,
                            torch.device("cpu"))
    fake = with_fake(runtime.stores) if prefetch else None
    try:
        tokens = torch.randint(0, CFG.vocab_size, (8,), generator=rng)
        hash_ids = hasher.hash_sequence(tokens.tolist())
        args = (hash_ids, torch.arange(8), torch.arange(8), tokens, "decode")
        for _ in range(2):  # eager warm-up
            step = runtime.begin(*args)
            got = {L: runtime.rows(step, L) for L in CFG.layer_ids}
            runtime.end(step, 0.0, 0.0, 2)
            maintenance.between_steps()
        with capture(runtime, *runtime.stores.values()) as cap:
            step = runtime.begin(*(cap.fake(a) for a in args[:4]), "decode")
            for L in CFG.layer_ids:
                assert runtime.rows(step, L).shape == (8, hash_ids.shape[2], ROW_VALUES)
            runtime.end(step, 0.0, 0.0, 2)
        maintenance.between_steps()
        for i, L in enumerate(CFG.layer_ids):
            assert torch.equal(bf16_bits(got[L]), expected(rows[L], hash_ids[:, i]))
        assert runtime.stats()["forward_steps"] == 3 and runtime.stats()["steps"] == 2
        if fake is not None:
            assert fake.ops("wait_event")  # the captured step joined its side streams
    finally:
        runtime.close()


@pytest.mark.parametrize("options", DISK, ids=["page-cache", "direct", "direct+dram"])
def test_every_worker_thread_sets_the_store_device_first(tables, rng, options):
    """Finding 2 (issue 23; recording fakes only, no GPU here): a thread starts on device 0, so
    each of a store's worker threads (prefetch staging, I/O, admission, read-ahead) makes the
    store's device current before anything else it does."""
    root, _ = tables
    before = set(threading.enumerate())
    stores = open_store(root, "disk", cfg=CFG, **options)
    fake = with_fake(stores)
    try:
        store = stores[CFG.layer_ids[0]]
        for step in range(6):
            ids = step_ids(rng, store.rows, 8 + step)
            store.prefetch(ids).wait()
            if store.reads_ahead:
                store.read_ahead(step_ids(rng, store.rows, 16)).result()
        fake.flush()
        store.maintain()
        me = threading.current_thread().name
        workers = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("engram-") and t.name != me]
        assert workers, "the store started worker threads"
        first = {}
        for e in fake.log:
            first.setdefault(e[1], e[0])
        assert all(first.get(name) == "set_device" for name in workers), (workers, first)
    finally:
        for s in stores.values():
            s.close()
