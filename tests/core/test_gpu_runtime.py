"""The GPU runtime binding (ops/gpu_runtime.py) and the native loaders' choice of runtime,
checked without a GPU: the copy already mapped in the process is the one bound, never another
on the library path; and, through a fake libamdhip64 built here (tests/support/native/
fake_hip_runtime.c), the real libengram_hip.so launcher is handed the device address the
runtime returns for a HostStore's registered rows, and refuses grids HIP cannot launch.

Proven only with fakes here (no GPU): the HIP device pointer reaching the launch, the HIP
registration flags and device guard, the grid limit. `make gpu-check` runs the real thing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram_sglang.core.ops import gpu_runtime, native

ROOT = Path(__file__).resolve().parents[2]
KERNELS = Path(os.environ.get("ENGRAM_KERNELS_DIR", ROOT / "build" / "kernels"))


# ------------------------------------------------------------------ finding the loaded copy
def test_find_loaded_matches_runtime_names_only():
    objects = ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/opt/x/libcudart_static_helper.so",
               "/venv/nvidia/cu13/lib/libcudart.so.13", "/other/libcudart.so.12"]
    assert gpu_runtime.find_loaded("libcudart", objects) == "/venv/nvidia/cu13/lib/libcudart.so.13"
    # pip's renamed copies (libcudart-<hash>.so.N) and ROCm's versioned file names.
    assert gpu_runtime.find_loaded("libcudart", ["/t/lib/libcudart-d0da41ae.so.11.0"]) == "/t/lib/libcudart-d0da41ae.so.11.0"
    assert gpu_runtime.find_loaded("libamdhip64", ["/opt/rocm/lib/libamdhip64.so.6.2.60200"]) is not None
    assert gpu_runtime.find_loaded("libamdhip64", ["/opt/rocm/lib/libamdhip64_fake.so"]) is None


def test_loaded_objects_lists_this_process_libraries():
    objects = gpu_runtime.loaded_objects()
    assert any(os.path.basename(p).startswith("libc.so") for p in objects)
    if torch.version.cuda:  # torch's CUDA build maps its libcudart at import
        assert gpu_runtime.find_loaded("libcudart", objects) is not None


def test_bind_refuses_a_runtime_that_is_not_loaded():
    with pytest.raises(gpu_runtime.GpuRuntimeUnavailable, match="no libamdhip64 is loaded in this process.*never loaded"):
        gpu_runtime.bind("hip", objects=["/usr/lib/x86_64-linux-gnu/libc.so.6"])


def test_elf_dynamic_reads_needed_and_soname():
    needed, soname = gpu_runtime.elf_dynamic(sys.executable if os.path.exists(sys.executable) else "/bin/sh")
    assert any(n.startswith("libc.so") for n in needed) or needed == []  # a static python has none
    cudart = gpu_runtime.find_loaded("libcudart")
    if cudart:
        assert gpu_runtime.elf_dynamic(cudart)[1].startswith("libcudart.so.")


# ------------------------------------------------------------------ native loaders
def test_hip_library_binds_to_the_mapped_runtime_not_a_path_candidate(tmp_path, monkeypatch):
    """Finding 7: a copy of libamdhip64 on the library path ($ROCM_PATH) loses to the mapped one."""
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "libengram_hip.so").write_bytes(b"")
    rocm = tmp_path / "rocm"
    (rocm / "lib").mkdir(parents=True)
    (rocm / "lib" / "libamdhip64.so").write_bytes(b"")  # another copy, on the library path
    mapped = "/opt/torch/lib/libamdhip64.so.6"
    calls = []

    class Loaded(Exception):
        pass

    def fake_cdll(path, mode=0):
        calls.append((str(path), mode))
        if str(path).endswith("libengram_hip.so"):
            raise Loaded  # stop here: which runtime was made global first is what we check
        return object()

    monkeypatch.setenv("ENGRAM_KERNELS_DIR", str(kernels))
    monkeypatch.setenv("ROCM_PATH", str(rocm))
    monkeypatch.setattr(native.ctypes, "CDLL", fake_cdll)
    monkeypatch.setattr(gpu_runtime, "loaded_objects", lambda: ["/usr/lib/libc.so.6", mapped])
    native.load.cache_clear()
    try:
        with pytest.raises(Loaded):
            native.load("hip")
    finally:
        native.load.cache_clear()
    assert calls[0] == (mapped, os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    assert not any("rocm" in p for p, _ in calls)


def test_hip_library_without_a_loaded_runtime_says_why(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "libengram_hip.so").write_bytes(b"")
    monkeypatch.setenv("ENGRAM_KERNELS_DIR", str(kernels))
    monkeypatch.setattr(gpu_runtime, "loaded_objects", lambda: ["/usr/lib/libc.so.6"])
    native.load.cache_clear()
    try:
        lib, why = native.try_load("hip")
    finally:
        native.load.cache_clear()
    assert lib is None and "no HIP runtime (libamdhip64) is loaded in this process" in why


def built_cuda_lib() -> Path:
    so = KERNELS / "libengram_cuda.so"
    if not so.exists():
        pytest.skip(f"{so} not built (run `make kernels`)")
    return so


def test_cuda_library_needs_the_runtime_torch_loaded(monkeypatch):
    """Finding 6: the library names libcudart by soname; one of another CUDA major than the
    loaded runtime's (or none loaded) is refused before it is loaded."""
    so = built_cuda_lib()
    needed = [n for n in gpu_runtime.elf_dynamic(str(so))[0] if n.startswith("libcudart")]
    assert needed, "libengram_cuda.so links the CUDA runtime statically"
    native.load.cache_clear()
    try:
        monkeypatch.setattr(gpu_runtime, "loaded_objects", lambda: ["/nowhere/libcudart.so.11"])
        lib, why = native.try_load("cuda")
        assert lib is None and f"needs {needed[0]} but torch runs on libcudart.so.11" in why
        monkeypatch.setattr(gpu_runtime, "loaded_objects", lambda: ["/usr/lib/libc.so.6"])
        native.load.cache_clear()
        lib, why = native.try_load("cuda")
        assert lib is None and "no CUDA runtime (libcudart) is loaded" in why
        monkeypatch.undo()
        native.load.cache_clear()
        if torch.version.cuda and gpu_runtime.find_loaded("libcudart"):
            def runtimes():
                return {os.path.realpath(p) for p in gpu_runtime.loaded_objects()
                        if os.path.basename(p).startswith("libcudart")}

            # (Other wheels may bring their own renamed copy, e.g. torchvision.libs/libcudart.<hash>.so.13:
            # what matters is that loading ours adds none.)
            before = runtimes()
            lib, why = native.try_load("cuda")
            assert lib is not None, why
            # No new CUDA runtime in the process: the library's NEEDED resolved to the loaded one.
            assert runtimes() == before, runtimes() - before
    finally:
        native.load.cache_clear()


# ------------------------------------------------------------------ a fake HIP runtime
@pytest.fixture(scope="module")
def fake_hip(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake HIP runtime")
    out = tmp_path_factory.mktemp("fakehip") / "libamdhip64.so.6"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(ROOT / "tests/support/native/fake_hip_runtime.c")],
                   check=True, capture_output=True, text=True)
    return out


# Runs in a subprocess: the fake runtime becomes "the HIP runtime already in the process"
# there, which must not leak into the test process.
CHAIN = r"""
import contextlib, ctypes, json, os, sys, types
fake_path, table_file, shm_dir = sys.argv[1:4]
fake = ctypes.CDLL(fake_path, mode=os.RTLD_GLOBAL)

class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint32), ("y", ctypes.c_uint32), ("z", ctypes.c_uint32)]

class Record(ctypes.Structure):
    _fields_ = [("register_calls", ctypes.c_int), ("register_device", ctypes.c_int),
                ("unregister_calls", ctypes.c_int), ("unregister_device", ctypes.c_int),
                ("register_flags", ctypes.c_uint), ("register_ptr", ctypes.c_size_t),
                ("unregister_ptr", ctypes.c_size_t), ("register_bytes", ctypes.c_size_t),
                ("launches", ctypes.c_int), ("grid", Dim3), ("block", Dim3), ("table", ctypes.c_size_t),
                ("n", ctypes.c_int64)]

fake.fake_record.restype = ctypes.POINTER(Record)
fake.fake_device_offset.restype = ctypes.c_size_t
rec = fake.fake_record().contents
import torch
from engram_sglang.core.ops import gather, gpu_runtime, native, probe
from engram_sglang.core.stores import base
from engram_sglang.core.stores.host import HostStore

# The base class keeps device-side counters, which need a real GPU: only what HostStore does
# with host memory and the runtime is under test here.
def base_init(self, layer_id, path, rows, row_range, device, backend, metric_ranks=None):
    self.layer_id, self.path, self.rows, self.row_range = layer_id, path, rows, row_range
    self.device, self.backend = torch.device(device), backend

base.TableStore.__init__ = base_init
base.TableStore.close = lambda self: None
ROWS, LO, HI = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
out = {"offset": fake.fake_device_offset()}
rt = gpu_runtime.bind("hip")
out["runtime_path"] = rt.path
out["access"] = list(vars(gpu_runtime.host_access(rt, 1)).values())
# The store's device: a simulated MI300X as rank 1's device (there is no GPU here).
dev = probe.hip_device("fake MI300X", "gfx942", index=1, uva=False, host_map=True)
probe.select_backend = lambda device=None, requested=None: probe.Choice(dev, "hip", (), "hip", False)
with gpu_runtime.injected(rt):
    import xxhash  # the shared copy is named by and checked against the manifest's checksums: one chunk here
    rows_bytes = open(table_file, "rb").read()[4096:]
    store = HostStore(3, table_file, ROWS, (LO, HI), torch.device("cuda", 1), "hip", shared=True,
                      shm_dir=shm_dir, checksums=(xxhash.xxh3_64(rows_bytes).hexdigest(),), chunk_rows=ROWS)
out["register"] = [rec.register_calls, rec.register_ptr, rec.register_bytes, rec.register_flags, rec.register_device]
out["map_address"], out["table_ptr"], out["table_address"] = store.memory.address, store.table.data_ptr(), store.table_address
out["device_after_register"] = rt.get_device()
# The real launcher, through the op's launch path (no GPU: the stream and device guard are stand-ins).
torch.cuda.device = lambda d: contextlib.nullcontext()
torch.cuda.current_stream = lambda d=None: types.SimpleNamespace(cuda_stream=0)
ids = torch.arange(LO, LO + 40, dtype=torch.int64)
rows = torch.empty((40, 256), dtype=torch.bfloat16)
gather._launch("hip", store.table, ids, LO, HI, rows, store.table_address)
out["launch"] = [rec.launches, rec.table, rec.n, rec.grid.x, rec.block.x]
# Grid limits: grid x block < 2^32 on HIP.
fn = native.load("hip").lib.engram_hip_gather_dequant
rows_per_block = 32
most = (2**32 - 1) // rec.block.x
a = rows.data_ptr()
rc_ok = fn(a, a, 8, most * rows_per_block, 0, 10, a, None)
grid_ok = rec.grid.x
rc_bad = fn(a, a, 8, most * rows_per_block + 1, 0, 10, a, None)
out["grid"] = [rc_ok, grid_ok, rc_bad, rec.launches]
# One ABI: the HIP library answers the probe's questions as the CUDA one does.
lib = native.load("hip")
out["device_info"] = native.device_info(lib, 1)
out["check_device"] = native.check_device(lib, 1)
with gpu_runtime.injected(rt):
    store.close()
out["unregister"] = [rec.unregister_calls, rec.unregister_ptr, rec.unregister_device]
print("RESULT " + json.dumps(out))
"""


def test_host_store_device_address_reaches_the_hip_launch(fake_hip, tmp_path):
    """Finding 3 (and 5 on HIP): rank 1 of a shared layer registers only its shard's pages, on
    its own device, Mapped|Portable-as-ruled and never flag 0x8 (on AMD that value means
    coarse-grained); the launcher gets the device address hipHostGetDevicePointer returned
    (host + a fake offset), not the host pointer; grids of 2^32 threads or more are refused."""
    hip = KERNELS / "libengram_hip.so"
    if not hip.exists():
        pytest.skip(f"{hip} not built (run `make kernels`)")
    from engram_sglang.core.rowformat import ROW_BYTES
    from engram_sglang.core.tablefile import DATA_OFFSET

    rows, lo, hi = 40_000, 20_000, 40_000
    table_file = tmp_path / "layer-3.rows"
    table_file.write_bytes(bytes(DATA_OFFSET) + os.urandom(rows * ROW_BYTES))
    shm = tmp_path / "shm"
    shm.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), ENGRAM_KERNELS_DIR=str(KERNELS))
    proc = subprocess.run([sys.executable, "-c", CHAIN, str(fake_hip), str(table_file), str(shm), str(rows), str(lo),
                           str(hi)], capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[0][len("RESULT "):])
    assert r["runtime_path"] == str(fake_hip)
    assert r["access"] == [True, False, False, False]  # mapped, not the same address, no read-only flag, hash order
    page = os.sysconf("SC_PAGE_SIZE")
    calls, ptr, nbytes, flags, device = r["register"]
    first = r["map_address"] + lo * ROW_BYTES  # the shard inside the whole-layer mapping
    assert calls == 1 and device == 1
    assert ptr == first // page * page and ptr + nbytes == -(-(r["map_address"] + hi * ROW_BYTES) // page) * page
    assert nbytes < rows * ROW_BYTES * 0.6  # the shard's pages, not the whole layer
    portable = torch.cuda.device_count() > 1
    assert flags == gpu_runtime.REGISTER_MAPPED | (gpu_runtime.REGISTER_PORTABLE if portable else 0)
    assert r["device_after_register"] == 0  # the guard restored the caller's device
    assert r["table_ptr"] == first
    assert r["table_address"] == first + r["offset"] != r["table_ptr"]
    launches, table, n, grid, block = r["launch"]
    assert (launches, table, n) == (1, r["table_address"], 40)
    assert block * grid >= 40 and block == 256
    rc_ok, grid_ok, rc_bad, launches = r["grid"]
    assert rc_ok == 0 and grid_ok * block == (2**32 - 1) // block * block
    assert rc_bad == -1 and launches == 2  # refused before any launch
    assert r["unregister"] == [1, ptr, 1]
    info = r["device_info"]
    assert (info["warp_size"], info["can_map_host_memory"], info["host_pointer_for_registered"]) == (64, 1, 0)
    assert r["check_device"] == 0
