"""sglang.srt.model_executor.pool_configurator: SGLang sizes the KV pool as free memory / bytes
per token; a model that keeps state per KV slot (Qwen3EngramForCausalLM's conv inputs) adds
its bytes to that cost, so the pool and the state fit together."""

from __future__ import annotations

import logging

from .targets import Target

MODULE = "sglang.srt.model_executor.pool_configurator"
logger = logging.getLogger(__name__)
_said = set()  # SGLang builds the configurator more than once: one line per size


def compute_cell_size(original, self, kvc, num_layers):
    cell = original(self, kvc, num_layers)
    extra = getattr(getattr(kvc, "model", None), "engram_bytes_per_kv_token", None)
    if callable(extra) and not getattr(kvc, "is_draft_worker", False):
        add = int(extra())
        if add and (add, cell) not in _said:
            _said.add((add, cell))
            logger.info("engram KV sizing: each KV-cache token also holds %d B of Engram state (%d B with the KV)",
                        add, cell + add)
        cell += add
    return cell


TARGETS = (Target(MODULE, "DefaultPoolConfigurator._compute_cell_size", "wrap", compute_cell_size),)
