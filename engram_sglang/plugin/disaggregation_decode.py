"""sglang.srt.disaggregation.decode: the decode server registers the same components as the
prefill server (disaggregation_prefill.py), in the same order, to receive them into; it checks
the identity that arrived before it decodes the request (serving/pd.py, `check_step`)."""

from __future__ import annotations

from ..serving import pd
from .targets import Target

MODULE = "sglang.srt.disaggregation.decode"
TARGETS = (Target(MODULE, "setup_state_kv_args", "replace", lambda original: pd.with_engram_state(original)),)
