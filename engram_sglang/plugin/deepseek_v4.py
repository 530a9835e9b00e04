"""sglang.srt.models.deepseek_v4: the loader skips the checkpoint's Engram tables when our stores
serve them (models/deepseek_v4_hook.py)."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.models.deepseek_v4"


def load_weights(original, self, weights, *args, **kwargs):
    from ..models.deepseek_v4_hook import load_weights as load_without_tables

    return load_without_tables(original, self, weights, *args, **kwargs)


TARGETS = (Target(MODULE, "DeepseekV4ForCausalLM.load_weights", "wrap", load_weights),)
