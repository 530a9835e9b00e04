#!/usr/bin/env bash
# Create .venv and install the project with real SGLang 0.5.23 on a machine without a GPU.
# Idempotent: pip skips what is already installed at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q -c requirements/constraints.txt)
# torch first, from sglang's own pin; a CUDA build that also runs on the CPU (the CPU-only
# wheel cannot sit beside torchvision, which sglang imports unconditionally).
"${pip[@]}" torch torchvision
# sglang without its dependencies: sgl-kernel, flashinfer and friends are CUDA-only wheels.
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${pip[@]}" -r requirements/sglang-cpu.txt -r requirements/dev.txt
"${pip[@]}" --no-deps --no-build-isolation -e .
