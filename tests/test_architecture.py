"""The rooms' rules of docs/architecture.md, read from the source (AST), not by running it.

The package has five rooms, each a top-level package, in this order:

    core < serving < models < plugin < tools

* the room of a module is the component after `engram_sglang.`; a module in no room is reported
  (the package's own `__init__` is the only one outside; `testing.py` belongs to tools);
* a room imports only itself and the rooms before it: the core no other room, serving never
  models, plugin or tools, and nothing outside tools imports tools;
* the core never imports sglang, directly or through another module of the package;
* only plugin/ calls `wrap_method` or assigns to an attribute of an sglang module or class;
* inside the core: ops never import stores; models reach the stores only through
  `open_store` / `TableStore` of `engram_sglang.core.stores`;
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

ROOMS = ("core", "serving", "models", "plugin", "tools")
# Modules whose room is not their first component: the shared test helpers are a tool.
ROOM_OF = {f"{PACKAGE}.testing": "tools"}
STORES = f"{PACKAGE}.core.stores"
OPS = f"{PACKAGE}.core.ops"
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


def room_of(module: str) -> str | None:
    """The room of a module of the package (None: in no room; "" for the package itself)."""
    if module == PACKAGE:
        return ""
    if module in ROOM_OF:
        return ROOM_OF[module]
    first = module.split(".")[1]
    return first if first in ROOMS else None


def in_core(module: str) -> bool:
    return room_of(module) == "core"


def sglang_names(tree: ast.AST) -> set[str]:
    """Names a module binds to sglang modules or their members (`import sglang.x as m`,
    `from sglang.srt.x import Cls`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if within(a.name, "sglang")}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and within(node.module, "sglang"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_outside_plugin(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, what) of each SGLang patch in a module: a `wrap_method` call, or an assignment
    (`x.attr = ...`, `setattr(x, ...)`) to an attribute of a name bound to sglang."""
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    # A patch function receives SGLang's module as its parameter `module` (plugin/'s convention).
    bound = sglang_names(tree) | {"module"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called == "wrap_method":
                found.append((node.lineno, "calls wrap_method"))
            elif called == "setattr" and node.args and _root_name(node.args[0]) in bound:
                found.append((node.lineno, f"setattr on sglang's {_root_name(node.args[0])}"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and _root_name(t) in bound:
                    found.append((node.lineno, f"assigns to sglang's {ast.unparse(t)}"))
    return found


def violations(files: dict[str, Path], sources: dict[str, str] | None = None) -> list[str]:
    sources = sources or {}
    known = set(files)
    graph: dict[str, set[str]] = {}
    found = []
    for mod, path in files.items():
        room = room_of(mod)
        rel = path.relative_to(ROOT)
        if room is None:
            found.append(f"{rel}: {mod} is in no room (one of {', '.join(ROOMS)})")
            room = ""
        edges = set()
        for line, target, name in imports_of(path, sources.get(mod)):
            where = f"{rel}:{line}"
            named = targets(target, name, known)
            edges |= {t for t in named if t in known}
            for t in sorted(named & known):
                theirs = room_of(t)
                if room and theirs and ROOMS.index(theirs) > ROOMS.index(room):
                    found.append(f"{where}: {room} imports {theirs} ({t}): rooms go {' < '.join(ROOMS)}")
                elif room == "core" and theirs and theirs != "core":
                    found.append(f"{where}: the core imports {theirs} ({t})")
            if within(mod, OPS) and any(within(t, STORES) for t in named):
                found.append(f"{where}: ops import stores ({target})")
            if room == "models" and any(within(t, STORES) for t in named):
                if target != STORES or name not in MODEL_ENTRY_TO_STORES:
                    what = f"{target}.{name}" if name else target
                    found.append(f"{where}: models reach the stores only through open_store/TableStore, not {what}")
            if in_core(mod) and any(within(t, "sglang") for t in named):
                found.append(f"{where}: the core imports {target}")
        if room != "plugin":
            for line, what in patches_outside_plugin(path, sources.get(mod)):
                found.append(f"{rel}:{line}: {what}: SGLang is patched only in plugin/")
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
    ("engram_sglang.core.ops.gather", "import engram_sglang.core.stores.host", "ops import stores"),
    ("engram_sglang.core.stores.base", "from ...serving.settings import ServeSettings", "core imports serving"),
    ("engram_sglang.core.stores.host", "from ... import models", "core imports models"),
    ("engram_sglang.models.qwen3_engram", "from ..core.stores.host import HostStore",
     "models reach the stores only through open_store/TableStore"),
    ("engram_sglang.models.qwen3_engram", "from ..core.stores import DiskStore",
     "models reach the stores only through open_store/TableStore"),
    ("engram_sglang.core.hashing", "def f():\n    from sglang.srt.layers import engram", "the core imports sglang"),
    # through another module: the rowformat core module imports serving.history, which imports sglang
    ("engram_sglang.core.rowformat", "from ..serving import history", "reaches sglang through"),
    ("engram_sglang.serving.runtime", "from ..models import reference", "serving imports models"),
    ("engram_sglang.serving.settings", "from ..plugin import targets", "serving imports plugin"),
    ("engram_sglang.models.layer", "from ..tools.demo import model", "models imports tools"),
    ("engram_sglang.core.config", "from .. import testing", "core imports tools"),
    ("engram_sglang.plugin.targets", "from .. import testing", "plugin imports tools"),
    # SGLang patched outside plugin/: a wrap_method call, an assignment, a setattr
    ("engram_sglang.serving.modes", "def f(m):\n    from ..plugin.targets import wrap_method\n    wrap_method(m.X, 'y', f)",
     "calls wrap_method"),
    ("engram_sglang.serving.readahead", "from sglang.srt.managers import scheduler\nscheduler.Scheduler.run_batch = None",
     "assigns to sglang's scheduler.Scheduler.run_batch"),
    ("engram_sglang.models.layer", "from sglang.srt.layers.engram import EngramHasher\nsetattr(EngramHasher, 'forward', None)",
     "setattr on sglang's EngramHasher"),
])
def test_a_broken_rule_is_reported(module, line, expected):
    files = package_files()
    source = files[module].read_text() + "\n" + line + "\n"
    found = violations(files, {module: source})
    assert any(expected in v for v in found), found


def test_a_module_in_no_room_is_reported():
    files = package_files()
    # a module at the package's top level, outside the five rooms (its text: any module's)
    stray = PACKAGE + ".stray"  # (built, so that no test names a module that does not exist)
    found = violations({**files, stray: files["engram_sglang.core.errors"]})
    assert any(f"{stray} is in no room" in v for v in found), found
    assert room_of("engram_sglang.testing") == "tools" and room_of("engram_sglang") == ""


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
    # The circle there was: the demo model imported the demo run for its corpus, the run the model.
    files = package_files()
    module = "engram_sglang.tools.demo.model"
    source = files[module].read_text() + "\n\ndef f():\n    from .run import demo_corpus\n"
    circles = import_cycles(files, {module: source})
    assert any({"engram_sglang.tools.demo.run", "engram_sglang.tools.demo.model"} <= set(c) for c in circles), circles
