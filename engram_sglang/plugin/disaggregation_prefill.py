"""sglang.srt.disaggregation.prefill: the prefill side of PD disaggregation registers the Engram
state (per-KV-slot conv inputs, the Engram identity) as state components of SGLang's own KV
transfer, after SGLang's (serving/pd.py)."""

from __future__ import annotations

import functools

from .targets import Target

MODULE = "sglang.srt.disaggregation.prefill"


def setup_state_kv_args(original):
    @functools.wraps(original)
    def setup(kv_args, token_to_kv_pool, *args, **kwargs):
        from sglang.srt.runtime_context import get_disagg

        from ..serving import pd

        original(kv_args, token_to_kv_pool, *args, **kwargs)
        pd.add_state_components(kv_args, token_to_kv_pool, kwargs.get("req_to_token_pool"), "prefill",
                                str(get_disagg().disaggregation_transfer_backend))

    return setup


TARGETS = (Target(MODULE, "setup_state_kv_args", "replace", setup_state_kv_args),)
