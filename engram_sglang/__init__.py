"""engram-sglang: serve Engram n-gram memory tables from HBM, pinned host DRAM or SSD.

The public names below are imported on first use, not here: SGLang imports this package
in every one of its processes (main, scheduler, detokenizer) to reach `plugin.load`, and
that must not register the gather op, open the stores' modules or create Prometheus
collectors (docs/architecture.md, "Import time").

The modules that the re-layout into five rooms moved (`_MOVED`) still import by their old
paths for one release: the old path gives the new module itself (one module object, so
patches and isinstance checks agree) and warns once; `python -m` of an old command path runs
the new module's `main()`. README.md, "Upgrade notes", lists them.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings

__version__ = "0.1.0"

# public name -> (module relative to this package, attribute; None for the module itself)
_PUBLIC = {
    "EngramConfig": (".core.config", "EngramConfig"),
    "EngramConfigError": (".core.errors", "EngramConfigError"),
    "EngramError": (".core.errors", "EngramError"),
    "TableFormatError": (".core.errors", "TableFormatError"),
    "TokenizerMismatchError": (".core.errors", "TokenizerMismatchError"),
    "EngramLayout": (".core.hashing", "EngramLayout"),
    "HashHistory": (".core.hashing", "HashHistory"),
    "NgramHasher": (".core.hashing", "NgramHasher"),
    "rowformat": (".core.rowformat", None),
    "tablefile": (".core.tablefile", None),
    "gather_dequant": (".core.ops", "gather_dequant"),
    "probe": (".core.ops.probe", None),
    "TableStore": (".core.stores", "TableStore"),
    "open_store": (".core.stores", "open_store"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    try:
        module_name, attr = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


# ------------------------------------------------------------------ moved modules
# old path (relative to the package) -> new path; a package's modules follow it.
_MOVED = {
    "config": "core.config", "errors": "core.errors", "fileio": "core.fileio", "hashing": "core.hashing",
    "nativelibs": "core.nativelibs", "placement_table": "core.placement_table", "rowformat": "core.rowformat",
    "tablefile": "core.tablefile", "ops": "core.ops", "stores": "core.stores",
    "stores.placements": "core.stores",  # split into core/stores/device.py and host.py
    "planning": "core.planning", "planning.report": "tools.planner_report",
    "layer": "models.layer", "patching": "plugin.targets",
    "cli": "tools.cli", "planner": "tools.planner", "profiling": "tools.profiling", "analysis": "tools.analysis",
    "demo": "tools.demo.run", "demo_corpus": "tools.demo.corpus", "demo_model": "tools.demo.model",
    "demo_prompts": "tools.demo.prompts", "demo_serve": "tools.demo.serve",
}
_warned: set[str] = set()


def moved_to(name: str):
    """The new dotted name of an old module path of the package, or None if it did not move."""
    prefix = __name__ + "."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    old = rest
    while old not in _MOVED:
        old, dot, _ = old.rpartition(".")
        if not dot:
            return None
    return prefix + _MOVED[old] + rest[len(old):]


class _Forward:
    """Loader of an old path: the new module itself, or (for `python -m`) code that runs its main()."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        if spec.name not in _warned:
            _warned.add(spec.name)
            warnings.warn(f"{spec.name} moved to {self.new}; the old path goes in the next release",
                          FutureWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass  # the new module ran when imported

    def get_code(self, name):  # runpy (`python -m OLD`): run the new module's main()
        warnings.warn(f"python -m {name}: moved to python -m {self.new}; the old path goes in the next release",
                      FutureWarning, stacklevel=2)
        return compile(f"import sys\nfrom {self.new} import main\nsys.exit(main())\n", f"<{name}: moved to {self.new}>",
                       "exec")


class _MovedFinder:
    """Finds old paths before the file system does (a package's old submodule path would
    otherwise load a second copy of the new module)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        new = moved_to(name)
        if new is None:
            return None
        import importlib.util

        found = importlib.util.find_spec(new)
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(name, _Forward(new), is_package=found.submodule_search_locations is not None)


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
