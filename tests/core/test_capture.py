"""What a CUDA graph captures must not sync with the host or advance Python state; what it
replays must still be counted and maintained. CPU proofs:

* the capture fixture (tests/support/capture.py) raises on each kind of host sync and state change
  (a negative test per kind), and passes the paths that claim to be capturable: the device
  and host stores' gather, the hot-row cache's gather over host placement (misses read from
  the inner table) and its directory lookup;
* a capture at the old in-gather maintenance cadence (the 8th call) passes: no gather
  maintains any more (it raised HostSync before);
* a "replay": the cache's gather traced once into an FX graph of aten ops (make_fx; the
  graph holds the store's tensors by reference, as a CUDA graph holds their addresses) and
  run with new ids, with only `maintenance.between_steps()` between replays, as SGLang's
  model runner does: rows bit-exact, the cache keeps admitting (hit rate rises), statistics
  and metrics count every replay.

What needs a GPU (a real torch.cuda.CUDAGraph capture and replay) runs in bench/gpu_check.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY, Counter

from engram_sglang.core import rowformat
from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.rowformat import ROW_VALUES, bf16_bits
from engram_sglang.core.stores import maintenance, open_store
from engram_sglang.core.stores.cache import HotRowCache
from tests.support.capture import CaptureViolation, HostSync, capture
from tests.support.tables import held_mask, random_table_dir, small_config

CFG = small_config(400)
LAYOUT = EngramLayout(CFG)
LAYER = CFG.layer_ids[0]
ROWS = LAYOUT.rows(LAYER)


# ------------------------------------------------------------------ the fixture itself
class Holder:
    def __init__(self):
        self.t = torch.arange(8)
        self.n = 0


_PROBE = Counter("engram_capture_probe", "a metric the capture fixture must see move (tests only)")

SYNCS = {
    "item": lambda h, cap: h.t.sum().item(),
    "int": lambda h, cap: int(h.t[0]),
    "bool (an if on a tensor)": lambda h, cap: bool((h.t > 3).any()),
    "tolist": lambda h, cap: h.t.tolist(),
    "boolean mask": lambda h, cap: h.t[h.t > 3],
    "nonzero": lambda h, cap: torch.nonzero(h.t),
    "unique": lambda h, cap: torch.unique(h.t),
    "masked_select": lambda h, cap: h.t.masked_select(h.t > 3),
    "torch.equal": lambda h, cap: torch.equal(h.t, h.t),
    "blocking device-to-host copy": lambda h, cap: cap.fake(h.t, "cuda").cpu(),
}


@pytest.mark.parametrize("kind", list(SYNCS))
def test_each_kind_of_host_sync_raises(kind):
    h = Holder()
    with pytest.raises(HostSync):
        with capture(h) as cap:
            SYNCS[kind](h, cap)


def _bump(h, cap):
    h.n += 1


def _rebind(h, cap):
    h.t = h.t + 1


def _metric(h, cap):
    _PROBE.inc()


@pytest.mark.parametrize("change, says", [(_bump, "changed Python state"), (_rebind, "rebound tensor"),
                                          (_metric, "moved Prometheus metrics")])
def test_python_state_rebinding_and_metrics_are_caught(change, says):
    h = Holder()
    with pytest.raises(CaptureViolation, match=says):
        with capture(h) as cap:
            change(h, cap)


def test_fixed_shape_device_work_passes_and_leaves_the_real_tensors_alone():
    h = Holder()
    with capture(h) as cap:
        h.t.add_(1)  # in place: allowed (a replay does it too), on the fake only
        torch.where(h.t > 3, h.t, -1).sum()
        cap.fake(h.t, "cuda").to("cpu", non_blocking=True)  # an asynchronous copy does not sync
    assert torch.equal(h.t, torch.arange(8)) and h.n == 0


# ------------------------------------------------------------------ tables
@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("tables"), CFG)


def reference(rows: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    return rowformat.dequantize(torch.from_numpy(rows[ids.reshape(-1).numpy()])).view(*ids.shape, ROW_VALUES)


def skewed(gen: torch.Generator, shape, universe: int = ROWS) -> torch.Tensor:
    u = torch.rand(shape, generator=gen)
    return (torch.exp(u * np.log(universe)) - 1).long().clamp_(0, universe - 1)


def opened(table_dir, placement, tp_size=1, **cache):
    stores = open_store(table_dir, placement, cfg=CFG, cache_bytes=cache.pop("cache_bytes", 0),
                        cache_options=cache or None, tp_rank=0, tp_size=tp_size)
    return stores


def close(stores):
    for s in stores.values():
        s.close()


# ------------------------------------------------------------------ capturable paths
@pytest.mark.parametrize("placement, cached, tp_size", [("device", False, 1), ("host", False, 1), ("host", True, 1),
                                                      ("device", False, 2), ("host", False, 2), ("host", True, 2)])
@pytest.mark.parametrize("into_out", [False, True])
def test_capturable_gathers_pass_the_fixture(tables, rng, placement, cached, into_out, tp_size):
    """TP 2: rank 0's balanced shard (several row ranges, ids mapped on the device)."""
    table_dir, rows = tables
    stores = opened(table_dir, placement, tp_size, **({"cache_bytes": 64 << 10} if cached else {}))
    store = stores[LAYER]
    assert (len(store.row_ranges) > 1) == (tp_size > 1)
    assert isinstance(store, HotRowCache) == cached
    try:
        for _ in range(3):  # eager warm-up first, as SGLang does before it captures a size
            store.gather(skewed(rng, (16, 24)))
            maintenance.between_steps()
        ids = skewed(rng, (16, 24))
        flat = ids.reshape(-1)
        with capture(store) as cap:
            out = torch.empty(16, 24, 256, dtype=torch.bfloat16) if into_out else None
            got = store.gather(cap.fake(ids), out=out)
            assert got.shape == (16, 24, 256) and got.dtype == torch.bfloat16
            if cached:
                hit, slot = store.directory.lookup(cap.fake(flat))
                assert hit.shape == slot.shape == (16 * 24,)
        got = store.gather(ids)  # the real tensors were left as they were: still exact
        want = reference(rows[LAYER], ids)
        want[~held_mask(ids, store.row_ranges)] = 0  # another rank's rows: +0.0
        assert torch.equal(bf16_bits(got), bf16_bits(want))
    finally:
        close(stores)


def test_a_capture_at_the_old_maintenance_cadence_passes(tables, rng):
    """The cache maintained inside its 8th gather (a host sync): SGLang captures a batch size
    after eager warm-up calls, so a captured call hit the cadence and the capture failed.
    Now a gather never maintains."""
    table_dir, _ = tables
    stores = opened(table_dir, "host", cache_bytes=64 << 10, maintain_every=8)
    cache = stores[LAYER]
    try:
        for _ in range(7):
            cache.gather(skewed(rng, (16, 24)))
        with capture(cache) as cap:
            cache.gather(cap.fake(skewed(rng, (16, 24))))
    finally:
        close(stores)


def test_statistics_refuse_to_sync_inside_a_capture_and_between_steps_waits(tables, rng):
    table_dir, _ = tables
    stores = opened(table_dir, "host", cache_bytes=64 << 10, maintain_every=1)
    cache = stores[LAYER]
    try:
        cache.gather(skewed(rng, (4, 24)))
        with capture(cache):
            with pytest.raises(EngramError, match="read them between steps, not inside a CUDA-graph capture"):
                cache.stats()
            assert maintenance.between_steps() == 0  # inside a capture: not between steps, nothing runs
        assert cache.stats()["cache_maintenances"] == 0
        assert maintenance.between_steps() > 0 and cache.stats()["cache_maintenances"] == 1
    finally:
        close(stores)


# ------------------------------------------------------------------ replays
def _value(name, labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_replays_are_maintained_between_steps_and_counted(tables, monkeypatch):
    """The cache's gather traced once, then replayed: only between_steps() runs between
    replays. The cache keeps admitting (the hit rate rises), every row is exact, and the
    statistics and metrics count the replays (device counters)."""
    import gc

    from torch.fx.experimental.proxy_tensor import make_fx

    gc.collect()  # stores other tests left open would share this layer's metric labels
    table_dir, rows = tables
    stores = opened(table_dir, "host", cache_bytes=96 << 10, maintain_every=4)
    cache = stores[LAYER]
    lab = {"layer": str(LAYER), "placement": "host", "tp_rank": "0", "dp_rank": "0", "pp_rank": "0"}
    gen = torch.Generator().manual_seed(5)
    universe = torch.randperm(ROWS, generator=gen)
    try:
        with monkeypatch.context() as m:  # the trace is the capture (make_fx also refuses host reads)
            m.setattr(maintenance, "capturing", lambda: True)
            graph = make_fx(lambda ids: cache.gather(ids))(universe[skewed(gen, (32, 24))])
        reads0, served0 = _value("engram_cache_reads_total", lab), _value("engram_rows_served_total", lab)
        rates = []
        for step in range(48):
            ids = universe[skewed(gen, (32, 24))]
            before = int(cache.directory.find(ids.reshape(-1))[0].sum())
            got = graph(ids)  # a replay: no Python of the store runs
            assert torch.equal(bf16_bits(got), bf16_bits(reference(rows[LAYER], ids))), f"replay {step}"
            rates.append(before / ids.numel())
            maintenance.between_steps()
        s = cache.stats()
        assert s["cache_lookups"] == 49 and s["calls"] == 49  # the traced call and every replay
        assert s["cache_reads"] == s["rows_served"] == 49 * 32 * 24
        assert s["cache_maintenances"] == 12 and s["cache_admitted"] > 0
        assert np.mean(rates[:4]) < 0.05 and np.mean(rates[-8:]) > 0.2, rates
        # Metrics at the last maintenance (step 48): every read and row so far, replays included.
        assert _value("engram_cache_reads_total", lab) - reads0 == 49 * 32 * 24
        assert _value("engram_rows_served_total", lab) - served0 == 49 * 32 * 24
    finally:
        close(stores)


def test_the_plugin_runs_between_steps_after_every_model_runner_forward():
    """The hook wraps SGLang's ModelRunner.forward (eager and replayed steps alike); wrapping
    twice, or beside another wrapper of the same method, keeps exactly one of each."""
    import types

    from engram_sglang import plugin
    from engram_sglang.plugin.targets import wrap_method

    class ModelRunner:
        def forward(self, batch):
            return ("out", batch, maintenance.steps())

    module = types.SimpleNamespace(ModelRunner=ModelRunner)
    plugin.patch(module, "sglang.srt.model_executor.model_runner", only="ModelRunner.forward")
    plugin.patch(module, "sglang.srt.model_executor.model_runner", only="ModelRunner.forward")  # loaded twice
    seen = []
    wrap_method(ModelRunner, "forward", lambda original, self, *a: seen.append(a) or original(self, *a))
    step = maintenance.steps()
    out = ModelRunner().forward("b")
    assert out == ("out", "b", step) and maintenance.steps() == step + 1  # after the forward, once
    assert seen == [("b",)]
