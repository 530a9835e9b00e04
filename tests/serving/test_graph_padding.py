"""A CUDA-graph replay at a padded batch size hashes its padding rows too: their ids must never
reach a store as row ids, so a hot-row cache neither counts, admits nor reports them as hits."""

from __future__ import annotations

import types

import torch

from engram_sglang.core.hashing import NgramHasher
from engram_sglang.serving.runtime import EngramRuntime
from engram_sglang.serving.settings import ServeSettings
from tests.support.tables import random_table_dir, small_config

REAL, PADDED, STEPS = 3, 8, 16


def _decode_batch(out_cache_loc: torch.Tensor):
    mode = types.SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True)
    return types.SimpleNamespace(forward_mode=mode, req_pool_indices=torch.arange(PADDED),
                                 out_cache_loc=out_cache_loc, positions=torch.zeros(PADDED, dtype=torch.int64))


def test_padding_ids_are_never_counted_admitted_or_hits(tmp_path):
    cfg = small_config(400)
    root, _ = random_table_dir(tmp_path, cfg)
    gen = torch.Generator().manual_seed(3)
    hasher = NgramHasher(cfg, torch.randint(0, cfg.compressed_vocab_size, (cfg.vocab_size,), generator=gen))
    runtime = EngramRuntime(cfg, hasher, ServeSettings(placement="host", cache_mib=1), root, torch.device("cpu"))
    try:
        L0 = cfg.layer_ids[0]
        rows = runtime.stores[L0].rows
        # The padding rows hash the same dummy tokens at every replay: the same ids each step.
        first = hasher.hash_sequence([1, 2, 3, 4, 5, 6, 7, 8])
        pad_ids = first[REAL:].clone()
        fresh = torch.tensor(sorted(set(range(rows)) - set(pad_ids.reshape(-1).tolist())))
        out_loc = torch.tensor([11, 12, 13] + [0] * (PADDED - REAL))
        for s in range(STEPS):
            ids = pad_ids.new_empty(PADDED, *pad_ids.shape[1:])
            ids[REAL:] = pad_ids
            # Real tokens read rows seen once only: nothing of theirs is worth admitting.
            n = REAL * ids[0].numel()
            ids[:REAL] = fresh[n * s:n * (s + 1)].view(REAL, *ids.shape[1:])
            step = runtime.begin_step(torch.zeros(PADDED, dtype=torch.int64), torch.zeros(PADDED), _decode_batch(out_loc),
                                      hash_ids=ids)
            for L in cfg.layer_ids:
                got = runtime.rows(step, L)
                assert not got[REAL:].view(torch.int16).any(), "padding rows are +0"
            runtime.end(step, 0.0, 0.0, 1)
            for L in cfg.layer_ids:
                runtime.stores[L].maintain()
        for i, L in enumerate(cfg.layer_ids):
            d = runtime.stores[L].directory
            resident = set(d.resident_ids().tolist())
            assert not resident & set(pad_ids[:, i].reshape(-1).tolist()), f"layer {L} admitted padding ids"
            assert d.counters()["hits"] == 0, f"layer {L} reported padding reads as hits"
            assert not d.estimate(pad_ids[:, i].reshape(-1)).any(), f"layer {L} counted padding ids"
    finally:
        runtime.close()
