"""Helpers of the data- and tensor-parallel e2e tests (test_e2e_dp.py, test_e2e_tp.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Sequence

from engram_sglang.serving.launch import Server, _group_members
from engram_sglang.tools.demo.corpus import demo_corpus
from tests.support.demo_support import reference, table_dir

# Tests only: SGLang's CPU platform without PyNccl, found through its entry point (see the module).
GLOO_PLATFORM_DIR = Path(__file__).resolve().parent / "cpu_gloo_platform"
COPY = re.compile(r"engram-[0-9a-f]+-layer(\d+)\.rows$")


def prompts(n: int = 6) -> list[list[int]]:
    """n prompts of 5, 10, 15, ... tokens cut from the demo corpus at fixed places."""
    ids = reference().tokenizer("\n".join(demo_corpus(20_000)))["input_ids"]
    return [ids[i * 211:][: 5 + 5 * i] for i in range(n)]


def thread_bind() -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for two ranks: one core each (two different ones where
    this process may use two)."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[-1]}"


def use_gloo_platform(server: Server) -> Server:
    """Serve TP > 1 on the CPU: the test platform first on the server's PYTHONPATH, chosen by name."""
    server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GLOO_PLATFORM_DIR), server.env.get("PYTHONPATH")]))
    server.env["SGLANG_PLATFORM"] = "engram_test_gloo"
    return server


@contextlib.contextmanager
def private_shm_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under /dev/shm for one server's shared copies (the test sees only its own)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def copies(shm: Path) -> list[str]:
    return sorted(p.name for p in shm.iterdir())


def mapped_copies(pgid: int, shm: Path) -> dict[int, set[str]]:
    """Per process of a server's group: the names of the files under `shm` it maps."""
    out = {}
    for pid in _group_members(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        files = {Path(line.split(None, 5)[5]).name for line in maps.splitlines() if f" {shm}/" in line}
        if files:
            out[pid] = files
    return out


def check_one_copy_per_layer(files: list[str], maps: dict[int, set[str]], ranks: int) -> None:
    """Each Engram layer has one copy in the directory, no unfinished fill, and each of the
    `ranks` scheduler processes maps exactly those copies."""
    layers = reference().engram.layer_ids
    found = [n for n in files if COPY.match(n)]
    assert sorted(int(COPY.match(n).group(1)) for n in found) == sorted(layers), files
    assert not [n for n in files if ".tmp" in n], files
    assert len(maps) == ranks, maps
    assert all(names == set(found) for names in maps.values()), maps


def table_rows() -> dict[int, int]:
    """Layer id -> rows of the demo model's table."""
    manifest = json.loads((table_dir() / "manifest.json").read_text())
    return {entry["layer_id"]: entry["rows"] for entry in manifest["layers"]}


def serve_and_collect(server: Server, shm: Path, prompts: Sequence[list[int]], new_tokens: int,
                      stats_files: str = "") -> dict:
    """Run `server` and send every prompt at once (SGLang's DP controller hands them to the
    replicas in turn; the TP ranks of a replica share each step). Collected: each prompt's
    output ids, the files in `shm` and which processes map them while it serves, the Engram
    statistics of every /server_info entry (one per DP replica), the `--engram-stats-file`
    files matching the glob `stats_files` (name -> JSON), and the files in `shm` after it stops."""
    run = {"prompts": list(prompts)}
    with server:
        with ThreadPoolExecutor(len(run["prompts"])) as pool:
            outs = pool.map(lambda p: server.generate(p, new_tokens), run["prompts"])
            run["outputs"] = [o["output_ids"] for o in outs]
        run["files"] = copies(shm)
        run["maps"] = mapped_copies(server.proc.pid, shm)
        run["states"] = [s.get("engram", {}) for s in server.get("/server_info")["internal_states"]]
    if stats_files:
        found = Path(stats_files).parent.glob(Path(stats_files).name)
        run["stats_files"] = {p.name: json.loads(p.read_text()) for p in sorted(found)}
    run["left"] = copies(shm)
    return run
