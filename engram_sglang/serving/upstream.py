"""The SGLang release engram-sglang was checked against, and the one installed here.

Standard library only: the plugin's patch checks (plugin/targets.py) read it in every SGLang
process that imports a patched module.
"""

from __future__ import annotations

# pyproject's `serve` extra pins the same release.
SGLANG_TESTED = "0.5.23"


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "(not installed)"
