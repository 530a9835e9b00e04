"""One way to patch a method of an SGLang class: wrap it once, keep the original reachable."""

from __future__ import annotations

import functools
from typing import Callable


def wrap_method(cls, name: str, wrapper: Callable) -> None:
    """Replace `cls.name` by a method that calls `wrapper(original, self, *args, **kwargs)`.

    Idempotent per wrapper (the same wrapper again, e.g. a plugin loaded twice, changes
    nothing; another wrapper of the same method wraps the wrapped one); the method it replaced
    stays at `cls.name.__wrapped__`.
    """
    original = getattr(cls, name)
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
