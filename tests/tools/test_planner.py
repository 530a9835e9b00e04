"""The capacity planner: DeepSeek-V4.1-Flash's known figures, bad input, the CLI and --json."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engram_sglang.core.config import configs_dir
from engram_sglang.core.errors import EngramError
from engram_sglang.tools.planner import (
    GIB,
    PLACEMENTS,
    PlannerError,
    add_parser,
    format_text,
    lines_per_row,
    load_gpus,
    main,
    plan,
    shard_bytes,
    valid_tps,
)

DSV41 = "deepseek-v4.1-flash"
ROWS = (384006168, 384016682)
SKUS = ("H100", "H200", "B200", "B300", "GB200", "MI300X", "MI355X")


def test_deepseek_tables_total_and_per_rank_at_tp4():
    p = plan(model=DSV41, gpu="H200", tp=4)
    assert p["tables"]["total_bytes"] == sum(ROWS) * 264
    assert p["tables"]["total_gib"] == 188.83
    assert round(p["tables"]["per_rank_bytes"] / GIB, 1) == 47.2
    text = format_text(p)
    assert "188.83 GiB" in text and "47.21 GiB" in text


@pytest.mark.parametrize("tp", valid_tps(64))
def test_row_range_shards_cover_every_row_once(tp):
    largest = shard_bytes(ROWS, tp, 264)
    assert largest * tp >= sum(ROWS) * 264  # every row has an owner
    assert largest <= (sum(ROWS) / tp + len(ROWS)) * 264  # and shards are even to one row


def test_lines_per_row():
    # 264-byte rows start at multiples of 8 within a line: every row touches exactly 5 lines.
    assert lines_per_row(264) == 5
    assert lines_per_row(256) == 4
    assert lines_per_row(72) == 2


def test_hbm_freed_and_kv_gained_are_the_shard():
    p = plan(model=DSV41, gpu="MI355X", tp=2, placement="host")
    shard = p["tables"]["per_rank_bytes"]
    assert p["hbm_freed_bytes"] == shard
    assert p["kv_tokens_gained"] == int(shard // p["model"]["kv_bytes_per_token"])
    h = p["hbm_per_gpu"]
    assert h["host"]["free_for_kv_bytes"] - h["device"]["free_for_kv_bytes"] == shard
    # A hot-row cache takes its HBM back out of what the placement frees.
    q = plan(model=DSV41, gpu="MI355X", tp=2, placement="host", hot_cache_gib=4)
    assert q["hbm_freed_bytes"] == shard - 4 * GIB


@pytest.mark.parametrize("sku", SKUS)
def test_smallest_tp_with_host_tables_never_larger(sku):
    p = plan(model=DSV41, gpu=sku)
    small = p["smallest_tp"]
    assert small["host"] <= small["device"]
    assert small["disk"] == small["host"]  # both keep the tables out of HBM
    assert p["tp"] == small["host"]  # --tp omitted: the smallest that fits the placement
    assert p["hbm_per_gpu"]["host"]["fits"] is True


def test_host_dram_and_dev_shm():
    p = plan(model=DSV41, gpu="H200", tp=4, placement="host", host_layout="shared")
    d = p["host_dram_per_node"]
    assert (d["ranks_per_node"], d["replicas_per_node"]) == (4, 2)
    # --engram-host-numa auto on a 2-socket host: one copy per NUMA node (configs/gpus.json: 2 x 1 TiB)
    assert (d["shared_copies"], d["shared_bytes"]) == (2, 2 * p["tables"]["total_bytes"])
    assert d["per_rank_bytes"] == 8 * p["tables"]["per_rank_bytes"]
    assert p["dev_shm"]["needed_bytes"] == 2 * p["tables"]["total_bytes"]
    assert p["dev_shm"]["docker_shm_size"] == "410g"  # 2 x 188.83 GiB of table + SGLang's own 32g
    q = plan(model=DSV41, gpu="H200", tp=4, placement="host", host_layout="per_rank")
    assert q["dev_shm"]["needed_bytes"] == 0
    assert q["host_link"]["decode_step_bytes"] * 4 == pytest.approx(p["host_link"]["decode_step_bytes"], abs=4)


def test_numa_copies_count_against_each_nodes_dram():
    total = plan(model=DSV41, gpu="H200", tp=4)["tables"]["total_bytes"]
    half = -(-total // 2)

    def numa(**kw):
        p = plan(model=DSV41, gpu="H200", tp=4, placement="host", **kw)
        n = p["numa"]
        return (n["copies"], n["per_node_bytes"], n["total_bytes"], p["host_dram_per_node"]["shared_bytes"],
                p["dev_shm"]["needed_bytes"]), n, p

    assert numa()[0] == (2, total, 2 * total, 2 * total, 2 * total)  # auto: a copy on each of 2 nodes of 1 TiB
    got, n, p = numa(numa_dram_gib=100)  # a node cannot hold a copy: auto interleaves one copy
    assert got == (1, half, total, total, total) and "interleaved" in n["layout"] and p["warnings"] == []
    assert numa(host_numa="interleave")[0] == (1, half, total, total, total)
    assert numa(host_numa="1")[0] == (1, total, total, total, total)
    assert numa(host_numa="off")[0][0] == 1 and numa(numa_nodes=1)[0][0] == 1
    assert numa(numa_nodes=4, numa_dram_gib=512)[0][0] == 4
    got, n, p = numa(host_numa="1", numa_dram_gib=100)  # the operator's node cannot hold it: said
    assert any("188.83 GiB on a NUMA node (bound to node 1), more than its 100.00 GiB" in w for w in p["warnings"])
    # Private shards (per-rank layout) go to each rank's node: half of all shards per node.
    got, n, p = numa(host_layout="per_rank")
    assert got[:3] == (1, -(-p["host_dram_per_node"]["per_rank_bytes"] // 2), p["host_dram_per_node"]["per_rank_bytes"])
    assert p["dev_shm"]["needed_bytes"] == 0
    text = format_text(numa()[2])
    assert re.search(r"per NUMA node \(2 nodes\) +188\.83 GiB of 1024\.00 GiB +--engram-host-numa auto: one copy per "
                     r"node, 2 x 188\.83 GiB", text), text
    assert "NUMA: 2 nodes of 1024 GiB each (configs/gpus.json: NVIDIA DGX H200 datasheet" in text
    assert "NUMA: 2 nodes of 300 GiB each (--numa-nodes/--numa-dram-gib)" in format_text(numa(numa_dram_gib=300)[2])


@pytest.mark.parametrize("kw, message", [
    (dict(host_numa="2"), "--host-numa must be auto, interleave, off or a node number below the 2 NUMA nodes, got '2'"),
    (dict(host_numa="near"), "--host-numa must be auto, interleave, off or a node number"),
    (dict(numa_nodes=0), "--numa-nodes must be a whole number from 1 to 1024, got 0"),
    (dict(numa_dram_gib=float("nan")), "--numa-dram-gib must be a number from 0 to 1048576, got nan"),
])
def test_bad_numa_inputs_are_one_line(kw, message):
    with pytest.raises(PlannerError) as e:
        plan(model=DSV41, gpu="H200", tp=4, **kw)
    assert message in one_line(e.value)


def test_numa_flags_on_the_command_line(capsys):
    assert main(["--model", DSV41, "--gpu", "GB200", "--tp", "4", "--host-numa", "interleave", "--json"]) == 0
    n = json.loads(capsys.readouterr().out)["numa"]
    assert (n["nodes"], n["dram_per_node_bytes"], n["copies"], n["mode"]) == (2, 480 * GIB, 1, "interleave")
    assert main(["--model", DSV41, "--gpu", "H200", "--numa-nodes", "4", "--numa-dram-gib", "256", "--tp", "4"]) == 0
    assert "per NUMA node (4 nodes)" in capsys.readouterr().out
    assert main(["--model", DSV41, "--gpu", "H200", "--host-numa", "9"]) == 2
    assert "--host-numa must be" in capsys.readouterr().err


def test_host_dram_warning():
    p = plan(model=DSV41, gpu="H200", tp=4, placement="host", host_dram_gib=128)
    assert any("more than the 128 GiB given" in w for w in p["warnings"])


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg
    return msg


def test_unknown_sku_is_one_clear_line():
    with pytest.raises(PlannerError) as e:
        plan(model=DSV41, gpu="A100")
    msg = one_line(e.value)
    assert "unknown GPU SKU 'A100'" in msg and "MI355X" in msg


@pytest.mark.parametrize("tp, want", [
    (3, "--tp 3 does not divide DeepSeek-V4.1-Flash's 64 attention heads; valid TP sizes: 1, 2, 4, 8, 16, 32, 64"),
    (128, "--tp 128 does not divide"),
    (0, "--tp must be a whole number >= 1"),
])
def test_bad_tp_is_one_clear_line(tp, want):
    with pytest.raises(PlannerError) as e:
        plan(model=DSV41, gpu="H200", tp=tp)
    assert want in one_line(e.value)


@pytest.mark.parametrize("kwargs, want", [
    (dict(placement="ssd"), "--placement must be one of device, host, disk"),
    (dict(host_layout="numa"), "--host-layout must be one of shared, per_rank"),
    (dict(hot_cache_gib=-1), "--hot-cache-gib must be a number from 0 to 1048576, got -1"),
    (dict(kv_bytes_per_token=0), "--kv-bytes-per-token must be a number from 1 to 1073741824, got 0"),
    # inf, NaN and absurd sizes: one line, never an OverflowError from int(inf).
    (dict(hot_cache_gib=float("inf")), "--hot-cache-gib must be a number from 0 to 1048576, got inf"),
    (dict(hot_cache_gib=float("nan")), "--hot-cache-gib must be a number from 0 to 1048576, got nan"),
    (dict(weights_gib=1e300), "--weights-gib must be a number from 0 to 1048576, got 1e+300"),
    (dict(reserve_gib=float("inf")), "--reserve-gib must be a number from 0 to 1048576, got inf"),
    (dict(host_dram_gib=float("-inf")), "--host-dram-gib must be a number from 0 to 1048576, got -inf"),
    (dict(kv_bytes_per_token=1e-300), "--kv-bytes-per-token must be a number from 1 to 1073741824, got 1e-300"),
    (dict(kv_bytes_per_token=float("inf")), "--kv-bytes-per-token must be a number from 1 to 1073741824, got inf"),
    (dict(tp=10**12), "--tp must be at most 1024, got 1000000000000"),
    (dict(min_kv_tokens=10**400), "--min-kv-tokens must be at most 1099511627776 (2^40)"),
    (dict(model="no-such-model"), "unknown preset 'no-such-model'"),
])
def test_other_bad_input_is_one_clear_line(kwargs, want):
    with pytest.raises(Exception) as e:
        plan(**{"model": DSV41, "gpu": "H200", **kwargs})
    assert want in one_line(e.value)


def test_cli_error_exit_code_and_one_stderr_line(capsys):
    assert main(["--model", DSV41, "--gpu", "h300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("engram-sglang plan: error: unknown GPU SKU 'h300'")


def test_cli_json_round_trip():
    """The module entry point in a fresh process prints JSON that equals plan()'s dict."""
    out = subprocess.run(
        [sys.executable, "-m", "engram_sglang.tools.planner", "--model", DSV41, "--gpu", "b300",
         "--tp", "2", "--placement", "host", "--json"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    got = json.loads(out)
    want = json.loads(json.dumps(plan(model=DSV41, gpu="B300", tp=2, placement="host")))
    assert got == want
    # At TP2 the tables' 94 GiB per GPU and SGLang's fixed sliding-window pool leave no KV room on B300.
    assert got["smallest_tp"] == {"device": 4, "host": 2, "disk": 2}


def test_add_parser_wires_into_a_cli(capsys):
    """What engram_sglang/tools/cli.py does with it: `engram-sglang plan ...`."""
    parser = argparse.ArgumentParser(prog="engram-sglang")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["plan", "--model", DSV41, "--gpu", "MI300X", "--json"])
    assert args.func(args) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["tp"], p["placement"], p["gpu"]["arch"]) == (2, "host", "gfx942")
    args = parser.parse_args(["plan", "--model", DSV41, "--gpu", "MI300X", "--placement", "device"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert re.search(r"smallest TP that fits\s+4\s+2\s+2", text)


def test_generic_config_without_facts_file(tmp_path):
    """A model dir whose config.json has standard attention fields: KV bytes and heads come
    from it; weights come from --weights-gib."""
    cfg = {
        "model_type": "qwen3_engram_test",
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_size": 2048, "max_position_embeddings": 32768,
        "engram_layer_ids": [1, 5], "engram_max_ngram_size": 3, "engram_n_heads": 4,
        "engram_head_dim": 256, "engram_vocab_size": 100000, "engram_compressed_vocab_size": 5000,
        "engram_pad_token_id": 0,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = plan(model=str(tmp_path), gpu="H100", tp=2, placement="device", weights_gib=8)
    m = p["model"]
    assert m["kv_bytes_per_token"] == 2 * 8 * 128 * 28 * 2 and not m["kv_replicated_across_tp"]
    assert m["attention_heads"] == 16 and m["context_length"] == 32768
    h = p["hbm_per_gpu"]["device"]
    assert h["kv_tokens"] == int(h["free_for_kv_bytes"] // (m["kv_bytes_per_token"] / 2))
    assert p["tables"]["total_bytes"] == sum(m["rows_per_layer"]) * 264
    with pytest.raises(PlannerError, match="does not divide .* 16 attention heads"):
        plan(model=str(tmp_path), gpu="H100", tp=3)
    # Without the weight size the planner cannot pick a TP, and says which flag it needs.
    with pytest.raises(PlannerError, match="pass --tp"):
        plan(model=str(tmp_path), gpu="H100")


def test_gpus_file():
    gpus = load_gpus()
    assert set(g.key for g in gpus.values()) == set(SKUS)
    labels = [g.runner_label for g in gpus.values()]
    assert len(set(labels)) == len(labels)
    for g in gpus.values():
        assert 64 * GIB < g.hbm_bytes < 512 * GIB, g
        assert g.host_link_gbps > 0 and g.gpus_per_node in (4, 8)
        assert g.numa_nodes == 2 and 256 * GIB <= g.dram_per_numa_node_bytes <= 4096 * GIB and g.dram_source, g
        if g.vendor == "nvidia":
            assert re.fullmatch(r"sm_\d{2,3}", g.arch), g
        else:
            assert g.vendor == "amd" and g.arch in ("gfx942", "gfx950"), g
    assert {p for p in PLACEMENTS} == {"device", "host", "disk"}


def test_kv_override_is_per_rank():
    p = plan(model=DSV41, gpu="H200", tp=4, kv_bytes_per_token=27000)
    h = p["hbm_per_gpu"]["host"]
    assert h["kv_tokens"] == int(h["free_for_kv_bytes"] // 27000)
    assert p["model"]["sources"]["kv_bytes_per_token"] == "--kv-bytes-per-token (per rank)"


@pytest.mark.parametrize("fields, want", [
    # Absurd Engram counts are refused before any prime search (this once computed for minutes).
    ({"engram_n_heads": 10**6}, "engram_n_heads must be an integer >= 1 (and <= 64), got 1000000"),
    ({"engram_max_ngram_size": 10**5}, "engram_max_ngram_size must be an integer >= 2 (and <= 8)"),
    ({"engram_layer_ids": list(range(5000))}, "engram_layer_ids must be at most 64 layers"),
    ({"engram_layer_ids": list(range(60)), "engram_n_heads": 8}, "= 1440 hash columns; at most 512 are supported"),
    ({"engram_vocab_size": 10**15}, "engram_vocab_size must be an integer >= 2 (and <= 2^32)"),
    # Model facts of the config: negative, fractional or absurd head counts and contexts.
    ({"num_attention_heads": 10**15}, "num_attention_heads) must be a whole number from 1 to 65536, got 10"),
    ({"num_attention_heads": -4}, "num_attention_heads) must be a whole number from 1 to 65536, got -4"),
    ({"num_attention_heads": 0}, "got 0"),
    ({"num_attention_heads": 1.5}, "got 1.5"),
    ({"max_position_embeddings": 1e300}, "max_position_embeddings (context_length) must be a whole number"),
    ({"max_position_embeddings": -5}, "got -5"),
])
def test_hostile_model_configs_are_refused_up_front(tmp_path, fields, want):
    import time

    base = json.loads((Path(configs_dir()) / f"{DSV41}.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **fields}))
    t0 = time.perf_counter()
    with pytest.raises(EngramError) as e:
        plan(model=str(path), gpu="H200")
    assert want in one_line(e.value) and str(path) in str(e.value)
    assert time.perf_counter() - t0 < 5


def test_attention_fields_out_of_bounds_are_one_line(tmp_path):
    """A config.json without a facts file: its attention fields give the KV size, checked."""
    base = json.loads((Path(configs_dir()) / f"{DSV41}.json").read_text())
    fields = {**base, "model_type": "no_facts_here", "num_hidden_layers": 10**30, "num_attention_heads": 8,
              "hidden_size": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(EngramError, match=r"config.json: num_hidden_layers must be a whole number from 1 to 65536"):
        plan(model=str(path), gpu="H200", tp=1)
    path.write_text(json.dumps({**fields, "num_hidden_layers": 4, "num_key_value_heads": -1}))
    with pytest.raises(EngramError, match=r"num_key_value_heads must be a whole number from 1 to 65536, got -1"):
        plan(model=str(path), gpu="H200", tp=1)
    path.write_text(json.dumps({**fields, "num_hidden_layers": 4, "model_type": "../../etc/x"}))
    plan(model=str(path), gpu="H200", tp=1, weights_gib=10)  # no facts file outside configs/models


def test_whole_rows_or_shard_per_sku_from_the_bytes():
    """Host placement, shared copy: whole rows remove the all-reduce (2(TP-1)/TP of the bf16 rows
    per GPU) and add (1 - 1/TP) of the tokens' row lines to each GPU's host link; the planner
    picks the smaller time: over NVLink-C2C (GB200) whole rows, over PCIe (H100) the shard."""
    from engram_sglang.core.planning import whole_rows

    picks = {}
    for gpu in ("H100", "GB200"):
        p = plan(model="deepseek-v4.1-flash", gpu=gpu, tp=8, placement="host", nnodes=2)
        r = p["rows_per_rank"]
        decode = r["phases"]["decode"]
        tokens, cols = decode["tokens"], 24 * 2  # 2 Engram layers x 24 hash columns
        assert decode["allreduce_payload_bytes"] == tokens * cols * 256 * 2
        assert decode["collective_bytes_removed"] == int(2 * 7 / 8 * decode["allreduce_payload_bytes"])
        lines = p["host_link"]["lines_per_row"]
        assert decode["host_bytes_added"] == int(tokens * cols * lines * 64 * 7 / 8)
        assert p["host_link"]["decode_step_bytes"] == decode["host_bytes_whole"]  # the shared layout reads whole rows
        picks[gpu] = r["recommend"]
        assert r["reason"] and f"Rows per rank, recommended: {r['recommend']}" in format_text(p)
    assert picks == {"H100": "sharded", "GB200": "whole"}
    tp1 = whole_rows.compare(tokens_by_phase={"decode": 256}, layers=2, columns=24, head_dim=256, lines_per_row=5,
                             tp=1, host_gbps=64, gpu_gbps=450)
    assert tp1["recommend"] == "whole" and tp1["phases"]["decode"]["collective_bytes_removed"] == 0
    # A hot-row cache serving half the reads halves the host bytes whole rows add.
    half = whole_rows.step_bytes(tokens=256, layers=2, columns=24, head_dim=256, lines_per_row=5, tp=8, hit_rate=0.5)
    full = whole_rows.step_bytes(tokens=256, layers=2, columns=24, head_dim=256, lines_per_row=5, tp=8)
    assert half["host_bytes_added"] == full["host_bytes_added"] / 2


def test_a_hot_row_cache_hits_each_layout_at_its_own_rate_and_moves_the_pick():
    """The same HBM per GPU covers 1/TP of the table thinly with whole rows and a shard TP x as
    thickly: the planner weighs each layout at its own hit rate (no --trace: the default curve
    at the cache's share and at TP x it), which moves H200 TP 8 from sharded to whole."""
    from engram_sglang.core.planning import disk as disk_model

    picks = {}
    for gib in (0, 1):
        p = plan(model="deepseek-v4.1-flash", gpu="H200", tp=8, placement="host", hot_cache_gib=gib)
        r = p["rows_per_rank"]
        share = gib * GIB / p["tables"]["total_bytes"]
        assert r["hit_rates"] == {"whole": disk_model.default_hit_rate(share),
                                  "sharded": disk_model.default_hit_rate(8 * share)}
        d = r["phases"]["decode"]
        raw = d["tokens"] * 48 * p["host_link"]["lines_per_row"] * 64
        assert d["host_bytes_whole"] == int(raw * (1 - r["hit_rates"]["whole"]))
        assert d["host_bytes_shard"] == int(raw / 8 * (1 - r["hit_rates"]["sharded"]))
        picks[gib] = r["recommend"]
        if gib:
            assert r["hit_rates"]["sharded"] > r["hit_rates"]["whole"] > 0 and "assumption" in r["hit_rate_source"]
            assert "hot-row cache hits: whole" in format_text(p)
    assert picks == {0: "sharded", 1: "whole"}


def test_a_trace_gives_each_layouts_hit_rate_by_replay(tmp_path):
    """plan --placement host --trace: each layout's hit rate replayed through the hot-row
    cache's own directory (a shard's cache sees rank 0's ids only); on a skewed trace the
    shard's cache hits more; without a cache, no hits either way."""
    model, cfg = small_model(tmp_path)
    path = disk_plan.write_trace(tmp_path / "t.npz", cfg.fingerprint(), zipf_trace(cfg, steps=40), {"streams": 32})
    table_gib = plan(model=str(model), gpu="H200", tp=4, placement="host")["tables"]["total_bytes"] / GIB
    r = plan(model=str(model), gpu="H200", tp=4, placement="host", trace=str(path), batch=32,
             hot_cache_gib=table_gib * 0.02)["rows_per_rank"]
    assert 0 < r["hit_rates"]["whole"] < r["hit_rates"]["sharded"] <= 1, r["hit_rates"]
    assert "replay of" in r["hit_rate_source"] and "rank 0" in r["hit_rate_source"]
    none = plan(model=str(model), gpu="H200", tp=4, placement="host", trace=str(path))["rows_per_rank"]
    assert none["hit_rates"] == {"whole": 0.0, "sharded": 0.0}
    with pytest.raises(PlannerError, match="--trace also plans the host placement"):
        plan(model=str(model), gpu="H200", tp=4, placement="device", trace=str(path))


# ------------------------------------------------------------------ disk placement: when SSD pays
from engram_sglang.core.planning import disk as disk_plan
from engram_sglang.core.planning import layouts


def small_model(tmp_path) -> tuple[Path, object]:
    """A model dir of a small Engram config (two layers), and its config."""
    from engram_sglang.core.config import EngramConfig

    cfg = {"model_type": "qwen3_engram_test", "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 64,
           "hidden_size": 256, "max_position_embeddings": 4096, "engram_layer_ids": [1, 2],
           "engram_max_ngram_size": 3, "engram_n_heads": 4, "engram_head_dim": 256, "engram_vocab_size": 20000,
           "engram_compressed_vocab_size": 1000, "engram_pad_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path, EngramConfig.from_pretrained(tmp_path)


def zipf_trace(cfg, steps=60, streams=32, seed=0) -> dict:
    import numpy as np

    from engram_sglang.core.hashing import EngramLayout

    rng = np.random.default_rng(seed)
    rows = EngramLayout(cfg).num_embeddings
    return {L: (rng.zipf(1.3, (steps, streams, cfg.hash_columns)) * 7919 % r).astype(np.int64)
            for L, r in zip(cfg.layer_ids, rows)}


def test_disk_prediction_arithmetic_on_the_default_curve():
    """No trace: misses = batch x 24 x distinct share x (1 - hit(cache share)) per layer; the
    read = latency + misses / IOPS; prefetch hides the lead, staged graphs hide nothing."""
    p = plan(model=DSV41, gpu="H200", tp=4, placement="disk", disk_iops=200_000, disk_latency_ms=0.2, lead_ms=0.5,
             dram_cache_gib=4, batch=64)
    d = p["disk"]
    from engram_sglang.core.stores.base import split_by_rows
    from engram_sglang.core.stores.dram_cache import plan_slots

    per = split_by_rows(4 * GIB * 4, dict(zip((1, 14), ROWS)))  # 4 ranks' caches together: the whole table's
    misses = sum(64 * 24 * 0.96 * (1 - disk_plan.default_hit_rate(plan_slots(per[L], 8) / r)) for L, r in zip((1, 14), ROWS))
    read = 0.2 + 1e3 * misses / 200_000
    assert d["step"]["misses_per_step"] == pytest.approx(misses, rel=1e-12)
    assert d["step"]["read_ms"] == pytest.approx(read, rel=1e-12)
    assert d["step"]["exposed_ms_prefetch"] == pytest.approx(read - 0.5, rel=1e-12)
    assert d["step"]["exposed_ms_staged_graphs"] == pytest.approx(read, rel=1e-12)
    assert d["step"]["curve"] == "default (assumption)" and "assumption" in d["curve_source"]
    # The curve's own points, and 0 with no cache.
    assert disk_plan.default_hit_rate(0) == 0 and disk_plan.default_hit_rate(0.01) == pytest.approx(0.423)
    assert disk_plan.default_hit_rate(1.0) == disk_plan.default_hit_rate(2.0) == 1.0
    assert disk_plan.default_hit_rate(0.0005) == pytest.approx(0.227 / 2)
    rates = [disk_plan.default_hit_rate(x) for x in (0.0001, 0.001, 0.003, 0.01, 0.05, 0.1, 0.3, 1)]
    assert rates == sorted(rates)
    # A lead longer than the reads hides them all.
    q = plan(model=DSV41, gpu="H200", tp=4, placement="disk", disk_iops=1e9, disk_latency_ms=0, lead_ms=0.5, batch=1)
    assert q["disk"]["step"]["exposed_ms_prefetch"] == 0.0
    # Savings: vs device the shard's HBM (KV tokens), vs host the host copies less the DRAM caches.
    assert d["vs_device"]["hbm_freed_bytes_per_gpu"] == p["hbm_per_gpu"]["disk"]["hbm_freed_bytes"] > 40 * GIB
    h = d["vs_host"]
    assert h["disk_dram_cache_bytes_per_node"] == 8 * 4 * GIB
    # Against the host placement's least DRAM: one shared copy (H200's two NUMA nodes would hold two with auto).
    assert p["host_dram_per_node"]["shared_bytes"] == 2 * p["tables"]["total_bytes"]
    assert h["dram_saved_bytes_per_node"] == p["tables"]["total_bytes"] - 8 * 4 * GIB
    assert d["vs_device"]["smallest_tp"] == {"device": p["smallest_tp"]["device"], "disk": p["smallest_tp"]["disk"]}
    assert d["lead_source"].startswith("--lead-ms") and d["iops_source"] == "--disk-iops"
    text = format_text(p)
    assert "Disk placement: decode step of batch 64" in text and "exposed, staged CUDA graphs" in text
    # DeepSeek-V4.1 keeps decode graphs from disk only staged (--engram-disk-graphs on): said as opt-in.
    assert p["decode_graphs"]["disk"]["kept"] == "opt-in" and p["decode_graphs"]["device"]["kept"] == "yes"
    assert "decode CUDA graphs" in text and "--engram-disk-graphs on and --disable-overlap-schedule" in text
    assert re.search(r"decode CUDA graphs kept\s+yes\s+yes\s+opt-in\n", text)
    assert f"{read - 0.5:.2f} ms" in text
    # Defaults are labelled: the lead from the model's facts, the latency an assumption.
    r = plan(model=DSV41, gpu="H200", tp=4, placement="disk", disk_iops=200_000)["disk"]
    assert r["lead_ms"] == 0.5 and "assumption" in r["lead_source"] and "assumption" in r["latency_source"]


def test_a_disk_plan_without_iops_uses_the_labelled_nvme_assumption(capsys):
    """`plan --placement disk` with neither --disk-iops nor --measure-disk plans the decode
    step's reads at the assumed NVMe (as `--rank` does), labelled as an assumption."""
    assert main(["--model", DSV41, "--gpu", "H200", "--tp", "4", "--placement", "disk", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["disk"]
    assert d["iops"] == layouts.DEFAULT_DISK["disk_iops"] and d["iops_source"].startswith("assumption")
    assert main(["--model", DSV41, "--gpu", "H200", "--tp", "4", "--placement", "disk", "--disk-iops", "200000",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["disk"]
    assert d["iops"] == 200_000 and d["iops_source"] == "--disk-iops"
    assert main(["--model", DSV41, "--gpu", "H200", "--tp", "4", "--placement", "device", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disk"] is None  # no disk section for other placements


def test_read_time_of_known_misses():
    assert disk_plan.read_time_ms(0, 1000, 5) == 0
    assert disk_plan.read_time_ms(500, 100_000, 0.25) == pytest.approx(5.25)


def test_trace_replay_exact_on_known_traces(tmp_path):
    """Every step reads the same rows: after the first step every fetch hits a cache that
    holds them; every step reads new rows: every fetch misses, whatever the cache."""
    import numpy as np

    same = np.tile(np.arange(24, dtype=np.int64) * 101, (10, 4, 1))  # [steps, streams, 24]
    r = disk_plan.replay(same, 100_000, 4, dram_bytes=1 << 20, warm_steps=1)
    assert (r["fetches_per_step"], r["misses_per_step"], r["hit_rate"]) == (24, 0, 1.0)
    new = np.arange(10 * 4 * 24, dtype=np.int64).reshape(10, 4, 24)
    r = disk_plan.replay(new, 100_000, 4, dram_bytes=1 << 20, hot_bytes=1 << 20)
    assert (r["fetches_per_step"], r["misses_per_step"], r["steps"], r["warm_steps"]) == (96, 96, 5, 5)
    assert disk_plan.replay(new, 100_000, 2, dram_bytes=0)["misses_per_step"] == 48  # the first 2 streams


def test_trace_replay_curve_is_monotone_in_cache_size(tmp_path):
    model, cfg = small_model(tmp_path)
    trace = zipf_trace(cfg)
    from engram_sglang.core.hashing import EngramLayout

    rows = EngramLayout(cfg).num_embeddings
    sizes = [0, 0.0005, 0.002, 0.01, 0.05, 0.2]
    c = disk_plan.curve(cfg.layer_ids, rows, cfg.hash_columns, 32, sizes, 0, trace)
    misses = [x["misses_per_step"] for x in c]
    assert all(a >= b for a, b in zip(misses, misses[1:])), misses
    assert misses[0] > misses[-1] and c[0]["hit_rate"] == 0
    # A hot-row cache in front takes its share too (at a DRAM cache small enough to leave it some:
    # from 0.2% of the rows the DRAM cache alone misses only the trace's first reads).
    with_hot = disk_plan.curve(cfg.layer_ids, rows, cfg.hash_columns, 32, [0.0005], 1 << 20, trace)
    assert with_hot[0]["misses_per_step"] < misses[1]


def test_plan_replays_a_trace_file(tmp_path):
    """plan --trace: the replayed misses of the model's own trace, at the rank's caches x TP."""
    model, cfg = small_model(tmp_path)
    trace = zipf_trace(cfg)
    path = disk_plan.write_trace(tmp_path / "t.npz", cfg.fingerprint(), trace, {"streams": 32})
    back, meta = disk_plan.read_trace(path, cfg.fingerprint())
    assert all((back[L] == trace[L]).all() for L in trace) and meta["streams"] == 32
    p = plan(model=str(model), gpu="H100", tp=2, placement="disk", weights_gib=1, disk_iops=50_000,
             disk_latency_ms=0.1, lead_ms=0.05, dram_cache_gib=0.001, trace=str(path), batch=16, warm_steps=20)
    d = p["disk"]
    from engram_sglang.core.hashing import EngramLayout

    want = disk_plan.predict(layers=cfg.layer_ids, rows=EngramLayout(cfg).num_embeddings, columns=cfg.hash_columns,
                             batch=16, iops=50_000, latency_ms=0.1, lead_ms=0.05, dram_bytes=2 * round(0.001 * GIB),
                             trace=trace, warm_steps=20)
    assert d["step"] == want and want["per_layer"]["1"]["steps"] == 40
    # The sweep over DRAM cache sizes holds the chosen size's step, and never reads more with more cache.
    sweep = d["by_dram_cache"]
    assert [c["dram_cache_gib"] for c in sweep] == [0, 0.00025, 0.0005, 0.001, 0.002, 0.004]
    assert sweep[3]["misses_per_step"] == want["misses_per_step"]
    assert sweep[3]["exposed_ms_prefetch"] == pytest.approx(want["exposed_ms_prefetch"])
    assert all(a["misses_per_step"] >= b["misses_per_step"] for a, b in zip(sweep, sweep[1:]))
    assert d["step"]["curve"] == "trace replay" and "RowDirectory" in d["curve_source"]
    assert want["read_ms"] == pytest.approx(0.1 + 1e3 * want["misses_per_step"] / 50_000)


def test_bad_disk_inputs_are_one_line(tmp_path, capsys):
    model, cfg = small_model(tmp_path)
    path = disk_plan.write_trace(tmp_path / "t.npz", "0" * 16, zipf_trace(cfg), {})
    base = dict(model=DSV41, gpu="H200", tp=4, placement="disk", disk_iops=1000)
    for kwargs, want in [
        (dict(disk_iops=0), "--disk-iops must be a number from 1 to"),
        (dict(disk_iops=float("nan")), "--disk-iops must be a number"),
        (dict(batch=0), "--batch must be a whole number from 1 to 65536, got 0"),
        (dict(lead_ms=-1), "--lead-ms must be a number from 0"),
        (dict(disk_latency_ms=float("inf")), "--disk-latency-ms must be a number"),
        (dict(dram_cache_gib=-2), "--dram-cache-gib must be a number from 0"),
        (dict(placement="host"), "--disk-iops, --measure-disk, --trace, --dram-cache-gib and --step-ms plan the disk"),
        (dict(placement="host", disk_iops=None, step_ms=30), "plan the disk placement; got --placement host"),
        (dict(step_ms=0), "--step-ms must be a number from"),
        (dict(placement="device", disk_iops=None, dram_cache_gib=1), "plan the disk placement; got --placement device"),
        (dict(trace=str(tmp_path / "none.npz")), "no such trace file"),
        (dict(trace=str(path)), "its row ids mean other n-grams"),
        (dict(measure_disk=str(tmp_path)), "--measure-disk"),
    ]:
        with pytest.raises(PlannerError) as e:
            plan(**{**base, **kwargs})
        assert want in one_line(e.value), (kwargs, str(e.value))
    good = disk_plan.write_trace(tmp_path / "g.npz", cfg.fingerprint(), zipf_trace(cfg, streams=8), {})
    with pytest.raises(PlannerError, match="--batch 16 is more than the trace's 8 streams"):
        plan(model=str(model), gpu="H100", tp=1, placement="disk", disk_iops=1000, trace=str(good), batch=16)
    with pytest.raises(PlannerError, match="--warm-steps must be a whole number from 0 to 59"):
        plan(model=str(model), gpu="H100", tp=1, placement="disk", disk_iops=1000, trace=str(good), batch=8,
             warm_steps=60)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(PlannerError, match="not an engram trace"):
        disk_plan.read_trace(tmp_path / "junk.npz")
    assert main(["--model", DSV41, "--gpu", "H200", "--placement", "disk", "--disk-iops", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--disk-iops must be a number" in err


def test_measure_disk_without_fio_uses_the_projects_reads(tmp_path, monkeypatch):
    """fio absent: the project's own O_DIRECT row reads measure IOPS and latency, and say so."""
    f = tmp_path / "disk.bin"
    f.write_bytes(bytes(4 << 20))
    monkeypatch.setattr(disk_plan.shutil, "which", lambda name: None)
    m = disk_plan.measure_disk(f, seconds=0.3, depth=8)
    assert m["iops"] > 0 and m["latency_ms"] > 0 and "fio not installed" in m["tool"]


@pytest.mark.skipif(disk_plan.shutil.which("fio") is None, reason="fio is not installed")
def test_measure_disk_with_fio(tmp_path):
    f = tmp_path / "disk.bin"
    f.write_bytes(bytes(4 << 20))
    m = disk_plan.measure_disk(f, seconds=0.3, depth=8)
    assert m["iops"] > 0 and 0 < m["latency_ms"] < 1000 and m["tool"].startswith("fio libaio 4k O_DIRECT qd8")


def test_tp_above_the_nodes_gpus_is_refused_in_one_line():
    with pytest.raises(EngramError) as e:
        plan(model="deepseek-v4.1-flash", gpu="H200", tp=16, placement="host")
    assert "\n" not in str(e.value) and "--tp 16" in str(e.value) and "(8)" in str(e.value)
    assert plan(model="deepseek-v4.1-flash", gpu="H200", tp=16, placement="host", nnodes=2)["tp"] == 16


def test_plan_prints_a_launch_line_that_sglang_parses(capsys):
    from engram_sglang.tools.planner import main

    assert main(["--model", "deepseek-v4.1-flash", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("docker run"))
    p = plan(model="deepseek-v4.1-flash", gpu="H200", placement="host")
    assert f"--shm-size={p['dev_shm']['docker_shm_size']}" in line and "-e ENGRAM_PLACEMENT=host" in line
    server_args = pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(line.split("sglang.launch_server", 1)[1].split())
    assert ns.tp_size == p["tp"] and ns.ep_size == p["tp"] and ns.chunked_prefill_size == 8192


def test_rank_lists_every_node_layout_best_first_with_its_launch_line(capsys):
    from engram_sglang.tools.planner import main

    assert main(["--model", "deepseek-v4.1-flash", "--gpu", "H200", "--rank", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["tp"], r["dp"]) for r in rows} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert all(r["tp"] * r["dp"] == 8 and r["pages"] and r["decode_graphs"] for r in rows)
    best = rows[0]
    assert best["fits"] and best["kv_tokens_per_node"] == max(r["kv_tokens_per_node"] for r in rows if r["fits"])
    # Per-rank at TP8 holds one copy of the shards; shared holds one copy per NUMA node (two on H200).
    tp8 = {r["host_layout"]: r for r in rows if r["tp"] == 8 and r["placement"] == "host"}
    assert tp8["shared"]["dram_bytes_per_node"] == pytest.approx(2 * tp8["per_rank"]["dram_bytes_per_node"], rel=1e-4)
    assert tp8["per_rank"]["dev_shm_bytes"] == 0 < tp8["shared"]["dev_shm_bytes"]
    assert f"--tp-size {best['tp']} " in best["launch"]["command"]
    assert main(["--model", "deepseek-v4.1-flash", "--gpu", "H200", "--rank"]) == 0
    assert best["launch"]["command"] in capsys.readouterr().out


def _rank(capsys, *extra):
    assert main(["--model", DSV41, "--gpu", "H200", "--rank", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_rank_narrowed_by_tp_and_placement(capsys):
    """--tp and --placement with --rank rank only that TP's or placement's layouts; a TP one
    node cannot run is one line naming the ones it can."""
    every = _rank(capsys)
    rows = _rank(capsys, "--tp", "4")
    assert rows and {r["tp"] for r in rows} == {4}
    assert [(r["placement"], r["host_layout"]) for r in rows] == [
        (r["placement"], r["host_layout"]) for r in every if r["tp"] == 4]
    rows = _rank(capsys, "--placement", "disk")
    assert rows and {r["placement"] for r in rows} == {"disk"} and {r["tp"] for r in rows} == {r["tp"] for r in every}
    assert main(["--model", DSV41, "--gpu", "H200", "--rank", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3 with --rank" in err and "1, 2, 4, 8" in err and err.count("\n") == 1


def test_rank_lists_disk_rows_fitting_only_within_the_step_budget(capsys):
    """Disk rows carry their exposed read time (eager and staged) at the stated disk and step;
    they fit only within the step budget and, at equal KV tokens, rank after host rows."""
    from engram_sglang.core.planning import disk

    rows = _rank(capsys)  # no disk given: the assumed NVMe, no DRAM cache: 2.55 ms exposed > 2 ms
    tp4 = next(r for r in rows if r["placement"] == "disk" and r["tp"] == 4)
    st = tp4["disk_step"]
    assert st["iops"] == disk.DEFAULT_IOPS and "assumption" in st["iops_source"] and "assumption" in st["step_source"]
    assert st["budget_ms"] == pytest.approx(disk.STEP_BUDGET_SHARE * disk.DEFAULT_STEP_MS)
    assert st["exposed_ms_staged"] == pytest.approx(st["read_ms"]) and st["exposed_ms"] == pytest.approx(st["read_ms"] - 0.5)
    assert st["exposed_ms"] > st["budget_ms"] and not tp4["fits"] and tp4["decode_graphs"] == "opt-in"
    assert all(r["disk_step"] is None and r["decode_graphs"] == "yes" for r in rows if r["placement"] != "disk")
    # A DRAM row cache (or a longer step) brings it within budget: it fits, after the host rows of its KV.
    rows = _rank(capsys, "--dram-cache-gib", "16", "--disk-iops", "2e6")
    tp4 = next(r for r in rows if r["placement"] == "disk" and r["tp"] == 4)
    assert tp4["fits"] and tp4["disk_step"]["iops_source"] == "--disk-iops"
    assert "ENGRAM_DISK_DRAM_CACHE_MIB=16384" in tp4["launch"]["command"]
    order = [(r["tp"], r["placement"]) for r in rows]
    assert order.index((4, "host")) < order.index((4, "disk")) and rows[0]["placement"] == "host"
    assert next(r for r in _rank(capsys, "--step-ms", "100") if r["placement"] == "disk" and r["tp"] == 4)["fits"]
    assert main(["--model", DSV41, "--gpu", "H200", "--rank"]) == 0
    out = capsys.readouterr().out
    assert "1,000,000 IOPS per replica (assumption" in out and "10% of a 20 ms decode step" in out
    assert "disk: opt-in: " in out and "--disable-overlap-schedule" in out


@pytest.mark.parametrize("argv, want", [
    (["--rank", "--step-ms", "0"], "--step-ms"),
    (["--node-settings"], "--node-settings and --shm-dir go with --rank"),
    (["--rank", "--shm-dir", "/mnt/x"], "--shm-dir needs --node-settings"),
])
def test_rank_flags_errors_are_one_line(capsys, argv, want):
    assert main(["--model", DSV41, "--gpu", "H200", *argv]) == 2
    err = capsys.readouterr().err
    assert want in err and err.count("\n") == 1


def test_help_names_the_rank_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "within 10% of it" in out
    assert all(f in out for f in ("--step-ms", "--node-settings", "--shm-dir", "--disk-iops"))


# The node's files as text (tests/core/test_thp.py's way): never this machine's settings.
def _node(huge="", fstype="tmpfs", enabled="always [madvise] never", shmem="always within_size advise [never] deny force",
          free=0, total_gib=2048):
    from engram_sglang.core.planning import node_pages

    opts = "rw,size=400g" + (f",huge={huge}" if huge else "")
    mountinfo = (f"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                 f"25 24 0:23 / /dev/shm rw,relatime shared:5 - {fstype} {fstype} {opts}\n")
    meminfo = (f"MemTotal:       {total_gib << 20} kB\nHugePages_Total:   {free}\nHugePages_Free:    {free}\n"
               f"Hugepagesize:       2048 kB\n")
    return node_pages.node_pages("/dev/shm", mountinfo, shmem, enabled, meminfo)


def test_node_pages_label_the_pages_column():
    from engram_sglang.core.planning import node_pages

    assert node_pages.label("host", "shared", None) == "4K shm"
    assert node_pages.label("host", "shared", _node()) == "4K shm (huge=never)"
    assert node_pages.label("host", "shared", _node("within_size")) == "2M shm (huge=within_size)"
    assert node_pages.label("host", "shared", _node("within_size", shmem="[deny]")) == "4K shm (deny)"
    assert node_pages.label("host", "shared", _node(fstype="hugetlbfs")) == "2M hugetlbfs"
    assert node_pages.label("host", "per_rank", _node()) == "2M anon (madvise)"
    assert node_pages.label("host", "per_rank", _node(enabled="always madvise [never]")) == "4K anon (never)"
    assert node_pages.label("disk", "shared", _node()) == "4K page cache"
    assert _node(free=1000)["hugetlb_free_bytes"] == 1000 * 2 * 2**20


def test_node_pages_recommend_a_choice_from_dram_and_tp(capsys, monkeypatch):
    from engram_sglang.core.planning import node_pages

    rows = _rank(capsys)
    table = plan(model=DSV41, gpu="H200", placement="host")["tables"]["total_bytes"]
    rec = lambda node: node_pages.recommend(node, rows, table)  # noqa: E731
    assert rec(_node("within_size")) == {"choice": "shared copy", "why": "tmpfs /dev/shm has huge=within_size", "fix": ""}
    # 4K shm, THP madvise and DRAM for per-rank copies: private copies at the best per-rank TP, no root needed.
    got = rec(_node())
    assert got["choice"] == "per-rank private copies (TP4 x DP2)" and "--engram-host-shared off" in got["fix"]
    # Free huge pages that hold both shared copies: the shared copy on a hugetlbfs mount, ahead of
    # private copies; too few: too little DRAM for per-rank copies (189 GiB at TP8) leaves the remount.
    got = rec(_node(total_gib=128, free=400 * 512))
    assert got["choice"] == "shared copy on hugetlbfs" and "mount -t hugetlbfs -o pagesize=2M" in got["fix"]
    assert "--engram-shm-dir /mnt/engram-huge" in got["fix"]
    assert rec(_node(free=400 * 512))["choice"] == "shared copy on hugetlbfs"
    assert rec(_node(total_gib=128, free=100 * 512))["choice"] == "shared copy after a remount"
    # Neither: remount the shm dir with huge=within_size, thp.py's fix.
    got = rec(_node(enabled="always madvise [never]"))
    assert got["fix"].startswith("mount -o remount,huge=within_size /dev/shm")
    # On the command line: the pages column and the advice from the probed node (here fixture text).
    monkeypatch.setattr(node_pages, "probe", lambda shm_dir: _node(enabled="always madvise [never]"))
    assert main(["--model", DSV41, "--gpu", "H200", "--rank", "--node-settings"]) == 0
    out = capsys.readouterr().out
    assert "4K shm (huge=never)" in out and "4K anon (never)" in out
    assert "Pages on this node: shared copy after a remount" in out and "fix: mount -o remount,huge=within_size /dev/shm" in out
    monkeypatch.setattr(node_pages, "probe", lambda shm_dir: _node("always"))
    doc = _rank(capsys, "--node-settings")
    assert doc["recommend"]["choice"] == "shared copy" and doc["layouts"][0]["pages"] == "2M shm (huge=always)"
