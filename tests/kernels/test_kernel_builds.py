"""What `make kernels` built, checked without a GPU: each target is present and current, its
disassembly holds the target's native fp8 conversion and no flush-to-zero, the host build
matches the reference bit for bit, and Triton's kernel compiles ahead of time for every GPU
target with denormals kept.

`make test` builds the kernels first; run alone, missing artifacts skip with the reason.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engram_sglang.core.ops import native
from tests.core.test_gather import bits_of, exhaustive_table, expected_bits

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("ENGRAM_KERNELS_DIR", ROOT / "build" / "kernels"))


def kernel_sources(*folders: str) -> tuple[Path, ...]:
    """Every file of these kernels/ folders: what a build may read (no hand list of headers to
    forget; the make rules take theirs from the compiler)."""
    return tuple(sorted(f for d in folders for f in (ROOT / "kernels" / d).iterdir() if f.is_file()))


CPU_SOURCES = kernel_sources("cpu", "common")
# One launcher source for both GPU vendors (CUDA calls renamed to HIP's in compat.h).
GPU_SOURCES = kernel_sources("cuda", "hip", "common")
CUDA_ARCHS = (80, 89, 90, 100, 120)
HIP_ARCHS = ("gfx942", "gfx950")
# LLVM tools as mk/kernels.mk names them: Debian's clang-22 packages, or the ROCm image's own.
LLVM = os.environ.get("LLVM_SUFFIX", "-22")
# Native fp8 -> wider conversions per target (docs/toolchain.md).
HIP_FP8_INSTR = {"gfx942": "v_cvt_pk_f32_fp8", "gfx950": "v_cvt_scalef32_pk_f32_fp8"}


def artifact(path: Path, *sources: Path, why_missing: str) -> Path:
    """The built file, skipping when it is absent and failing when older than its sources."""
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} not built: {why_missing}")
    for src in sources:
        if src.stat().st_mtime > path.stat().st_mtime:
            pytest.fail(f"{path.name} is older than {src.relative_to(ROOT)}: run `make kernels`")
    return path


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} not installed (scripts/setup-toolchain.sh installs it)")
    return found


def run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


# ------------------------------------------------------------------ host library
def test_cpu_library_matches_reference(rng):
    lib_path = artifact(OUT / "libengram_cpu.so", *CPU_SOURCES,
                        why_missing="run `make kernels`")
    lib = ctypes.CDLL(str(lib_path))
    native._bind("cpu", lib)  # the package's binding (tests/kernels/test_native_abi.py checks it against the ABI header)
    assert lib.engram_cpu_abi_version() == 1
    t = exhaustive_table(extra_rows=500, gen=rng)
    ids = torch.randint(-1, t.shape[0] + 1, (3000,), generator=rng)
    out = torch.empty((ids.numel(), 256), dtype=torch.bfloat16)
    fn = lib.engram_cpu_gather_dequant
    assert fn(t.data_ptr(), ids.data_ptr(), 8, ids.numel(), 0, t.shape[0], out.data_ptr(), 2) == 0
    assert torch.equal(bits_of(out), expected_bits(t, ids, 0, t.shape[0]))
    assert fn(t.data_ptr(), ids.data_ptr(), 3, ids.numel(), 0, t.shape[0], out.data_ptr(), 2) == -1


def test_cpu_library_has_no_fast_math():
    """-ffast-math links crtfastmath, whose constructor turns on FTZ/DAZ for the process."""
    lib = artifact(OUT / "libengram_cpu.so", *CPU_SOURCES, why_missing="run `make kernels`")
    symbols = run(tool("nm"), str(lib))
    assert "set_fast_math" not in symbols


# ------------------------------------------------------------------ CUDA
def cuda_lib() -> Path:
    why = "nvcc missing" if not Path("/usr/local/cuda/bin/nvcc").exists() and not shutil.which("nvcc") else \
        "run `make kernels`"
    return artifact(OUT / "libengram_cuda.so", *GPU_SOURCES, why_missing=why)


def fatbin_entries(so: Path) -> list[tuple[str, int]]:
    """(kind, arch) of each entry of the library's .nv_fatbin: ELF = SASS, PTX = PTX."""
    dump = so.parent / "cuda" / "nv_fatbin.bin"
    dump.parent.mkdir(parents=True, exist_ok=True)
    run(tool("objcopy"), "-O", "binary", "--only-section=.nv_fatbin", str(so), str(dump))
    data, off, out = dump.read_bytes(), 0, []
    while off + 16 <= len(data):
        magic, _, header, size = struct.unpack_from("<IHHQ", data, off)
        assert magic == 0xBA55ED50, "not a fatbin"
        p, end = off + header, off + header + size
        while p < end:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            out.append(({1: "PTX", 2: "ELF"}.get(kind, str(kind)), arch))
            p += entry_header + entry_size
        off = end
    return out


def test_cuda_library_targets():
    so = cuda_lib()
    entries = set(fatbin_entries(so))
    assert {("ELF", a) for a in CUDA_ARCHS} <= entries
    assert ("PTX", 120) in entries
    # The shared CUDA runtime, by soname: the copy torch loaded serves it (nvcc's default static
    # runtime would be a second one in the process).
    dynamic = run(tool("readelf"), "-d", str(so))
    assert re.search(r"\(NEEDED\)\s+Shared library: \[libcudart\.so\.\d+\]", dynamic), dynamic
    # Loads without a GPU after torch (which maps the runtime it needs); a launch reports the
    # missing driver instead of crashing. In a subprocess so that a crash cannot take pytest down.
    code = f"""
        import ctypes
        import torch
        from engram_sglang.core.ops import native
        lib = ctypes.CDLL({str(so)!r})
        native._bind("cuda", lib)
        print(lib.engram_cuda_abi_version(), lib.engram_cuda_targets().decode())
        f = lib.engram_cuda_gather_dequant
        buf = ctypes.create_string_buffer(1 << 16)
        addr = (ctypes.addressof(buf) + 15) // 16 * 16
        rc = f(addr, addr, 8, 4, 0, 10, addr, None)
        print(rc, lib.engram_cuda_error_string(rc).decode())
        print(f(addr + 4, addr, 8, 4, 0, 10, addr, None), f(addr, addr, 8, -1, 0, 10, addr, None))
    """
    lines = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, capture_output=True,
                           text=True, timeout=60).stdout.splitlines()
    assert lines[0] == "2 sm_80 sm_89 sm_90 sm_100 sm_120 compute_120"
    rc, msg = lines[1].split(" ", 1)
    assert int(rc) > 0 and msg  # e.g. 35 "CUDA driver version is insufficient" / 100 "no device"
    assert lines[2] == "-2 -1"  # misaligned table, bad n: refused before any CUDA call


@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_cuda_ptx_native_fp8_and_no_ftz(arch):
    cuda_lib()
    ptx = artifact(OUT / "cuda" / f"engram_gather.sm_{arch}.ptx", *GPU_SOURCES,
                   why_missing="run `make kernels`").read_text()
    ops = collections.Counter(re.findall(r"^\s*(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, re.M))
    if arch >= 89:
        assert ops["cvt.rn.f16x2.e4m3x2"] >= 16  # 8 values a chunk, 2 per instruction, 2 id widths
    else:  # sm_80/86 have no e4m3 conversion: nvcc lowers it to integer code
        assert ops["cvt.rn.f16x2.e4m3x2"] == 0
    assert not [op for op in ops if ".ftz" in op]
    assert ops["mul.rn.f32"] > 0
    assert ops["ld.global.nc.v2.u32"] > 0  # 8-byte row loads
    assert ops["st.global.v4.u32"] > 0  # 16-byte stores


# ------------------------------------------------------------------ HIP
def hip_lib() -> Path:
    hipcxx = os.environ.get("HIPCXX", "clang++-22")
    why = f"{hipcxx} missing" if not shutil.which(hipcxx) else "run `make kernels`"
    return artifact(OUT / "libengram_hip.so", *GPU_SOURCES, why_missing=why)


def test_hip_library_binds_to_any_rocm():
    so = hip_lib()
    dynamic = run(tool(f"llvm-readelf{LLVM}"), "-d", "--dyn-syms", str(so))
    assert "libamdhip64" not in dynamic  # no soname baked in: resolved against torch's runtime
    assert re.search(r"UND\s+hipLaunchKernel", dynamic)
    assert re.search(r"UND\s+hipDeviceGetAttribute", dynamic)  # device_info asks HIP as it asks CUDA
    for sym in ("engram_hip_gather_dequant", "engram_hip_targets", "engram_hip_check_device", "engram_hip_device_info"):
        assert re.search(rf"FUNC\s+GLOBAL\s+DEFAULT\s+\d+\s+{sym}$", dynamic, re.M), sym
    bundles = run(tool(f"clang-offload-bundler{LLVM}"), "--list", "--type=o", f"--input={OUT / 'hip' / 'fatbin.bin'}")
    assert {f"hipv4-amdgcn-amd-amdhsa--{a}" for a in HIP_ARCHS} <= set(bundles.split())


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_code_object_native_fp8_and_denormals(arch):
    hip_lib()
    co = artifact(OUT / "hip" / f"engram_gather.{arch}.co", *GPU_SOURCES, why_missing="run `make kernels`")
    text = run(tool(f"llvm-objdump{LLVM}"), "-D", f"--mcpu={arch}", str(co))
    instrs = collections.Counter(re.findall(r"^\s+(v_\w+|s_\w+|global_\w+)", text, re.M))
    assert any(i.startswith(HIP_FP8_INSTR[arch]) for i in instrs), sorted(i for i in instrs if "cvt" in i)
    kernels = re.findall(r"<(\w*engram_gather_kernel\w*)\.kd>", text)
    assert len(kernels) == 2  # int32 and int64 ids
    # fp32 denormals kept (mode 3) in both kernel descriptors.
    assert text.count(".amdhsa_float_denorm_mode_32 3") == 2
    assert instrs["global_load_dwordx2"] > 0 and instrs["global_store_dwordx4"] > 0
    notes = run(tool(f"llvm-readelf{LLVM}"), "--notes", str(co))
    assert notes.count(".wavefront_size: 64") == 2


def test_one_abi_for_both_gpu_vendors():
    """The CUDA and HIP libraries come from one source: the same entry points, vendor prefix aside."""
    cuda, hip = cuda_lib(), hip_lib()

    def entries(so: Path, vendor: str) -> set[str]:
        names = run(tool("nm"), "-D", "--defined-only", str(so)).split()
        return {n.replace(f"engram_{vendor}_", "engram_X_") for n in names if n.startswith(f"engram_{vendor}_")}

    want = {f"engram_X_{e}" for e in ("abi_version", "targets", "error_string", "check_device", "device_info",
                                      "gather_dequant")}
    assert entries(cuda, "cuda") == entries(hip, "hip") == want


# ------------------------------------------------------------------ Triton, ahead of time
TRITON_TARGETS = [("cuda", 90, 32), ("cuda", 100, 32), ("cuda", 120, 32), ("hip", "gfx942", 64), ("hip", "gfx950", 64)]


@pytest.fixture(scope="module")
def compiled_kernel():
    """Triton's kernel as the JIT compiler sees it (not the interpreter's wrapper)."""
    triton = pytest.importorskip("triton")
    import importlib

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        mp.setenv("TRITON_CACHE_DIR", str(ROOT / "build" / "triton-cache"))
        import engram_sglang.core.ops.gather_triton as gt

        gt = importlib.reload(gt)
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        sig = {"table_ptr": "*i64", "ids_ptr": "*i64", "out_ptr": "*i16", "n": "i64", "lo": "i64", "hi": "i64",
               "ROWS": "constexpr"}
        aligned = [["tt.divisibility", 16]]  # what the launcher specializes for torch's allocations
        src = ASTSource(gt._gather_dequant_kernel, signature=sig, constexprs={"ROWS": gt.ROWS_PER_PROGRAM},
                        attrs={(0,): aligned, (1,): aligned, (2,): aligned})

        def compile_for(backend, arch, warp):
            return triton.compile(src, target=GPUTarget(backend, arch, warp), options={"num_warps": 4}).asm

        yield compile_for
    importlib.reload(gt)


@pytest.mark.parametrize("backend, arch, warp", TRITON_TARGETS)
def test_triton_compiles_for_every_gpu_target(compiled_kernel, backend, arch, warp):
    asm = compiled_kernel(backend, arch, warp)
    if backend == "cuda":
        ptx = asm["ptx"]
        assert ".ftz" not in ptx
        assert re.search(r"\bmul(\.rn)?\.f32(x2)?\b", ptx)
        assert "st.global.v4.b32" in ptx  # 16-byte stores of bf16 rows
    else:
        gcn = asm["amdgcn"]
        assert ".amdhsa_float_denorm_mode_32 3" in gcn
        assert "global_store_dwordx4" in gcn and "global_load_dwordx2" in gcn
