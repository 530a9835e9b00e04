"""What a rank serves, as one value every rank of a model must share: the tables' content and
the settings that change outputs. Ranks on different nodes (`--nnodes`) each open their own
table directory; a node on another table version, or with another `--engram-mode`, would mix
its rows or its choices into every sum and produce wrong tokens without a word. So the
tensor-parallel ranks compare it once at start-up (one all-gather on SGLang's CPU group) and
a mismatch stops start-up in one line naming the ranks, their nodes and what differs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.errors import EngramError

# The settings that change what a token's Engram rows are or whether they are used.
OUTPUT_SETTINGS = ("mode", "ablation", "debug")


def serving_identity(table_dir: Path, settings) -> dict:
    """{"tables": 16 hex digits of every layer's content (the names its shared copies carry:
    the manifest's chunk checksums), "settings": the output-changing settings as text}."""
    import xxhash

    from ..core.stores.shmadmin import table_identities

    layers = table_identities(table_dir)
    tables = xxhash.xxh3_64(",".join(f"{L}:{layers[L]}" for L in sorted(layers)).encode()).hexdigest()
    chosen = " ".join(f"{name}={_text(getattr(settings, name))}" for name in OUTPUT_SETTINGS)
    return {"tables": tables, "settings": chosen}


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _as_int64(identity: dict) -> int:
    import xxhash

    # 63 bits: a positive int64 for the collective.
    return xxhash.xxh3_64_intdigest(f"{identity['tables']}|{identity['settings']}".encode()) >> 1


def agree_over_tp_group(identity: dict, node_rank: int) -> None:
    """Stop start-up unless every rank of SGLang's tensor-parallel group serves `identity`;
    nothing to compare in a group of one (or outside a server)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return
    mine = torch.tensor([_as_int64(identity), node_rank], dtype=torch.int64, device="cpu")
    everyone = [torch.empty_like(mine) for _ in range(group.world_size)]
    torch.distributed.all_gather(everyone, mine, group=group.cpu_group)
    check_agreement([(int(v[0]), int(v[1])) for v in everyone], identity, group.rank_in_group)


def check_agreement(everyone: list[tuple[int, int]], identity: dict, my_rank: int) -> None:
    """`everyone`: (identity value, node rank) per TP rank. A mismatch is one line, the same on
    every rank: which ranks (on which nodes) differ from rank 0, and this rank's own values."""
    first = everyone[0][0]
    differ = [r for r, (value, _) in enumerate(everyone) if value != first]
    if not differ:
        return
    where = ", ".join(f"rank {r} (node {everyone[r][1]})" for r in differ)
    raise EngramError(
        f"the tensor-parallel ranks serve different Engram tables or settings: {where} differ from rank 0 "
        f"(node {everyone[0][1]}); this rank {my_rank} (node {everyone[my_rank][1]}) has tables "
        f"{identity['tables']}, {identity['settings']}: give every node the same table version (each "
        f"rank's /server_info shows its table_identity) and the same --engram-mode/--engram-ablation")
