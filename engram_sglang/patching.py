"""One way to patch a method of an SGLang class: wrap it once, keep the original reachable."""

from __future__ import annotations

import functools
from typing import Callable


def wrap_method(cls, name: str, wrapper: Callable) -> None:
    """Replace `cls.name` by a method that calls `wrapper(original, self, *args, **kwargs)`.

    Idempotent (a second call, e.g. a plugin loaded twice, changes nothing); the original
    stays at `cls.name.__wrapped__`.
    """
    original = getattr(cls, name)
    if getattr(original, "_engram_sglang", False):
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    method._engram_sglang = True
    setattr(cls, name, method)
