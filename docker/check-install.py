"""Image build check: engram-sglang imports from the image's Python, SGLang will load its
plugin, the native libraries `make kernels` built for this vendor are where the package
looks for them, and the vendor stack of that vendor's extra in pyproject.toml (`[cuda]`:
flashinfer, sglang-kernel, triton; `[rocm]`: pytorch-triton-rocm) is installed at the versions
it names. Fails the `docker build` with one line otherwise."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, entry_points, requires, version
from pathlib import Path

# The vendor a kernel library was built for -> the extra naming its stack.
EXTRA = {"libengram_cuda.so": "cuda", "libengram_hip.so": "rocm"}


def extra_requirements(extra: str) -> list[str]:
    """The requirements of `extra`: from the tree's pyproject.toml (the image installs it
    editable), else from the installed package's metadata (Python < 3.11 has no tomllib)."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib

        return tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][extra]
    except (ImportError, OSError, KeyError):
        marker = f'extra == "{extra}"'
        return [r.split(";")[0].strip() for r in requires("engram-sglang") or () if marker in r.replace("'", '"')]


def check_stack(extra: str) -> list[str]:
    """One problem per requirement of `extra` that is missing or at a version it refuses."""
    from packaging.requirements import Requirement

    problems = []
    for text in extra_requirements(extra):
        req = Requirement(text)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            problems.append(f"{req.name} is not installed (the [{extra}] extra needs {req})")
            continue
        if not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} is installed, the [{extra}] extra needs {req}")
    return problems


def main() -> int:
    import engram_sglang
    from engram_sglang.core.ops.native import kernels_dir

    plugins = [e for e in entry_points(group="sglang.srt.plugins") if e.value.startswith("engram_sglang")]
    if not plugins:
        print("check-install: engram_sglang is not registered under sglang.srt.plugins", file=sys.stderr)
        return 1
    libs = sorted(p.name for p in kernels_dir().glob("libengram_*.so"))
    if not libs:
        print(f"check-install: no native libraries in {kernels_dir()}", file=sys.stderr)
        return 1
    extras = sorted({EXTRA[lib] for lib in libs if lib in EXTRA})
    problems = [p for extra in extras for p in check_stack(extra)]
    if problems:
        print(f"check-install: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print(f"engram-sglang {engram_sglang.__version__}: plugin {plugins[0].value}, kernels {', '.join(libs)} in "
          f"{kernels_dir()}, vendor stack [{', '.join(extras) or 'none'}] as pyproject.toml pins it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
