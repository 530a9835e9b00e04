"""Per-rank Engram statistics: every entry names its rank (tp_rank, dp_rank, attention DP/CP
ranks), and `--engram-stats-file` is one file per rank instead of one all ranks overwrite."""

from __future__ import annotations

import json

import pytest
import torch

from engram_sglang.core.hashing import EngramLayout
from engram_sglang.serving.ranks import rank_labels, stats_path
from engram_sglang.serving.settings import ServeSettings
from tests.support.tables import random_table_dir, small_config

CFG = small_config(300, layer_ids=(1, 3), n_heads=2)


def labels(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1):
    return {"tp_rank": tp_rank, "tp_size": tp_size, "dp_rank": dp_rank, "dp_size": dp_size, "pp_rank": pp_rank,
            "pp_size": pp_size, "attn_dp_rank": 0, "attn_cp_rank": 0, "node_rank": 0}


@pytest.mark.parametrize("template, ranks, want", [
    ("/s/stats.json", labels(), "/s/stats.json"),  # one rank: the path as given
    ("/s/stats.json", labels(1, 2), "/s/stats.tp1.dp0.json"),
    ("/s/stats.json", labels(0, 1, 1, 2), "/s/stats.tp0.dp1.json"),
    ("/s/stats", labels(3, 4), "/s/stats.tp3.dp0"),
    ("/s/{rank}/e.json", labels(1, 2, 1, 2), "/s/tp1.dp1/e.json"),
    ("/s/{rank}.json", labels(), "/s/tp0.dp0.json"),
    # Pipeline stages share TP and DP ranks: each stage its own file (review R3.4).
    ("/s/stats.json", labels(pp_rank=1, pp_size=2), "/s/stats.tp0.dp0.pp1.json"),
    ("/s/{rank}.json", labels(1, 2, 0, 1, 0, 2), "/s/tp1.dp0.pp0.json"),
])
def test_the_stats_file_of_each_rank(template, ranks, want):
    assert str(stats_path(template, ranks)) == want


def test_outside_a_server_the_runtimes_own_ranks_label_it():
    assert rank_labels(1, 2) == labels(1, 2)


def test_two_ranks_write_two_labelled_files(tmp_path, monkeypatch):
    """Two TP ranks of one server (their own tables: private host copies, rows summed) each
    write their statistics to their own file, labelled with their rank."""
    from engram_sglang.core.hashing import NgramHasher
    from engram_sglang.serving import runtime as runtime_mod

    root = random_table_dir(tmp_path / "t", CFG)[0]
    monkeypatch.setattr(runtime_mod, "agree_over_tp", lambda everywhere: everywhere)
    hasher = NgramHasher(CFG, torch.zeros(CFG.vocab_size, dtype=torch.int64))
    settings = ServeSettings(placement="host", stats_file=str(tmp_path / "stats.json"), prefetch=False)
    runtimes = [runtime_mod.EngramRuntime(CFG, hasher, settings, root, torch.device("cpu"), tp_rank=r, tp_size=2)
                for r in (0, 1)]
    try:
        for r in runtimes:
            assert r.stats()["tp_rank"] == r.tp_rank and r.stats()["dp_rank"] == 0
            r.write_stats()
    finally:
        for r in runtimes:
            r.close()
    assert sorted(p.name for p in tmp_path.glob("stats*")) == ["stats.tp0.dp0.json", "stats.tp1.dp0.json"]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"stats.tp{rank}.dp0.json").read_text())
        assert (got["tp_rank"], got["tp_size"], got["dp_rank"]) == (rank, 2, 0) and len(got["tables"]) == 2
    # The runtime serves balanced shards: each rank's file lists its row ranges (every other
    # column of a layer, several ranges), and the two ranks' lists hold every row once.
    files = [json.loads((tmp_path / f"stats.tp{rank}.dp0.json").read_text()) for rank in (0, 1)]
    layout = EngramLayout(CFG)
    for L in CFG.layer_ids:
        held = [next(t for t in f["tables"] if t["layer_id"] == L)["row_ranges"] for f in files]
        assert all(len(h) > 1 for h in held), held
        bounds = layout.column_bounds(layout.layer_index(L))
        assert [tuple(r) for h in held for r in h] == [(bounds[c], bounds[c + 1]) for r in (0, 1)
                                                       for c in range(r, len(bounds) - 1, 2)]
