"""sglang.srt.models.registry: the project's Engram model family in SGLang's model registry."""

from __future__ import annotations

from .targets import Target

MODULE = "sglang.srt.models.registry"
ARCHITECTURE = "Qwen3EngramForCausalLM"


def register_model(models: dict) -> None:
    from ..models.qwen3_engram import Qwen3EngramForCausalLM

    models.setdefault(ARCHITECTURE, Qwen3EngramForCausalLM)


TARGETS = (Target(MODULE, "ModelRegistry.models", "extend", register_model, says=f"registers {ARCHITECTURE} in"),)
