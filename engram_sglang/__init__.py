"""engram-sglang: serve Engram n-gram memory tables from HBM, pinned host DRAM or SSD.

The public names below are imported on first use, not here: SGLang imports this package
in every one of its processes (main, scheduler, detokenizer) to reach `plugin.load`, and
that must not register the gather op, open the stores' modules or create Prometheus
collectors (docs/architecture.md, "Import time").
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> (module relative to this package, attribute; None for the module itself)
_PUBLIC = {
    "EngramConfig": (".config", "EngramConfig"),
    "EngramConfigError": (".errors", "EngramConfigError"),
    "EngramError": (".errors", "EngramError"),
    "TableFormatError": (".errors", "TableFormatError"),
    "TokenizerMismatchError": (".errors", "TokenizerMismatchError"),
    "EngramLayout": (".hashing", "EngramLayout"),
    "HashHistory": (".hashing", "HashHistory"),
    "NgramHasher": (".hashing", "NgramHasher"),
    "rowformat": (".rowformat", None),
    "tablefile": (".tablefile", None),
    "gather_dequant": (".ops", "gather_dequant"),
    "probe": (".ops.probe", None),
    "TableStore": (".stores", "TableStore"),
    "open_store": (".stores", "open_store"),
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
