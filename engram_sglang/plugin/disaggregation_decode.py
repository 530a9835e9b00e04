"""sglang.srt.disaggregation.decode: the decode server registers the same components as the
prefill server (disaggregation_prefill.py), in the same order, to receive them into; where
SGLang verifies a transferred request's KV checksum, before the request's first decode step
(eager or replayed), it checks the Engram identity that arrived (serving/pd.py
`refuse_mismatched_transfers`)."""

from __future__ import annotations

from ..serving import pd
from .targets import Target

MODULE = "sglang.srt.disaggregation.decode"


def verify_transfers(original, self, batch):
    original(self, batch)
    pd.refuse_mismatched_transfers(self, batch)


TARGETS = (
    Target(MODULE, "setup_state_kv_args", "replace", lambda original: pd.with_engram_state(original)),
    Target(MODULE, "SchedulerDisaggregationDecodeMixin._verify_kv_checksums", "wrap", verify_transfers),
)
