"""The launch recipes in configs/recipes/ agree with the planner, the SKU data and SGLang's flags."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from engram_sglang.serving.settings import KNOBS, ServeSettings
from engram_sglang.tools.planner import GIB, PLACEMENTS, load_gpus, plan, valid_tps

RECIPE_DIR = Path(__file__).resolve().parents[2] / "configs" / "recipes"
FILES = sorted(RECIPE_DIR.glob("*.json"))
RECIPES = [(f, r) for f in FILES for r in json.loads(f.read_text())["recipes"]]


def ids(items):
    return [r["name"] for _, r in items]


def test_every_sku_has_a_host_recipe_and_a_device_one_where_a_node_fits_it():
    by_gpu = {}
    for f in FILES:
        doc = json.loads(f.read_text())
        assert doc["model"] == "deepseek-v4.1-flash"
        assert f.name == f"{doc['model']}-{doc['gpu'].lower()}.json"
        by_gpu[doc["gpu"]] = {r["placement"] for r in doc["recipes"]}
        if "device" not in by_gpu[doc["gpu"]]:
            # Only where the tables in HBM need more GPUs than one node has, and the file says so.
            p = plan(model=doc["model"], gpu=doc["gpu"], placement="host")
            smallest = p["smallest_tp"]["device"]
            assert smallest is None or smallest > load_gpus()[doc["gpu"]].gpus_per_node, (doc["gpu"], smallest)
            assert doc.get("no_device_recipe"), f.name
    assert set(by_gpu) == {g.key for g in load_gpus().values()}
    for gpu, placements in by_gpu.items():
        assert "host" in placements, gpu
    names = [r["name"] for _, r in RECIPES]
    assert len(set(names)) == len(names)


def test_recipes_are_what_the_planner_generates():
    """configs/recipes/ is the planner's ranking of one node per SKU (tools/recipes.py): a
    changed planner figure, SKU or launch line changes them, and a stale file fails here."""
    from engram_sglang.tools import recipes

    want = recipes.generate()
    assert sorted(want) == sorted(f.name for f in FILES)
    for f in FILES:
        assert f.read_text() == recipes.render(want[f.name]), f"{f.name} is stale: python -m engram_sglang.tools.recipes --write"
        best = json.loads(f.read_text())["recipes"][0]
        assert best["reason"].startswith("Best on one")


@pytest.mark.parametrize("path, recipe", RECIPES, ids=ids(RECIPES))
def test_recipe_fits_the_plan(path, recipe):
    gpu = json.loads(path.read_text())["gpu"]
    assert recipe["placement"] in PLACEMENTS
    layout = recipe.get("host_layout", "shared")
    p = plan(model="deepseek-v4.1-flash", gpu=gpu, tp=recipe["tp"], placement=recipe["placement"],
             host_layout=layout, hot_cache_gib=recipe["hot_cache_gib"])
    # The TP is one the attention accepts and at least the smallest that fits this placement.
    assert recipe["tp"] in valid_tps(p["model"]["attention_heads"])
    assert recipe["tp"] >= p["smallest_tp"][recipe["placement"]], p["smallest_tp"]
    assert p["hbm_per_gpu"][recipe["placement"]]["fits"] and not p["warnings"]
    # Docker's /dev/shm holds the shared host table (its default 64 MiB would not).
    shm = recipe["docker"]["shm_size"]
    assert re.fullmatch(r"\d+g", shm)
    assert int(shm[:-1]) * GIB >= p["dev_shm"]["needed_bytes"]
    assert shm == p["dev_shm"]["docker_shm_size"]
    # The plugin reads the recipe's variables as the recipe means them.
    env = recipe["env"]
    known = {k.env for k in KNOBS}
    assert set(env) <= known, set(env) - known
    settings = ServeSettings.from_env(env)
    assert settings.placement == recipe["placement"]
    if recipe["placement"] == "host":
        assert settings.host_shared == (layout == "shared")
    assert settings.cache_mib == int(recipe["hot_cache_gib"] * 1024)
    settings.store_options()  # raises for a cache the placement cannot have
    if recipe["placement"] == "host" and layout == "shared":
        # --engram-host-whole-rows auto on the recipe's GPU serves the layout the plan recommends.
        import torch

        from engram_sglang.core.config import EngramConfig
        from engram_sglang.serving.whole_rows_auto import resolve

        sku = load_gpus()[gpu]
        served = resolve(settings, EngramConfig.from_preset("deepseek-v4.1-flash"), recipe["tp"], torch.device("cpu"),
                         device_name=sku.name).host_whole_rows
        assert served == (p["rows_per_rank"]["recommend"] in ("whole", None)), (served, p["rows_per_rank"]["reason"])
    # One-line reason a reader can act on.
    assert recipe["reason"] and "\n" not in recipe["reason"] and len(recipe["reason"]) < 240


def test_recipe_flags_parse_in_sglang():
    """Every recipe's SGLang flags exist in the pinned SGLang and carry the recipe's TP."""
    server_args = pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed")
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    for _, r in RECIPES:
        ns = parser.parse_args(["--model-path", "deepseek-ai/DeepSeek-V4.1-Flash", *r["sglang_args"]])
        assert ns.tp_size == r["tp"] and ns.ep_size == r["tp"], r["name"]
        assert ns.chunked_prefill_size == 8192  # the planner's runtime reserve assumes it
