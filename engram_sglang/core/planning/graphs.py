"""Whether a placement keeps SGLang's decode CUDA graphs, per model: the one policy the
serving side applies (serving/graphs.py reads the placement table's `capturable`; a model
hook refuses --engram-disk-graphs with `UNSTAGED_MODEL_TYPES`'s reason) and the planner
reports (`decode_graphs`)."""

from __future__ import annotations

from typing import Optional

from ..placement_table import placement as placement_spec

# Model types whose host-reading (disk) decode steps cannot be staged before a replay, with why.
# Keyed by model_type prefix (DeepSeek-V4.1's configs say deepseek_v4 / deepseek_v41).
# Both families stage today (DeepSeek-V4.1: a peek over upstream's hasher history); a model
# added here decodes eagerly on the disk tier, and its hook refuses --engram-disk-graphs.
UNSTAGED_MODEL_TYPES: dict[str, str] = {}


def unstaged_reason(model_type: Optional[str]) -> Optional[str]:
    """Why this model's disk-tier decode steps cannot keep staged graphs (None: they can)."""
    for prefix, why in UNSTAGED_MODEL_TYPES.items():
        if model_type and model_type.startswith(prefix):
            return why
    return None


def decode_graphs(model_type: Optional[str], placement: str) -> dict:
    """{"kept": "yes" | "no" | "opt-in", "why": one line} for decode CUDA graphs with this
    placement and model: capturable placements keep them; a host-reading placement keeps them
    only staged (--engram-disk-graphs on with --disable-overlap-schedule) for a model whose
    ids can be staged, else decodes eagerly."""
    spec = placement_spec(placement)
    if spec.capturable:
        return {"kept": "yes", "why": f"{placement} rows are read in-kernel, which a decode graph replays"}
    why = unstaged_reason(model_type)
    if why is not None:
        return {"kept": "no", "why": f"{placement} reads each step's ids on the host and {why}: decode runs eagerly"}
    return {"kept": "opt-in", "why": (f"{placement} reads each step's ids on the host: decode graphs kept only with "
                                      f"--engram-disk-graphs on and --disable-overlap-schedule (rows staged before "
                                      f"each replay), else eager")}
