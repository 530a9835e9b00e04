"""Record files: named numpy arrays plus one JSON metadata entry, in one compressed .npz.

The profile (`engram-sglang profile`), the planner's decode trace (`profile --trace`) and the
gate statistics (`scan --gate-stats`) are record files. Each has a `RecordFormat`: a name and
a version, written as the metadata's "format" value `NAME-vVERSION` (the layout the files have
always had: the arrays as `np.savez_compressed` names them, the metadata as the UTF-8 bytes of
a JSON object in a uint8 array named `meta`).

Writing is atomic: a temporary file beside the target, then os.replace; the temporary file is
removed on any failure, so a reader sees the old file or the new one, never half of one.
Reading never unpickles (a file is data, not code), checks the format and the arrays a format
requires, and turns every way a file can be broken into the format's error with one line that
names the file and what is wrong.

Stdlib and numpy only: the stores (core) read profiles, and the tools read and write all three.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import zipfile
import zlib
from pathlib import Path
from typing import Iterable, Mapping, Optional, Type

import numpy as np

from .errors import EngramError
from .fileio import open_regular

META = "meta"  # the array holding the JSON metadata
MAX_META_BYTES = 1 << 24
ZIP_MAGIC = b"PK\x03\x04"
# What a broken or hostile archive raises while numpy and zipfile read it.
READ_ERRORS = (OSError, ValueError, KeyError, EOFError, TypeError, NotImplementedError, zipfile.BadZipFile,
               zlib.error, RecursionError)


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """One kind of record file. `label` names it in messages ("profile": "no such profile
    file", "not an engram profile file (...)"); `missing_hint` follows "no such ... file"
    (how to make one); `error` is the EngramError subclass its problems raise."""

    name: str
    version: int
    label: str
    error: Type[EngramError] = EngramError
    missing_hint: str = ""

    @property
    def tag(self) -> str:
        """The metadata's "format" value."""
        return f"{self.name}-v{self.version}"

    def problem(self, meta) -> Optional[str]:
        """Why metadata `meta` is not of this format, or None."""
        if not isinstance(meta, dict):
            return f"its meta is {type(meta).__name__}, not an object"
        got = meta.get("format")
        if got == self.tag:
            return None
        newer = re.fullmatch(re.escape(self.name) + r"-v(\d+)", got) if isinstance(got, str) else None
        if newer and int(newer[1]) > self.version:
            return f"format {got!r} is newer than this engram-sglang reads ({self.tag}): upgrade engram-sglang"
        return f"format {got!r}, want {self.tag}"


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:100]}"


# ------------------------------------------------------------------------ write
def write_record(path: str | os.PathLike, fmt: RecordFormat, arrays: Mapping[str, np.ndarray], meta: Mapping) -> Path:
    """Write `arrays` and `meta` (JSON-serializable; "format" is set to `fmt.tag`, first)
    to `path` (in an existing directory: a missing one is an error, not made) atomically. A
    failure to write is `fmt.error` with one line; the target is then
    untouched and no temporary file is left."""
    path = Path(path)
    entries = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        if name == META or a.dtype.hasobject:  # an object array would be written as a pickle
            raise ValueError(f"record array {name!r}: {'the name of the metadata' if name == META else 'objects'}")
        entries[name] = a
    body = {"format": fmt.tag, **meta}
    body["format"] = fmt.tag
    entries[META] = np.frombuffer(json.dumps(body).encode(), dtype=np.uint8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    created = False
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "is a directory")
        # O_EXCL: a name nobody else writes; 0o666 less the umask, as a plain open would give.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        created = True
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **entries)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if created:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise fmt.error(f"{path}: cannot write the {fmt.label} file ({e.strerror or e})") from None
        raise
    return path


# ------------------------------------------------------------------------ read
class Record:
    """An open record file: `meta`, the array names (`files`), each array's header without
    reading it, and its arrays read on demand. Close it (or use `with`) when done."""

    def __init__(self, path: Path, fmt: RecordFormat, data: np.lib.npyio.NpzFile, meta: dict, fileobj):
        self.path, self.fmt, self.data, self.meta, self._file = path, fmt, data, meta, fileobj

    @property
    def files(self) -> list[str]:
        return [k for k in self.data.files if k != META]

    def numbered(self, prefix: str) -> list[int]:
        """The N of every array named `prefix` + N (a layer id), sorted."""
        return sorted(int(k[len(prefix):]) for k in self.files if re.fullmatch(re.escape(prefix) + r"\d+", k))

    def header(self, key: str, where: Optional[str] = None) -> tuple[tuple, np.dtype]:
        """(shape, dtype) of array `key`, from its .npy header alone (a huge or broken array
        is refused before it is read)."""
        where = where or str(self.path)
        try:
            with self.data.zip.open(f"{key}.npy") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
        except KeyError:
            raise self.fmt.error(f"{where}: missing array {key!r}") from None
        except READ_ERRORS as e:
            raise self.fmt.error(f"{where}: unreadable ({_why(e)})") from None
        return shape, dtype

    def array(self, key: str, where: Optional[str] = None) -> np.ndarray:
        """Array `key` (never unpickled), or `fmt.error` with one line."""
        where = where or str(self.path)
        if key not in self.data.files:
            raise self.fmt.error(f"{where}: missing array {key!r}")
        try:
            return self.data[key]
        except READ_ERRORS as e:
            raise self.fmt.error(f"{where}: unreadable ({_why(e)})") from None

    def close(self) -> None:
        self.data.close()
        self._file.close()

    def __del__(self) -> None:  # an unclosed record (a Profile left to the collector) closes its file
        self._file.close()

    def __enter__(self) -> "Record":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_meta(data: np.lib.npyio.NpzFile):
    if META not in data.files:
        raise ValueError("no meta entry")
    info = data.zip.getinfo(f"{META}.npy")
    if info.file_size > MAX_META_BYTES:
        raise ValueError(f"its meta entry is over {MAX_META_BYTES >> 20} MiB")
    meta = data[META]
    if meta.dtype != np.uint8 or meta.ndim != 1:
        raise ValueError(f"its meta entry is {meta.dtype} {list(meta.shape)}, not JSON bytes")
    return json.loads(meta.tobytes().decode())


def read_record(path: str | os.PathLike, fmt: RecordFormat, required: Iterable[str] = ()) -> Record:
    """Open a record file of format `fmt` holding at least the arrays `required`. Anything
    else (no such file, not a regular file, not an .npz, a pickle, no or broken metadata,
    another format or version, a required array missing) is `fmt.error` with one line."""
    path = Path(path)
    try:
        fd = open_regular(path, fmt.error, f"{fmt.label} file")  # a FIFO would block np.load
    except FileNotFoundError:
        raise fmt.error(f"{path}: no such {fmt.label} file{fmt.missing_hint}") from None
    f = os.fdopen(fd, "rb")
    try:
        if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:  # a lone .npy would be read whole, a pickle refused
            raise ValueError("not an .npz archive")
        f.seek(0)
        data = np.load(f, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        meta = _read_meta(data)
        problem = fmt.problem(meta) or next((f"no array {k!r}" for k in required if k not in data.files), None)
    except READ_ERRORS as e:
        f.close()
        raise fmt.error(f"{path}: not an engram {fmt.label} file ({_why(e)})") from None
    except BaseException:
        f.close()
        raise
    if problem:
        data.close()
        f.close()
        raise fmt.error(f"{path}: not an engram {fmt.label} file ({problem})")
    return Record(path, fmt, data, meta, f)
