"""sglang.srt.model_executor.runner.decode_cuda_graph_runner: with --engram-disk-graphs, the
staged rows' buffers are made before the decode graphs are captured (sized for the largest),
and filled before every replay (serving/staged_rows.py). A runtime without staged rows makes
both a no-op."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"


def capture(original, self, *args, **kwargs):
    from ..serving import staged_rows

    staged_rows.reserve_for_capture(self.model_runner.model, self.max_bs * self.captured_req_width)
    return original(self, *args, **kwargs)


def execute(original, self, forward_batch, *args, **kwargs):
    from ..serving import staged_rows

    staged_rows.stage_before_replay(self.model_runner.model, forward_batch)
    return original(self, forward_batch, *args, **kwargs)


TARGETS = (
    Target(MODULE, "DecodeCudaGraphRunner.capture", "wrap", capture),
    Target(MODULE, "DecodeCudaGraphRunner.execute", "wrap", execute),
)
