"""`gather_dequant`: packed Engram rows by row id -> bf16, one op over the backends of the
table in ops/backends.py, whose launchers are here:

    torch   the reference (`gather_dequant_ref`, on `rowformat.dequantize`)
    triton  ops/gather_triton.py, any GPU Triton targets (and the interpreter in tests)
    cpu     kernels/cpu via ctypes: the shared row decode on the host cores
    cuda    kernels/cuda (nvcc) via ctypes on the caller's stream
    hip     kernels/cuda + kernels/hip/vendor.h (clang -x hip) via ctypes on the caller's stream

All return the same bf16 bits (NaNs canonical). The op is registered with torch.library
(`engram::gather_dequant`, and `engram::gather_dequant_out` writing a caller's buffer) with
fake implementations, so torch.compile traces through it and CUDA graphs capture it: the
native launches are asynchronous and allocate nothing but the output.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Optional

import numpy as np
import torch

from ..rowformat import ROW_BYTES, ROW_VALUES, dequantize
from . import backends, native, probe


# ------------------------------------------------------------------ reference
def gather_dequant_ref(table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Torch reference: rows `ids` (any integer dtype, 1-D) of a packed table holding global
    rows [lo, hi) -> bf16 [n, 256] on ids' device; ids outside [lo, hi) give +0 rows."""
    idx = ids.reshape(-1).to(device=table.device, dtype=torch.int64)
    live = (idx >= lo) & (idx < hi)
    if hi == lo:
        return torch.zeros((idx.numel(), ROW_VALUES), dtype=torch.bfloat16, device=ids.device)
    rows = table[(idx - lo).clamp_(0, hi - lo - 1)]
    out = dequantize(rows)
    out = torch.where(live[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(ids.device)


# ------------------------------------------------------------------ backends
def table_pointer(table: torch.Tensor, table_address: Optional[int] = None) -> int:
    """The address a GPU kernel reads `table` by: its own pointer in device memory; for host
    memory registered with the GPU, the device address the runtime mapped it at (given by the
    caller, e.g. HostStore.table_address, else asked from the runtime). On ROCm that address
    may differ from the host pointer, which the device would then fault on. 0 for an empty
    table (the native launchers take a null table for an empty shard: they read no row)."""
    if table.numel() == 0:
        return 0
    if table.device.type != "cpu":
        return table.data_ptr()
    if table_address is not None:
        return int(table_address)
    from . import gpu_runtime

    try:
        return gpu_runtime.current().host_device_pointer(table.data_ptr())
    except (gpu_runtime.GpuRuntimeUnavailable, gpu_runtime.GpuRuntimeError) as e:
        raise ValueError(f"engram gather: the host table at {table.data_ptr():#x} has no device address ({e}); "
                         f"register it with the GPU (HostStore does) or pass table_address") from None


class _DevicePointer:
    """What Triton reads a pointer argument from (.data_ptr() and .dtype): a host table by the
    device address it is mapped at."""

    def __init__(self, address: int, dtype: torch.dtype):
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


def launch_torch(spec: backends.Backend, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int,
                 out: torch.Tensor, table_address: Optional[int] = None) -> None:
    out.copy_(gather_dequant_ref(table, ids, lo, hi))


def launch_triton(spec: backends.Backend, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int,
                  out: torch.Tensor, table_address: Optional[int] = None) -> None:
    from .gather_triton import gather_dequant_triton

    if table.device != ids.device and table.device.type == "cuda":
        raise ValueError(f"engram gather: table on {table.device}, ids on {ids.device}")
    words = None
    if table.device.type == "cpu" and ids.is_cuda and table.numel():
        words = _DevicePointer(table_pointer(table, table_address), torch.int64)
    with torch.cuda.device(ids.device) if ids.is_cuda else contextlib.nullcontext():
        gather_dequant_triton(table, ids, lo, hi, out, words=words)


def launch_native_cpu(spec: backends.Backend, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int,
                      out: torch.Tensor, table_address: Optional[int] = None) -> None:
    native.load(spec.name).gather(table.data_ptr() if table.numel() else 0, ids.data_ptr(), ids.element_size(),
                                  ids.numel(), lo, hi, out.data_ptr(), torch.get_num_threads())


def launch_native_gpu(spec: backends.Backend, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int,
                      out: torch.Tensor, table_address: Optional[int] = None) -> None:
    """The CUDA and HIP libraries: one ABI, launched on the caller's stream."""
    lib = native.load(spec.name)
    # The kernel stores 16 bytes at a time: a caller's odd view goes through a copy.
    target = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
    with torch.cuda.device(ids.device):
        stream = torch.cuda.current_stream(ids.device).cuda_stream
        lib.gather(table_pointer(table, table_address), ids.data_ptr(), ids.element_size(), ids.numel(), lo, hi,
                   target.data_ptr(), stream)
    if target is not out:
        out.copy_(target)


def _launch(backend: str, table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
            table_address: Optional[int] = None) -> None:
    """Write out[n, 256] (contiguous bf16) for 1-D contiguous int32/int64 ids, with the launcher
    the backend table names."""
    if ids.numel() == 0:
        return
    spec = backends.BACKEND_TABLE.get(backend)
    if spec is None:
        raise probe.BackendUnavailableError(f"engram gather: unknown backend {backend!r}")
    spec.launcher()(spec, table, ids, lo, hi, out, table_address)


def _resolve(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return probe.select_backend(device).backend
    return probe.select_backend(device, requested=backend).backend  # raises if it cannot run


# ------------------------------------------------------------------ custom ops
@torch.library.custom_op("engram::gather_dequant", mutates_args=())
def _gather_dequant_op(table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, backend: str,
                       table_address: Optional[int] = None) -> torch.Tensor:
    out = torch.empty((ids.numel(), ROW_VALUES), dtype=torch.bfloat16, device=ids.device)
    _launch(_resolve(backend, ids.device), table, ids, lo, hi, out, table_address)
    return out


@_gather_dequant_op.register_fake
def _(table, ids, lo, hi, backend, table_address=None):
    return ids.new_empty((ids.numel(), ROW_VALUES), dtype=torch.bfloat16)


@torch.library.custom_op("engram::gather_dequant_out", mutates_args=("out",))
def _gather_dequant_out_op(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, lo: int, hi: int,
                           backend: str, table_address: Optional[int] = None) -> None:
    _launch(_resolve(backend, ids.device), table, ids, lo, hi, out, table_address)


@_gather_dequant_out_op.register_fake
def _(table, ids, out, lo, hi, backend, table_address=None):
    return None


def _eager(*tensors: torch.Tensor) -> bool:
    """Whether a call may launch directly instead of through the registered op: the same
    launcher and bits, without the dispatcher's Python layers (~20 us a call here, a
    sixth of a decode-shaped CPU gather). The op stays in the path wherever something
    traces, watches or transforms ops: torch.compile, fake and dispatch modes, torch function
    modes, functorch transforms, the profiler, tensor subclasses, autograd."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active()
            or torch.autograd._profiler_enabled()):
        return False
    return all(type(t) is torch.Tensor and not t.requires_grad for t in tensors)


# Host outputs this large are fresh pages on every call from torch's allocator: glibc serves
# them by mmap (its largest mmap threshold is 32 MiB on 64-bit) and unmaps them when freed, and
# writing 4 KiB pages that were never touched costs ~8x the writes themselves (a prefill-shaped
# 100 MB output: ~45 ms against ~5 ms into touched memory, one thread). Huge pages cut the faults
# 512-fold (~10 ms); smaller outputs are recycled by glibc and fault once.
_HUGE_OUTPUT_BYTES = 32 << 20
_HUGE_PAGE = 2 << 20


def _host_output(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty bf16 tensor of `shape` in host memory, advised into huge pages where it is large
    (freed, like any tensor, when its last view dies: the mapping goes with the array)."""
    nbytes = 2 * int(np.prod(shape))
    if nbytes < _HUGE_OUTPUT_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=torch.bfloat16)
    mem = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mem.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
        pass
    words = np.frombuffer(mem, dtype=np.uint8)
    start = -words.ctypes.data % _HUGE_PAGE  # huge pages cover 2 MiB-aligned ranges only
    return torch.from_numpy(words[start:start + nbytes]).view(torch.bfloat16).view(shape)


# ------------------------------------------------------------------ public entry
def gather_dequant(table: torch.Tensor, ids: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                   row_range: Optional[tuple[int, int]] = None, backend: str = "auto",
                   table_address: Optional[int] = None) -> torch.Tensor:
    """Gather packed Engram rows by global row id and dequantize them to bf16.

    Parameters
    ----------
    table : torch.Tensor
        uint8 [R, 264] packed rows (rowformat), row-major, 8-byte aligned. On the compute
        device, or in host memory registered with the GPU runtime (read over UVA).
    ids : torch.Tensor
        Global row ids of any shape and integer dtype (int32 and int64 pass through; others
        are widened). Their device is the compute device.
    out : torch.Tensor, optional
        bf16 [*ids.shape, 256] on ids' device to write into (e.g. a static buffer in a CUDA
        graph); allocated when omitted.
    row_range : (lo, hi), optional
        The table holds only global rows [lo, hi) (a shard): table row i is global row lo + i,
        and ids outside the range come back as +0 rows. Default (0, R).
    backend : str
        "auto" (the device probe's choice, or $ENGRAM_BACKEND), or a backend of the table in
        ops/backends.py ("torch", "triton", "cpu", "cuda", "hip"); an explicit backend that
        cannot run raises BackendUnavailableError.
    table_address : int, optional
        For a table in registered host memory: the device address the GPU runtime mapped its
        first row at (HostStore.table_address). GPU backends read the table by it; when it is
        omitted they ask the runtime. The torch and cpu backends read the host tensor.

    Returns
    -------
    torch.Tensor
        bf16 [*ids.shape, 256]: value = fp32(e4m3fn) * 2^(e8m0 - 127) rounded once to bf16,
        every zero +0.0, bit-identical across backends.
    """
    if table.dtype != torch.uint8 or table.dim() != 2 or table.shape[1] != ROW_BYTES:
        raise ValueError(f"engram gather: table must be uint8 [R, {ROW_BYTES}], got {table.dtype} {tuple(table.shape)}")
    # An empty table (a shard that holds none of a call's rows: torch gives it strides (0, 0)
    # and any pointer) has no rows to be laid out or aligned; every id reads as +0.
    empty = table.shape[0] == 0
    if not empty and (table.stride(1) != 1 or (table.shape[0] > 1 and table.stride(0) != ROW_BYTES)):
        raise ValueError("engram gather: table rows must be contiguous (packed, 264 bytes apart)")
    # (Not while torch.compile traces: there is no pointer then; the launchers check again.)
    if not empty and not torch.compiler.is_compiling() and table.data_ptr() % 8:
        raise ValueError("engram gather: table must start 8-byte aligned (rows are read 8 bytes at a time)")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"engram gather: ids must be integers, got {ids.dtype}")
    rows = table.shape[0]
    lo, hi = (0, rows) if row_range is None else (int(row_range[0]), int(row_range[1]))
    if not (0 <= lo <= hi) or hi - lo > rows:
        raise ValueError(f"engram gather: row_range ({lo}, {hi}) does not fit a table of {rows} rows")
    device = ids.device
    if table.device != device and not (table.device.type == "cpu" and device.type == "cuda"):
        raise ValueError(f"engram gather: table on {table.device} cannot serve ids on {device}")
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int64)
    flat = flat.contiguous()
    shape = (*ids.shape, ROW_VALUES)
    if out is None:
        if not _eager(table, flat):
            return _gather_dequant_op(table, flat, lo, hi, backend, table_address).view(shape)
        out = _host_output(shape) if device.type == "cpu" else torch.empty(shape, dtype=torch.bfloat16, device=device)
        _launch(_resolve(backend, device), table, flat, lo, hi, out.view(-1, ROW_VALUES), table_address)
        return out
    if out.dtype != torch.bfloat16 or tuple(out.shape) != shape or out.device != device:
        raise ValueError(f"engram gather: out must be bf16 {list(shape)} on {device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("engram gather: out must be contiguous")
    if not _eager(table, flat, out):
        _gather_dequant_out_op(table, flat, out.view(-1, ROW_VALUES), lo, hi, backend, table_address)
        return out
    _launch(_resolve(backend, device), table, flat, lo, hi, out.view(-1, ROW_VALUES), table_address)
    torch._C._increment_version((out,))  # what the op's declared mutation of out does
    return out
