"""sglang.srt.layers.engram: DeepSeek-V4.1's Engram table lookup served by an EngramRuntime
when a table directory is configured (models/deepseek_v4_hook.py): `EngramEmbedding` becomes a
factory of our store-backed layer (upstream's class when no tables are configured), and every
layer's rows are prefetched once upstream's hasher has run."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.layers.engram"


def engram_embedding(upstream):
    """The replacement of upstream's EngramEmbedding class (a factory; upstream's stays reachable)."""
    from ..models.deepseek_v4_hook import embedding_factory, in_breakable_cuda_graph

    in_breakable_cuda_graph()  # at start-up: a moved SGLang module fails here, once
    return embedding_factory(upstream)


def hasher_forward(original, self, input_ids, forward_batch, *args, **kwargs):
    """Upstream's `EngramHasher.forward` (the step's hashing), then its ids begin the runtime's
    step. Subclasses with their own forward (our Qwen3 family's StepHasher) are not affected."""
    from ..models.deepseek_v4_hook import begin_step_after_hashing

    hash_ids = original(self, input_ids, forward_batch, *args, **kwargs)
    begin_step_after_hashing(self, input_ids, forward_batch, hash_ids)
    return hash_ids


TARGETS = (
    Target(MODULE, "EngramEmbedding", "replace", engram_embedding),
    Target(MODULE, "EngramHasher.forward", "wrap", hasher_forward),
    # Staged decode graphs hash a step's windows with it before the replay (serving/history.py).
    Target(MODULE, "EngramHasher.hash_windows", "use"),
)
