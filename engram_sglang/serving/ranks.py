"""Which rank of the server this process is: the labels of its Engram statistics (each
/server_info entry, each `--engram-stats-file` file), so ranks and replicas can be told apart.
"""

from __future__ import annotations

from pathlib import Path

# label -> SGLang's get_parallel() name. dp_rank/dp_size: the replica (--dp-size) and their
# number; tp_rank is SGLang's, unique within a replica also under attention DP/CP (where the
# runtime opens whole rows as TP 1); attn_*: the attention DP group and CP rank;
# node_rank (added below): which node of `--nnodes` the rank runs on.
_FROM_SGLANG = (("tp_rank", "tp_rank"), ("tp_size", "tp_size"), ("dp_rank", "dp_rank"), ("dp_size", "dp_size"),
                ("pp_rank", "pp_rank"), ("pp_size", "pp_size"), ("attn_dp_rank", "attn_dp_rank"),
                ("attn_cp_rank", "attn_cp_rank"))


def rank_labels(tp_rank: int = 0, tp_size: int = 1) -> dict[str, int]:
    """This process's ranks as SGLang publishes them; what it has not published (outside a
    server: unit tests, tools) comes from the runtime's own `tp_rank`/`tp_size`, else 0 of 1."""
    out = {"tp_rank": tp_rank, "tp_size": tp_size, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
           "attn_dp_rank": 0, "attn_cp_rank": 0}
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    except ImportError:
        return out
    for label, name in _FROM_SGLANG:
        try:
            value = getattr(parallel, name)
        except (AttributeError, ValueError, RuntimeError):  # not published in this process
            continue
        if isinstance(value, int) and not isinstance(value, bool):  # dp_rank None: no DP controller
            out[label] = value
    out["node_rank"] = _node_rank()
    return out


def _node_rank() -> int:
    """This process's node (`--node-rank` of `--nnodes`); 0 outside a server."""
    try:
        from sglang.srt.runtime_context import get_server_args

        value = getattr(get_server_args(), "node_rank", 0)
    except (ImportError, AttributeError, ValueError, RuntimeError):  # ValueError: not set in this process
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def stats_path(template: str, labels: dict[str, int]) -> Path:
    """The `--engram-stats-file` of this rank: `{rank}` in the path becomes `tpN.dpM` (plus
    `.ppK` with pipeline stages, whose ranks share TP and DP ranks); else, with more than one
    rank, that goes before the extension (stats.json -> stats.tp1.dp0.json); one rank writes
    the path as given."""
    rank = f"tp{labels['tp_rank']}.dp{labels['dp_rank']}"
    if labels.get("pp_size", 1) > 1:
        rank += f".pp{labels['pp_rank']}"
    if "{rank}" in template:
        return Path(template.replace("{rank}", rank))
    path = Path(template)
    if labels["tp_size"] == 1 and labels["dp_size"] == 1 and labels.get("pp_size", 1) == 1:
        return path
    return path.with_name(f"{path.stem}.{rank}{path.suffix}")
