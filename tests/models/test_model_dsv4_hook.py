"""The DeepSeek-V4.1 hook at module level (DeepSeek's attention backend has no CPU path):
upstream SGLang's own EngramEmbedding and EngramHasher over small tables and synthetic
forward batches, served through the process's one EngramRuntime. Upstream's EngramEmbedding
over a table returns the same rows as our StoreEngramEmbedding over the same table, bit for
bit, in every placement (the only difference by design: our gather writes +0.0 for -0.0)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engram_sglang import EngramLayout
from engram_sglang.core.hashing import NgramHasher
from engram_sglang.core.rowformat import (
    PAYLOAD_BYTES,
    ROW_BYTES,
    ROW_VALUES,
    bf16_bits,
    dequantize,
    row_checksums,
    split,
)
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import small_config

sglang_engram = pytest.importorskip("sglang.srt.layers.engram", reason="needs the installed sglang")

CFG = small_config(300, layer_ids=(2, 5), n_heads=2)
LAYER = 5
SERIAL = SimpleNamespace(tp_rank=0, tp_size=1, attn_dp_size=1, attn_cp_size=1)


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
    return out, rows, layout


@pytest.fixture(scope="module")
def parallel():
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_size=1, tp_rank=0):
        yield


def expected(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return bf16_bits(dequantize(packed[ids.reshape(-1)]).view(*ids.shape, ROW_VALUES))


def upstream_rows(table, ids):
    _, packed, layout = table
    i = layout.layer_index(LAYER)
    up = upstream_class()(layout.rows(LAYER), 256, LAYER, layout.column_bounds(i))
    weight, scale = split(packed[LAYER])
    up._load_rows(up.weight, weight.view(torch.float8_e4m3fn))
    up._load_rows(up.scale, scale.view(torch.float8_e8m0fnu))
    out = up(ids)
    return out.masked_fill(out == 0, 0.0)  # -0.0 -> +0.0: ours writes +0.0 by design


def open_runtime(table_dir, placement="host", **settings):
    from engram_sglang.models.deepseek_v4_hook import process_runtime
    from engram_sglang.serving.settings import ServeSettings

    return process_runtime(settings=ServeSettings(placement=placement, table_dir=str(table_dir), **settings),
                           device="cpu", parallel=SERIAL)


def embeddings(runtime, layout):
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding

    return {L: StoreEngramEmbedding(layout.rows(L), 256, L, layout.column_bounds(i), runtime=runtime)
            for i, L in enumerate(CFG.layer_ids)}


def upstream_hasher(rng):
    """Upstream's EngramHasher (a subclass whose forward the test wraps, so the class SGLang
    uses stays as it is), its buffers those of our NgramHasher for a random token map (its
    constructor derives the same from a tokenizer: tests/core/test_hashing.py checks they agree)."""
    from engram_sglang import plugin

    ours = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    base = sglang_engram.EngramHasher
    forward = getattr(base.forward, "__wrapped__", base.forward)  # upstream's, unwrapped
    cls = type("Hasher", (base,), {"forward": forward})
    plugin.patch(SimpleNamespace(EngramHasher=cls), "sglang.srt.layers.engram", only="EngramHasher.forward")
    hasher = cls.__new__(cls)
    nn.Module.__init__(hasher)
    hasher.max_ngram_size, hasher.pad_id = CFG.max_ngram_size, ours.pad_id
    for name in ("token_map", "multipliers", "primes", "offsets"):
        hasher.register_buffer(name, getattr(ours, name).clone(), persistent=False)
    hasher.image_token_id, hasher.history, hasher.pad_row, hasher._cpu_hash_params = None, None, 0, None
    hasher.init_history(8, "cpu")
    return hasher, ours


def batch(mode: str, slots, lens, positions, input_ids):
    """A synthetic ForwardBatch with the fields upstream's hasher and our runtime read."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lens_t = torch.tensor(lens)
    return SimpleNamespace(
        forward_mode={"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE,
                      "verify": ForwardMode.TARGET_VERIFY}[mode],
        req_pool_indices=torch.tensor(slots), extend_seq_lens=lens_t, extend_seq_lens_cpu=list(lens),
        extend_start_loc=torch.cumsum(lens_t, 0) - lens_t, positions=torch.tensor(positions), input_ids=input_ids,
        engram_history=None, out_cache_loc=torch.arange(1, len(input_ids) + 1),
        spec_info=SimpleNamespace(draft_token_num=lens[0]))


# ---------------------------------------------------------------------------------- rows
@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_store_embedding_returns_upstream_rows(parallel, table, placement):
    table_dir, _, layout = table
    rows = layout.rows(LAYER)
    gen = torch.Generator().manual_seed(11)
    ids = torch.cat([torch.arange(256), torch.randint(0, rows, (701,), generator=gen), torch.tensor([rows - 1])])
    ids = ids.view(-1, 2)  # [T, hash columns], as the Engram layer passes them
    runtime = open_runtime(table_dir, placement)
    try:
        got = embeddings(runtime, layout)[LAYER](ids)  # no step began: gathered as it comes
    finally:
        runtime.close()
    want = upstream_rows(table, ids)
    assert got.shape == want.shape == (*ids.shape, 256) and got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(bf16_bits(got), bf16_bits(want))
    assert torch.isnan(got[:128]).any() and (got[:128] == 0).any()  # the special codes were exercised


# ------------------------------------------------------------------- the one runtime
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_steps_of_upstreams_hasher_are_served_through_the_runtime(parallel, table, rng, placement, tmp_path):
    """Extend, decode and an MTP target-verify step hashed by upstream's EngramHasher: every
    layer's gather starts when the ids exist and each lookup takes its own prefetched rows
    (exact, and the ids equal one pass over each request's tokens); the step ends between
    steps with its statistics and trace line; no prefetch handle is ever dropped."""
    from engram_sglang.core.stores import maintenance
    from engram_sglang.core.stores.base import Prefetch
    from engram_sglang.serving.runtime import active_runtimes

    table_dir, packed, layout = table
    trace = tmp_path / "trace.jsonl"
    runtime = open_runtime(table_dir, placement, trace=str(trace))
    dropped = Prefetch.dropped
    started = {}
    for L, store in runtime.stores.items():
        real = store.prefetch
        store.prefetch = lambda ids, real=real, L=L: started.setdefault(L, []).append(real(ids)) or started[L][-1]
    try:
        embeds = embeddings(runtime, layout)
        hasher, ours = upstream_hasher(rng)
        assert runtime.step_hasher is None and not runtime.reads_ahead
        a, b = (torch.randint(0, CFG.vocab_size, (n,), generator=rng) for n in (11, 9))
        steps = [  # (mode, slots, per-request (tokens, first position))
            ("extend", [3, 5], [(a[:7], 0), (b[:5], 0)]),
            ("decode", [3, 5], [(a[7:8], 7), (b[5:6], 5)]),
            ("verify", [3, 5], [(a[8:11], 8), (b[6:9], 6)]),
        ]
        for n, (mode, slots, parts) in enumerate(steps):
            tokens = torch.cat([t for t, _ in parts])
            positions = [p + k for t, p in parts for k in range(len(t))]
            fb = batch(mode, slots, [len(t) for t, _ in parts], positions, tokens)
            hash_ids = hasher(tokens, fb)
            step = runtime.current_step
            assert runtime.step_hasher is hasher and step.hash_ids is hash_ids and step.mode == mode
            assert step.token_req.tolist() == [s for s, (t, _) in zip(slots, parts) for _ in range(len(t))]
            whole = torch.cat([ours.hash_sequence((a if s == 3 else b)[:p + len(t)].tolist())[p:]
                               for s, (t, p) in zip(slots, parts)])
            assert torch.equal(hash_ids, whole)  # upstream's hash, with the history it keeps
            assert sorted(step.handles) == list(CFG.layer_ids)  # every layer's gather, before any layer
            for i, L in enumerate(CFG.layer_ids):
                got = embeds[L](hash_ids[:, i], fb)
                assert got is started[L][n]._rows  # the prefetched rows, not a second gather
                assert torch.equal(bf16_bits(got), expected(packed[L], hash_ids[:, i]))
            assert step.handles == {}
            maintenance.between_steps()  # SGLang's ModelRunner.forward returned: the step ends
            stats = runtime.stats()
            assert stats["steps"] == stats["forward_steps"] == n + 1
        assert stats["tokens"] == 12 + 2 + 6 and stats["engram_seconds_per_step"] > 0
        # /server_info: the plugin's hook on the scheduler's internal state reports this runtime.
        from engram_sglang import plugin

        class Controller:
            def get_internal_state(self, recv_req):
                return SimpleNamespace(internal_state={})

        plugin.patch(SimpleNamespace(SchedulerInternalStateController=Controller),
                     "sglang.srt.managers.scheduler_components.internal_state")
        assert active_runtimes() == [runtime]
        reported = Controller().get_internal_state(None).internal_state["engram"]
        assert reported["steps"] == 3 and reported["placement"] == placement and len(reported["tables"]) == 2
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        assert [line["mode"] for line in lines] == ["extend", "decode", "verify"]
        assert lines[2]["req"] == [3, 3, 3, 5, 5, 5] and lines[2]["pos"] == [8, 9, 10, 6, 7, 8]
        last = hash_ids  # the verify step's
        for i, L in enumerate(CFG.layer_ids):
            assert lines[2]["ids"][str(L)] == last[:, i].tolist()
            assert lines[2]["sum"][str(L)] == row_checksums(dequantize(packed[L][last[:, i].reshape(-1)])
                                                            .view(*last[:, i].shape, ROW_VALUES)).tolist()
    finally:
        runtime.close()
    started.clear()
    assert Prefetch.dropped == dropped


def test_a_pd_decode_prebuilt_batch_is_seeded_by_sglang_and_decodes_through_the_runtime(parallel, table, rng):
    """PD disaggregation, module level: the prefill side's runtime serves the prompt's extend;
    the decode side's (its stores opened again, as the decode server opens them; the same
    Engram identity) gets SGLang's prebuilt batch, whose Engram history upstream's
    NgramEmbeddingManager seeds from the request's tokens without a forward: no step, no
    prefetch (no layer reads rows for it). Its decode steps then hash as one pass over the
    whole sequence would, their rows exact and counted in the statistics. The control: a slot
    the prebuilt batch did not seed hashes other ids."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import NgramEmbeddingManager

    from engram_sglang.core.stores import maintenance

    table_dir, packed, layout = table
    hasher, ours = upstream_hasher(rng)
    seq = torch.randint(0, CFG.vocab_size, (12,), generator=rng)  # a 9-token prompt, then 3 outputs
    prompt_len = 9

    def served(runtime, embeds, mode, slots, lens, positions, tokens):
        fb = batch(mode, slots, lens, positions, tokens)
        ids = hasher(tokens, fb)
        for i, L in enumerate(CFG.layer_ids):
            assert torch.equal(bf16_bits(embeds[L](ids[:, i], fb)), expected(packed[L], ids[:, i]))
        maintenance.between_steps()
        return ids

    runtime = open_runtime(table_dir, "host")  # the prefill server's
    try:
        served(runtime, embeddings(runtime, layout), "extend", [2], [prompt_len], list(range(prompt_len)),
               seq[:prompt_len])
        prefill_identity = runtime.pd_identity()
    finally:
        runtime.close()
    hasher.init_history(8, "cpu")  # the decode server's hasher: no history of its own
    runtime = open_runtime(table_dir, "host")
    started = []
    for store in runtime.stores.values():
        real = store.prefetch
        store.prefetch = lambda ids, real=real: started.append(ids) or real(ids)
    try:
        embeds = embeddings(runtime, layout)
        assert runtime.pd_identity() == prefill_identity
        manager = NgramEmbeddingManager(enabled=False, table=None, n=0, engram_hasher=hasher)
        req = SimpleNamespace(origin_input_ids=seq[:prompt_len].tolist(), output_ids=[int(seq[prompt_len])],
                              kv=SimpleNamespace(req_pool_idx=5))
        prebuilt = SimpleNamespace(forward_mode=ForwardMode.PREBUILT, reqs=[req])
        assert manager.prepare_for_forward(prebuilt, chunked_req=None) is prebuilt
        assert runtime.current_step is None and started == [] and runtime.stats()["steps"] == 0
        for pos in range(prompt_len, len(seq)):
            ids = served(runtime, embeds, "decode", [5, 6], [1, 1], [pos, pos], seq[pos:pos + 1].repeat(2))
            whole = ours.hash_sequence(seq[:pos + 1].tolist())[pos]
            assert torch.equal(ids[0], whole)  # seeded by SGLang's prebuilt batch
            if pos == prompt_len:
                assert not torch.equal(ids[1], whole)  # slot 6: never seeded
        assert len(started) == len(CFG.layer_ids) * (len(seq) - prompt_len)  # the decode steps' own
        stats = runtime.stats()
        assert stats["steps"] == stats["forward_steps"] == len(seq) - prompt_len
        assert stats["tokens"] == 2 * (len(seq) - prompt_len)
    finally:
        runtime.close()


def test_a_decode_step_captured_into_a_cuda_graph_gathers_the_graphs_own_ids(parallel, table, rng):
    """Upstream hashes a decode step inside the captured graph: no prefetch is started there and
    no Python state of the runtime, its stores or the hasher changes (a replay runs none); each
    layer's lookup is captured as a gather of the ids it is handed. Eager steps around the
    capture stay exact and a replay is counted between steps."""
    from engram_sglang.core.stores import maintenance
    from tests.support.capture import capture

    table_dir, packed, layout = table
    runtime = open_runtime(table_dir, "host")
    try:
        embeds = embeddings(runtime, layout)
        hasher, _ = upstream_hasher(rng)
        tokens = torch.randint(0, CFG.vocab_size, (8,), generator=rng)
        slots, positions = list(range(8)), [5] * 8
        fb = batch("decode", slots, [1] * 8, positions, tokens)
        hash_ids = hasher(tokens, fb)  # eager, as the warm-up before a capture
        for i, L in enumerate(CFG.layer_ids):
            assert torch.equal(bf16_bits(embeds[L](hash_ids[:, i], fb)), expected(packed[L], hash_ids[:, i]))
        maintenance.between_steps()
        with capture(runtime, hasher, *runtime.stores.values()) as cap:
            fake = batch("decode", slots, [1] * 8, positions, tokens)
            for name in ("req_pool_indices", "positions", "out_cache_loc", "input_ids"):
                setattr(fake, name, cap.fake(getattr(fake, name)))
            ids = hasher(fake.input_ids, fake)
            for i, L in enumerate(CFG.layer_ids):
                assert embeds[L](ids[:, i], fake).shape == (8, ids.shape[2], ROW_VALUES)
        maintenance.between_steps()  # a replay's ModelRunner.forward
        assert runtime.stats()["forward_steps"] == 2 and runtime.stats()["steps"] == 1
        hash_ids = hasher(tokens, fb)
        for i, L in enumerate(CFG.layer_ids):
            assert torch.equal(bf16_bits(embeds[L](hash_ids[:, i], fb)), expected(packed[L], hash_ids[:, i]))
    finally:
        runtime.close()


def test_a_context_parallel_slice_is_gathered_as_it_comes(parallel, table, rng):
    """Under context parallelism each rank looks up a strided slice of the prompt's ids (padded):
    not the step's ids, so served by a gather of exactly those, never the prefetched rows; the
    prefetch nobody uses is released, not dropped."""
    from engram_sglang.core.stores import maintenance
    from engram_sglang.core.stores.base import Prefetch

    table_dir, packed, layout = table
    runtime = open_runtime(table_dir, "host")
    dropped = Prefetch.dropped
    try:
        embeds = embeddings(runtime, layout)
        hasher, _ = upstream_hasher(rng)
        tokens = torch.randint(0, CFG.vocab_size, (10,), generator=rng)
        fb = batch("extend", [1], [10], list(range(10)), tokens)
        hash_ids = hasher(tokens, fb)
        cp_slice = torch.cat([hash_ids[1::2], hash_ids.new_zeros(1, *hash_ids.shape[1:])])  # rank 1 of 2, padded
        for i, L in enumerate(CFG.layer_ids):
            got = embeds[L](cp_slice[:, i], fb, cp_all_tokens=True)
            assert got.shape == (6, hash_ids.shape[2], ROW_VALUES)
            assert torch.equal(bf16_bits(got), expected(packed[L], cp_slice[:, i]))
            # Ids of the step column's shape but other contents (not the hasher's own view):
            # gathered as they come, never the step's prefetched rows.
            flipped = hash_ids.flip(0)[:, i]
            got = embeds[L](flipped, fb)
            assert torch.equal(bf16_bits(got), expected(packed[L], flipped))
        maintenance.between_steps()
        assert runtime.stats()["steps"] == 1
    finally:
        runtime.close()
    assert Prefetch.dropped == dropped


def test_a_failed_read_fails_only_its_requests_through_the_runtime(parallel, table, rng):
    """A row that cannot be read fails the requests whose tokens needed it (the scheduler hook
    aborts them after the batch); every other token's rows are exact."""
    from engram_sglang.core.stores import maintenance
    from engram_sglang.core.stores.base import TableReadFault
    from engram_sglang.serving import faults

    table_dir, packed, layout = table
    runtime = open_runtime(table_dir, "disk")
    try:
        embeds = embeddings(runtime, layout)
        hasher, _ = upstream_hasher(rng)
        a, b = (torch.randint(0, CFG.vocab_size, (n,), generator=rng) for n in (6, 5))
        tokens = torch.cat([a, b])
        fb = batch("extend", [2, 6], [6, 5], list(range(6)) + list(range(5)), tokens)
        L = LAYER
        store = runtime.stores[L]
        real = store.prefetch

        def failing(ids):  # the rows of request 6's last token fail; the others were read
            rows = real(ids).wait()
            bad = sorted(set(col[-1].tolist()) - set(col[:6].reshape(-1).tolist()))
            rows = rows.clone()
            rows[torch.isin(ids, torch.tensor(bad))] = 0
            fault = TableReadFault("layer-5.rows: reading 1 row failed: Input/output error", failed_ids=bad, rows=rows)

            class Failed:
                def wait(self):
                    raise fault

                def release(self):
                    pass

            return Failed()

        store.prefetch = failing
        col = _hash_without_commit(hasher, tokens, fb)[:, runtime.layer_index[L]]  # the ids the step will ask for
        step_ids = hasher(tokens, fb)
        got = {M: embeds[M](step_ids[:, i], fb) for i, M in enumerate(CFG.layer_ids)}
        maintenance.between_steps()
        assert torch.equal(bf16_bits(got[L])[:6], expected(packed[L], col[:6]))
        other = CFG.layer_ids[0]
        assert torch.equal(bf16_bits(got[other]), expected(packed[other], step_ids[:, 0]))
        assert runtime.stats()["read_faults"] == 1
        # After the batch the scheduler hook aborts exactly request 6, naming the layer and the error.
        reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=i), to_finish=None, finished=lambda: False)
                for i in (2, 6)]
        assert faults.abort_failed_requests(SimpleNamespace(tp_size=1), SimpleNamespace(reqs=reqs)) == 1
        assert reqs[0].to_finish is None
        assert f"engram layer {L}" in reqs[1].to_finish.message and "Input/output error" in reqs[1].to_finish.message
        assert runtime.take_failed_requests() == {}
    finally:
        runtime.close()


def _hash_without_commit(hasher, tokens, fb):
    """The step's ids computed ahead by upstream's own torch path, its history left as it is."""
    saved = hasher.history.clone()
    try:
        return type(hasher).forward.__wrapped__(hasher, tokens, fb)
    finally:
        hasher.history.copy_(saved)


def test_prefill_read_ahead_hashes_with_upstreams_hasher(parallel, table, rng, monkeypatch):
    """The disk tier's read-ahead of a chunked prompt's next chunk, for a runtime whose hasher
    is upstream's: the rows the next chunk's step will ask for land in the DRAM row cache."""
    from array import array

    import numpy as np

    from engram_sglang import plugin
    from engram_sglang.serving import readahead
    from engram_sglang.serving.readahead import read_ahead_next_chunk

    monkeypatch.setattr(readahead, "_failed_once", False)
    table_dir, _, layout = table
    runtime = open_runtime(table_dir, "disk", disk_direct=True, disk_dram_cache_mib=8)
    try:
        embeds = embeddings(runtime, layout)
        hasher, ours = upstream_hasher(rng)
        assert not runtime.reads_ahead  # no hasher yet: nothing to hash with

        class Model(nn.Module):  # the loader attaches the model's hasher once weights are in
            def load_weights(self, weights):
                return list(weights)

        plugin.patch(SimpleNamespace(DeepseekV4ForCausalLM=Model), "sglang.srt.models.deepseek_v4")
        model = Model()
        model.model = SimpleNamespace(engram_hasher=hasher)
        model.embeds = nn.ModuleList(embeds.values())
        model.load_weights([("model.layers.2.engram.embed.weight", None), ("model.layers.2.engram.wkv.weight", None)])
        assert runtime.step_hasher is hasher and runtime.reads_ahead
        tokens = torch.randint(0, CFG.vocab_size, (100,), generator=rng).tolist()
        req = SimpleNamespace(full_untruncated_fill_ids=array("q", tokens), extend_end=40)
        scheduler = SimpleNamespace(chunked_req=req, chunked_prefill_size=32)
        extend = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True))
        assert read_ahead_next_chunk(scheduler, extend) == 32
        # The next chunk's step, hashed by upstream's hasher with the history SGLang gives it.
        fb = batch("extend", [4], [32], list(range(40, 72)), torch.tensor(tokens[40:72]))
        fb.engram_history = torch.tensor([tokens[37:40]], dtype=torch.int32)
        step_ids = _hash_without_commit(hasher, torch.tensor(tokens[40:72]), fb)
        assert torch.equal(step_ids, ours.hash_sequence(tokens)[40:72])
        for L, i in runtime.layer_index.items():
            store = runtime.stores[L]
            store.read_ahead(np.zeros(0, np.int64)).result()  # one thread, in order: the chunk is in
            want = np.unique(step_ids[:, i].numpy())
            assert store.dram.contains(want).mean() > 0.9  # (set conflicts may drop a few)
    finally:
        runtime.close()


# --------------------------------------------------------------- factory and parallelism
def test_factory_serves_configured_tables_and_keeps_upstream_otherwise(parallel, table, monkeypatch):
    import importlib

    from engram_sglang import plugin
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding

    table_dir, _, layout = table
    module = importlib.import_module("sglang.srt.layers.engram")
    monkeypatch.setattr(module, "EngramEmbedding", upstream_class())
    plugin.patch(module)
    args = (layout.rows(LAYER), 256, LAYER, layout.column_bounds(1))
    monkeypatch.delenv("ENGRAM_TABLE_DIR", raising=False)
    assert isinstance(module.EngramEmbedding(*args), upstream_class())
    monkeypatch.setenv("ENGRAM_TABLE_DIR", str(table_dir))
    monkeypatch.setenv("ENGRAM_PLACEMENT", "host")
    emb = module.EngramEmbedding(*args)
    other = module.EngramEmbedding(layout.rows(2), 256, 2, layout.column_bounds(0))
    try:
        assert isinstance(emb, StoreEngramEmbedding) and emb.store.placement == "host"
        assert other.runtime is emb.runtime  # one runtime per process serves every layer
        with pytest.raises(Exception, match="wants 1"):
            module.EngramEmbedding(1, 256, LAYER, (0, 1))
    finally:
        emb.runtime.close()


@pytest.mark.parametrize("placement, options, how", [
    ("host", {"host_shared": True}, "shared-copy"), ("host", {}, "exchange"),
    ("host", {"host_shared": True, "host_whole_rows": False}, "exchange"),
    ("device", {}, "exchange"), ("device", {"disk_graphs": True}, "exchange"), ("disk", {}, "exchange"),
    ("disk", {"disk_dram_cache_mib": 1}, "exchange"), ("disk", {"disk_graphs": True}, "files"),
    ("disk", {"mode": "off"}, "files")])
def test_dsv4_attn_dp_serves_every_placement(table, tmp_path, caplog, placement, options, how):
    """Under attention DP the TP ranks hold different tokens: with the node's shared host copy
    every rank reads whole rows (no all-reduce); device, private host and disk shards keep
    SGLang's TP ranks and exchange ids per layer (the exchange itself, over real ranks:
    tests/models/test_dsv4_attn_dp_exchange.py). Where the exchange cannot serve (staged disk
    graphs: a replay cannot wait for other ranks' ids; Engram modes) the disk tier opens the
    whole layer and reads its own tokens' rows from the files, and the start-up line says why.
    The placement table says which."""
    import logging

    from sglang.srt.runtime_context import get_parallel

    from engram_sglang.core.placement_table import placement as spec
    from engram_sglang.models.deepseek_v4_hook import _layers_read_these_ids, process_runtime
    from engram_sglang.serving import startup
    from engram_sglang.serving.settings import ServeSettings

    table_dir, packed, layout = table
    if placement == "host":
        options = dict(options, shm_dir=str(tmp_path))
    settings = ServeSettings(placement=placement, table_dir=str(table_dir), **options)
    with get_parallel().override(tp_size=2, tp_rank=1, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=2, attn_dp_rank=1,
                                 attn_cp_size=1, attn_cp_rank=0) as par:
        refused = startup.exchange_refused(settings, par)
        assert spec(placement).attention_rows(settings.store_options(), refused and refused[0]) == how
        assert startup.attention_rows(settings, par) == how
        if how == "exchange":
            # SGLang's TP rank and size: a shard per rank (opening one needs the TP group's ranks:
            # tests/models/test_dsv4_attn_dp_exchange.py opens them and exchanges ids for real).
            assert startup.rank_rows(par, startup.attention_rows(settings, par)) == (1, 2)
            return
        with caplog.at_level(logging.INFO, logger="engram_sglang.serving.startup"):
            runtime = process_runtime(settings=settings, device="cpu", parallel=par)
    try:
        line = [r.getMessage() for r in caplog.records if "attention data parallelism" in r.getMessage()]
        assert line and f"rows by {how}" in line[0], line
        if how == "files":  # why the disk tier does not exchange ids here
            assert ("--engram-disk-graphs on" if settings.disk_graphs else "Engram modes") in line[0], line
        assert runtime.attention_rows == how == runtime.stats()["attention_rows"]
        decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False))
        assert (runtime.tp_rank, runtime.tp_size, runtime.row_exchange) == (0, 1, None)  # whole rows: no sum
        assert not runtime.reduce_rows and all(s.row_range == (0, s.rows) for s in runtime.stores.values())
        if runtime.staged is None:
            assert _layers_read_these_ids(runtime, decode, lambda: False)
        ids = torch.randint(0, layout.rows(LAYER), (9, 6))
        got = runtime.rows(None, LAYER, ids)
        assert torch.equal(bf16_bits(got), expected(packed[LAYER], ids))
    finally:
        runtime.close()


def test_dsv4_attn_dp_refusals_are_one_line(table, tmp_path):
    """What the exchange does not serve is refused before anything opens, in one line: attention
    DP and CP together over shards, and Engram modes on exchanged ids."""
    from sglang.srt.runtime_context import get_parallel

    from engram_sglang.core.errors import EngramError
    from engram_sglang.models.deepseek_v4_hook import process_runtime
    from engram_sglang.serving.settings import ServeSettings

    table_dir, _, _ = table
    with get_parallel().override(tp_size=4, tp_rank=1, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=2, attn_dp_rank=0,
                                 attn_cp_size=2, attn_cp_rank=1) as par:
        with pytest.raises(EngramError, match="data and context parallelism together") as e:
            process_runtime(settings=ServeSettings(placement="device", table_dir=str(table_dir)), device="cpu",
                            parallel=par)
        assert "\n" not in str(e.value)
    with get_parallel().override(tp_size=2, tp_rank=1, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=2, attn_dp_rank=1,
                                 attn_cp_size=1, attn_cp_rank=0) as par:
        with pytest.raises(EngramError, match="exchanged between attention data-parallel ranks"):
            process_runtime(settings=ServeSettings(placement="device", table_dir=str(table_dir), mode="off"),
                            device="cpu", parallel=par)


def test_dsv4_disk_graphs_stage_the_host_reading_layers(table):
    """--engram-disk-graphs on opens staged rows for DeepSeek-V4.1's disk stores (the staging
    itself: tests/models/test_dsv4_staged_graphs.py)."""
    table_dir, _, _ = table
    runtime = open_runtime(table_dir, "disk", disk_graphs=True)
    try:
        assert runtime.staged is not None and sorted(runtime.staged.layers) == sorted(CFG.layer_ids)
    finally:
        runtime.close()


def test_dsv4_disk_graphs_policy_is_the_planners(table, monkeypatch):
    """The hook's refusal and the planner's "decode graphs kept" read one policy
    (core/planning/graphs.py): changing it changes both."""
    from engram_sglang.core.errors import EngramError
    from engram_sglang.core.planning import graphs

    table_dir, _, _ = table
    monkeypatch.setitem(graphs.UNSTAGED_MODEL_TYPES, "deepseek_v4", "policy under test")
    with pytest.raises(EngramError, match="policy under test: start without it"):
        open_runtime(table_dir, "disk", disk_graphs=True)
    disk = graphs.decode_graphs("deepseek_v41", "disk")
    assert disk["kept"] == "no" and "policy under test" in disk["why"]
    assert graphs.decode_graphs("qwen3_engram", "disk")["kept"] == "opt-in"
    assert [graphs.decode_graphs("deepseek_v41", p)["kept"] for p in ("device", "host")] == ["yes", "yes"]


def test_loader_skips_table_tensors_only_when_our_store_serves():
    from engram_sglang import plugin
    from engram_sglang.models.deepseek_v4_hook import StoreEngramEmbedding

    seen = []

    class FakeModel(torch.nn.Module):
        def load_weights(self, weights):
            seen.extend(name for name, _ in weights)

    class Module:
        DeepseekV4ForCausalLM = FakeModel

    plugin.patch(Module, "sglang.srt.models.deepseek_v4")
    names = ["model.layers.1.engram.embed.weight", "layers.1.engram.embed.scale", "model.layers.1.engram.wkv.weight"]
    FakeModel().load_weights((n, None) for n in names)
    assert seen == names
    seen.clear()
    model = FakeModel()
    model.embed = StoreEngramEmbedding.__new__(StoreEngramEmbedding)
    torch.nn.Module.__init__(model.embed)
    model.load_weights((n, None) for n in names)
    assert seen == ["model.layers.1.engram.wkv.weight"]


# The start-up decision (docs/deploy-deepseek.md, "Who serves the tables"), row by row:
# (our knobs, table directory, upstream's variables) -> who serves, or the one line that stops start-up.
_HOST_TABLE = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1"}
_DECISION = [
    ("none", "absent", {}, "upstream", "loaded from the checkpoint"),
    ("none", "absent", _HOST_TABLE, "upstream", "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE set"),
    ("none", "model dir", {}, "ours", None),
    ("none", "model dir", _HOST_TABLE, "stop", "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE is upstream's own table option"),
    ("placement", "absent", {}, "stop", "ENGRAM_PLACEMENT is set but no Engram table directory was found"),
    ("placement", "absent", _HOST_TABLE, "stop", "ENGRAM_PLACEMENT is set but no Engram table directory was found"),
    ("table-dir", "found", {}, "ours", None),
    ("table-dir", "found", {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "0"}, "ours", None),  # set off: no effect
    ("table-dir", "missing", {}, "stop", "does not exist: mount the converted tables there, or pass -e ENGRAM_TABLE_DIR="),
    ("table-dir empty", "absent", {}, "upstream", "upstream's own Engram tables serve"),  # `-e ENGRAM_TABLE_DIR=`
] + [("table-dir", "found", {var: value}, "stop", f"{var} is upstream's own table option")
     for var, value in (("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE", "true"), ("SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT",
                        "per_rank"), ("SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING", "1"),
                        ("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS", "1"))]


@pytest.mark.parametrize("knobs, tables, upstream, serves, line", _DECISION)
def test_dsv4_startup_decision_table(table, tmp_path, caplog, knobs, tables, upstream, serves, line):
    from engram_sglang.core.errors import EngramError
    from engram_sglang.models import deepseek_v4_hook as hook
    from engram_sglang.serving.settings import ServeSettings

    table_dir, _, _ = table
    model = tmp_path / "model"
    model.mkdir()
    if tables == "model dir":
        (model / "engram_tables").symlink_to(table_dir)
    env = dict(upstream)
    if knobs == "placement":
        env["ENGRAM_PLACEMENT"] = "host"
    elif knobs == "table-dir":
        env["ENGRAM_TABLE_DIR"] = str(table_dir if tables == "found" else tmp_path / "missing")
    elif knobs == "table-dir empty":
        env["ENGRAM_TABLE_DIR"] = ""
    hook._said.clear()
    decide = lambda: hook.who_serves(ServeSettings.from_env(env), str(model), env)  # noqa: E731
    if serves == "stop":
        with pytest.raises(EngramError, match=re.escape(line)) as e:
            decide()
        assert "\n" not in str(e.value)
        return
    with caplog.at_level("WARNING", logger=hook.__name__):
        got = decide()
    if serves == "ours":
        assert got is not None and got.resolve() == table_dir.resolve() and not caplog.records
    else:
        assert got is None and [r.getMessage() for r in caplog.records if line in r.getMessage()]
