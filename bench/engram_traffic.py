"""Where Engram's bytes cross the network, beside the KV cache's: PD disaggregation, multi-node
tensor parallelism and attention data parallelism, at a decode step of 256 tokens and a
prefill chunk of 8192, for DeepSeek-V4.1-Flash and the demo model.

Per step and setup it counts what one rank sends for Engram (token ids, bf16 rows, the Qwen3
family's per-KV-slot conv inputs) against the KV bytes the same tokens add to the cache (what
PD's transfer moves for them), and the DRAM each node needs for the tables. The counts follow
what the code does (serving/runtime.py, serving/identity.py, the PD state component):

* PD: prefill hands decode the KV and, for a model with a short conv, the conv inputs of every
  prompt token (a state component of SGLang's own transfer); the Engram rows are never sent:
  decode reads its own tables, and its history comes from the prompt ids the request carries.
* multi-node TP: with one shared host copy per node every rank reads whole rows of its tokens
  (nothing crosses); with row shards the rows are summed by an all-reduce (a ring sends
  2 (n-1)/n of the rows per rank).
* attention DP (one node, `tokens` per rank): whole rows from the node's copy (nothing
  crosses), or shards with the ranks' ids all-gathered and the rows reduce-scattered
  (serving/row_exchange.py, as upstream's `_dp_sharded_lookup`): what the device and private
  host placements do, and the disk tier (fewer reads on the slowest rank: bench/attn_dp_rows.py).

`--measured FILE` adds the figures of a real PD run (the demo model on the CPU: the JSON
tests/e2e write with SGLang's transfer metrics) beside the counts.

    python -m bench.engram_traffic [--json F] [--png F] [--nodes 2] [--tp 16] [--dp 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import OUT, print_table, write_json
from engram_sglang.core.config import EngramConfig
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.planning.data import load_facts
from engram_sglang.core.rowformat import ROW_BYTES

SHAPES = {"decode 256": 256, "prefill 8192": 8192}
ID_BYTES = 8  # int64 hash ids, as the runtime and upstream exchange them
BF16 = 2


def model_facts(name: str, cfg: EngramConfig, kv_bytes: float, conv_state_bytes: int) -> dict:
    layout = EngramLayout(cfg)
    return {"model": name, "layers": cfg.n_layers, "columns": cfg.hash_columns, "head_dim": cfg.head_dim,
            "table_bytes": layout.table_bytes(ROW_BYTES), "kv_bytes_per_token": kv_bytes,
            "conv_state_bytes_per_token": conv_state_bytes}


def deepseek() -> dict:
    cfg = EngramConfig.from_preset("deepseek-v4.1-flash")
    return model_facts("DeepSeek-V4.1-Flash", cfg, float(load_facts(cfg).kv_bytes_per_token), 0)  # no short conv


def demo(workdir: Path) -> dict:
    from engram_sglang.tools.demo.run import demo_model

    model_dir, _ = demo_model(workdir)
    cfg = EngramConfig.from_pretrained(str(model_dir))
    raw = json.loads((model_dir / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    kv = 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * BF16  # K and V, bf16
    return model_facts("demo (Qwen3 + Engram)", cfg, float(kv), cfg.n_layers * raw["hidden_size"] * BF16)


def rows_bytes(m: dict, tokens: int) -> int:
    return tokens * m["layers"] * m["columns"] * m["head_dim"] * BF16


def ids_bytes(m: dict, tokens: int) -> int:
    return tokens * m["layers"] * m["columns"] * ID_BYTES


def setups(m: dict, args) -> list[dict]:
    out = []
    for shape, tokens in SHAPES.items():
        decode = shape.startswith("decode")
        kv = tokens * m["kv_bytes_per_token"]
        ring = lambda n: 2 * (n - 1) / n  # noqa: E731  all-reduce: bytes each rank sends per byte summed
        rows = [
            # PD: the transfer happens once, at the end of the prompt's prefill; a decode step moves nothing.
            ("PD prefill -> decode", "conv state with the KV", 0, 0, 0 if decode else tokens * m["conv_state_bytes_per_token"],
             0 if decode else kv, m["table_bytes"]),
            (f"TP {args.tp} over {args.nodes} nodes", "whole rows (shared copy per node)", 0, 0, 0, 0, m["table_bytes"]),
            (f"TP {args.tp} over {args.nodes} nodes", "row shards + all-reduce", 0, ring(args.tp) * rows_bytes(m, tokens), 0,
             0, m["table_bytes"] // args.nodes),
            (f"attention DP {args.dp}", "whole rows (shared copy per node)", 0, 0, 0, 0, m["table_bytes"]),
            # `tokens` per rank: a ring all-gather sends this rank's ids to the n - 1 others; the rows of
            # all n x tokens are reduce-scattered, (n - 1)/n of them per rank.
            (f"attention DP {args.dp}", "shards + id all-gather + reduce-scatter",
             (args.dp - 1) * ids_bytes(m, tokens), (args.dp - 1) * rows_bytes(m, tokens), 0, 0, m["table_bytes"]),
        ]
        for setup, how, ids, rws, conv, kv_moved, dram in rows:
            engram = ids + rws + conv
            out.append({"model": m["model"], "shape": shape, "tokens": tokens, "setup": setup, "how": how,
                        "ids_bytes": ids, "rows_bytes": rws, "conv_state_bytes": conv,
                        "engram_bytes": engram, "kv_bytes_of_these_tokens": kv, "kv_bytes_moved": kv_moved,
                        "engram_vs_kv": engram / kv if kv else None, "dram_per_node_bytes": dram})
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in results if r["model"] == model and r["shape"].startswith("prefill")]
        names = [f"{r['setup']}\n{r['how']}" for r in rs]
        x = range(len(rs))
        ax.bar([i - 0.2 for i in x], [r["engram_bytes"] / 2**20 for r in rs], 0.4, label="Engram bytes per rank")
        ax.bar([i + 0.2 for i in x], [r["kv_bytes_of_these_tokens"] / 2**20 for r in rs], 0.4,
               label="KV bytes of the same tokens")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("MiB per prefill chunk of 8192")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--tp", type=int, default=16, help="TP size across --nodes nodes")
    p.add_argument("--dp", type=int, default=8, help="attention DP size")
    p.add_argument("--workdir", default="build/bench", help="where the demo model is built once")
    p.add_argument("--measured", help="a PD run's JSON (tests/e2e): measured bytes beside the counts")
    p.add_argument("--json", default=str(OUT / "engram_traffic.json"))
    p.add_argument("--png", default=str(OUT / "engram_traffic.png"))
    args = p.parse_args(argv)

    results = []
    for m in (deepseek(), demo(Path(args.workdir))):
        results += setups(m, args)
    mib = lambda b: b / 2**20  # noqa: E731
    print_table("Engram bytes each rank sends per step, beside the KV bytes of the same tokens (MiB)",
                ["model", "shape", "setup", "how", "ids", "rows", "conv state", "Engram", "KV", "Engram/KV",
                 "DRAM/node GiB"],
                [[r["model"], r["shape"], r["setup"], r["how"], mib(r["ids_bytes"]), mib(r["rows_bytes"]),
                  mib(r["conv_state_bytes"]), mib(r["engram_bytes"]), mib(r["kv_bytes_of_these_tokens"]),
                  "" if r["engram_vs_kv"] is None else f"{r['engram_vs_kv']:.3f}", r["dram_per_node_bytes"] / 2**30]
                 for r in results])
    payload = {"args": vars(args), "results": results}
    if args.measured:
        payload["measured"] = json.loads(Path(args.measured).read_text())
        print(f"\nmeasured (PD on the CPU, demo model): {json.dumps(payload['measured'])}")
    out = write_json(Path(args.json).stem, payload) if Path(args.json).parent == OUT else _write(args.json, payload)
    plot(results, Path(args.png))
    print(f"\nwrote {out} and {args.png}")
    return 0


def _write(path: str, payload: dict) -> Path:
    from bench.common import machine

    Path(path).write_text(json.dumps({"machine": machine(), **payload}, indent=1))
    return Path(path)


if __name__ == "__main__":
    sys.exit(main())
