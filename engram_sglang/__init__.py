"""engram-sglang: serve Engram n-gram memory tables from HBM, pinned host DRAM or SSD."""

from .config import EngramConfig
from .errors import EngramConfigError, EngramError, TableFormatError, TokenizerMismatchError
from .hashing import EngramLayout, HashHistory, NgramHasher
from . import rowformat
from .ops import gather_dequant, probe
from .stores import TableStore, open_store

__all__ = [
    "EngramConfig",
    "EngramConfigError",
    "EngramError",
    "EngramLayout",
    "HashHistory",
    "NgramHasher",
    "TableFormatError",
    "TokenizerMismatchError",
    "TableStore",
    "gather_dequant",
    "open_store",
    "probe",
    "rowformat",
]
__version__ = "0.1.0"
