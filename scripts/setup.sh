#!/usr/bin/env bash
# Create .venv and install the project with real SGLang 0.5.23 on a machine without a GPU.
# Idempotent: pip skips what is already installed at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23

# Debian packages the Python ones need at run time: Mooncake's transfer engine (PD
# disaggregation, requirements/sglang-cpu.txt) links libibverbs; the PD and multi-node tests
# put their servers into network namespaces with iproute2's `ip`; the alert rules' test
# (tests/test_monitoring.py) runs prometheus's `promtool`. As scripts/setup-toolchain.sh:
# apt only when one is missing, and only as root (else one line saying what to install).
debs=()
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] \
    || debs+=(libibverbs1)
command -v ip >/dev/null 2>&1 || debs+=(iproute2)
command -v promtool >/dev/null 2>&1 || debs+=(prometheus)
if [ ${#debs[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing Debian packages ${debs[*]}; run as root (or: sudo apt-get install ${debs[*]})" >&2
        exit 1
    fi
    apt-cache policy "${debs[@]}" 2>/dev/null | grep -q 'Candidate: [0-9]' || apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${debs[@]}"
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q -c requirements/constraints.txt)
# torch first, from sglang's own pin; a CUDA build that also runs on the CPU (the CPU-only
# wheel cannot sit beside torchvision, which sglang imports unconditionally).
"${pip[@]}" torch torchvision
# sglang without its dependencies: sgl-kernel, flashinfer and friends are CUDA-only wheels.
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${pip[@]}" -r requirements/sglang-cpu.txt -r requirements/dev.txt
"${pip[@]}" --no-deps --no-build-isolation -e .
