"""The GPU runtime this process already runs on, bound by ctypes: torch's libcudart or libamdhip64.

Only the copy that is already mapped into the process is used (found in /proc/self/maps, as
upstream SGLang finds libcudart for its custom all-reduce), never another one found on the
library path: a second runtime keeps its own device and context bookkeeping, so memory it
registers and kernels it launches would not be those of torch's runtime. Where none is loaded
the reason says so and host placement is refused.

The calls are the few the host placement and the probe need: host register/unregister, the
device pointer of registered memory, device attributes, get/set device (and a guard).
Tests inject a fake with the same methods (`GpuRuntime` is duck-typed everywhere it is used).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterator, Optional

CUDA, HIP = "cuda", "hip"
LIBRARY_PREFIX = {CUDA: "libcudart", HIP: "libamdhip64"}

# cudaHostRegister / hipHostRegister flags (driver_types.h, hip_runtime_api.h: same values).
REGISTER_PORTABLE = 0x1
REGISTER_MAPPED = 0x2
# CUDA only. On AMD 0x8 is also hipExtHostRegisterCoarseGrained and HIP documents ReadOnly as
# ignored, so it is never passed to HIP (HIP has no attribute that reports support for it).
REGISTER_READ_ONLY = 0x8

# Device attributes by name -> enum value per vendor. CUDA: cudaDeviceAttr (driver_types.h).
# HIP: hipDeviceAttribute_t, whose CUDA-compatible range has kept these values from ROCm 5.2
# through 6.x (checked against both headers); None = the vendor has no such attribute.
ATTRIBUTES: dict[str, dict[str, Optional[int]]] = {
    "warp_size": {CUDA: 10, HIP: 87},
    "can_map_host_memory": {CUDA: 19, HIP: 3},
    "unified_addressing": {CUDA: 41, HIP: 85},
    "compute_capability_major": {CUDA: 75, HIP: 23},
    "compute_capability_minor": {CUDA: 76, HIP: 61},
    "pageable_memory_access": {CUDA: 88, HIP: 65},
    "can_use_host_pointer_for_registered_mem": {CUDA: 91, HIP: 4},
    "host_register_read_only_supported": {CUDA: 113, HIP: None},
    # 1 where the device reads host memory through the host's page tables (ATS: NVLink-C2C,
    # GH200/GB200); 0 where it maps registered host memory in its own (PCIe Hopper/Blackwell).
    # HIP: not asked (row order is not a measured win there; upstream SGLang never sorts on HIP).
    "pageable_memory_access_uses_host_page_tables": {CUDA: 100, HIP: None},
}


class GpuRuntimeUnavailable(RuntimeError):
    """No GPU runtime is loaded in this process (or it lacks an entry point we need)."""


class GpuRuntimeError(RuntimeError):
    """A runtime call returned an error; `code` is the runtime's error number."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ finding the loaded copy
def loaded_objects() -> list[str]:
    """Paths of the files mapped into this process (shared objects among them), in map order."""
    paths: list[str] = []
    seen: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    path = fields[5].rstrip("\n")
                    if path not in seen:
                        seen.add(path)
                        paths.append(path)
    except OSError:
        pass
    return paths


def find_loaded(prefix: str, objects: Optional[list[str]] = None) -> Optional[str]:
    """The mapped shared object named `prefix`.so[.N...] (or pip's `prefix`-HASH.so.N), or None."""
    pattern = re.compile(rf"{re.escape(prefix)}(-[0-9a-f]+)?\.so(\.\d+)*")
    for path in loaded_objects() if objects is None else objects:
        if pattern.fullmatch(os.path.basename(path)):
            return path
    return None


def torch_vendor() -> Optional[str]:
    """"cuda" or "hip" for the runtime torch was built for, None for a CPU-only torch."""
    import torch

    if getattr(torch.version, "hip", None):
        return HIP
    if getattr(torch.version, "cuda", None):
        return CUDA
    return None


# ------------------------------------------------------------------ the binding
class GpuRuntime:
    """ctypes binding of one vendor's runtime library (a CDLL, or a stand-in in tests)."""

    def __init__(self, vendor: str, lib, path: str = ""):
        if vendor not in LIBRARY_PREFIX:
            raise ValueError(f"unknown GPU runtime vendor {vendor!r}")
        self.vendor, self.lib, self.path = vendor, lib, path
        p, i32, u32, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        signatures = {
            "HostRegister": ([p, size, u32], i32),
            "HostUnregister": ([p], i32),
            "HostGetDevicePointer": ([ctypes.POINTER(p), p, u32], i32),
            "DeviceGetAttribute": ([ctypes.POINTER(i32), i32, i32], i32),
            "GetDevice": ([ctypes.POINTER(i32)], i32),
            "SetDevice": ([i32], i32),
            "GetErrorString": ([i32], ctypes.c_char_p),
        }
        self._fn = {}
        for name, (args, res) in signatures.items():
            try:
                fn = getattr(lib, vendor + name)
            except AttributeError:
                raise GpuRuntimeUnavailable(f"{path or vendor}: no {vendor}{name}") from None
            fn.argtypes, fn.restype = args, res
            self._fn[name] = fn

    def error_string(self, code: int) -> str:
        s = self._fn["GetErrorString"](code)
        return s.decode(errors="replace") if s else f"error {code}"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise GpuRuntimeError(f"{self.vendor}{what} failed: {self.error_string(code)} (error {code})", code)

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        """Page-lock [address, address + nbytes) for the current device; returns the error code."""
        return int(self._fn["HostRegister"](address, nbytes, flags))

    def host_unregister(self, address: int) -> int:
        return int(self._fn["HostUnregister"](address))

    def host_device_pointer(self, address: int) -> int:
        """The device address of registered host memory at `address` (current device)."""
        out = ctypes.c_void_p(0)
        self._check(self._fn["HostGetDevicePointer"](ctypes.byref(out), address, 0), "HostGetDevicePointer")
        return int(out.value or 0)

    def attribute(self, name: str, device: int) -> Optional[int]:
        """A device attribute by name (see ATTRIBUTES), or None when this vendor has none or the
        runtime does not know it (an older runtime than the attribute)."""
        code = ATTRIBUTES[name][self.vendor]
        if code is None:
            return None
        value = ctypes.c_int(0)
        if self._fn["DeviceGetAttribute"](ctypes.byref(value), code, device) != 0:
            return None
        return int(value.value)

    def get_device(self) -> int:
        dev = ctypes.c_int(0)
        self._check(self._fn["GetDevice"](ctypes.byref(dev)), "GetDevice")
        return int(dev.value)

    def set_device(self, device: int) -> None:
        self._check(self._fn["SetDevice"](device), "SetDevice")

    @contextlib.contextmanager
    def device_guard(self, device: int) -> Iterator[None]:
        """Make `device` current for the block and restore the previous one after."""
        prev = self.get_device()
        if prev != device:
            self.set_device(device)
        try:
            yield
        finally:
            if prev != device:
                self.set_device(prev)


@dataclass(frozen=True)
class HostAccess:
    """How a device reads registered host memory, as its runtime reports it.

    mapped        it can map registered host memory into its address space (read by the
                  device pointer HostGetDevicePointer returns)
    same_address  that device pointer is the host pointer itself (unified addressing and
                  can-use-host-pointer-for-registered-memory)
    read_only     it accepts the ReadOnly registration flag (CUDA only)
    address_ordered  random rows of registered host memory are best read in address order: the
                  device maps it in its own page tables (reported, not assumed: no ATS), whose
                  translation reach is far below a table's size
    """

    mapped: bool
    same_address: bool
    read_only: bool
    address_ordered: bool = False


def host_access(runtime, device: int) -> HostAccess:
    """Ask `device`'s runtime the same questions on CUDA and HIP (an attribute the runtime does
    not know counts as no)."""
    def yes(name: str) -> bool:
        return bool(runtime.attribute(name, device))

    same = yes("unified_addressing") and yes("can_use_host_pointer_for_registered_mem")
    return HostAccess(mapped=yes("can_map_host_memory"), same_address=same,
                      read_only=yes("host_register_read_only_supported"),
                      address_ordered=runtime.attribute("pageable_memory_access_uses_host_page_tables", device) == 0)


def bind(vendor: str, objects: Optional[list[str]] = None) -> GpuRuntime:
    """Bind `vendor`'s runtime as already mapped in this process; raises GpuRuntimeUnavailable."""
    prefix = LIBRARY_PREFIX[vendor]
    path = find_loaded(prefix, objects)
    if path is None:
        raise GpuRuntimeUnavailable(
            f"no {prefix} is loaded in this process (torch loads it when it is a "
            f"{'ROCm' if vendor == HIP else 'CUDA'} build); another copy from the library path is never "
            f"loaded: it would be a second runtime beside torch's")
    try:
        # RTLD_NOLOAD: the handle of the copy already mapped, or an error; never a new load.
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError as e:
        raise GpuRuntimeUnavailable(f"{path}: mapped but cannot be bound ({e})") from None
    return GpuRuntime(vendor, lib, path)


@functools.lru_cache(maxsize=1)
def _current() -> GpuRuntime:
    vendor = torch_vendor()
    if vendor is None:
        raise GpuRuntimeUnavailable("torch is a CPU-only build: no GPU runtime in this process")
    return bind(vendor)


_injected: Optional[object] = None


@contextlib.contextmanager
def injected(runtime) -> Iterator[None]:
    """Make `current()` answer `runtime` (a fake, or another vendor's binding) inside the block."""
    global _injected
    prev, _injected = _injected, runtime
    try:
        yield
    finally:
        _injected = prev


def current() -> GpuRuntime:
    """The runtime torch runs on, bound once; raises GpuRuntimeUnavailable with the reason."""
    return _injected if _injected is not None else _current()


def try_current() -> tuple[Optional[GpuRuntime], str]:
    try:
        return current(), ""
    except GpuRuntimeUnavailable as e:
        return None, str(e)


def reset() -> None:
    _current.cache_clear()


# ------------------------------------------------------------------ ELF dynamic entries
def elf_dynamic(path: str) -> tuple[list[str], Optional[str]]:
    """(DT_NEEDED names, DT_SONAME) of a 64-bit little-endian ELF shared object: which runtime
    a native library will bind to, read before loading it."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    soname = None
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sh[6]]  # sh_link: the dynamic string table
        str_off = strtab[4]

        def string(offset: int) -> str:
            end = data.index(b"\0", str_off + offset)
            return data[str_off + offset:end].decode()

        for off in range(sh[4], sh[4] + sh[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:
                needed.append(string(val))
            elif tag == 14:
                soname = string(val)
    return needed, soname
