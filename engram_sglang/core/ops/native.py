"""ctypes bindings of the native gather libraries built by `make kernels`.

The libraries are torch-free (kernels/cpu; kernels/cuda, built for CUDA and, through kernels/hip/vendor.h, for HIP): raw pointers in, an
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

from .. import nativelibs
from ..nativelibs import kernels_dir  # noqa: F401  (where tools look; docker/check-install.py)
from . import gpu_runtime
from .backends import native_libraries

# Per library: the GPU launchers share one source and one ABI (kernels/cuda/engram_gather.cu).
ABI_VERSION = {"cpu": 1, "cuda": 2, "hip": 2}
LIB_NAMES = native_libraries()  # backend -> its library, from the backend table (ops/backends.py)


class NativeUnavailable(RuntimeError):
    """A native library that is not built, does not load, or does not fit this machine."""


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
    """The signatures of kernels/cpu/engram_cpu_abi.h or kernels/cuda/engram_gpu_abi.h (cuda, hip);
    tests/kernels/test_native_abi.py checks them against those headers."""
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
        lib.engram_cpu_threads_for.argtypes, lib.engram_cpu_threads_for.restype = [i64, i32], i32
        lib.engram_cpu_decode_avx512.restype = i32
        lib.engram_cpu_gather_raw.argtypes = [p, p, i32, i64, i64, i64, p, i32]
        lib.engram_cpu_gather_raw.restype = i32
        return
    getattr(lib, f"engram_{kind}_targets").restype = ctypes.c_char_p
    getattr(lib, f"engram_{kind}_error_string").argtypes = [i32]
    getattr(lib, f"engram_{kind}_error_string").restype = ctypes.c_char_p
    for name in ("check_device", "device_info"):  # the same signatures for both vendors
        fn = getattr(lib, f"engram_{kind}_{name}")
        fn.argtypes, fn.restype = [i32, ctypes.POINTER(i32)], i32


def _bind_to_loaded_runtime(kind: str, path: Path) -> None:
    """Make sure `path` will run on the GPU runtime torch already loaded, never on another copy.

    hip:  libengram_hip.so leaves its HIP symbols unresolved (the runtime's soname changes
          across ROCm releases): the mapped libamdhip64 is made global first so they resolve
          against it. A copy on the library path is never loaded: its fat binary would register
          with a second HIP runtime ("invalid device function").
    cuda: libengram_cuda.so needs the shared libcudart by soname; the loader reuses a loaded
          object of that soname, so torch's copy must be the one it names (a CUDA major that
          differs from torch's would bring a second runtime in)."""
    prefix = gpu_runtime.LIBRARY_PREFIX[kind]
    loaded = gpu_runtime.find_loaded(prefix)
    if kind == "hip":
        if loaded is None:
            raise NativeUnavailable(
                f"no HIP runtime ({prefix}) is loaded in this process (torch is not a ROCm build?): "
                f"{path.name} binds only to the runtime torch loaded, never to another copy on the library path")
        try:
            ctypes.CDLL(loaded, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        except OSError as e:
            raise NativeUnavailable(f"{loaded}: mapped but cannot be made global for {path.name}: {e}") from None
        return
    try:
        needed = [n for n in gpu_runtime.elf_dynamic(str(path))[0] if n.startswith(prefix)]
    except (OSError, ValueError) as e:
        raise NativeUnavailable(f"{path} cannot be read: {e}") from None
    if not needed:
        raise NativeUnavailable(f"{path} links the CUDA runtime statically (a second runtime beside torch's): "
                                f"rebuild with `make kernels`")
    if loaded is None:
        raise NativeUnavailable(f"no CUDA runtime ({prefix}) is loaded in this process (torch is not a CUDA "
                                f"build?): {path.name} would load {needed[0]} on its own")
    try:
        soname = gpu_runtime.elf_dynamic(loaded)[1] or os.path.basename(loaded)
    except (OSError, ValueError):
        soname = os.path.basename(loaded)
    if soname != needed[0]:
        raise NativeUnavailable(f"{path.name} needs {needed[0]} but torch runs on {soname} ({loaded}): "
                                f"rebuild it with the CUDA toolkit of torch's CUDA major (`make kernels`)")


@functools.lru_cache(maxsize=None)
def load(kind: str) -> NativeLib:
    """The native library of `kind` ("cpu", "cuda", "hip"); raises NativeUnavailable."""
    if kind not in LIB_NAMES:
        raise ValueError(f"unknown native library kind {kind!r}")
    try:
        path = nativelibs.locate(LIB_NAMES[kind])  # prebuilt, or the host library built on first use
    except nativelibs.NativeLibraryError as e:
        raise NativeUnavailable(str(e)) from None
    if kind in ("cuda", "hip"):
        _bind_to_loaded_runtime(kind, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"{path} does not load: {e}") from None
    try:
        _bind(kind, lib)
    except AttributeError as e:
        raise NativeUnavailable(f"{path} lacks an entry point ({e}); rebuild with `make kernels`") from None
    abi = getattr(lib, f"engram_{kind}_abi_version")()
    if abi != ABI_VERSION[kind]:
        raise NativeUnavailable(f"{path} has ABI {abi}, this package wants {ABI_VERSION[kind]}; "
                                f"rebuild with `make kernels`")
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


DEVICE_INFO_KEYS = ("major", "minor", "warp_size", "unified_addressing", "host_pointer_for_registered",
                    "pageable_access", "can_map_host_memory")


def device_info(lib: NativeLib, device: int) -> Optional[dict]:
    """What the GPU library's runtime says about `device` (the same questions on CUDA and HIP),
    or None if it says no."""
    vals = (ctypes.c_int * len(DEVICE_INFO_KEYS))()
    if getattr(lib.lib, f"engram_{lib.kind}_device_info")(device, vals) != 0:
        return None
    return dict(zip(DEVICE_INFO_KEYS, list(vals)))


def check_device(lib: NativeLib, device: int) -> int:
    """0 when the library holds code that runs on `device`, else the runtime's error code."""
    version = ctypes.c_int(0)
    return getattr(lib.lib, f"engram_{lib.kind}_check_device")(device, ctypes.byref(version))
