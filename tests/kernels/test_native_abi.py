"""One ABI header per native library, and the Python bindings checked against it.

kernels/cpu/engram_cpu_abi.h (libengram_cpu.so), kernels/cuda/engram_gpu_abi.h (libengram_cuda.so
and libengram_hip.so: one ABI, engram_{cuda,hip}_*) and kernels/io/engram_rowio_abi.h
(libengram_rowio.so) declare the extern "C" entry points, status codes and structures; the
sources include them, so the compiler holds the definitions to them. Here the ctypes side is held
to them: every argtypes/restype that ops/native.py and stores/rowio.py set (recorded by running
their _bind on a stand-in library), the ctypes structures, and the Python copies of the
constants. Nothing else binds these entry points (tests and benchmarks use those bindings).

And the host libraries' file list (nativelibs.HOST_SOURCES: what the wheel carries and the
first-use build hashes) is what the compiler says their sources include.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engram_sglang.core import nativelibs
from engram_sglang.core.ops import native
from engram_sglang.core.stores import rowio

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
CPU_ABI = KERNELS / "cpu" / "engram_cpu_abi.h"
GPU_ABI = KERNELS / "cuda" / "engram_gpu_abi.h"
ROWIO_ABI = KERNELS / "io" / "engram_rowio_abi.h"
STATUS = KERNELS / "common" / "engram_status.h"
GPU_API = re.compile(r"ENGRAM_GPU_API\((\w+)\)")
# The Python ctypes structure of each C structure the ABI passes by pointer.
STRUCTS = {"engram_disk_file": rowio.DiskFile, "engram_dram_cache": rowio.DramCacheView,
           "engram_step_result": rowio.StepResult}
SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint8_t": ctypes.c_uint8,
           "uint16_t": ctypes.c_uint16}


# ------------------------------------------------------------------ the header parser
@dataclass
class Header:
    functions: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # name -> (return, [arg types])
    constants: dict[str, int] = field(default_factory=dict)  # enumerators and numeric #defines
    structs: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # typedef name -> [(field, type)]


def c_type(decl: str) -> str:
    """'const uint8_t* base' -> 'uint8_t*' (qualifiers and the parameter name dropped)."""
    decl = re.sub(r"\bconst\b", " ", decl).replace("*", " * ")
    words = decl.split()
    if len(words) > 1 and words[-1] != "*" and words[-1] not in SCALARS:
        words = words[:-1]  # the name
    return "".join(w if w == "*" else (" " + w) for w in words).strip()


def parse_header(text: str, vendor: str = "") -> Header:
    """The prototypes, constants and structures of an ABI header (the simple C these headers are
    written in). ENGRAM_GPU_API(name) is read as engram_<vendor>_<name>."""
    h = Header()
    for name, value in re.findall(r"^\s*#\s*define\s+(\w+)\s+\(?(-?\d+)\)?\s*$", text, re.M):
        h.constants[name] = int(value)
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"^\s*#[^\n]*$", " ", text, flags=re.M)
    text = re.sub(r'extern\s+"C"\s*\{|^\s*\}\s*$', " ", text, flags=re.M)
    for body in re.findall(r"\benum\s+\w*\s*\{(.*?)\}\s*;", text, re.S):
        for name, value in re.findall(r"(\w+)\s*=\s*(-?\d+)", body):
            h.constants[name] = int(value)
    for body, name in re.findall(r"\btypedef\s+struct\s+\w*\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            first, *more = (part.strip() for part in decl.split(","))
            base = c_type(first).rstrip("* ")
            for d in [first, *(base + " " + m for m in more)]:
                fields.append((re.findall(r"\w+", d)[-1], c_type(d)))
        h.structs[name] = fields
    text = re.sub(r"\b(typedef\s+struct|enum)\b[^{;]*\{.*?\}[^;]*;", " ", text, flags=re.S)
    if vendor:
        text = GPU_API.sub(rf"engram_{vendor}_\1", text)
    for ret, name, args in re.findall(r"([\w\s\*]+?)\b(\w+)\s*\(([^()]*)\)\s*;", text):
        args = [c_type(a) for a in args.split(",")] if args.strip() not in ("", "void") else []
        h.functions[name] = (c_type(ret + " x"), args)
    return h


def read_header(path: Path, vendor: str = "") -> Header:
    h = parse_header(path.read_text(), vendor)
    if '"../common/engram_status.h"' in path.read_text():
        h.constants.update(parse_header(STATUS.read_text()).constants)
    return h


# ------------------------------------------------------------------ the bindings, recorded
UNSET = object()


class RecordedFunction:
    def __init__(self):
        self.argtypes, self.restype = UNSET, UNSET


class RecordingLibrary:
    """Stands in for a ctypes.CDLL: every entry point the binding touches, with what it set."""

    def __init__(self):
        self.functions: dict[str, RecordedFunction] = {}

    def __getattr__(self, name):
        return self.functions.setdefault(name, RecordedFunction())

    def bound(self) -> dict[str, tuple[object, object]]:
        return {n: (f.argtypes, f.restype) for n, f in self.functions.items()
                if f.argtypes is not UNSET or f.restype is not UNSET}


def recorded(bind) -> dict[str, tuple[object, object]]:
    lib = RecordingLibrary()
    bind(lib)
    return lib.bound()


def ctypes_name(t) -> str:
    return "None" if t is None else getattr(t, "__name__", repr(t))


def matches(ctype: str, py) -> bool:
    """Whether ctypes type `py` passes or returns C type `ctype` as the ABI means it."""
    if ctype == "void":
        return py is None
    if ctype in SCALARS:
        return py is SCALARS[ctype]
    if ctype == "char*":
        return py is ctypes.c_char_p
    if ctype.endswith("*"):
        target = ctype[:-1]
        if target in STRUCTS:
            return py is ctypes.POINTER(STRUCTS[target])
        return py is ctypes.c_void_p or (target in SCALARS and py is ctypes.POINTER(SCALARS[target]))
    return False


def binding_problems(header: Header, bound: dict[str, tuple[object, object]], where: str) -> list[str]:
    """What differs between the header's prototypes and the recorded argtypes/restype."""
    extra = sorted(set(bound) - set(header.functions))
    problems = [f"{where}: {n} is bound but not declared in the header" for n in extra]
    for name, (ret, args) in sorted(header.functions.items()):
        if name not in bound:
            problems.append(f"{where}: {name} is declared in the header but not bound")
            continue
        argtypes, restype = bound[name]
        if restype is UNSET:
            problems.append(f"{where}: {name} has no restype (the header returns {ret})")
        elif not matches(ret, restype):
            problems.append(f"{where}: {name} returns {ret} in the header, {ctypes_name(restype)} in the binding")
        if argtypes is UNSET:
            if args:
                problems.append(f"{where}: {name} has no argtypes (the header takes {', '.join(args)})")
            continue
        if len(argtypes) != len(args):
            problems.append(f"{where}: {name} takes {len(args)} arguments in the header, "
                            f"{len(argtypes)} in the binding")
            continue
        for i, (c, py) in enumerate(zip(args, argtypes), 1):
            if not matches(c, py):
                problems.append(f"{where}: {name} argument {i} is {c} in the header, {ctypes_name(py)} in the binding")
    return problems


def struct_problems(header: Header, structs: dict) -> list[str]:
    problems = []
    for cname, pytype in structs.items():
        c_fields = header.structs.get(cname)
        if c_fields is None:
            problems.append(f"{cname}: not in the header")
            continue
        py_fields = [(n, t) for n, t in pytype._fields_]
        if [n for n, _ in c_fields] != [n for n, _ in py_fields]:
            problems.append(f"{cname}: fields {[n for n, _ in c_fields]} in the header, "
                            f"{[n for n, _ in py_fields]} in {pytype.__name__}")
            continue
        for (n, c), (_, py) in zip(c_fields, py_fields):
            if not matches(c, py):
                problems.append(f"{cname}.{n} is {c} in the header, {ctypes_name(py)} in {pytype.__name__}")
    return problems


# ------------------------------------------------------------------ the checks
def test_the_parser_reads_what_the_headers_declare():
    h = read_header(ROWIO_ABI)
    assert h.functions["engram_rowio_aio"] == ("int", ["int", "int64_t", "int64_t*", "int64_t", "uint8_t*", "int",
                                                       "int64_t*"])
    assert h.functions["engram_rowio_uring_buffers"] == ("void", ["int64_t*"])
    assert h.functions["engram_disk_step_layout"] == ("int64_t", ["int"])
    assert h.structs["engram_disk_file"][:2] == [("fd", "int32_t"), ("mode", "int32_t")]
    assert h.constants["ENGRAM_STEP_AIO_UNAVAILABLE"] == -2 and h.constants["ENGRAM_ROWIO_MAX_THREADS"] == 256
    g = read_header(GPU_ABI, "hip")
    assert g.functions["engram_hip_targets"] == ("char*", [])
    assert g.functions["engram_hip_gather_dequant"][1][-1] == "void*"
    assert read_header(CPU_ABI).constants["ENGRAM_MISALIGNED"] == -2
    assert len(read_header(CPU_ABI).functions) == 7 and len(g.functions) == 6 and len(h.functions) == 11


@pytest.mark.parametrize("kind", ["cpu", "cuda", "hip"])
def test_gather_bindings_match_their_header(kind):
    header = read_header(CPU_ABI) if kind == "cpu" else read_header(GPU_ABI, kind)
    assert binding_problems(header, recorded(lambda lib: native._bind(kind, lib)), f"native {kind}") == []


def test_rowio_binding_and_structures_match_the_header():
    header = read_header(ROWIO_ABI)
    assert binding_problems(header, recorded(rowio._bind), "rowio") == []
    assert struct_problems(header, STRUCTS) == []


def test_python_constants_are_the_headers():
    rowio_h, cpu_h, gpu_h = read_header(ROWIO_ABI), read_header(CPU_ABI), read_header(GPU_ABI, "cuda")
    names = [n for n in vars(rowio) if re.fullmatch(r"(READ|STEP)_[A-Z_]+|AIO_UNAVAILABLE|MAX_THREADS", n)]
    assert len(names) == 9
    for n in names:
        c = {"MAX_THREADS": "ENGRAM_ROWIO_MAX_THREADS"}.get(n, "ENGRAM_" + n)
        assert getattr(rowio, n) == rowio_h.constants[c], (n, c)
    assert native.ABI_VERSION == {"cpu": cpu_h.constants["ENGRAM_CPU_ABI_VERSION"],
                                  "cuda": gpu_h.constants["ENGRAM_GPU_ABI_VERSION"],
                                  "hip": gpu_h.constants["ENGRAM_GPU_ABI_VERSION"]}
    # The CPU library's messages: one for each negative status, none for a code it never returns.
    cpu = native.NativeLib("cpu", Path("-"), None, ())
    codes = {v for k, v in cpu_h.constants.items() if k.startswith("ENGRAM_") and v < 0}
    assert codes == {-1, -2}
    assert all(cpu.error_string(c) != "unknown error" for c in codes)
    assert cpu.error_string(min(codes) - 1) == "unknown error"


# Entry points of these libraries (a prefix of every name their headers declare).
ABI_NAME = r"engram_(?:cpu|cuda|hip|rowio|disk_step)\w*"
BINDINGS = {ROOT / "engram_sglang" / "core" / "ops" / "native.py", ROOT / "engram_sglang" / "core" / "stores" / "rowio.py"}


def ad_hoc_bindings(text: str) -> list[str]:
    """Entry points given argtypes/restype in `text` directly (lib.engram_x.argtypes) or through
    a name (f = lib.engram_x; f.argtypes), code in strings included."""
    found = re.findall(rf"\b({ABI_NAME})\s*\.\s*(?:argtypes|restype)\b", text)
    for alias, name in re.findall(rf"\b(\w+)\s*=\s*[\w.()]*\.({ABI_NAME})\b", text):
        if re.search(rf"\b{alias}\s*\.\s*(?:argtypes|restype)\b", text):
            found.append(name)
    return found


def test_nothing_else_binds_the_entry_points():
    found = {}
    for folder in ("engram_sglang", "tests", "bench", "scripts", "docker", "fuzz"):
        for path in (ROOT / folder).rglob("*.py") if (ROOT / folder).is_dir() else ():
            if path in BINDINGS or path == Path(__file__).resolve():
                continue
            names = ad_hoc_bindings(path.read_text())
            if names:
                found[str(path.relative_to(ROOT))] = names
    assert found == {}, "bind through ops/native.py or stores/rowio.py (checked against the headers)"


@pytest.mark.parametrize("lang", ["c", "c++"])
@pytest.mark.parametrize("header", [CPU_ABI, GPU_ABI, ROWIO_ABI])
def test_headers_stand_alone(tmp_path, header, lang):
    """Each header compiles by itself, as C and as C++ (a caller needs nothing but it)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    unit = tmp_path / "unit.c"
    unit.write_text(f'#include "{header}"\nint main(void) {{ return 0; }}\n')
    run = subprocess.run([cc, "-x", lang, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-DENGRAM_VENDOR=cuda",
                          str(unit)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# ------------------------------------------------------------------ negative controls
def test_a_changed_argument_type_in_the_header_is_reported(tmp_path):
    text = ROWIO_ABI.read_text()
    changed = text.replace("int engram_rowio_aio(int fd,", "int engram_rowio_aio(int64_t fd,")
    assert changed != text
    problems = binding_problems(parse_header(changed), recorded(rowio._bind), "rowio")
    assert problems == ["rowio: engram_rowio_aio argument 1 is int64_t in the header, c_int in the binding"]
    gpu = GPU_ABI.read_text().replace("(int device, int* out);", "(int device, int64_t* out);")
    problems = binding_problems(parse_header(gpu, "hip"), recorded(lambda lib: native._bind("hip", lib)), "hip")
    assert problems == ["hip: engram_hip_device_info argument 2 is int64_t* in the header, LP_c_int in the binding"]


def test_a_changed_binding_is_reported():
    header = read_header(CPU_ABI)
    bound = recorded(lambda lib: native._bind("cpu", lib))
    args, res = bound["engram_cpu_gather_dequant"]
    bound["engram_cpu_gather_dequant"] = ([*args[:2], ctypes.c_int64, *args[3:]], res)
    bound["engram_cpu_threads_for"] = (bound["engram_cpu_threads_for"][0][:1], ctypes.c_int)
    bound["engram_cpu_decode_avx512"] = (UNSET, ctypes.c_void_p)
    del bound["engram_cpu_gather_raw"]
    bound["engram_cpu_gather_fast"] = ([], ctypes.c_int)
    assert binding_problems(header, bound, "cpu") == [
        "cpu: engram_cpu_gather_fast is bound but not declared in the header",
        "cpu: engram_cpu_decode_avx512 returns int in the header, c_void_p in the binding",
        "cpu: engram_cpu_gather_dequant argument 3 is int in the header, c_long in the binding",
        "cpu: engram_cpu_gather_raw is declared in the header but not bound",
        "cpu: engram_cpu_threads_for takes 2 arguments in the header, 1 in the binding",
    ]
    rowio_bound = recorded(rowio._bind)
    rowio_bound["engram_rowio_test_fail_enters"] = ([ctypes.c_int], UNSET)
    assert binding_problems(read_header(ROWIO_ABI), rowio_bound, "rowio") == [
        "rowio: engram_rowio_test_fail_enters has no restype (the header returns void)"]


def test_a_changed_structure_is_reported():
    class Swapped(ctypes.Structure):
        _fields_ = [(n, t) for n, t in rowio.StepResult._fields_[::-1]]

    class Narrow(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int64 if n == "threads" else t) for n, t in rowio.DiskFile._fields_]

    problems = struct_problems(read_header(ROWIO_ABI), {"engram_step_result": Swapped, "engram_disk_file": Narrow})
    assert len(problems) == 2
    assert problems[0].startswith("engram_step_result: fields ['unique', 'misses', 'error', 'failed'] in the header")
    assert problems[1] == "engram_disk_file.threads is int32_t in the header, c_long in Narrow"


def test_an_ad_hoc_binding_is_reported():
    assert ad_hoc_bindings("lib.engram_cpu_gather_raw.argtypes = [ctypes.c_void_p]") == ["engram_cpu_gather_raw"]
    assert ad_hoc_bindings("f = lib.lib.engram_rowio_aio\nf.restype = ctypes.c_int\n") == ["engram_rowio_aio"]
    assert ad_hoc_bindings("fm = ctypes.CDLL(p)\nfm.engram_test_fm.restype = ctypes.c_float\n") == []


# ------------------------------------------------------------------ the host libraries' files
def included_files(kernels: Path, host_libs: dict) -> set[str]:
    """The files the host libraries' builds read, relative to `kernels`, as the compiler reports
    them (-MM: the project's headers, not the system's), plus the flags file."""
    cxx = nativelibs.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = nativelibs.read_flags(kernels / "host-flags.mk")
    files = {"host-flags.mk"}
    for source, flags_name in host_libs.values():
        run = subprocess.run([*cxx, *flags[flags_name], "-MM", str(kernels / source)], capture_output=True,
                             text=True, check=True)
        deps = run.stdout.replace("\\\n", " ").split(":", 1)[1].split()
        files |= {os.path.relpath(os.path.normpath(d), kernels) for d in deps}
    return files


def test_host_sources_are_what_the_sources_include():
    assert len(set(nativelibs.HOST_SOURCES)) == len(nativelibs.HOST_SOURCES)
    assert set(nativelibs.HOST_SOURCES) == included_files(KERNELS, nativelibs.HOST_LIBS)
    assert "graft kernels" in (ROOT / "MANIFEST.in").read_text().splitlines()  # the sdist carries them all


def test_a_new_header_missing_from_host_sources_is_reported(tmp_path):
    kernels = tmp_path / "kernels"
    shutil.copytree(KERNELS, kernels)
    src = kernels / "io" / "engram_rowio.cpp"
    src.write_text('#include "engram_new.h"\n' + src.read_text())
    (kernels / "io" / "engram_new.h").write_text("#pragma once\n")
    assert included_files(kernels, nativelibs.HOST_LIBS) - set(nativelibs.HOST_SOURCES) == {"io/engram_new.h"}
