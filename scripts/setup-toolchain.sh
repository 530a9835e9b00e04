#!/usr/bin/env bash
# Install the compilers `make kernels` needs on a fresh Debian 12 machine (run as root).
# Idempotent and quick when everything is present: it only asks apt when a tool is missing,
# and runs `apt-get update` only when apt does not yet know a package (bookworm-security
# carries clang-22; a fresh image's lists may predate it).
#
#   VENDOR=cuda|hip|cpu|all (default all): which toolchain to make sure of.
#   HIPCXX: a HIP compiler the caller brings (the ROCm image's clang): then nothing HIP is
#           installed here.
# CUDA's nvcc is not installed here: it comes with the CUDA image / toolkit. Without it the
# CUDA build is skipped with a message (see mk/kernels.mk).
set -euo pipefail
VENDOR=${VENDOR:-all}

need=()
want() {  # want <command> <package...>: queue packages when the command is missing
    local cmd=$1; shift
    command -v "$cmd" >/dev/null 2>&1 || need+=("$@")
}

case "$VENDOR" in
    cpu|cuda|hip|all) ;;
    *) echo "setup-toolchain: unknown VENDOR=$VENDOR (cuda|hip|cpu|all)" >&2; exit 2 ;;
esac

# Host library (and nvcc's host compiler).
want g++ g++ make
HIPCXX=${HIPCXX:-clang++-22}
if { [ "$VENDOR" = hip ] || [ "$VENDOR" = all ]; } && [ "$HIPCXX" = clang++-22 ]; then
    # Debian's hipcc (ROCm 5.2) knows only up to gfx940; clang 22 targets gfx942/gfx950 and
    # uses Debian's HIP headers and device bitcode (see docs/toolchain.md).
    want clang++-22 clang-22
    # clang-offload-bundler packs the per-target code objects into the host object; Debian
    # ships it in clang-tools-22, which clang-22 only recommends.
    want clang-offload-bundler-22 clang-tools-22
    want ld.lld-22 lld-22
    want llvm-dis-22 llvm-22
    [ -e /usr/include/hip/hip_runtime.h ] || need+=(libamdhip64-dev)
    [ -e /usr/lib/x86_64-linux-gnu/amdgcn/bitcode/oclc_isa_version_940.bc ] || need+=(rocm-device-libs)
fi

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "setup-toolchain: missing ${need[*]}; run as root (or: sudo $0)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# apt-get update only when some package has no install candidate yet.
for p in "${need[@]}"; do
    if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        apt-get update -q
        break
    fi
done
echo "setup-toolchain: installing ${need[*]}"
apt-get install -y -q --no-install-recommends "${need[@]}"
