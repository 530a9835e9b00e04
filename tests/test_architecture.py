"""The rooms' import rules of docs/architecture.md, read from the source (AST), not by running it.

* the core (config, hashing, rowformat, tablefile, ops, stores) never imports sglang, directly or
  through another module of the package;
* ops never import stores;
* models reach the stores only through `open_store` / `TableStore` of `engram_sglang.core.stores`;
* stores never import serving or models;
* kernels/ has no torch (no include, no import).

Every import counts, also one inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "engram_sglang"
# The stand-in for sgl_kernel is a folder put on PYTHONPATH for CPU runs, not a module of the package.
NOT_PACKAGE = ROOT / PACKAGE / "serving" / "cpu_shim"

CORE = ("config", "errors", "placement_table", "hashing", "rowformat", "tablefile", "ops", "stores")
MODEL_ENTRY_TO_STORES = {"open_store", "TableStore"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, source: str | None = None) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) of every import in a file, relative
    imports resolved to absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out += [(node.lineno, target, a.name) for a in node.names]
    return out


def package_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py")) if NOT_PACKAGE not in p.parents}


def targets(module: str, name: str | None, known: set[str]) -> set[str]:
    """Modules an import names: `from a import b` names a.b as well when a.b is a module."""
    found = {module}
    if name and f"{module}.{name}" in known:
        found.add(f"{module}.{name}")
    return found


def within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def in_core(module: str) -> bool:
    return any(within(module, f"{PACKAGE}.{room}") for room in CORE)


def violations(files: dict[str, Path], sources: dict[str, str] | None = None) -> list[str]:
    sources = sources or {}
    known = set(files)
    graph: dict[str, set[str]] = {}
    found = []
    for mod, path in files.items():
        edges = set()
        for line, target, name in imports_of(path, sources.get(mod)):
            where = f"{path.relative_to(ROOT)}:{line}"
            named = targets(target, name, known)
            edges |= {t for t in named if t in known}
            if within(mod, f"{PACKAGE}.ops") and any(within(t, f"{PACKAGE}.stores") for t in named):
                found.append(f"{where}: ops import stores ({target})")
            if within(mod, f"{PACKAGE}.stores") and any(within(t, f"{PACKAGE}.{room}") for t in named
                                                        for room in ("serving", "models")):
                found.append(f"{where}: stores import {target}")
            if within(mod, f"{PACKAGE}.models") and any(within(t, f"{PACKAGE}.stores") for t in named):
                if target != f"{PACKAGE}.stores" or name not in MODEL_ENTRY_TO_STORES:
                    what = f"{target}.{name}" if name else target
                    found.append(f"{where}: models reach the stores only through open_store/TableStore, not {what}")
            if in_core(mod) and any(within(t, "sglang") for t in named):
                found.append(f"{where}: the core imports {target}")
        graph[mod] = edges
    # sglang through another module of the package counts too: follow the package's own imports.
    direct_sglang = {m for m, p in files.items()
                     if any(within(t, "sglang") for _, t, _ in imports_of(p, sources.get(m)))}
    for mod in sorted(m for m in files if in_core(m)):
        seen, stack, parent = {mod}, [mod], {}
        while stack:
            cur = stack.pop()
            for nxt in sorted(graph.get(cur, ())):
                if nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = cur
                    stack.append(nxt)
        for bad in sorted((seen - {mod}) & direct_sglang):
            chain = [bad]
            while chain[-1] != mod:
                chain.append(parent[chain[-1]])
            found.append(f"{mod} reaches sglang through {' -> '.join(reversed(chain))}")
    return found


def test_package_rooms_keep_their_import_rules():
    found = violations(package_files())
    assert not found, "\n".join(found)


TORCH_IN_NATIVE = re.compile(r'^\s*#\s*include\s*[<"](torch/|ATen/|c10/)|pybind11|TORCH_LIBRARY', re.M)


def kernel_violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(ROOT)
        if path.suffix == ".py":
            for line, target, _ in imports_of(path):
                if within(target, "torch"):
                    found.append(f"{rel}:{line}: imports {target}")
        elif path.suffix in {".h", ".hpp", ".cuh", ".c", ".cc", ".cpp", ".cu", ".hip"}:
            for m in TORCH_IN_NATIVE.finditer(path.read_text(errors="replace")):
                found.append(f"{rel}:{path.read_text(errors='replace')[:m.start()].count(chr(10)) + 1}: {m.group(0).strip()}")
    return found


def test_kernels_have_no_torch():
    assert (ROOT / "kernels").is_dir()
    found = kernel_violations(ROOT / "kernels")
    assert not found, "\n".join(found)


# ------------------------------------------------------------ negative controls
@pytest.mark.parametrize("module, line, expected", [
    ("engram_sglang.core.ops.gather", "from ..stores import open_store", "ops import stores"),
    ("engram_sglang.core.ops.gather", "import engram_sglang.core.stores.placements", "ops import stores"),
    ("engram_sglang.core.stores.base", "from ..serving.settings import ServeSettings", "stores import engram_sglang.serving"),
    ("engram_sglang.core.stores.placements", "from .. import models", "stores import engram_sglang"),
    ("engram_sglang.models.qwen3_engram", "from ..stores.placements import HostStore",
     "models reach the stores only through open_store/TableStore"),
    ("engram_sglang.models.qwen3_engram", "from ..stores import DiskStore",
     "models reach the stores only through open_store/TableStore"),
    ("engram_sglang.core.hashing", "def f():\n    from sglang.srt.layers import engram", "the core imports sglang"),
    # through another module: the rowformat core module imports serving.history, which imports sglang
    ("engram_sglang.core.rowformat", "from .serving import history", "reaches sglang through"),
])
def test_a_broken_rule_is_reported(module, line, expected):
    files = package_files()
    source = files[module].read_text() + "\n" + line + "\n"
    found = violations(files, {module: source})
    assert any(expected in v for v in found), found


def test_torch_in_kernels_is_reported(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "kernels" / "cuda").mkdir(parents=True)
    (tmp_path / "kernels" / "cuda" / "x.cu").write_text('#include <cuda.h>\n#include <torch/extension.h>\n')
    (tmp_path / "kernels" / "x.py").write_text("import torch.utils.cpp_extension\n")
    found = kernel_violations(tmp_path / "kernels")
    assert any("x.cu:2" in v for v in found) and any("x.py:1" in v for v in found), found


# ------------------------------------------------------------------ import circles
def import_cycles(files: dict[str, Path], sources: dict[str, str] | None = None) -> list[list[str]]:
    """Circles among the package's modules (strongly connected groups of the import graph,
    lazy imports included). `from a import b` with a.b a module is an edge to a.b alone, and
    a module's import of its own package is no edge: Python runs a package's __init__ before
    any of its modules in any case."""
    sources = sources or {}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges = set()
        for _, target, name in imports_of(path, sources.get(mod)):
            t = f"{target}.{name}" if name and f"{target}.{name}" in known else target
            if t in known and t != mod and not within(mod, t):
                edges.add(t)
        graph[mod] = edges
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    circles = import_cycles(package_files())
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_an_import_circle_is_reported():
    # The circle there was: the demo model imported the demo for its corpus, the demo the model.
    files = package_files()
    module = "engram_sglang.tools.demo.model"
    source = files[module].read_text() + "\n\ndef f():\n    from .demo import demo_corpus\n"
    circles = import_cycles(files, {module: source})
    assert any({"engram_sglang.tools.demo.run", "engram_sglang.tools.demo.model"} <= set(c) for c in circles), circles
