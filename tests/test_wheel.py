"""The package works where it is installed, not only in this checkout.

The native host libraries (host gather, disk row reads) are found through one lookup
(engram_sglang/core/nativelibs.py): ENGRAM_KERNELS_DIR, the checkout's build/kernels, the package's
_lib, else built on first use into the cache from the sources the wheel carries. The slow test
builds the wheel, installs it into a fresh venv (dependencies from this venv, no index), and
from a directory outside the repository writes a table, opens it on disk and gathers with the
cpu backend, bit-exact against the torch reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from engram_sglang.core import nativelibs
from engram_sglang.core.errors import EngramError
from engram_sglang.core.ops import native
from engram_sglang.core.stores import rowio

ROOT = Path(__file__).resolve().parents[1]
HOST_LIB = "libengram_rowio.so"  # the quicker of the two host builds (~2 s)


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No prebuilt library anywhere: an empty ENGRAM_KERNELS_DIR, no checkout, no package _lib."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("ENGRAM_KERNELS_DIR", str(empty))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(nativelibs, "_is_checkout", lambda: False)
    monkeypatch.setattr(nativelibs, "_PACKAGE", tmp_path / "pkg")
    return tmp_path


def test_search_order(tmp_path, monkeypatch):
    env, pkg = tmp_path / "env", tmp_path / "pkg"
    (pkg / "_lib").mkdir(parents=True)
    env.mkdir()
    monkeypatch.setattr(nativelibs, "_PACKAGE", pkg)
    monkeypatch.setenv("ENGRAM_KERNELS_DIR", str(env))
    assert nativelibs.search_dirs() == [env, ROOT / "build" / "kernels", pkg / "_lib"]
    assert native.kernels_dir() == rowio.kernels_dir() == env  # one definition, re-exported
    (pkg / "_lib" / "libengram_probe_only.so").write_bytes(b"")
    assert nativelibs.locate("libengram_probe_only.so") == pkg / "_lib" / "libengram_probe_only.so"
    (env / "libengram_probe_only.so").write_bytes(b"")
    assert nativelibs.locate("libengram_probe_only.so") == env / "libengram_probe_only.so"
    monkeypatch.delenv("ENGRAM_KERNELS_DIR")
    monkeypatch.setattr(nativelibs, "_is_checkout", lambda: False)
    assert nativelibs.kernels_dir() == pkg / "_lib"


def test_gpu_library_is_never_built(nowhere):
    with pytest.raises(nativelibs.NativeLibraryError, match=r"^libengram_cuda.so not built: not in .*make kernels"):
        nativelibs.locate("libengram_cuda.so")


def test_host_library_is_built_on_first_use_once(nowhere):
    path = nativelibs.locate(HOST_LIB)
    assert path.parent.parent == nowhere / "cache" / "engram-sglang" and path.is_file()
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".so")] == [HOST_LIB]  # no temporaries
    mtime = path.stat().st_mtime_ns
    assert nativelibs.locate(HOST_LIB) == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    rowio.library.cache_clear()
    try:
        assert rowio.library()._name == str(path)
    finally:
        rowio.library.cache_clear()


def test_a_corrupt_cached_build_is_rebuilt_once(nowhere):
    path = nativelibs.locate(HOST_LIB)
    # A new file at the name (a truncated or corrupt build: a full disk, a crash). Never write over
    # the old one in place: this process has it mapped, and its pages past the new end would SIGBUS.
    path.unlink()
    path.write_bytes(b"\x7fELF garbage")
    # A fresh process: this one has the good build loaded, and dlopen would hand that back.
    code = ("import logging, sys\nfrom pathlib import Path\nfrom engram_sglang.core import nativelibs\n"
            "logging.basicConfig(format='%(levelname)s %(message)s')\n"
            "nativelibs._is_checkout = lambda: False\nnativelibs._PACKAGE = Path(sys.argv[1])\n"
            "print(nativelibs.locate(sys.argv[2]))\n")
    run = subprocess.run([sys.executable, "-c", code, str(nowhere / "pkg"), HOST_LIB], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and run.stdout.strip() == str(path), run.stderr
    assert run.stderr == f"WARNING engram-sglang: {path} does not load (a corrupt cached build): building it again\n"
    assert path.read_bytes()[:4] == b"\x7fELF" and len(path.read_bytes()) > 1000  # rebuilt


def test_a_corrupt_prebuilt_library_is_one_line_and_a_warning(nowhere, caplog):
    lib = nowhere / "empty" / "libengram_cpu.so"
    lib.write_bytes(b"not a library")
    with caplog.at_level("WARNING", logger="engram_sglang"), pytest.raises(nativelibs.NativeLibraryError) as e:
        nativelibs.locate("libengram_cpu.so")
    with pytest.raises(nativelibs.NativeLibraryError):  # probing again: no second warning
        nativelibs.locate("libengram_cpu.so")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{lib} does not load (") and "make kernels-cpu" in msg, msg
    assert len(caplog.records) == 1 and caplog.records[0].levelname == "WARNING"


def test_no_compiler_is_one_line_saying_what_to_do(nowhere, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(nowhere / "empty"))
    rowio.library.cache_clear()
    try:
        with pytest.raises(EngramError) as e:
            rowio.library()
    finally:
        rowio.library.cache_clear()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"native row I/O library: {HOST_LIB} not in {nowhere / 'empty'}, ")
    assert "no C++ compiler (c++, g++ or clang++) on PATH to build it on first use: install g++" in msg
    monkeypatch.setenv("CXX", "no-such-compiler")
    native.load.cache_clear()
    try:
        lib, why = native.try_load("cpu")
    finally:
        native.load.cache_clear()
    assert lib is None and "CXX='no-such-compiler' is not a program on PATH" in why and "\n" not in why


def test_failed_build_names_its_log(nowhere, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails every build
    with pytest.raises(nativelibs.NativeLibraryError) as e:
        nativelibs.locate(HOST_LIB)
    msg = str(e.value)
    assert msg.startswith(f"{HOST_LIB}: building it on first use with false failed: exit status 1 (full log: ")
    assert "\n" not in msg
    log = Path(msg.rsplit("full log: ", 1)[1].rstrip(")"))
    assert log.read_text().startswith("false -std=c++17")
    assert sorted(p.name for p in log.parent.iterdir()) == [".lock", log.name]  # no half-built library


def test_makefiles_and_first_use_build_share_the_flags():
    flags = nativelibs.read_flags(ROOT / "kernels" / "host-flags.mk")
    for name in ("ENGRAM_CPU_CXXFLAGS", "ENGRAM_ROWIO_CXXFLAGS"):
        assert "-fno-fast-math" in flags[name]
    assert "-ffp-contract=off" in flags["ENGRAM_CPU_CXXFLAGS"]
    mk = (ROOT / "mk" / "kernels.mk").read_text() + (ROOT / "mk" / "rowio.mk").read_text()
    assert "include kernels/host-flags.mk" in mk
    assert "KERNEL_CXXFLAGS := $(ENGRAM_CPU_CXXFLAGS)" in mk
    assert "$(CXX) $(ENGRAM_ROWIO_CXXFLAGS) $(KERNEL_DEPFLAGS) -shared" in mk
    assert "-fno-fast-math -Wall -Wextra -Wl" not in mk  # no second copy of the flags


# ------------------------------------------------------------------ the wheel, installed
CHECK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np, torch
    import engram_sglang
    from engram_sglang.core import rowformat
    from engram_sglang.core.config import EngramConfig
    from engram_sglang.core.hashing import EngramLayout
    from engram_sglang.core.ops import native
    from engram_sglang.core.stores import open_store, rowio
    from engram_sglang.core.tablefile import write_tables

    cfg = EngramConfig(layer_ids=(1, 3), max_ngram_size=4, n_heads=4, head_dim=256, vocab_size=1000,
                       compressed_vocab_size=400, pad_token_id=2, hidden_size=64)
    layout = EngramLayout(cfg)
    rng = np.random.default_rng(int(sys.argv[1]))
    tables = {L: rng.integers(0, 256, (layout.rows(L), rowformat.ROW_BYTES), dtype=np.uint8) for L in cfg.layer_ids}
    for L in cfg.layer_ids:  # every fp8 code against every scale byte in the first rows
        for r in range(256):
            tables[L][r, :256] = np.roll(np.arange(256, dtype=np.uint8), r)
            tables[L][r, 256:] = r
    write_tables(Path("tables"), cfg, tables, progress=False)
    stores = open_store("tables", "disk", cfg=cfg, backend="cpu")
    for L, store in stores.items():
        ids = torch.from_numpy(rng.integers(0, layout.rows(L), 700)).to(torch.int64)
        ids[:256] = torch.arange(256)
        got = store.gather(ids)
        want = rowformat.dequantize(torch.from_numpy(tables[L][ids.numpy()])).view(-1, 256)
        assert store.backend == "cpu", store.backend
        assert torch.equal(rowformat.bf16_bits(got), rowformat.bf16_bits(want)), f"layer {L}: bits differ"
    print(json.dumps({"package": engram_sglang.__file__, "cpu": str(native.load("cpu").path),
                      "rowio": rowio.library()._name}))
""")


def _site_packages(venv: Path) -> Path:
    rel = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    return venv / rel


@pytest.mark.slow
def test_installed_wheel_gathers_from_disk_outside_the_repository(tmp_path):
    if nativelibs.compiler() is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++): the installed package could not build its host libraries")
    # Build from a copy of the working tree, so no build/ of an earlier run leaks into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    shutil.copytree(ROOT / "engram_sglang", src / "engram_sglang", ignore=ignore)
    shutil.copytree(ROOT / "kernels", src / "kernels", ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("engram_sglang-*-py3-none-any.whl")

    # A fresh venv; its dependencies are this venv's installed packages (not the project itself),
    # seen through a .pth file: linked, not copied, and no index is asked.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    deps = tmp_path / "deps"
    deps.mkdir()
    here = Path(sysconfig.get_path("purelib"))
    for entry in here.iterdir():
        if not entry.name.startswith(("engram_sglang", "__editable__", "_virtualenv")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    (_site_packages(venv) / "main_venv_deps.pth").write_text(f"{deps}\n")
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-index", str(wheel)], check=True, cwd=tmp_path)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ENGRAM_KERNELS_DIR", "PYTHONPATH")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    seed = int.from_bytes(os.urandom(4), "little")
    run = subprocess.run([str(python), "-c", CHECK, str(seed)], cwd=outside, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"seed {seed}: {run.stderr[-3000:]}"
    where = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(where["package"]).is_relative_to(_site_packages(venv))  # the installed copy, not the checkout
    for lib in ("cpu", "rowio"):  # built on first use from the wheel's sources, into the cache
        assert Path(where[lib]).is_relative_to(tmp_path / "cache" / "engram-sglang"), where
