#!/usr/bin/env bash
# Run a command in an engram-sglang image with the GPU access and memory settings it needs:
#
#   docker/gpu-run.sh cuda|rocm [docker run options...] -- IMAGE [COMMAND...]
#
# cuda: --gpus all. rocm: /dev/kfd and /dev/dri, plus the host's video and render group ids
# (the devices belong to those host groups; the image's own group ids may differ).
# Both: a /dev/shm large enough for a shared host table (Docker's default is 64 MiB): half of
# this host's memory, as the host's own /dev/shm gets, so DeepSeek-V4.1-Flash's 189 GiB copy
# fits wherever the host can hold it and the cap never exceeds the memory there is (a larger one
# would let a fill run the host out of memory instead of falling back); override with
# ENGRAM_SHM_SIZE, e.g. the planner's `docker_shm_size`. No limit on locked memory, which
# registering a host table with the GPU runtime needs, and CAP_SYS_NICE, without which Docker's
# seccomp profile refuses the mbind that binds a copy to its NUMA node.
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

shm=${ENGRAM_SHM_SIZE:-}
if [ -z "$shm" ]; then
    mem_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null || true)
    if [ -n "$mem_kib" ]; then
        shm="$((mem_kib / 2 / 1048576))g"
    else
        shm=32g  # no /proc/meminfo (not Linux): set ENGRAM_SHM_SIZE for a shared copy
    fi
    echo "gpu-run.sh: --shm-size $shm (half of this host's memory; ENGRAM_SHM_SIZE overrides)" >&2
fi

exec docker run "${gpu[@]}" --shm-size "$shm" --ulimit memlock=-1 --cap-add SYS_NICE \
    "${opts[@]}" "$@"
