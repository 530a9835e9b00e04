"""DeepSeek-V4.1-Flash's KV figures in configs/models/deepseek_v41.json are what SGLang's own
DSV4PoolConfigurator computes (tools/kv_facts.py); the planner takes the fixed pool out before
counting KV tokens and says when another engine's figure is far from its own."""

import json

import pytest

from engram_sglang.core.planning.data import GIB
from engram_sglang.tools import kv_facts
from engram_sglang.tools.planner import format_text, plan

DSV41 = "deepseek-v4.1-flash"


@pytest.fixture(scope="module")
def figures():
    pytest.importorskip("sglang")
    return kv_facts.compute()


def test_recorded_figures_are_sglangs_own(figures):
    facts = json.loads(kv_facts.model_facts_path().read_text())
    want = kv_facts.record(kv_facts.model_facts_path(), figures)
    stale = {k for k in want if facts.get(k) != want[k]}
    assert not stale, f"{sorted(stale)} stale: run python -m engram_sglang.tools.kv_facts --write"
    # SGLang 0.5.23's numbers for the recorded config, by hand: 21 ratio-4 layers at
    # 584/4 + 4 B of page padding/4 ... come to 179.25 B each, 20 ratio-128 layers 864/128 B each.
    assert figures["bytes_per_full_token"] == pytest.approx(21 * 179.25 + 20 * 864 / 128)
    assert figures["kv_latent_slot_bytes"] == 448 + 2 * 64 + 8  # FlashMLA's latent slot
    assert figures["swa_fixed_bytes"] == figures["swa_cap_tokens"] * figures["bytes_per_swa_token"]


def test_figures_follow_the_config(figures):
    # One more ratio-4 layer in place of a ratio-128 one costs the difference, per token.
    text = dict(kv_facts.TEXT_CONFIG, compress_ratios=[0, 0, 4, 4] + kv_facts.TEXT_CONFIG["compress_ratios"][4:])
    other = kv_facts.compute(text)
    assert other["bytes_per_full_token"] - figures["bytes_per_full_token"] == pytest.approx(179.25 - 864 / 128)
    # A ratio given on the command line turns the sliding-window pool per token: no fixed pool.
    ratio = kv_facts.compute(argv=("--skip-tokenizer-init", "--swa-full-tokens-ratio", "0.5"))
    assert ratio["swa_cap_tokens"] is None and ratio["swa_fixed_bytes"] == 0
    assert ratio["bytes_per_full_token"] == pytest.approx(figures["bytes_per_full_token"] + 0.5 * figures["bytes_per_swa_token"])


def test_planner_takes_the_fixed_pool_before_kv_tokens():
    facts = json.loads(kv_facts.model_facts_path().read_text())
    fixed, per_token = facts["kv_fixed_bytes_per_rank"], facts["kv_bytes_per_token"]
    p = plan(model=DSV41, gpu="H200", tp=4, placement="host")
    h = p["hbm_per_gpu"]["host"]
    assert h["kv_fixed_bytes"] == round(fixed)
    assert h["free_for_kv_bytes"] == (h["hbm_bytes"] - h["weights_bytes"] - h["tables_bytes"] - h["hot_cache_bytes"]
                                      - h["reserve_bytes"] - round(fixed))
    assert h["kv_tokens"] == int(h["free_for_kv_bytes"] // per_token)
    text = format_text(p)
    assert f"KV pools of fixed size {fixed / GIB:.2f} GiB per rank" in text
    assert "another engine's figure differs 6.9x (26987 B per token: vLLM PR 57491" in text
    # The operator's own figure replaces the comparison (it is their server's).
    assert "another engine" not in format_text(plan(model=DSV41, gpu="H200", tp=4, kv_bytes_per_token=27000))
