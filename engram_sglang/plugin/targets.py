"""Patching SGLang: every target declared in one list, checked before it is patched.

`TARGETS` names each SGLang attribute the plugin wraps, replaces or hooks. When SGLang
imports a module that holds targets, the plugin checks them all before it patches any
(plugin._apply); a missing one stops the process with one line naming it and the SGLang
version. A log line instead would leave the server half-patched: upstream's own Engram
layer would then load every table into GPU memory (189 GiB for DeepSeek-V4.1-Flash).

This module is imported by the plugin in every SGLang process: it stays free of heavy
imports (the errors module is imported only when a target is missing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

# The SGLang release the targets were checked against (pyproject's `serve` extra).
SGLANG_TESTED = "0.5.23"


@dataclass(frozen=True)
class Target:
    module: str  # the module SGLang imports
    attr: str  # "Class.method", "Class" or "function" inside it
    how: str  # what the plugin does to it (for the error line)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


TARGETS: tuple[Target, ...] = (
    Target("sglang.srt.server_args", "prepare_server_args", "hooks (--engram-* flags)"),
    Target("sglang.srt.server_args", "ServerArgs.add_cli_args", "hooks (--engram-* flags)"),
    Target("sglang.srt.models.registry", "ModelRegistry.models", "registers Qwen3EngramForCausalLM in"),
    Target("sglang.srt.managers.scheduler_components.internal_state",
           "SchedulerInternalStateController.get_internal_state", "wraps"),
    Target("sglang.srt.layers.engram", "EngramEmbedding", "replaces"),
    Target("sglang.srt.layers.engram", "EngramHasher.forward", "wraps"),
    Target("sglang.srt.models.deepseek_v4", "DeepseekV4ForCausalLM.load_weights", "wraps"),
    Target("sglang.srt.managers.scheduler", "Scheduler.run_batch", "wraps"),
    Target("sglang.srt.managers.tokenizer_manager", "TokenizerManager._create_tokenized_object", "wraps"),
    Target("sglang.srt.model_executor.pool_configurator", "DefaultPoolConfigurator._compute_cell_size", "wraps"),
    Target("sglang.srt.model_executor.model_runner", "ModelRunner._init_post_memory_pool_components", "wraps"),
    Target("sglang.srt.model_executor.model_runner", "ModelRunner.forward", "wraps"),
    Target("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner.capture", "wraps"),
    Target("sglang.srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner.execute", "wraps"),
)

TARGET_MODULES: tuple[str, ...] = tuple(dict.fromkeys(t.module for t in TARGETS))


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "(not installed)"


def _lookup(obj, attr: str):
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def missing_targets(module, module_name: Optional[str] = None) -> list[Target]:
    """The declared targets of `module` (SGLang's module `module_name`) it lacks."""
    module_name = module_name or module.__name__
    out = []
    for t in TARGETS:
        if t.module != module_name:
            continue
        try:
            _lookup(module, t.attr)
        except AttributeError:
            out.append(t)
    return out


def missing_message(target: Target) -> str:
    return (f"SGLang {sglang_version()} has no {target.name}, which engram-sglang {target.how}: this engram-sglang "
            f"was checked against SGLang {SGLANG_TESTED}; install that release (pip install sglang=={SGLANG_TESTED}) "
            f"or an engram-sglang made for yours")


def check_module(module, module_name: Optional[str] = None) -> None:
    """Raise PatchTargetMissing naming the first declared target `module` lacks."""
    missing = missing_targets(module, module_name)
    if missing:
        from ..core.errors import PatchTargetMissing

        raise PatchTargetMissing(missing_message(missing[0]))


def wrap_method(cls, name: str, wrapper: Callable) -> None:
    """Replace `cls.name` by a method that calls `wrapper(original, self, *args, **kwargs)`.

    Idempotent per wrapper (the same wrapper again, e.g. a plugin loaded twice, changes
    nothing; another wrapper of the same method wraps the wrapped one); the method it replaced
    stays at `cls.name.__wrapped__`. A missing method raises PatchTargetMissing (the
    plugin's check names declared targets first; this catches one never declared).
    """
    try:
        original = getattr(cls, name)
    except AttributeError:
        from ..core.errors import PatchTargetMissing

        raise PatchTargetMissing(missing_message(Target(cls.__module__, f"{cls.__qualname__}.{name}", "wraps")))
    key = f"{wrapper.__module__}.{wrapper.__qualname__}"
    applied = getattr(original, "_engram_sglang_wrappers", frozenset())
    if key in applied:
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    method._engram_sglang = True
    method._engram_sglang_wrappers = applied | {key}
    setattr(cls, name, method)
