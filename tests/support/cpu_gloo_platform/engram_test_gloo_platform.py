"""Tests only: SGLang 0.5.23's CPU platform, out of tree, with PyNccl switched off.

SGLang's in-tree CPU platform gives every model-parallel group a PyNccl communicator,
which fails on a CPU ("Expected a cuda device"), so TP > 1 cannot start there. An
out-of-tree platform whose capabilities say `supports_pynccl=False` gets groups without
it (sglang/srt/distributed/parallel_state.py, init_model_parallel_group), and the CPU
all-reduce falls through to torch.distributed on the gloo group. Everything else is the
in-tree CPU platform. SGLang finds this module through the entry point in the
`.dist-info` beside it (group `sglang.srt.platforms`), on PYTHONPATH for the test server only.
"""

from __future__ import annotations

import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities

NAME = "engram_test_gloo"


class CpuGlooPlatform(CpuSRTPlatform):
    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(graph_capture=True, supports_pynccl=False)

    def is_cpu(self) -> bool:
        return True  # SGLang's CPU-only choices (e.g. the KV cache dtype) still apply

    def get_group_coordinator_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")


def activate() -> str | None:
    return f"{__name__}.CpuGlooPlatform"
