"""Where the native libraries are found, and the host ones built when nowhere to be found.

One lookup for every library (ops/native.py loads the gather libraries, stores/rowio.py the
disk tier's row reads), first hit wins:

1. ENGRAM_KERNELS_DIR, when set (the images point it at their build);
2. the repository's build/kernels, when the package runs from a checkout (`make kernels`,
   `make rowio`; editable installs);
3. engram_sglang/_lib inside the installed package (for whoever prebuilds into it);
4. host libraries only (libengram_cpu.so, libengram_rowio.so): a build on first use, from the
   sources the wheel carries (engram_sglang/_kernels, copied there by setup.py) with the
   flags of kernels/host-flags.mk, into $XDG_CACHE_HOME/engram-sglang/<version>-<digest>/.

The GPU libraries are never built here: they need a vendor toolchain, and the images build
them (`make kernels VENDOR=...`). Standard library only, so that importing it is cheap.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

_PACKAGE = Path(__file__).resolve().parents[1]  # engram_sglang/
_CHECKOUT = _PACKAGE.parent

# library -> (its source, relative to the kernels directory; its flags in host-flags.mk)
HOST_LIBS = {
    "libengram_cpu.so": ("cpu/engram_gather.cpp", "ENGRAM_CPU_CXXFLAGS"),
    "libengram_rowio.so": ("io/engram_rowio.cpp", "ENGRAM_ROWIO_CXXFLAGS"),
}
# What the host builds read: their sources, every header they include, the flags. The one list:
# the wheel carries these (setup.py), the first-use build hashes them, and
# tests/kernels/test_native_abi.py checks it against what the compiler reports the sources include.
HOST_SOURCES = ("cpu/engram_gather.cpp", "cpu/engram_cpu_abi.h", "cpu/engram_decode_avx512.h",
                "common/engram_gather.h", "common/engram_denormals.h", "common/engram_status.h",
                "io/engram_rowio.cpp", "io/engram_rowio_abi.h", "io/engram_disk_step.h",
                "io/engram_dram_policy.h", "io/engram_uring.h", "host-flags.mk")


class NativeLibraryError(RuntimeError):
    """A native library that is nowhere to be found and cannot be built here (one line)."""


def _is_checkout() -> bool:
    return (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "kernels").is_dir()


def kernels_dir() -> Path:
    """The first place prebuilt libraries are looked for: ENGRAM_KERNELS_DIR, else the
    checkout's build/kernels, else the installed package's _lib."""
    return search_dirs()[0]


def search_dirs() -> list[Path]:
    """The directories searched for a prebuilt library, in order."""
    dirs = []
    env = os.environ.get("ENGRAM_KERNELS_DIR")
    if env:
        dirs.append(Path(env))
    if _is_checkout():
        dirs.append(_CHECKOUT / "build" / "kernels")
    dirs.append(_PACKAGE / "_lib")
    return dirs


def sources_dir() -> Optional[Path]:
    """The host libraries' sources: the wheel's copy, else the checkout's kernels/; None if neither."""
    for d in (_PACKAGE / "_kernels", _CHECKOUT / "kernels"):
        if all((d / s).is_file() for s in HOST_SOURCES):
            return d
    return None


def find(name: str) -> Optional[Path]:
    """The first prebuilt `name` in search_dirs(), or None."""
    for d in search_dirs():
        if (d / name).is_file():
            return d / name
    return None


def locate(name: str) -> Path:
    """The path of library `name`: prebuilt, or (host libraries) built now into the cache.
    Raises NativeLibraryError with one line saying where it looked and what to do."""
    path = find(name)
    if path is not None:
        if name in HOST_LIBS:
            _check_loads(path, f"rebuild it (`make {_MAKE_TARGET[name]}`) or delete it")
        return path
    where = ", ".join(str(d) for d in search_dirs())
    if name not in HOST_LIBS:
        raise NativeLibraryError(f"{name} not built: not in {where} (run `make kernels`, "
                                 f"or set ENGRAM_KERNELS_DIR to the directory holding it)")
    return build_host_library(name, where)


_MAKE_TARGET = {"libengram_cpu.so": "kernels-cpu", "libengram_rowio.so": "rowio"}
_log = logging.getLogger("engram_sglang")
_warned: set = set()


def _load_error(path: Path) -> Optional[str]:
    """Why the dynamic loader refuses `path` (a truncated or corrupt file), or None."""
    import ctypes

    try:
        ctypes.CDLL(str(path))
    except OSError as e:
        return str(e)
    return None


def _check_loads(path: Path, fix: str) -> None:
    """A host library that does not load is one line naming it and the fix, logged once as a
    WARNING too: a gather backend falls back to torch on it, which must not pass silently."""
    why = _load_error(path)
    if why is not None:
        message = f"{path} does not load ({why}): {fix}"
        if path not in _warned:  # backend probing asks again: one warning per file and process
            _warned.add(path)
            _log.warning("engram-sglang: %s", message)
        raise NativeLibraryError(message)


def read_flags(path: Path) -> dict[str, list[str]]:
    """The `NAME := flags` lines of host-flags.mk."""
    flags = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if ":=" in line:
            key, _, value = line.partition(":=")
            flags[key.strip()] = shlex.split(value)
    return flags


def compiler() -> Optional[list[str]]:
    """$CXX (split like a shell word list), else the first of c++, g++, clang++ on PATH."""
    env = os.environ.get("CXX")
    if env:
        words = shlex.split(env)
        return words if words and shutil.which(words[0]) else None
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    return None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "engram-sglang"


def build_host_library(name: str, where: str = "") -> Path:
    """Build host library `name` into the cache (once per version, sources, flags and compiler;
    under a lock, so that the ranks starting together build it once) and return its path."""
    from .. import __version__

    src = sources_dir()
    looked = f"not in {where}" if where else "not prebuilt"
    if src is None:
        raise NativeLibraryError(f"{name} {looked}, and this installation carries no sources to build it "
                                 f"from (engram_sglang/_kernels): reinstall engram-sglang from its wheel")
    cxx = compiler()
    if cxx is None:
        what = f"CXX={os.environ['CXX']!r} is not a program on PATH" if os.environ.get("CXX") else \
            "no C++ compiler (c++, g++ or clang++) on PATH"
        raise NativeLibraryError(f"{name} {looked}, and {what} to build it on first use: install g++ (or set "
                                 f"CXX), or set ENGRAM_KERNELS_DIR to a directory holding a built {name}")
    source, flags_name = HOST_LIBS[name]
    flags = read_flags(src / "host-flags.mk")[flags_name]
    digest = hashlib.sha256()
    for part in HOST_SOURCES:
        digest.update((src / part).read_bytes())
    digest.update(" ".join(cxx + flags).encode())
    out_dir = cache_root() / f"{__version__}-{digest.hexdigest()[:12]}"
    out = out_dir / name
    if out.is_file() and _load_error(out) is None:
        return out
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if out.is_file():  # another process built it while this one waited, or a corrupt one
                if _load_error(out) is None:
                    return out
                _log.warning("engram-sglang: %s does not load (a corrupt cached build): building it again", out)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
            os.close(fd)
            cmd = [*cxx, *flags, "-shared", "-o", tmp, str(src / source)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                os.unlink(tmp)
                log = out_dir / f"{name}.log"
                log.write_text(shlex.join(cmd) + "\n" + run.stdout + run.stderr)
                first = next((ln for ln in run.stderr.splitlines() if "error" in ln),
                             run.stderr.strip()[:200] or f"exit status {run.returncode}")
                raise NativeLibraryError(f"{name}: building it on first use with {cxx[0]} failed: {first.strip()} "
                                         f"(full log: {log})")
            os.replace(tmp, out)  # whole or absent: a process that finds it never loads half a file
            _check_loads(out, f"delete {out_dir} and retry, or set ENGRAM_KERNELS_DIR to a directory holding a "
                              f"built {name}")
    except OSError as e:
        raise NativeLibraryError(f"{name}: cannot build it into {out_dir}: {e.strerror or e} (set XDG_CACHE_HOME "
                                 f"to a writable directory, or ENGRAM_KERNELS_DIR to one holding a built {name})") \
            from None
    return out
