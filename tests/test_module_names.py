"""Module names written as strings in the tests, benches and fuzzers (importorskip, startswith, logger names,
monkeypatch targets, sys.modules keys) name modules that exist, by their current paths.

A moved module leaves such strings pointing at nothing, and most of them then fail silently:
a `startswith` that matches no module, a logger name no record carries, an importorskip that
skips. Each string `engram_sglang.a.b.c` must resolve as a module followed by attributes of it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import engram_sglang

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "engram_sglang"


def module_strings(root: Path) -> list[tuple[str, str]]:
    """(file:line, string) of every string constant in root's Python files that names the package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # this file's negative controls name stale paths on purpose
        tree = ast.parse(path.read_text(), str(path))
        pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces:
                text = node.value
                if (text == PREFIX or text.startswith(PREFIX + ".")) and text.replace(".", "").replace("_", "").isalnum():
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", text))
    return found


def unresolved(name: str) -> str | None:
    """Why `name` (module[.attr...]) names nothing, or None if it does."""
    if engram_sglang.moved_to(name) is not None:
        return f"an old path (now {engram_sglang.moved_to(name)})"
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(module)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{module} has no {'.'.join(parts[i:])}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def test_every_module_name_in_the_tests_exists():
    strings = [s for d in ("tests", "bench", "fuzz") for s in module_strings(ROOT / d)]
    assert len(strings) >= 30, strings  # the scan itself still finds them
    bad = [f"{where}: {name!r}: {why}" for where, name in strings if (why := unresolved(name))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name, why", [
    ("engram_sglang.stores.cache", "an old path"),  # moved to engram_sglang.core.stores.cache
    ("engram_sglang.core.plan", "has no plan"),  # a stale startswith prefix
    ("engram_sglang.serving.runtime.NO_SUCH", "has no NO_SUCH"),  # a monkeypatch target gone
])
def test_a_stale_name_is_reported(name, why):
    assert why in (unresolved(name) or ""), unresolved(name)
    assert unresolved("engram_sglang.core.stores.cache.HotRowCache") is None
