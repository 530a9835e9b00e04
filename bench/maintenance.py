"""What the hot-row caches' between-steps maintenance costs, at model-shaped sizes.

    python -m bench.maintenance [--layers 4] [--tokens 256] [--rows 1048576] [--share 0.05]
                                [--every 1,2,4,8,16] [--steps 96] [--device cpu] [--json]

Each step: every layer's cache gathers `tokens` x 24 skewed ids (a decode batch), then
`maintenance.between_steps()` runs, as the plugin does after SGLang's ModelRunner.forward.
For each cadence (`maintain_every`) it reports the gather time per step and the time of
the steps that maintain (all layers together: one host sync per maintenance step), per
maintenance and amortized over the steps. The inner table is in memory (its bits do not
matter here); the ids follow the log-uniform skew of the tests. On a GPU (--device cuda)
each time includes a device synchronize, so the figures are what the host waits.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engram_sglang.core.ops import gather_dequant
from engram_sglang.core.rowformat import ROW_BYTES
from engram_sglang.core.stores import maintenance
from engram_sglang.core.stores.base import ResidentTable, TableStore
from engram_sglang.core.stores.cache import HotRowCache
from engram_sglang.core.stores.row_directory import SLOT_OVERHEAD

IDS_PER_TOKEN = 24


class MemoryTable(TableStore):
    """A layer table in device memory, contents irrelevant (timing only)."""

    placement = "host"
    table_address = None  # the op reads `table` itself

    def __init__(self, layer_id: int, rows: int, device: str):
        super().__init__(layer_id, None, rows, (0, rows), torch.device(device), "auto")
        self.table = torch.zeros((rows, ROW_BYTES), dtype=torch.uint8, device=device)

    @property
    def resident_bytes(self) -> int:
        return self.table.numel()

    @property
    def resident_table(self) -> ResidentTable:  # what a hot-row cache in front reads its misses from
        return ResidentTable(self.table, self.table_address)

    def _gather(self, ids, out):
        return gather_dequant(self.table, ids.to(self.device), out=out, backend=self.backend), None


def skewed(gen: torch.Generator, shape, universe: int) -> torch.Tensor:
    u = torch.rand(shape, generator=gen)
    return (torch.exp(u * np.log(universe)) - 1).long().clamp_(0, universe - 1)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args, every: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    cache_bytes = int(args.rows * args.share * (ROW_BYTES + SLOT_OVERHEAD + 40))
    caches = [HotRowCache(MemoryTable(L, args.rows, args.device), cache_bytes, maintain_every=every)
              for L in range(args.layers)]
    perm = [torch.randperm(args.rows, generator=gen) for _ in caches]  # each layer its own hot rows
    gather_s, maint_s, maint_steps = 0.0, 0.0, 0
    total = args.warmup + args.steps
    for step in range(total):
        ids = [p[skewed(gen, (args.tokens, IDS_PER_TOKEN), args.rows)].to(args.device) for p in perm]
        sync(args.device)
        t0 = time.perf_counter()
        for c, i in zip(caches, ids):
            c.gather(i)
        sync(args.device)
        t1 = time.perf_counter()
        before = caches[0].directory.maintenances
        maintenance.between_steps()
        sync(args.device)
        t2 = time.perf_counter()
        if step >= args.warmup:
            gather_s += t1 - t0
            if caches[0].directory.maintenances != before:
                maint_s += t2 - t1
                maint_steps += 1
    s = caches[0].stats()
    for c in caches:
        c.close()
    return {
        "maintain_every": every, "layers": args.layers, "ids_per_layer_step": args.tokens * IDS_PER_TOKEN,
        "cache_rows_per_layer": caches[0].directory.slots,
        "gather_ms_per_step": 1e3 * gather_s / args.steps,
        "maintenance_ms_each": 1e3 * maint_s / max(1, maint_steps),
        "maintenance_ms_per_step": 1e3 * maint_s / args.steps,
        "maintenance_ms_per_layer_each": 1e3 * maint_s / max(1, maint_steps) / args.layers,
        "hit_rate_layer0": s["cache_hit_rate"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rows", type=int, default=1 << 20, help="rows per layer table")
    p.add_argument("--share", type=float, default=0.05, help="cache rows as a share of the table")
    p.add_argument("--every", default="1,2,4,8,16")
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [run(args, int(e)) for e in args.every.split(",")]
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{args.layers} layers x {args.tokens * IDS_PER_TOKEN} ids a step, cache {results[0]['cache_rows_per_layer']:,} "
          f"rows a layer, {args.device}, {torch.get_num_threads()} threads")
    print(f"{'every':>5} {'gather ms/step':>15} {'maint ms each':>14} {'per layer':>10} {'maint ms/step':>14} {'hit rate':>9}")
    for r in results:
        print(f"{r['maintain_every']:>5} {r['gather_ms_per_step']:>15.2f} {r['maintenance_ms_each']:>14.2f} "
              f"{r['maintenance_ms_per_layer_each']:>10.2f} {r['maintenance_ms_per_step']:>14.2f} {r['hit_rate_layer0']:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
