"""The launch line of a plan: the `docker run` options, `ENGRAM_*` variables and SGLang flags that
serve the planned layout (TP, placement, host layout, hot-row cache). Pure text; no SGLang import."""

from __future__ import annotations

import shlex
from typing import Any

# The image each vendor/arch runs (docker/README.md).
IMAGES = {"gfx942": "engram-sglang:rocm-mi30x", "gfx950": "engram-sglang:rocm-mi35x"}
CUDA_IMAGE = "engram-sglang:cuda"
MODEL_PATH = "/models/DeepSeek-V4.1-Flash"


def sglang_args(tp: int, nnodes: int = 1) -> list[str]:
    """SGLang flags for TP `tp` (expert parallel over the same ranks; the planner's runtime reserve
    assumes the 8192-token chunked prefill)."""
    args = ["--tp-size", str(tp), "--ep-size", str(tp), "--attn-dp-size", "1", "--chunked-prefill-size", "8192"]
    if nnodes > 1:
        args += ["--nnodes", str(nnodes), "--node-rank", "NODE_RANK", "--dist-init-addr", "HEAD_IP:5000"]
    return args + ["--trust-remote-code"]


def engram_env(placement: str, host_layout: str, hot_cache_gib: float, dram_cache_bytes: int = 0) -> dict[str, str]:
    """The `ENGRAM_*` variables of a layout (the knobs in engram_sglang/serving/settings.py)."""
    env = {"ENGRAM_PLACEMENT": placement, "ENGRAM_TABLE_DIR": "/tables"}
    if placement == "host":
        env["ENGRAM_HOST_SHARED"] = "1" if host_layout == "shared" else "0"
    if placement == "disk" and dram_cache_bytes:  # the DRAM row cache the disk step was planned with
        env["ENGRAM_DISK_DRAM_CACHE_MIB"] = str(dram_cache_bytes // (1 << 20))
    if hot_cache_gib:
        env["ENGRAM_CACHE_MIB"] = str(int(hot_cache_gib * 1024))
    return env


def docker_options(vendor: str, shm_size: str) -> list[str]:
    """`docker run` options: the GPUs, /dev/shm for the shared copy, pinned memory, NUMA binding."""
    if vendor == "amd":
        gpus = ["--device", "/dev/kfd", "--device", "/dev/dri",
                "--group-add", "$(getent group video | cut -d: -f3)",
                "--group-add", "$(getent group render | cut -d: -f3)", "--security-opt", "seccomp=unconfined"]
    else:
        gpus = ["--gpus", "all"]
    return gpus + [f"--shm-size={shm_size}", "--ulimit", "memlock=-1", "--cap-add", "SYS_NICE"]


def launch(p: dict[str, Any], nnodes: int = 1) -> dict[str, Any]:
    """The launch line of plan `p` (its TP, placement, host layout and hot-row cache)."""
    g = p["gpu"]
    shm = p["dev_shm"]["docker_shm_size"]
    env = engram_env(p["placement"], p["host_layout"], p.get("hot_cache_gib", 0.0),
                     (p.get("disk") or {}).get("dram_cache_bytes_per_rank", 0))
    flags = sglang_args(p["tp"], nnodes)
    docker = docker_options(g["vendor"], shm)
    image = IMAGES.get(g["arch"], CUDA_IMAGE)

    def q(a: str) -> str:
        return a if a.startswith("$(") else shlex.quote(a)

    line = " ".join(
        ["docker run -d --name dsv41", *map(q, docker), "-p 30000:30000 -v /models:/models:ro",
         "-v /data/engram-tables:/tables:ro", *(f"-e {k}={v}" for k, v in env.items()), image,
         "python3 -m sglang.launch_server --model-path", MODEL_PATH, "--host 0.0.0.0 --port 30000", *flags]
    )
    return {"docker": docker, "env": env, "image": image, "sglang_args": flags, "shm_size": shm, "command": line}
