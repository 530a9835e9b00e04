"""sglang.srt.disaggregation.prefill: a prefill server registers the Engram state (per-KV-slot
conv inputs, the Engram identity) as state components of SGLang's own KV transfer, after
SGLang's own (serving/pd.py; the decode server's: disaggregation_decode.py)."""

from __future__ import annotations

from ..serving import pd
from .targets import Target

MODULE = "sglang.srt.disaggregation.prefill"
TARGETS = (Target(MODULE, "setup_state_kv_args", "replace", lambda original: pd.with_engram_state(original)),)
