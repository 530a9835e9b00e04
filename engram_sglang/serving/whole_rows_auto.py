"""`--engram-host-whole-rows auto` (the default): whole rows or a shard per rank, decided at
start-up as `engram-sglang plan` would decide it (planning/whole_rows.py `choose`) for this
rank's TP size and GPU, with one log line saying which and why.

Whole rows where nothing can be weighed (TP 1, no GPU, a GPU configs/gpus.json lacks): the
behaviour before `auto`. `on` and `off` pass through untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from ..hashing import EngramLayout
from ..placement_table import placement as placement_spec
from ..rowformat import ROW_BYTES
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
    from ..planning.whole_rows import choose

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
