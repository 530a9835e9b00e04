"""The wheel carries the host libraries' sources, not the libraries.

build_py copies what engram_sglang/core/nativelibs.py needs to build libengram_cpu.so (host gather)
and libengram_rowio.so (disk row reads) on first use into engram_sglang/_kernels: the sources,
the headers they include and kernels/host-flags.mk (the flags `make kernels` uses too). So the
wheel stays pure Python (one wheel for every platform, no manylinux tagging), and the libraries
are compiled by the machine that runs them. Editable installs skip the copy: the package then
runs from the checkout and finds kernels/ (and build/kernels) beside itself.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def host_sources() -> tuple:
    """The list nativelibs.py builds from (read from that file alone: the package's
    dependencies are not installed while a wheel builds)."""
    spec = importlib.util.spec_from_file_location("_nativelibs", ROOT / "engram_sglang" / "core" / "nativelibs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HOST_SOURCES


class BuildPyWithHostSources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "engram_sglang" / "_kernels"
        for rel in host_sources():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / "kernels" / rel, dest / rel)


setup(cmdclass={"build_py": BuildPyWithHostSources})
