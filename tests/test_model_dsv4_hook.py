"""The DeepSeek-V4.1 hook at module level: upstream SGLang's EngramEmbedding over a small
table returns the same rows as our StoreEngramEmbedding over the same table, bit for bit,
in every placement (the only difference by design: our gather writes +0.0 for -0.0)."""

from __future__ import annotations

import pytest
import torch

from conftest import small_config
from engram_sglang import EngramLayout
from engram_sglang.rowformat import PAYLOAD_BYTES, ROW_BYTES, bf16_bits, split
from engram_sglang.tablefile import write_tables

sglang_engram = pytest.importorskip("sglang.srt.layers.engram", reason="needs the installed sglang")

CFG = small_config(300, layer_ids=(2, 5), n_heads=2)
LAYER = 5


def upstream_class():
    cls = sglang_engram.EngramEmbedding
    return getattr(cls, "upstream", cls)  # unwrap the plugin's factory if this process loaded it


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Random packed rows, the first 256 of which pair every fp8 code with scale byte = row."""
    layout = EngramLayout(CFG)
    gen = torch.Generator().manual_seed(7)
    rows = {L: torch.randint(0, 256, (layout.rows(L), ROW_BYTES), dtype=torch.uint8, generator=gen) for L in CFG.layer_ids}
    rows[LAYER][:256, :PAYLOAD_BYTES] = torch.arange(256, dtype=torch.uint8)
    rows[LAYER][:256, PAYLOAD_BYTES:] = torch.arange(256, dtype=torch.uint8).unsqueeze(-1)
    out = write_tables(tmp_path_factory.mktemp("dsv4") / "tables", CFG, rows, progress=False)
    return out, rows[LAYER], layout


@pytest.fixture(scope="module")
def parallel():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_size=1, tp_rank=0):
        yield


def upstream_rows(table, ids):
    _, packed, layout = table
    i = layout.layer_index(LAYER)
    up = upstream_class()(layout.rows(LAYER), 256, LAYER, layout.column_bounds(i))
    weight, scale = split(packed)
    up._load_rows(up.weight, weight.view(torch.float8_e4m3fn))
    up._load_rows(up.scale, scale.view(torch.float8_e8m0fnu))
    out = up(ids)
    return out.masked_fill(out == 0, 0.0)  # -0.0 -> +0.0: ours writes +0.0 by design


@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_store_embedding_returns_upstream_rows(parallel, table, placement):
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding
    from engram_sglang.stores import open_store

    table_dir, packed, layout = table
    rows = layout.rows(LAYER)
    gen = torch.Generator().manual_seed(11)
    ids = torch.cat([torch.arange(256), torch.randint(0, rows, (701,), generator=gen), torch.tensor([rows - 1])])
    ids = ids.view(-1, 2)  # [T, hash columns], as the Engram layer passes them
    stores = open_store(table_dir, placement, "cpu", cfg=CFG)
    try:
        ours = StoreEngramEmbedding(rows, 256, LAYER, layout.column_bounds(1), store=stores[LAYER])
        got = ours(ids)
    finally:
        for s in stores.values():
            s.close()
    want = upstream_rows(table, ids)
    assert got.shape == want.shape == (*ids.shape, 256) and got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(bf16_bits(got), bf16_bits(want))
    assert torch.isnan(got[:128]).any() and (got[:128] == 0).any()  # the special codes were exercised


def test_factory_serves_configured_tables_and_keeps_upstream_otherwise(parallel, table, monkeypatch):
    import importlib

    from engram_sglang.models import deepseek_v4_hook
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding, patch_engram_module

    table_dir, _, layout = table
    module = importlib.import_module("sglang.srt.layers.engram")
    monkeypatch.setattr(module, "EngramEmbedding", upstream_class())
    monkeypatch.setattr(deepseek_v4_hook, "_STORES", {})
    patch_engram_module(module)
    args = (layout.rows(LAYER), 256, LAYER, layout.column_bounds(1))
    monkeypatch.delenv("ENGRAM_TABLE_DIR", raising=False)
    assert isinstance(module.EngramEmbedding(*args), upstream_class())
    monkeypatch.setenv("ENGRAM_TABLE_DIR", str(table_dir))
    monkeypatch.setenv("ENGRAM_PLACEMENT", "host")
    emb = module.EngramEmbedding(*args)
    assert isinstance(emb, StoreEngramEmbedding) and emb.store.placement == "host"
    with pytest.raises(Exception, match="wants 1"):
        module.EngramEmbedding(1, 256, LAYER, (0, 1))
    for stores in deepseek_v4_hook._STORES.values():
        for s in stores.values():
            s.close()


def test_loader_skips_table_tensors_only_when_our_store_serves():
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding, patch_deepseek_v4

    seen = []

    class FakeModel(torch.nn.Module):
        def load_weights(self, weights):
            seen.extend(name for name, _ in weights)

    class Module:
        DeepseekV4ForCausalLM = FakeModel

    patch_deepseek_v4(Module)
    names = ["model.layers.1.engram.embed.weight", "layers.1.engram.embed.scale", "model.layers.1.engram.wkv.weight"]
    FakeModel().load_weights((n, None) for n in names)
    assert seen == names
    seen.clear()
    model = FakeModel()
    model.embed = StoreEngramEmbedding.__new__(StoreEngramEmbedding)
    torch.nn.Module.__init__(model.embed)
    model.load_weights((n, None) for n in names)
    assert seen == ["model.layers.1.engram.wkv.weight"]


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_hashing_prefetches_every_served_layer_and_each_lookup_waits_on_its_own(parallel, table, placement,
                                                                              monkeypatch):
    """The wrapped EngramHasher.forward starts each served layer's gather as soon as the
    step's ids exist; a layer's lookup of that very view takes the prefetched rows, any
    other ids are gathered afresh (never stale rows), and the next step replaces the rest."""
    from engram_sglang.models import deepseek_v4_hook
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding, patch_engram_hasher
    from engram_sglang.stores import open_store

    table_dir, _, layout = table
    monkeypatch.setattr(deepseek_v4_hook, "_EMBEDS", deepseek_v4_hook.weakref.WeakSet())
    stores = open_store(table_dir, placement, "cpu", cfg=CFG)
    started = []  # (layer, Prefetch) in the order they were started
    for L, store in stores.items():
        real = store.prefetch
        monkeypatch.setattr(store, "prefetch",
                            lambda ids, real=real, L=L: started.append((L, real(ids))) or started[-1][1])
    embs = {L: StoreEngramEmbedding(layout.rows(L), 256, L, layout.column_bounds(i), store=stores[L], hash_index=i)
            for i, L in enumerate(CFG.layer_ids)}
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    step_ids = torch.stack([torch.randint(0, layout.rows(L), (40, 6), generator=gen) for L in CFG.layer_ids], 1)

    class Hasher:  # stands in for upstream's EngramHasher: its forward returns the step's ids
        def forward(self, input_ids, forward_batch):
            return step_ids

    patch_engram_hasher(type("Module", (), {"EngramHasher": Hasher}))
    try:
        hash_ids = Hasher().forward(None, None)
        assert len(started) == 2  # both layers, before any layer ran
        for i, L in enumerate(CFG.layer_ids):
            want = stores[L].gather(hash_ids[:, i])
            got = embs[L](hash_ids[:, i])
            assert got is dict(started)[L]._rows  # the prefetched rows, not a second gather
            assert torch.equal(bf16_bits(got), bf16_bits(want))
        # Other ids than the prefetched view: gathered afresh.
        Hasher().forward(None, None)
        other = hash_ids[:, 0].flip(0).contiguous()
        got = embs[CFG.layer_ids[0]](other)
        assert torch.equal(bf16_bits(got), bf16_bits(stores[CFG.layer_ids[0]].gather(other)))
        assert embs[CFG.layer_ids[0]]._pending is None  # consumed or dropped: never served later
        # Prefetch off (ENGRAM_PREFETCH=0): no hash index, the lookup gathers in the layer.
        quiet = StoreEngramEmbedding(layout.rows(LAYER), 256, LAYER, layout.column_bounds(1), store=stores[LAYER],
                                     hash_index=1, prefetch=False)
        n = len(started)
        Hasher().forward(None, None)
        assert len(started) == n + 2 and quiet._pending is None
    finally:
        for s in stores.values():
            s.close()
