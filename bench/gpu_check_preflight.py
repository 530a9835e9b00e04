"""The preflight of bench/gpu_check.py: in seconds, before any worker starts, what cannot run here.

It reads facts (`gather`: versions, files, the native libraries' ELF bytes; torch is imported
only where the run imports it anyway) and judges them with pure functions (`judge`, unit-tested
on the CPU with made-up facts): torch and the native CUDA library on the same CUDA major, the
libraries' glibc against this one, a C compiler and Python.h (Triton compiles its launcher with
them at the first kernel), the Python modules the checks import, the GPU count (the 2-GPU checks).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the checks import: (module, what needs it). torch and numpy are needed by every check.
MODULES = (("torch", "every check"), ("numpy", "every check"), ("safetensors", "the tables check"),
           ("xxhash", "the tables check"), ("sympy", "the tables check (table layout)"),
           ("triton", "the triton checks"), ("matplotlib", "the decode step harness (its plots)"))
FATAL_MODULES = {"torch", "numpy"}


@dataclass
class Facts:
    """What the preflight looked at (all plain values: `judge` needs no machine)."""

    gpu: bool  # a GPU run (not --dry-run)
    modules: dict = field(default_factory=dict)  # name -> found
    torch_cuda: str | None = None  # torch.version.cuda ("13.0"), None for a CPU or ROCm build
    torch_hip: str | None = None
    libs: dict = field(default_factory=dict)  # library file name -> its bytes' facts (lib_facts)
    glibc: str = ""  # this machine's ("2.36")
    compiler: str | None = None  # path of cc/gcc/clang ($CC first)
    python_h: bool = False
    gpus: int = 0


def lib_facts(data: bytes) -> dict:
    """From a shared library's bytes: the CUDA runtime major it needs by soname, the newest glibc
    symbol version it needs (cheap: strings of the dynamic section, no ELF parse needed)."""
    cudart = sorted({int(m) for m in re.findall(rb"libcudart\.so\.(\d+)", data)})
    glibc = sorted({tuple(int(x) for x in m.split(b".")) for m in re.findall(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)", data)})
    return {"cudart": cudart[0] if cudart else None, "glibc": ".".join(map(str, glibc[-1])) if glibc else ""}


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def judge(f: Facts) -> list[tuple[str, str]]:
    """(level, line) per problem: level "fatal" (nothing can run: the run stops now) or "warn"
    (the named checks will fail or skip). Empty when everything the checks need is here."""
    out = []
    for name, needed_by in MODULES:
        if not f.modules.get(name, False):
            level = "fatal" if name in FATAL_MODULES else "warn"
            out.append((level, f"Python module {name} is missing ({needed_by}): pip install {name}"))
    cuda_lib = f.libs.get("libengram_cuda.so")
    if f.gpu and f.torch_hip is None:
        if cuda_lib is None:
            out.append(("warn", "build/kernels/libengram_cuda.so is missing (the native checks fail): build it with "
                                "`make kernels VENDOR=cuda` and carry build/kernels"))
        elif f.torch_cuda and cuda_lib["cudart"] is not None and _version(f.torch_cuda)[0] != cuda_lib["cudart"]:
            out.append(("warn", f"libengram_cuda.so needs libcudart.so.{cuda_lib['cudart']} but torch is built for "
                                f"CUDA {f.torch_cuda} (the native checks fail): rebuild with the CUDA "
                                f"{_version(f.torch_cuda)[0]} toolkit"))
    if f.gpu and f.torch_hip is not None and "libengram_hip.so" not in f.libs:
        out.append(("warn", "build/kernels/libengram_hip.so is missing (the native checks fail): "
                            "`make kernels VENDOR=hip`"))
    if "libengram_cpu.so" not in f.libs and not f.gpu:
        out.append(("fatal", "build/kernels/libengram_cpu.so is missing (the dry run's native checks): "
                             "`make kernels VENDOR=cpu`"))
    for name, lib in sorted(f.libs.items()):
        if f.glibc and lib["glibc"] and _version(lib["glibc"]) > _version(f.glibc):
            out.append(("warn", f"{name} needs glibc {lib['glibc']} but this machine has {f.glibc} (it will not "
                                f"load): build it on a machine with glibc <= {f.glibc}"))
    if f.modules.get("triton", False):
        if not f.compiler:
            out.append(("warn", "no C compiler (cc, gcc, clang or $CC): Triton cannot build its launcher, the triton "
                                "checks fail; install gcc"))
        if not f.python_h:
            out.append(("warn", "no Python.h for this Python: Triton cannot build its launcher, the triton checks "
                                "fail; install the python3-dev package of this Python"))
    if f.gpu and f.gpus < 2:
        out.append(("warn", f"{f.gpus} GPU visible: the 2-GPU checks skip (needs 2 GPUs)"))
    return out


def gather(gpu: bool, torch=None) -> Facts:
    """This machine's facts. `torch` is the imported module on a GPU run (the parent imports it
    anyway); the dry run reads torch's version file without importing torch (seconds saved)."""
    f = Facts(gpu=gpu)
    for name, _ in MODULES:
        f.modules[name] = importlib.util.find_spec(name) is not None
    if torch is not None:
        f.torch_cuda, f.torch_hip = torch.version.cuda, torch.version.hip
        f.gpus = torch.cuda.device_count()
    elif f.modules["torch"]:
        f.torch_cuda, f.torch_hip = _torch_version_file()
    for path in sorted((ROOT / "build" / "kernels").glob("libengram_*.so")):
        if path.name.split("_", 1)[1] in ("cpu.so", "cuda.so", "hip.so"):
            f.libs[path.name] = lib_facts(path.read_bytes())
    f.glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").removeprefix("glibc ") if hasattr(os, "confstr") else ""
    cc = os.environ.get("CC")
    f.compiler = (shutil.which(cc) if cc else None) or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))),
                                                            None)
    f.python_h = (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    return f


def _torch_version_file() -> tuple[str | None, str | None]:
    spec = importlib.util.find_spec("torch")
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except (OSError, TypeError, AttributeError):
        return None, None

    def value(key):
        m = re.search(rf"^{key}\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None

    return value("cuda"), value("hip")


# ------------------------------------------------------------------ torch APIs the lent machine lacks
# The lent GPU runs torch 2.11.0; the dev venv's torch is newer. Public names of torch 2.14.1 that
# torch 2.11.0 lacks, from dir() of both (measured 2026-12 with `make gpu-check-compat`'s venv),
# in the namespaces the checks use. `make test` refuses them in bench/gpu_check*.py;
# `make gpu-check-compat` confirms that 2.11 still lacks each (the list stays true).
NEWER_THAN_2_11 = {
    "torch": ("bcomplex32", "thread_safe_generator"),
    "torch.cuda": ("caching_allocator_disabled", "current_solver_handle", "export_dot", "export_graph_data",
                   "graph_annotations", "DEVICE_REQUIREMENT_POST_JETSON_SBSA_UNIFICATION"),
    "torch.distributed": ("ProcessGroupNCCL2", "ProcessGroupNCCLLazy", "all_gather_single", "gather_into_tensor",
                          "gather_single", "get_backend_impl", "record_comm", "reduce_scatter_single", "set_timeout"),
    # Methods: refused by name on any object (these names mean nothing else in the checks).
    "torch.Tensor": ("const_data_ptr",),
    "torch.cuda.Stream": ("is_capturing",),
    "torch.cuda.CUDAGraph": ("begin_capture_to_if_node", "begin_capture_to_while_node", "capture_end_post",
                             "capture_end_pre", "end_capture_to_conditional_node", "get_currently_capturing_graph",
                             "get_graph_data", "register_capture_end_hook", "register_capture_start_hook",
                             "register_destroy_callback", "register_post_instantiate_hook", "register_replay_end_hook",
                             "register_replay_start_hook", "retain_object", "set_conditional_handle_for_current_node"),
}
_MODULES = ("torch", "torch.cuda", "torch.distributed")


def newer_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) for each use in `source` of a torch API newer than 2.11: `torch.X` chains
    (also `ctx.torch.X`, `dist.X` for torch.distributed) and the methods listed by name."""
    import ast

    def chain(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.append(node.id)
        return parts[::-1]

    methods = {n for k, names in NEWER_THAN_2_11.items() if k not in _MODULES for n in names}
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        parts = chain(node)
        if "torch" in parts:
            parts = parts[parts.index("torch"):]
        elif parts[:1] == ["dist"]:
            parts = ["torch", "distributed", *parts[1:]]
        else:
            parts = []
        for i in range(1, len(parts)):
            if parts[i] in NEWER_THAN_2_11.get(".".join(parts[:i]), ()):
                found.add((node.lineno, ".".join(parts[:i + 1])))
        if node.attr in methods:
            found.add((node.lineno, node.attr))
    return sorted(found)


def still_newer(torch) -> list[str]:
    """The listed names that this torch has (run under 2.11 by `make gpu-check-compat`: must be none)."""
    import importlib

    have = []
    for where, names in NEWER_THAN_2_11.items():
        mod, _, cls = where.rpartition(".") if where not in _MODULES else (where, "", "")
        obj = importlib.import_module(mod)
        obj = getattr(obj, cls) if cls else obj
        have += [f"{where}.{n}" for n in names if hasattr(obj, n)]
    return have
