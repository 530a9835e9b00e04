"""Device probe: read the device once, answer capability questions, pick the gather backend.

Callers ask capabilities (`DeviceInfo.uva`, `.fp8`, `.warp_size`), never "am I on ROCm".
The backends, their preference order (native library built for this target > Triton > torch)
and each one's reasons not to run are the table of ops/backends.py; the choice is logged as
one line with the reasons the others were rejected. `ENGRAM_BACKEND` forces a backend: an
explicit choice that cannot run raises; the automatic one falls back with a warning when the
best backend for the device (its native library) is missing. Nothing happens at import: the
device is read on the first question, and simulated devices (`cuda_device`, `hip_device`,
`cpu_device`) let the tests ask for an H200 or an MI300X on a laptop.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from ..errors import EngramError
from . import backends

logger = logging.getLogger("engram_sglang.core.ops")

BACKENDS = backends.BACKENDS  # the table's names, in its preference order
ENV_BACKEND = "ENGRAM_BACKEND"

# gfx targets Triton's AMD backend compiles for (CDNA2-4, RDNA3-4).
TRITON_GFX = frozenset({"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1200", "gfx1201"})
# Native fp8 conversion flavour by AMD target: CDNA3 reads e4m3fnuz, CDNA4 and RDNA4 OCP.
_GFX_FP8 = {"gfx940": "e4m3fnuz", "gfx941": "e4m3fnuz", "gfx942": "e4m3fnuz",
            "gfx950": "e4m3fn", "gfx1200": "e4m3fn", "gfx1201": "e4m3fn"}


class BackendUnavailableError(EngramError, RuntimeError):
    """A gather backend was asked for explicitly and cannot run here."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the gather needs to know about one device.

    kind      "cuda" (NVIDIA), "hip" (AMD) or "cpu"
    arch      "sm_90", "gfx942", or the host machine ("x86_64")
    warp_size threads that run in lockstep: 32 on NVIDIA, 64 on CDNA, 1 on the host
    uva       kernels can read host memory registered with the runtime by its host pointer
    fp8       native fp8 conversion: "e4m3fn" (OCP), "e4m3fnuz" (gfx942), or "none"
    host_map  kernels can read registered host memory by the device address the runtime
              maps it at (HostGetDevicePointer); host placement needs this or uva
    """

    kind: str
    name: str
    arch: str
    index: Optional[int] = None
    warp_size: int = 1
    uva: bool = False
    fp8: str = "none"
    simulated: bool = False
    host_map: bool = False

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index or 0)

    def describe(self) -> str:
        caps = [self.arch, f"warp {self.warp_size}", f"fp8 {self.fp8}"]
        if self.uva:
            caps.append("uva")
        elif self.host_map:
            caps.append("host-mapped")
        where = "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index or 0}"
        return f"{self.name} ({where}, {', '.join(caps)})"


# ------------------------------------------------------------------ device constructors
def cuda_device(name: str, major: int, minor: int, *, index: int = 0, uva: bool = True,
                host_map: Optional[bool] = None, warp_size: int = 32, simulated: bool = True) -> DeviceInfo:
    """An NVIDIA device of compute capability major.minor (host_map defaults to uva)."""
    fp8 = "e4m3fn" if (major, minor) >= (8, 9) else "none"  # cvt.*.e4m3x2 from sm_89
    return DeviceInfo("cuda", name, f"sm_{major}{minor}", index, warp_size, uva, fp8, simulated,
                      uva if host_map is None else host_map)


def gfx_target(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'."""
    return gcn_arch_name.split(":")[0].strip()


def hip_device(name: str, gcn_arch_name: str, *, index: int = 0, uva: bool = True,
               host_map: Optional[bool] = None, warp_size: Optional[int] = None,
               simulated: bool = True) -> DeviceInfo:
    """An AMD device of the given gfx target (features after ':' are ignored; host_map
    defaults to uva)."""
    arch = gfx_target(gcn_arch_name)
    if warp_size is None:
        warp_size = 64 if arch.startswith("gfx9") else 32  # CDNA/GCN wave64, RDNA wave32
    return DeviceInfo("hip", name, arch, index, warp_size, uva, _GFX_FP8.get(arch, "none"), simulated,
                      uva if host_map is None else host_map)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "host CPU"


def cpu_device(*, name: Optional[str] = None, simulated: bool = True) -> DeviceInfo:
    return DeviceInfo("cpu", name or _cpu_name(), platform.machine() or "cpu", None, 1, False, "none", simulated)


def read_device(device: Optional[torch.device | str] = None) -> DeviceInfo:
    """Read the real device (default: the current CUDA/HIP device if any, else the CPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_device(simulated=False)
    if device.type != "cuda":
        raise EngramError(f"engram gather: unsupported device type {device.type!r}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    warp = getattr(props, "warp_size", None)
    # The same questions of either vendor's runtime (the one torch loaded): can the device map
    # registered host memory, and is the mapped address the host pointer itself? Without a
    # runtime to ask, neither is assumed (host placement is then refused).
    from . import gpu_runtime

    runtime, why = gpu_runtime.try_current()
    access = gpu_runtime.host_access(runtime, index) if runtime else gpu_runtime.HostAccess(False, False, False)
    if runtime is None:
        logger.debug("engram gather: no GPU runtime to ask about host memory access: %s", why)
    elif runtime.attribute("warp_size", index):
        warp = runtime.attribute("warp_size", index)
    if torch.version.hip:
        return hip_device(props.name, getattr(props, "gcnArchName", "unknown"), index=index, uva=access.same_address,
                          host_map=access.mapped, warp_size=warp, simulated=False)
    return cuda_device(props.name, props.major, props.minor, index=index, uva=access.same_address,
                       host_map=access.mapped, warp_size=warp or 32, simulated=False)


# ------------------------------------------------------------------ what can run
def cuda_code_runs(targets: tuple[str, ...] | list[str], arch: str) -> bool:
    """Does a library holding `targets` (sm_XY SASS, compute_XY PTX) run on `arch` (sm_XY)?
    SASS runs on its own major version at an equal or higher minor; PTX is JIT-compiled for
    any later device."""
    m = re.fullmatch(r"sm_(\d+)(\d)", arch)
    if not m:
        return False
    major, minor = int(m.group(1)), int(m.group(2))
    for t in targets:
        tm = re.fullmatch(r"(sm|compute)_(\d+)(\d)a?", t)
        if not tm:
            continue
        tmaj, tmin = int(tm.group(2)), int(tm.group(3))
        if tm.group(1) == "sm" and tmaj == major and tmin <= minor:
            return True
        if tm.group(1) == "compute" and (tmaj, tmin) <= (major, minor):
            return True
    return False


@dataclass
class Environment:
    """What is installed, as the probe sees it; tests pass their own."""

    native_targets: Mapping[str, Optional[tuple[str, ...]]]  # kind -> targets, None = missing
    native_missing_reason: Mapping[str, str] = field(default_factory=dict)
    triton_error: str = ""  # why Triton cannot be used ("" = importable)
    triton_interpret: bool = False
    native_device_check: Optional[Callable[[str, DeviceInfo], str]] = None  # real devices only


def current_environment(device_kind: str) -> Environment:
    """What is installed, for a device of `device_kind`: only its own native library is
    loaded (loading HIP's runtime on an NVIDIA box, say, would be a side effect for nothing)."""
    from . import native

    targets: dict[str, Optional[tuple[str, ...]]] = {}
    missing: dict[str, str] = {}
    for kind in backends.native_libraries():
        if kind != device_kind:
            targets[kind], missing[kind] = None, f"not loaded for a {device_kind} device"
            continue
        lib, why = native.try_load(kind)
        targets[kind] = lib.targets if lib else None
        if why:
            missing[kind] = why
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    triton_error = ""
    if device_kind != "cpu" or interpret:  # on a CPU it only runs interpreted: skip the import
        try:
            import triton  # noqa: F401
        except Exception as e:  # a broken install raises more than ImportError
            triton_error = f"triton does not import ({type(e).__name__}: {e})"

    def device_check(kind: str, dev: DeviceInfo) -> str:
        lib, why = native.try_load(kind)
        if lib is None:
            return why
        code = native.check_device(lib, dev.index or 0)
        return "" if code == 0 else f"{lib.path.name} cannot run on {dev.arch}: {lib.error_string(code)}"

    return Environment(targets, missing, triton_error, interpret, device_check)


def rejection(backend: str, dev: DeviceInfo, env: Environment) -> str:
    """Why `backend` cannot serve `dev` ("" when it can)."""
    spec = backends.BACKEND_TABLE.get(backend)
    if spec is None:
        return f"unknown backend {backend!r} (choose from {', '.join(backends.preference_order())} or auto)"
    return spec.rejection(dev, env)


# ------------------------------------------------------------------ each backend's reasons (ops/backends.py names them)
def triton_rejection(spec: backends.Backend, dev: DeviceInfo, env: Environment) -> str:
    if env.triton_error:
        return env.triton_error
    if dev.kind == "cpu":
        return "" if env.triton_interpret else "Triton has no CPU backend (TRITON_INTERPRET=1 is for tests)"
    if dev.kind == "hip" and dev.arch not in TRITON_GFX:
        return f"Triton does not target {dev.arch}"
    if dev.kind == "cuda" and not cuda_code_runs(["compute_75"], dev.arch):
        return f"Triton needs sm_75 or later, device is {dev.arch}"
    return ""


def _library_targets(spec: backends.Backend, env: Environment) -> tuple[Optional[tuple[str, ...]], str]:
    """(the targets its built library holds, "") or (None, why it is missing)."""
    targets = env.native_targets.get(spec.name)
    if targets is None:
        return None, env.native_missing_reason.get(spec.name, f"{spec.native_lib} not built (run `make kernels`)")
    return targets, ""


def _device_check(spec: backends.Backend, dev: DeviceInfo, env: Environment) -> str:
    """What the GPU library's runtime says of a real device (simulated devices have none to ask)."""
    if not dev.simulated and env.native_device_check is not None:
        return env.native_device_check(spec.name, dev)
    return ""


def cpu_library_rejection(spec: backends.Backend, dev: DeviceInfo, env: Environment) -> str:
    return _library_targets(spec, env)[1]


def cuda_library_rejection(spec: backends.Backend, dev: DeviceInfo, env: Environment) -> str:
    targets, missing = _library_targets(spec, env)
    if missing:
        return missing
    if not cuda_code_runs(targets, dev.arch):
        return f"{spec.native_lib} holds {' '.join(targets)}, none runs on {dev.arch}"
    return _device_check(spec, dev, env)


def hip_library_rejection(spec: backends.Backend, dev: DeviceInfo, env: Environment) -> str:
    targets, missing = _library_targets(spec, env)
    if missing:
        return missing
    if dev.arch not in targets:
        return f"{spec.native_lib} has no code object for {dev.arch} (built: {' '.join(targets)})"
    return _device_check(spec, dev, env)


@dataclass(frozen=True)
class Choice:
    device: DeviceInfo
    backend: str
    rejected: tuple[tuple[str, str], ...]  # (backend, reason) for those that cannot run
    requested: str  # "auto" or the forced backend
    degraded: bool  # auto, and the device's native backend is missing

    def line(self, **extra) -> str:
        """The one start-up line: device, backend, why not the others, plus `extra` facts
        (placement, table bytes, huge page coverage) from the caller."""
        parts = [f"engram gather: device {self.device.describe()}", f"backend {self.backend}"]
        if self.requested != "auto":
            parts[-1] += " (forced)"
        parts += [f"{k.replace('_', ' ')} {v}" for k, v in extra.items()]
        if self.rejected:
            parts.append("rejected: " + "; ".join(f"{b}: {r}" for b, r in self.rejected))
        return ", ".join(parts)


def choose(dev: DeviceInfo, env: Environment, requested: str = "auto") -> Choice:
    """Pick the backend for `dev`. Raises BackendUnavailableError when `requested` is a
    backend that cannot run here."""
    requested = (requested or "auto").strip().lower()
    order = backends.preference_order()
    reasons = {b: rejection(b, dev, env) for b in order}
    if requested != "auto":
        if requested not in reasons:
            raise BackendUnavailableError(
                f"engram gather: unknown backend {requested!r} (choose from {', '.join(order)} or auto)")
        if reasons[requested]:
            raise BackendUnavailableError(
                f"engram gather: backend {requested} was asked for but cannot run on {dev.describe()}: "
                f"{reasons[requested]}")
        backend = requested
    else:
        backend = next((b for b in order if not reasons[b]), None)
        if backend is None:
            raise BackendUnavailableError(f"engram gather: no backend can run on {dev.describe()}: "
                                          + "; ".join(f"{b}: {r}" for b, r in reasons.items()))
    rejected = tuple((b, reasons[b] or ("not asked for" if requested != "auto" else "lower priority"))
                     for b in order if b != backend)
    # The device's own native library (cuda / hip / cpu) is the one it should use.
    degraded = requested == "auto" and bool(reasons.get(backends.native_backend(dev.kind)))
    return Choice(dev, backend, rejected, requested, degraded)


# ------------------------------------------------------------------ the cached probe
def log_choice(choice: Choice, announce: bool = True) -> None:
    """One line: INFO for the start-up choice, DEBUG for a caller's explicit backend, WARNING
    when the automatic choice had to fall back from the device's native library."""
    if choice.degraded:
        native = backends.native_backend(choice.device.kind)
        why = dict(choice.rejected).get(native, "")
        logger.warning("%s (the native %s backend cannot run: %s; falling back)", choice.line(), native, why)
    else:
        logger.log(logging.INFO if announce else logging.DEBUG, "%s", choice.line())


@functools.lru_cache(maxsize=None)
def _probe_cached(device_key: str, requested: str, announce: bool) -> Choice:
    dev = read_device(None if device_key == "default" else device_key)
    choice = choose(dev, current_environment(dev.kind), requested)
    log_choice(choice, announce)
    return choice


def select_backend(device: Optional[torch.device | str] = None, requested: Optional[str] = None) -> Choice:
    """The backend choice for `device`, read once per device and request, then cached.

    `requested` None or "auto" means $ENGRAM_BACKEND if set, else the automatic choice; both
    are logged once at INFO (the start-up line). A backend named by a caller is checked the
    same way (raising BackendUnavailableError if it cannot run) and logged at DEBUG."""
    announce = requested is None or requested == "auto"
    if announce:
        requested = os.environ.get(ENV_BACKEND, "auto") or "auto"
    key = "default" if device is None else str(torch.device(device))
    if key == "cuda":
        key = f"cuda:{torch.cuda.current_device()}"
    return _probe_cached(key, requested.strip().lower(), announce)


def reset() -> None:
    """Forget cached probes (tests; after changing ENGRAM_BACKEND or rebuilding kernels)."""
    _probe_cached.cache_clear()
    from . import native

    native.load.cache_clear()
