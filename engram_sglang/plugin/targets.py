"""What the plugin patches in SGLang: a `Target` per attribute, declared beside its hook.

Each hooks module of this package (named after the SGLang module it patches) lists its
targets in `TARGETS`, each with the hook that patches it, as SGLang's own
`HookRegistry.register(target, hook, type)` does. When SGLang imports a module that holds
targets, the plugin checks them all before it patches any (`check_module`); a missing one
stops the process with one line naming it and the SGLang version. A log line instead would
leave the server half-patched: upstream's own Engram layer would then load every table into
GPU memory (189 GiB for DeepSeek-V4.1-Flash).

Imported by the plugin in every SGLang process that imports a patched module: standard
library only (the errors module is imported only when a target is missing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ..serving.upstream import SGLANG_TESTED, sglang_version  # noqa: F401  (the targets were checked against it)

# What a target's hook does to the attribute (the verb is the error line's).
ACTIONS = {
    "wrap": "wraps",  # hook(original, self, *args, **kwargs) becomes the method (wrap_method)
    "replace": "replaces",  # the attribute becomes hook(original)
    "extend": "extends",  # hook(attribute) changes it in place (e.g. a registry's dict)
    "hook-around": "hooks",  # registered with SGLang's HookRegistry as AROUND when the plugin loads
    "hook-after": "hooks",  # ... as AFTER
    "use": "calls",  # read, never patched: checked present like the others (hook None)
}


@dataclass(frozen=True)
class Target:
    module: str  # the module SGLang imports
    attr: str  # "Class.method", "Class" or "function" inside it
    action: str  # a key of ACTIONS
    hook: Optional[Callable] = None
    says: str = ""  # the error line's verb phrase, when ACTIONS' is too plain

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"{self.name}: action {self.action!r} is none of {', '.join(ACTIONS)}")

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"

    @property
    def how(self) -> str:
        return self.says or ACTIONS[self.action]

    @property
    def on_import(self) -> bool:
        """Applied when SGLang imports the module (not a HookRegistry hook, which SGLang applies)."""
        return not self.action.startswith("hook-")


def _lookup(obj, attr: str):
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def missing_targets(module, targets: Iterable[Target], module_name: Optional[str] = None) -> list[Target]:
    """The targets of `module` (SGLang's module `module_name`) that it lacks."""
    module_name = module_name or module.__name__
    out = []
    for t in targets:
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


def check_module(module, targets: Iterable[Target], module_name: Optional[str] = None) -> None:
    """Raise PatchTargetMissing naming the first target `module` lacks."""
    missing = missing_targets(module, targets, module_name)
    if missing:
        from ..core.errors import PatchTargetMissing

        raise PatchTargetMissing(missing_message(missing[0]))


def apply(targets: Iterable[Target], module, *, only: Optional[str] = None) -> None:
    """Patch `module` with each of its targets applied on import (or the one whose attr is `only`)."""
    for t in targets:
        if not t.on_import or t.action == "use" or (only is not None and t.attr != only):
            continue
        owner_path, _, leaf = t.attr.rpartition(".")
        owner = _lookup(module, owner_path) if owner_path else module
        if t.action == "wrap":
            wrap_method(owner, leaf, t.hook)
        elif t.action == "replace":
            original = getattr(owner, leaf)
            if not getattr(original, "_engram_sglang", False):  # a plugin loaded twice replaces once
                replacement = t.hook(original)
                replacement._engram_sglang = True
                setattr(owner, leaf, replacement)
        else:
            t.hook(getattr(owner, leaf))


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

        raise PatchTargetMissing(missing_message(Target(cls.__module__, f"{cls.__qualname__}.{name}", "wrap")))
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
