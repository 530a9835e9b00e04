"""The gather backends, as data: the one table that the probe (which backends exist, in which
order it prefers them, why one cannot run here), `gather_dequant` (how each one launches) and
the native loaders (which library each one needs) read. A backend added here is probed,
chosen, forced by ENGRAM_BACKEND and launched with no other change.

Each entry names its launch and rejection functions as "module:function" (imported on first
use), as the placement table names its store classes: the code stays beside what it needs
(the launchers in ops/gather.py call ops/native.py, which reads its library names from this
table), and this module imports nothing of the package but its errors.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Optional

from ..errors import EngramError

# The device kinds the probe reads (DeviceInfo.kind), as a reason names them.
DEVICE_KINDS = {"cuda": "an NVIDIA GPU", "hip": "an AMD GPU", "cpu": "a CPU"}


@functools.lru_cache(maxsize=None)
def _function(path: str) -> Callable:
    """The function a "module:function" path names (cached: launches look it up per call)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module, __package__), name)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run the gather.

    name : the `backend=` / ENGRAM_BACKEND / `--engram-backend` value.
    devices : the device kinds (DEVICE_KINDS) it can serve at all.
    preference : the automatic choice takes the runnable backend of the lowest preference.
    launch_path : "module:function" of its launcher, called as
        f(backend, table, ids, lo, hi, out, table_address): writes out[n, 256] (contiguous bf16)
        for n > 0 contiguous int32/int64 ids.
    rejection_path : "module:function" called as f(backend, dev, env) on a device it serves:
        why it cannot run there ("" when it can); None: it runs on every device it serves.
    native_lib : the ctypes library it launches through (ops/native.py loads it), if any.
    """

    name: str
    devices: tuple[str, ...]
    preference: int
    launch_path: str
    rejection_path: Optional[str] = None
    native_lib: Optional[str] = None

    def __post_init__(self):
        unknown = [d for d in self.devices if d not in DEVICE_KINDS]
        if unknown or not self.devices:
            raise EngramError(f"backend {self.name}: devices {self.devices!r} are not among {', '.join(DEVICE_KINDS)}")

    def launcher(self) -> Callable[..., None]:
        return _function(self.launch_path)

    def rejection(self, dev: Any, env: Any) -> str:
        """Why this backend cannot serve `dev` (a probe.DeviceInfo, with what is installed: a
        probe.Environment; "" when it can)."""
        if dev.kind not in self.devices:
            return f"needs {' or '.join(DEVICE_KINDS[d] for d in self.devices)}, device is {dev.kind}"
        return _function(self.rejection_path)(self, dev, env) if self.rejection_path else ""


# What each backend is: ops/gather.py's docstring, beside their launchers.
BACKEND_TABLE: dict[str, Backend] = {b.name: b for b in (
    Backend("cuda", devices=("cuda",), preference=10, launch_path=".gather:launch_native_gpu",
            rejection_path=".probe:cuda_library_rejection", native_lib="libengram_cuda.so"),
    Backend("hip", devices=("hip",), preference=20, launch_path=".gather:launch_native_gpu",
            rejection_path=".probe:hip_library_rejection", native_lib="libengram_hip.so"),
    Backend("cpu", devices=("cpu",), preference=30, launch_path=".gather:launch_native_cpu",
            rejection_path=".probe:cpu_library_rejection", native_lib="libengram_cpu.so"),
    # On a CPU only interpreted (TRITON_INTERPRET=1, tests): its rejection says so.
    Backend("triton", devices=("cuda", "hip", "cpu"), preference=40, launch_path=".gather:launch_triton",
            rejection_path=".probe:triton_rejection"),
    Backend("torch", devices=("cuda", "hip", "cpu"), preference=50, launch_path=".gather:launch_torch"),
)}


def preference_order() -> tuple[str, ...]:
    """The table's backend names, the automatic choice's first preference first."""
    order = sorted(BACKEND_TABLE.values(), key=lambda b: b.preference)
    for a, b in zip(order, order[1:]):
        if a.preference == b.preference:  # the choice between them would be the table's accident
            raise EngramError(f"backends {a.name} and {b.name} share preference {a.preference}")
    return tuple(b.name for b in order)


# The backend names in preference order (help texts; imported as probe.BACKENDS).
BACKENDS: tuple[str, ...] = preference_order()


def native_backend(device_kind: str) -> Optional[str]:
    """The backend a device of `device_kind` should run: the preferred one of those serving it
    through a native library (None if there is none)."""
    return next((name for name in preference_order()
                 if BACKEND_TABLE[name].native_lib and device_kind in BACKEND_TABLE[name].devices), None)


def native_libraries() -> dict[str, str]:
    """Backend name -> the native library it launches through, for those that have one."""
    return {b.name: b.native_lib for b in BACKEND_TABLE.values() if b.native_lib}
