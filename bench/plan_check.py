"""The planner's disk prediction against the measured decode step, same inputs, same run.

`engram-sglang plan --placement disk` predicts a decode step's disk reads from the disk's
IOPS and latency, the cache sizes and a trace replayed through the caches. This bench runs
the measured decode step of `bench/tiers.py --part pipeline` (its `decode_run`: one layer,
O_DIRECT reads by native AIO behind a DRAM row cache) and the planner's own functions for the
same inputs: the IOPS and latency its `--measure-disk` measures on the table file (right
before and after each measured batch, the mean used), the same DRAM cache size, and a trace file of the very
streams the steps read (written as `engram-sglang profile --trace` writes one), replayed with
the same warm-up steps. There is no model here, so nothing is hidden (lead 0): the predicted
exposed read time is the whole read time, which the measured step (reads plus the host's
dedupe, lookup, admission and, on this CPU-only machine, decode) is compared with. Goal:
within 25%.

Per cache size and batch a fresh store: steps 0..W-1 of the first `batch` streams warm it
(W-1 here, the last by decode_run's untimed first call), steps W..W+M-1 are measured.

    python -m bench.plan_check [--rows-per-layer 8000000] [--dram-shares 0.01,0.1] [--batches 16,64,256]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import OUT, print_table, write_json
from bench.tiers import decode_run, ensure_table
from bench.workload import hashed_streams
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.planning import disk as planner_disk
from engram_sglang.core.stores import open_store
from engram_sglang.core.tablefile import layer_file_name

GOAL = 0.25


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-layer", type=int, default=8_000_000)
    ap.add_argument("--kind", choices=("code", "prose"), default="code")
    ap.add_argument("--dram-shares", default="0,0.01,0.1", help="DRAM row cache sizes, shares of the table")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--warm-steps", type=int, default=48, help="decode steps that warm each cache")
    ap.add_argument("--steps", type=int, default=40, help="measured decode steps per cache size and batch")
    ap.add_argument("--threads", type=int, default=64, help="reads in flight")
    ap.add_argument("--iops-seconds", type=float, default=2.0)
    args = ap.parse_args()

    cfg, streams, n_tokens = hashed_streams(args.rows_per_layer, args.kind, layer_ids=(1,))
    root = ensure_table(cfg, args.rows_per_layer)
    path = root / layer_file_name(cfg.layer_ids[0])
    table_bytes = path.stat().st_size
    layer = cfg.layer_ids[0]
    rows = EngramLayout(cfg).rows(layer)  # the prime layout's rows, a little over --rows-per-layer
    shares = [float(x) for x in args.dram_shares.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    W, M = args.warm_steps, args.steps
    # The trace: every stream's ids of the steps the store reads, in decode order (what
    # `engram-sglang profile --trace` writes), then read back as the planner reads it.
    ids = torch.stack([s[: W + M, 0] for s in streams], dim=1).numpy()  # [steps, streams, 24]
    OUT.mkdir(parents=True, exist_ok=True)
    trace_path = planner_disk.write_trace(OUT / "plan_check_trace.npz", cfg.fingerprint(), {layer: ids},
                                          {"streams": len(streams), "steps": W + M, "kind": args.kind})
    trace, _ = planner_disk.read_trace(trace_path, cfg.fingerprint())
    print(f"{table_bytes / 2**30:.2f} GiB table, O_DIRECT, {len(streams)} streams of {args.kind}; trace {trace_path} "
          f"({W} warm + {M} measured steps)", flush=True)

    planner_disk.measure_disk(path, 1.0, args.threads)  # untimed: the first reads after a pause run slow here
    results, disks = [], []
    for share in shares:
        for batch in batches:
            store = open_store(root, "disk", cfg=cfg, threads=args.threads, direct=True,
                               dram_cache_bytes=int(share * table_bytes))[layer]
            try:
                for t in range(W - 1):  # decode_run's untimed first call is step W-1
                    store.gather(torch.stack([streams[b][t, 0] for b in range(batch)]))
                # The disk right before and after the measured steps: this machine's disk moves
                # minute to minute (docs/measurements.md section 5); the mean is the input.
                before = planner_disk.measure_disk(path, args.iops_seconds, args.threads)
                m = decode_run(store, streams, batch, W, M, before["iops"])
                after = planner_disk.measure_disk(path, args.iops_seconds, args.threads)
            finally:
                store.close()
            iops, latency = (before["iops"] + after["iops"]) / 2, (before["latency_ms"] + after["latency_ms"]) / 2
            steady = bool(abs(after["iops"] - before["iops"]) <= 0.2 * iops)
            disks.append({"share": share, "batch": batch, "before": before, "after": after})
            p = planner_disk.predict(layers=[layer], rows=[rows], columns=cfg.hash_columns, batch=batch, iops=iops,
                                     latency_ms=latency, lead_ms=0.0, dram_bytes=int(share * table_bytes),
                                     trace=trace, warm_steps=W)
            ratio = p["exposed_ms_prefetch"] / m["ms_per_step"]
            results.append({
                "dram_share": share, "batch": batch, "iops": iops, "latency_ms": latency, "iops_steady": steady,
                "measured_ms": m["ms_per_step"], "measured_p99_ms": m["p99_ms"], "measured_cpu_ms": m["cpu_ms_per_step"],
                "measured_misses": m["misses_per_step"], "measured_dram_hit": m["dram_hit_rate"],
                "predicted_ms": p["exposed_ms_prefetch"], "predicted_misses": p["misses_per_step"],
                "predicted_dram_hit": p["per_layer"][str(layer)]["dram_hit_rate"],
                "predicted_over_measured": ratio, "within_goal": bool(abs(ratio - 1) <= GOAL),
            })
            r = results[-1]
            print(f"  DRAM {share:>4.0%} batch {batch:3d}: measured {r['measured_ms']:7.2f} ms ({r['measured_misses']:7.1f} "
                  f"misses), predicted {r['predicted_ms']:7.2f} ms ({r['predicted_misses']:7.1f}), x{ratio:.2f}"
                  + ("" if steady else "  (disk UNSTEADY)"), flush=True)

    print_table(
        f"Planner (plan --placement disk) vs the measured decode step (bench/tiers.py decode_run), "
        f"{table_bytes / 2**30:.2f} GiB table, O_DIRECT, {args.threads} in flight; IOPS and latency by "
        f"{disks[0]['before']['tool']}, mean of right before and after each batch; goal: within {GOAL:.0%}",
        ["DRAM cache", "batch", "k IOPS (before/after)", "lat ms", "measured ms", "predicted ms", "pred/meas", "misses meas",
         "misses pred", "DRAM hit meas", "DRAM hit pred", "CPU ms/step"],
        [[f"{r['dram_share']:.0%}", r["batch"], f"{r['iops'] / 1e3:.1f} ({d['before']['iops'] / 1e3:.0f}/"
          f"{d['after']['iops'] / 1e3:.0f})" + ("" if r["iops_steady"] else " UNSTEADY"),
          r["latency_ms"], r["measured_ms"], r["predicted_ms"], r["predicted_over_measured"], r["measured_misses"],
          r["predicted_misses"], f"{r['measured_dram_hit']:.1%}", f"{r['predicted_dram_hit']:.1%}",
          r["measured_cpu_ms"]] for r, d in zip(results, disks)])
    met = sum(r["within_goal"] for r in results)
    print(f"within {GOAL:.0%}: {met} of {len(results)}")
    write_json("plan_check", {"args": vars(args), "table_bytes": table_bytes, "disks": disks, "results": results,
                              "within_goal": met, "goal": GOAL})
    plot(results)
    return 0


def plot(results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for share in sorted({r["dram_share"] for r in results}):
        rs = [r for r in results if r["dram_share"] == share]
        line, = ax.plot([r["batch"] for r in rs], [r["measured_ms"] for r in rs], "o-", label=f"DRAM {share:.0%}: measured")
        ax.plot([r["batch"] for r in rs], [r["predicted_ms"] for r in rs], "x--", color=line.get_color(),
                label=f"DRAM {share:.0%}: planner")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("ms per step (one layer)")
    ax.set_title("decode step: planner vs measured")
    ax.legend(fontsize=7)
    ax = axes[1]
    labels = [f"{r['dram_share']:.0%}/{r['batch']}" for r in results]
    ax.bar(labels, [r["predicted_over_measured"] for r in results])
    ax.axhspan(1 - GOAL, 1 + GOAL, color="tab:green", alpha=0.2, label=f"within {GOAL:.0%}")
    ax.set_xlabel("DRAM cache / batch")
    ax.set_ylabel("predicted / measured")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "plan_check.png", dpi=110)
    print(f"wrote {OUT / 'plan_check.json'} and {OUT / 'plan_check.png'}")


if __name__ == "__main__":
    sys.exit(main())
