"""`--engram-host-whole-rows auto` (the default): whole rows or a shard per rank, decided at
start-up as `engram-sglang plan` would decide it (`choose` below, from planning/whole_rows.py `compare`) for this
rank's TP size and GPU, with one log line saying which and why.

Whole rows where nothing can be weighed (TP 1, no GPU, a GPU configs/gpus.json lacks): the
behaviour before `auto`. `on` and `off` pass through untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from ..core.hashing import EngramLayout
from ..core.placement_table import placement as placement_spec
from ..core.rowformat import ROW_BYTES
from .settings import ServeSettings

logger = logging.getLogger(__name__)

AUTO = "auto"


def resolve(settings: ServeSettings, cfg, tp_size: int, device: torch.device, *, tp_rank: int = 0,
            device_name: Optional[str] = None) -> ServeSettings:
    """`settings` with `host_whole_rows` on or off. `device_name` defaults to the CUDA/HIP
    device's name (torch.cuda.get_device_name), None on the CPU."""
    if settings.host_whole_rows != AUTO:
        return settings
    spec = placement_spec(settings.placement)
    options = {**settings.store_options(), "whole_rows": True}
    if "whole_rows" not in spec.whole_rows_with or spec.rows_held(options) != "whole":
        # Nothing to choose: this placement (or host without a shared copy) shards anyway.
        return dataclasses.replace(settings, host_whole_rows=True)
    if device_name is None and torch.device(device).type == "cuda":
        device_name = torch.cuda.get_device_name(torch.device(device))
    table_bytes = sum(EngramLayout(cfg).rows(L) for L in cfg.layer_ids) * ROW_BYTES
    # The hot-row cache's HBM per GPU as a share of the tables (HotRowCache splits it over the
    # layers by their rows): the two layouts hit differently with it (layout_hit_rates).
    share = (settings.cache_mib << 20) / table_bytes if table_bytes else 0.0
    whole, reason = choose(cfg=cfg, tp=tp_size, device_name=device_name, cache_share=share)
    if tp_rank == 0:  # one line per server, not per rank
        logger.info("engram-sglang: --engram-host-whole-rows auto -> %s: %s",
                    "on (whole rows, no all-reduce)" if whole else "off (a row shard per rank, all-reduced)", reason)
    return dataclasses.replace(settings, host_whole_rows=whole)


def choose(*, cfg, tp: int, device_name: Optional[str], cache_share: float = 0.0,
           gpus: Optional[dict] = None) -> tuple[bool, str]:
    """`--engram-host-whole-rows auto`: whole rows (True) or a shard and an all-reduce (False)
    for TP `tp` on the GPU named `device_name` (None: no GPU), and why in one line: the
    planner's pick (`compare`, decode and prefill as `engram-sglang plan` weighs them), with
    a hot-row cache of `cache_share` of each layer's rows per GPU at each layout's hit rate.
    Whole rows wherever there is nothing to weigh (TP 1, no GPU, a GPU the file lacks): the
    behaviour before `auto`, and what attention data parallelism reads from a shared copy."""
    from ..core.planning.data import load_gpus
    from ..core.planning.model import DECODE_BATCH, PREFILL_CHUNK, lines_per_row, row_bytes
    from ..core.planning.whole_rows import compare, layout_hit_rates, sku_for_device

    if tp <= 1:
        return True, "TP 1: one rank holds every row"
    if device_name is None:
        return True, "no GPU: nothing to weigh an all-reduce against"
    sku = sku_for_device(device_name, load_gpus() if gpus is None else gpus)
    if sku is None:
        return True, f"GPU {device_name!r} is not a SKU of configs/gpus.json: no link figures to weigh"
    rates = layout_hit_rates(cache_share, tp)
    r = compare(tokens_by_phase={"decode": DECODE_BATCH, "prefill": PREFILL_CHUNK}, layers=cfg.n_layers,
                columns=cfg.hash_columns, head_dim=cfg.head_dim, lines_per_row=lines_per_row(row_bytes(cfg)), tp=tp,
                host_gbps=sku.host_link_gbps, gpu_gbps=sku.gpu_link_gbps, hit_rate=rates["whole"],
                shard_hit_rate=rates["sharded"])
    if r["recommend"] is None:
        return True, f"{sku.key}: {r['reason']}"
    return r["recommend"] == "whole", f"{sku.key} ({device_name}): {r['reason']}"
