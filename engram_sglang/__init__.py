"""engram-sglang: serve Engram n-gram memory tables from HBM, pinned host DRAM or SSD."""

from .config import EngramConfig
from .errors import EngramConfigError, EngramError, TableFormatError, TokenizerMismatchError
from .hashing import EngramLayout, HashHistory, NgramHasher
from . import rowformat

__all__ = [
    "EngramConfig",
    "EngramConfigError",
    "EngramError",
    "EngramLayout",
    "HashHistory",
    "NgramHasher",
    "TableFormatError",
    "TokenizerMismatchError",
    "rowformat",
]
__version__ = "0.1.0"
