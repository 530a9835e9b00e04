"""Placement as data (engram_sglang/core/placement_table.py): the serving settings, open_store, the
CUDA-graph policy, the planner and the CLI all read the one table; and whole rows from the
node's shared host copy (no shard, no all-reduce) against shards summed, bit for bit."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from engram_sglang.core import placement_table, rowformat
from engram_sglang.core.errors import EngramError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.placement_table import PLACEMENT_TABLE, PLACEMENTS, Placement, PlacementOption
from engram_sglang.core.rowformat import bf16_bits
from engram_sglang.core.shards import column_shards
from engram_sglang.serving.graphs import graph_args, placement_needs_host_ids
from engram_sglang.serving.settings import KNOBS, ServeSettings
from tests.support.tables import random_table_dir, small_config

CFG = small_config(300, layer_ids=(1, 3), n_heads=2)
OFF = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("placements"), CFG)


def reference(rows: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    return rowformat.dequantize(torch.from_numpy(rows)[ids.reshape(-1)]).view(*ids.shape, 256)


def _close(stores: dict) -> None:
    for s in stores.values():
        s.close()


# ------------------------------------------------------------------ the one table
def test_every_consumer_lists_the_tables_placements():
    from engram_sglang.core import config, stores
    from engram_sglang.tools import cli, planner

    knob = next(k for k in KNOBS if k.flag == "placement")
    assert knob.choices == PLACEMENTS == tuple(PLACEMENT_TABLE) == config.PLACEMENTS == stores.PLACEMENTS
    assert planner.PLACEMENTS == PLACEMENTS
    parser = argparse.ArgumentParser()
    planner._add_arguments(parser)
    assert tuple(next(a for a in parser._actions if a.dest == "placement").choices) == PLACEMENTS
    assert cli._demo_placements(",".join(PLACEMENTS)) == PLACEMENTS


@pytest.mark.parametrize("name", PLACEMENTS)
def test_settings_give_open_store_the_tables_options(name):
    spec = PLACEMENT_TABLE[name]
    options = ServeSettings(placement=name).store_options()
    # Every option the table lists reaches the store, except those passed only when set.
    assert set(options) == {o.name for o in spec.options if not o.only_when_set}
    for o in spec.options:  # each knob lands on its option, scaled
        knob = next(k for k in KNOBS if k.flag == o.knob)
        raw = {"bool": "on", "auto-bool": "on", "require-bool": "on", "int": "3", "str": "/somewhere", "numa": "1"}[knob.kind]
        got = ServeSettings.from_env({"ENGRAM_PLACEMENT": name, knob.env: raw}).store_options()[o.name]
        parsed = {"on": True, "3": 3, "/somewhere": "/somewhere", "1": "1"}[raw]
        assert got == (parsed * o.scale if o.scale != 1 else parsed)


@pytest.mark.parametrize("name", PLACEMENTS)
def test_open_store_takes_the_tables_class_and_options(tables, name):
    from engram_sglang.core.stores import open_store

    spec = PLACEMENT_TABLE[name]
    root, _ = tables
    with pytest.raises(EngramError) as e:
        open_store(root, name, cfg=CFG, no_such_option=1)
    allowed = ", ".join(sorted(spec.option_names)) or "none"
    assert str(e.value) == f"placement {name} has no option(s) no_such_option (options: {allowed})"
    stores = open_store(root, name, cfg=CFG)
    try:
        for store in stores.values():
            assert type(store) is spec.store_class()
            assert store.needs_host_ids == spec.ids_visit_host == (not spec.capturable)
    finally:
        _close(stores)


@pytest.mark.parametrize("name", PLACEMENTS)
def test_the_graph_policy_reads_the_table(name):
    spec = PLACEMENT_TABLE[name]
    assert placement_needs_host_ids(name) == spec.ids_visit_host
    extra, _ = graph_args(name, ["--model-path", "m"])
    assert extra == ([] if spec.capturable else OFF)


def test_a_placement_added_to_the_table_is_served_everywhere(tables, monkeypatch):
    """A new entry (here: device memory again, under another name, declared not capturable)
    is opened by open_store, gets its options from the settings and its graph policy, with
    no other change."""
    from engram_sglang.core.stores import open_store
    from engram_sglang.core.stores.device import DeviceStore

    entry = Placement("hbm-copy", "engram_sglang.core.stores.device:DeviceStore", (), ids_visit_host=False,
                      capturable=False, whole_rows_with=(), cache_in_front=False, what="a test entry")
    monkeypatch.setitem(PLACEMENT_TABLE, "hbm-copy", entry)
    root, rows = tables
    stores = open_store(root, "hbm-copy", cfg=CFG)
    try:
        assert all(type(s) is DeviceStore for s in stores.values())
        ids = torch.tensor([[0, 5, 7]])
        assert torch.equal(bf16_bits(stores[1].gather(ids)), bf16_bits(reference(rows[1], ids)))
    finally:
        _close(stores)
    assert ServeSettings(placement="hbm-copy").store_options() == {}
    assert graph_args("hbm-copy", ["--model-path", "m"])[0] == OFF  # not capturable: graphs off
    with pytest.raises(EngramError, match="unknown placement 'nowhere'; choose one of device, host, disk, hbm-copy"):
        open_store(root, "nowhere", cfg=CFG)


def test_the_table_refuses_a_contradiction():
    with pytest.raises(EngramError, match="cannot be capturable"):
        Placement("x", "m:C", (), ids_visit_host=True, capturable=True, whole_rows_with=(), cache_in_front=False,
                  what="")
    with pytest.raises(EngramError, match="are not all its options"):
        Placement("x", "m:C", (PlacementOption("a", "b"),), ids_visit_host=False, capturable=True,
                  whole_rows_with=("shared",), cache_in_front=False, what="")
    assert placement_table.placement("host").rows_held({"shared": True}) == placement_table.WHOLE  # default on
    assert placement_table.placement("host").rows_held({"shared": True, "whole_rows": False}) == placement_table.SHARD
    assert placement_table.placement("host").rows_held({"shared": False}) == placement_table.SHARD
    assert placement_table.placement("device").rows_held({"shared": True}) == placement_table.SHARD


# ------------------------------------------------------------------ whole rows
def _open_ranks(root, tp, shm_dir, agree, **options):
    from engram_sglang.core.stores import open_store

    return [open_store(root, "host", cfg=CFG, tp_rank=r, tp_size=tp, shared=True, shm_dir=shm_dir, agree=agree,
                       **options) for r in range(tp)]


def test_whole_rows_equal_shards_summed_bit_for_bit(tables, tmp_path, rng):
    from engram_sglang.core.stores import open_store

    root, rows = tables
    whole = _open_ranks(root, 2, tmp_path, agree=lambda everywhere: everywhere)
    shards = [open_store(root, "host", cfg=CFG, tp_rank=r, tp_size=2) for r in range(2)]
    try:
        for L in CFG.layer_ids:
            n = rows[L].shape[0]
            ids = torch.randint(0, n, (64, 12), generator=rng)
            ids[0, :2] = torch.tensor([0, n - 1])
            summed = (shards[0][L].gather(ids).float() + shards[1][L].gather(ids).float()).to(torch.bfloat16)
            assert shards[0][L].row_range != (0, n) and not shards[0][L].holds_whole_rows
            for rank in whole:  # each rank alone: every row of its tokens, no sum
                store = rank[L]
                assert store.row_range == (0, n) and store.holds_whole_rows and store.stats()["rows_held"] == "whole"
                got = store.gather(ids)
                assert torch.equal(bf16_bits(got), bf16_bits(summed))
                assert torch.equal(bf16_bits(got), bf16_bits(reference(rows[L], ids)))
        assert len(list(tmp_path.glob("engram-*-layer1.rows"))) == 1  # one copy for both ranks
    finally:
        for stores in whole + shards:
            _close(stores)


def test_without_agreement_ranks_keep_their_shards(tables, tmp_path, rng):
    """No `agree` (a caller that sums over ranks, e.g. the DeepSeek hook), or a peer rank
    without whole rows: every rank serves its shard of the shared copy, and the sum is exact."""
    root, rows = tables
    for agree in (None, lambda everywhere: False):
        ranks = _open_ranks(root, 2, tmp_path, agree=agree)
        try:
            for L in CFG.layer_ids:
                n = rows[L].shape[0]
                bounds = EngramLayout(CFG).column_bounds(EngramLayout(CFG).layer_index(L))
                assert [s[L].row_ranges for s in ranks] == [column_shards(bounds, r, 2) for r in (0, 1)]
                ids = torch.randint(0, n, (32, 12), generator=rng)
                summed = (ranks[0][L].gather(ids).float() + ranks[1][L].gather(ids).float()).to(torch.bfloat16)
                assert torch.equal(bf16_bits(summed), bf16_bits(reference(rows[L], ids)))
        finally:
            for stores in ranks:
                _close(stores)


def test_agreement_is_asked_once_per_rank(tables, tmp_path):
    """Every rank calls `agree` exactly once, also a rank that holds no whole rows at all
    (device placement), so that a collective behind it never waits for a silent peer."""
    from engram_sglang.core.stores import open_store

    root, _ = tables
    for placement, options, answer in (("host", {"shared": True, "shm_dir": tmp_path}, True),
                                       ("device", {}, False)):
        asked = []
        stores = open_store(root, placement, cfg=CFG, tp_rank=1, tp_size=2,
                            agree=lambda everywhere: asked.append(everywhere) or everywhere, **options)
        _close(stores)
        assert asked == [answer]


def test_a_hot_row_cache_in_front_of_whole_rows_covers_the_whole_table(tables, tmp_path, rng):
    root, rows = tables
    L = CFG.layer_ids[0]
    n = rows[L].shape[0]
    ranks = _open_ranks(root, 2, tmp_path, agree=lambda everywhere: everywhere, cache_bytes=64 << 10,
                        cache_options={"ways": 4, "maintain_every": 0})
    try:
        for stores in ranks:
            cache = stores[L]
            assert cache.row_range == (0, n) and cache.directory.slots > 0
            hot = torch.tensor([[1, n - 2, n // 2, 3]])  # rows of both halves of the table
            for _ in range(4):
                assert torch.equal(bf16_bits(cache.gather(hot)), bf16_bits(reference(rows[L], hot)))
                cache.maintain()
            before = cache.stats()["cache_hits"]
            assert torch.equal(bf16_bits(cache.gather(hot)), bf16_bits(reference(rows[L], hot)))
            cache.maintain()
            assert cache.stats()["cache_hits"] - before == hot.numel()  # both halves' rows are hits
    finally:
        for stores in ranks:
            _close(stores)


def _runtime(root, tmp_path, monkeypatch, shared: bool, tp_rank: int = 0, whole: bool = True):
    from engram_sglang.core.hashing import NgramHasher
    from engram_sglang.serving import runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "agree_over_tp", lambda everywhere: everywhere)  # both ranks alike
    hasher = NgramHasher(CFG, torch.zeros(CFG.vocab_size, dtype=torch.int64))
    settings = ServeSettings(placement="host", host_shared=shared, host_whole_rows=whole, shm_dir=str(tmp_path),
                             prefetch=False)
    return runtime_mod.EngramRuntime(CFG, hasher, settings, root, torch.device("cpu"), tp_rank=tp_rank, tp_size=2)


def test_the_runtime_does_not_all_reduce_whole_rows(tables, tmp_path, monkeypatch, rng):
    from engram_sglang.serving import runtime as runtime_module

    root, rows = tables
    reduced = []
    monkeypatch.setattr(runtime_module, "exact_sum_", lambda t: reduced.append(t) or t * 2)  # the one row sum
    ids = torch.randint(0, min(r.shape[0] for r in rows.values()), (8, len(CFG.layer_ids), 12), generator=rng)
    # "auto" (the default) on the CPU: whole rows, as before auto (serving/whole_rows_auto.py).
    for shared, whole in ((True, True), (False, True), (True, False), (True, "auto")):
        runtime = _runtime(root, tmp_path, monkeypatch, shared=shared, tp_rank=1, whole=whole)
        shared = shared and whole  # --engram-host-whole-rows off: the shared copy is read as shards
        try:
            assert runtime.reduce_rows is not shared and runtime.stats()["rows_all_reduced"] is not shared
            step = runtime.begin(ids, torch.zeros(8, dtype=torch.int64), torch.arange(8), torch.arange(8), "extend")
            for L, i in runtime.layer_index.items():
                got = runtime.rows(step, L)
                if shared:  # the rank's own whole rows, exact, no collective
                    assert torch.equal(bf16_bits(got), bf16_bits(reference(rows[L], ids[:, i])))
            runtime.end(step, 0.0, 0.0, 0)
        finally:
            runtime.close()
        assert len(reduced) == (0 if shared else len(CFG.layer_ids))
        reduced.clear()
