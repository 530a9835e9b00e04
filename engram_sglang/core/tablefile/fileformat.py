"""The table directory's format: file names, the header page, the manifest's constants, and
the small checks every reader and writer of it shares."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch

FORMAT = "engram-sglang packed rows"
VERSION = 1
MANIFEST = "manifest.json"
DATA_OFFSET = 4096  # header page; rows start page-aligned
CHUNK_ROWS = 1 << 18  # rows per checksum (~66 MiB): a verify error names a small range
_MAGIC = b"ENGRAMRW"
_HEADER = struct.Struct("<8sII")  # magic, format version, header JSON length
MAX_MANIFEST_BYTES = 16 << 20  # DeepSeek-V4.1's manifest is ~60 KB (a checksum per 2^18 rows)
_CHECKSUM = re.compile(r"[0-9a-f]{16}")

RowSource = Union[np.ndarray, torch.Tensor, Iterable[Union[np.ndarray, torch.Tensor]]]


def _no_bar(progress: Optional[bool]) -> Optional[bool]:
    """tqdm's `disable`: None shows a bar only on a terminal."""
    return None if progress is None else not progress


def layer_file_name(layer_id: int) -> str:
    return f"layer-{layer_id}.rows"


@dataclass(frozen=True)
class LayerInfo:
    layer_id: int
    path: Path
    rows: int
    checksums: tuple[str, ...]


def _same_int(v, want: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == want


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _one_line(text: str, limit: int = 120) -> str:
    """A library's words about a file we were handed, kept to one line: they may quote the
    file (safetensors quotes a header's dtype, newline and all), so control characters are
    escaped and long text is cut."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("unicode_escape").decode("ascii")


def _plain_name(name) -> bool:
    """A file name inside the directory itself: no separator, not `.`/`..`, and printable (a
    NUL or a lone surrogate cannot be handed to the OS, a newline would split the one-line
    error naming the file, and no name we write has either)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and name.isprintable()
