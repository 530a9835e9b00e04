#!/usr/bin/env bash
# Run a command in an engram-sglang image with the GPU access and memory settings it needs:
#
#   docker/gpu-run.sh cuda|rocm [docker run options...] -- IMAGE [COMMAND...]
#
# cuda: --gpus all. rocm: /dev/kfd and /dev/dri, plus the host's video and render group ids
# (the devices belong to those host groups; the image's own group ids may differ).
# Both: a /dev/shm large enough for a shared host table (Docker's default is 64 MiB; override
# with ENGRAM_SHM_SIZE, e.g. the planner's `docker_shm_size`), and no limit on locked memory,
# which registering a host table with the GPU runtime needs.
set -euo pipefail

usage() { echo "usage: $0 cuda|rocm [docker run options...] -- IMAGE [COMMAND...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
vendor=$1; shift

gpu=()
case "$vendor" in
    cuda) gpu=(--gpus all) ;;
    rocm)
        gpu=(--device /dev/kfd --device /dev/dri --security-opt seccomp=unconfined)
        for g in video render; do
            gid=$(getent group "$g" | cut -d: -f3 || true)
            if [ -n "$gid" ]; then gpu+=(--group-add "$gid"); fi
        done
        ;;
    *) usage ;;
esac

opts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
[ $# -ge 2 ] || usage  # "--" and an image
shift

exec docker run "${gpu[@]}" --shm-size "${ENGRAM_SHM_SIZE:-32g}" --ulimit memlock=-1 \
    "${opts[@]}" "$@"
