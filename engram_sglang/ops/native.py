"""ctypes bindings of the native gather libraries built by `make kernels`.

The libraries are torch-free (kernels/cpu, kernels/cuda, kernels/hip): raw pointers in, an
error code out. Loading is lazy and cached; a missing or stale library is reported as a
reason string (the probe logs it and falls back), never as an import error.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ABI_VERSION = 1
LIB_NAMES = {"cpu": "libengram_cpu.so", "cuda": "libengram_cuda.so", "hip": "libengram_hip.so"}


class NativeUnavailable(RuntimeError):
    """A native library that is not built, does not load, or does not fit this machine."""


def kernels_dir() -> Path:
    """Where `make kernels` puts the libraries (override with ENGRAM_KERNELS_DIR)."""
    env = os.environ.get("ENGRAM_KERNELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "build" / "kernels"


@dataclass(frozen=True)
class NativeLib:
    kind: str  # "cpu" | "cuda" | "hip"
    path: Path
    lib: ctypes.CDLL
    targets: tuple[str, ...]  # sm_90 ... / gfx942 ...; empty for cpu

    def gather(self, table_ptr: int, ids_ptr: int, id_bytes: int, n: int, lo: int, hi: int,
               out_ptr: int, stream_or_threads: int) -> None:
        """Run the gather; raises RuntimeError with the library's message on failure."""
        fn = getattr(self.lib, f"engram_{self.kind}_gather_dequant")
        rc = fn(table_ptr, ids_ptr, id_bytes, n, lo, hi, out_ptr, stream_or_threads)
        if rc != 0:
            raise RuntimeError(f"engram {self.kind} gather failed: {self.error_string(rc)} (code {rc})")

    def error_string(self, code: int) -> str:
        if self.kind == "cpu":
            return {-1: "bad argument", -2: "misaligned"}.get(code, "unknown error")
        return getattr(self.lib, f"engram_{self.kind}_error_string")(code).decode(errors="replace")


def _bind(kind: str, lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    getattr(lib, f"engram_{kind}_abi_version").restype = i32
    gather = getattr(lib, f"engram_{kind}_gather_dequant")
    # Last argument: the stream (cuda/hip) or the number of threads (cpu).
    gather.argtypes = [p, p, i32, i64, i64, i64, p, i32 if kind == "cpu" else p]
    gather.restype = i32
    if kind == "cpu":
        lib.engram_cpu_gather_dequant_emulated.argtypes = [p, p, i32, i64, i64, i64, p, i32, i32]
        lib.engram_cpu_gather_dequant_emulated.restype = i32
        lib.engram_cpu_default_threads.restype = i32
        return
    getattr(lib, f"engram_{kind}_targets").restype = ctypes.c_char_p
    getattr(lib, f"engram_{kind}_error_string").argtypes = [i32]
    getattr(lib, f"engram_{kind}_error_string").restype = ctypes.c_char_p
    if kind == "cuda":
        lib.engram_cuda_check_device.argtypes = [i32, ctypes.POINTER(i32)]
        lib.engram_cuda_device_info.argtypes = [i32, ctypes.POINTER(i32)]
    else:
        lib.engram_hip_check_device.argtypes = [i32]
    getattr(lib, f"engram_{kind}_check_device").restype = i32


def _make_hip_runtime_global() -> None:
    """libengram_hip.so leaves its HIP symbols unresolved (the runtime's soname changes across
    ROCm releases): load the runtime torch uses with RTLD_GLOBAL before it."""
    candidates = []
    try:
        import torch

        candidates.append(Path(torch.__file__).parent / "lib" / "libamdhip64.so")
    except ImportError:
        pass
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    candidates += [Path(rocm) / "lib" / "libamdhip64.so", Path("libamdhip64.so")]
    errors = []
    for c in candidates:
        if c.is_absolute() and not c.exists():
            continue
        try:
            ctypes.CDLL(str(c), mode=ctypes.RTLD_GLOBAL)
            return
        except OSError as e:
            errors.append(f"{c}: {e}")
    raise NativeUnavailable("no HIP runtime (libamdhip64.so) to bind libengram_hip.so to: " + "; ".join(errors))


@functools.lru_cache(maxsize=None)
def load(kind: str) -> NativeLib:
    """The native library of `kind` ("cpu", "cuda", "hip"); raises NativeUnavailable."""
    if kind not in LIB_NAMES:
        raise ValueError(f"unknown native library kind {kind!r}")
    path = kernels_dir() / LIB_NAMES[kind]
    if not path.is_file():
        raise NativeUnavailable(f"{path} not built (run `make kernels`)")
    if kind == "hip":
        _make_hip_runtime_global()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"{path} does not load: {e}") from None
    try:
        _bind(kind, lib)
    except AttributeError as e:
        raise NativeUnavailable(f"{path} lacks an entry point ({e}); rebuild with `make kernels`") from None
    abi = getattr(lib, f"engram_{kind}_abi_version")()
    if abi != ABI_VERSION:
        raise NativeUnavailable(f"{path} has ABI {abi}, this package wants {ABI_VERSION}; rebuild with `make kernels`")
    targets: tuple[str, ...] = ()
    if kind != "cpu":
        targets = tuple(getattr(lib, f"engram_{kind}_targets")().decode().split())
    return NativeLib(kind, path, lib, targets)


def try_load(kind: str) -> tuple[Optional[NativeLib], str]:
    """(library, "") or (None, why not)."""
    try:
        return load(kind), ""
    except NativeUnavailable as e:
        return None, str(e)


def cuda_device_info(lib: NativeLib, device: int) -> Optional[dict]:
    """Attributes the probe wants beyond torch's properties, or None if the runtime says no."""
    vals = (ctypes.c_int * 6)()
    if lib.lib.engram_cuda_device_info(device, vals) != 0:
        return None
    keys = ("major", "minor", "warp_size", "unified_addressing", "host_pointer_for_registered", "pageable_access")
    return dict(zip(keys, list(vals)))


def check_device(lib: NativeLib, device: int) -> int:
    """0 when the library holds code that runs on `device`, else the runtime's error code."""
    if lib.kind == "cuda":
        version = ctypes.c_int(0)
        return lib.lib.engram_cuda_check_device(device, ctypes.byref(version))
    return lib.lib.engram_hip_check_device(device)
