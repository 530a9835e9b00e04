"""Tests only: what SGLang 0.5.23's PD disaggregation needs to run on a CPU.

`prefill.py` `_send_kv_chunk` hands a sender that says `supports_host_tensor_indices` its
page indices through pinned host memory and a `torch.cuda.Event`, neither of which exists
without a GPU; with the flag off it takes the plain host path (`kv_to_page_indices`). A
general SGLang plugin (group `sglang.srt.plugins`, found through the `.dist-info` beside it),
on PYTHONPATH of the PD test servers only (tests/support/pd_support.py).
"""

from __future__ import annotations


def load() -> None:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    MooncakeKVSender.supports_host_tensor_indices = False
