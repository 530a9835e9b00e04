"""Image build check: engram-sglang imports from the image's Python, SGLang will load its
plugin, and the native libraries `make kernels` built for this vendor are where the package
looks for them. Fails the `docker build` with one line otherwise."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points


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
    print(f"engram-sglang {engram_sglang.__version__}: plugin {plugins[0].value}, kernels {', '.join(libs)} in {kernels_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
