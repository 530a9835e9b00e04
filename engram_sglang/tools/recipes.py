"""The launch recipes in configs/recipes/, generated from the planner's ranking of one node.

Per GPU SKU: the node's best layout (`engram-sglang plan --rank`'s first row), and beside it
the best layout that keeps the tables in HBM where one fits a node (the baseline it beats),
else the reason none does; the best host layout where the best is not one. Each recipe is the
planned layout's launch line as data (docker options, `ENGRAM_*`, SGLang flags) with one line
saying why. tests/tools/test_recipes.py regenerates them and fails when a file is stale.

    python -m engram_sglang.tools.recipes            # print what would be written
    python -m engram_sglang.tools.recipes --write    # write configs/recipes/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ..core.planning import layouts
from ..core.planning.data import GIB, load_gpus
from .planner import plan, valid_tps

MODEL = "deepseek-v4.1-flash"
COMMENT = ("DeepSeek-V4.1-Flash launch recipes for one GPU SKU, generated from the planner's ranking of one "
           "node (python -m engram_sglang.tools.recipes --write); tests/tools/test_recipes.py checks each against "
           "the planner. docker/README.md shows how to launch one.")


def recipes_dir() -> Path:
    from ..core.config import configs_dir

    return configs_dir() / "recipes"


def _name(sku: str, row: dict[str, Any]) -> str:
    layout = "-per-rank" if row["host_layout"] == "per_rank" else ""
    return f"{sku.lower()}-tp{row['tp']}-{row['placement']}{layout}"


def _recipe(sku: str, row: dict[str, Any], why: str) -> dict[str, Any]:
    launch = row["launch"]
    out = {"name": _name(sku, row), "placement": row["placement"], "tp": row["tp"]}
    if row["placement"] == "host":
        out["host_layout"] = row["host_layout"]
    out.update({
        "hot_cache_gib": row["hot_cache_gib"],
        "docker": {"shm_size": launch["shm_size"], "ulimit_memlock": "-1"},
        "env": launch["env"],
        "sglang_args": launch["sglang_args"],
        "reason": why,
    })
    return out


def _said(row: dict[str, Any]) -> str:
    dram = f"{row['dram_bytes_per_node'] / GIB:.0f} GiB of DRAM" if row["dram_bytes_per_node"] else "no host DRAM"
    return (f"TP{row['tp']} x DP{row['dp']}: {row['kv_tokens_per_node'] / 1e6:.1f} M KV tokens per node, {dram} "
            f"for the tables, decode graphs {row['decode_graphs']}")


def for_sku(sku: str) -> dict[str, Any]:
    """The recipe file of one SKU (key of configs/gpus.json)."""
    gpus = load_gpus()
    g = gpus[sku]

    def run(**kw):
        return plan(model=MODEL, gpu=sku, **kw)

    heads = run(tp=1, placement="host")["model"]["attention_heads"]
    rows = [r for r in layouts.rank(run, valid_tps(heads), g.gpus_per_node) if r["fits"]]
    if not rows:
        raise ValueError(f"{sku}: no layout of one node fits")
    best = rows[0]
    chosen = [(best, f"Best on one {g.gpus_per_node}-GPU node: {_said(best)}.")]
    device = next((r for r in rows if r["placement"] == "device"), None)
    host = next((r for r in rows if r["placement"] == "host"), None)
    doc: dict[str, Any] = {"_comment": COMMENT, "model": MODEL, "gpu": sku}
    if best["placement"] != "device":
        if device is not None:
            gain = best["kv_tokens_per_node"] / max(1, device["kv_tokens_per_node"])
            chosen.append((device, f"Tables in HBM, the baseline: {_said(device)} (the best holds {gain:.2f}x "
                                   f"its KV tokens)."))
        else:
            smallest = run(placement="host")["smallest_tp"]["device"]
            doc["no_device_recipe"] = (f"Tables in HBM need TP{smallest} on {sku} (no TP that divides one "
                                       f"{g.gpus_per_node}-GPU node leaves room for KV once SGLang's fixed "
                                       f"sliding-window pool is taken): serve them from host memory or disk instead.")
    if best["placement"] != "host" and host is not None:
        chosen.append((host, f"Tables in host memory: {_said(host)}."))
    doc["recipes"] = [_recipe(sku, row, why) for row, why in chosen]
    return doc


def generate() -> dict[str, dict[str, Any]]:
    """File name -> contents, one per SKU of configs/gpus.json."""
    return {f"{MODEL}-{sku.lower()}.json": for_sku(sku) for sku in load_gpus()}


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engram_sglang.tools.recipes", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="write configs/recipes/*.json")
    args = p.parse_args(argv)
    for name, doc in generate().items():
        if args.write:
            (recipes_dir() / name).write_text(render(doc))
        for r in doc["recipes"]:
            print(f"{name}: {r['name']}: {r['reason']}")
        if "no_device_recipe" in doc:
            print(f"{name}: {doc['no_device_recipe']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
