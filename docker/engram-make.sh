#!/usr/bin/env bash
# `make` for the project tree inside the engram-sglang images (installed as `engram-make`).
#
# The images have no .venv: SGLang, torch and the test tools live in the image's own Python.
# So the Makefile is pointed at python3, and `make setup` (which would build a CPU-only venv
# with its own torch) is marked done by a stamp the Dockerfile writes after copying the tree.
# Everything else is the same make targets CI and developers run:
#   engram-make kernels VENDOR=cuda     engram-make test-gpu VENDOR=hip
set -euo pipefail
root=${ENGRAM_ROOT:-/opt/engram-sglang}
stamp=${ENGRAM_SETUP_STAMP:-$root/.image-setup}
cd "$root"
exec make PY=python3 SETUP_STAMP="$stamp" "$@"
