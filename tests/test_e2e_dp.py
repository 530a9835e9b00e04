"""End to end on CPU: data parallelism (`--dp-size 2`) over the node's one shared host copy.

Two SGLang schedulers (DP ranks, each bound to its own core by SGLANG_CPU_OMP_THREADS_BIND)
serve the demo model with host placement and `--engram-host-shared on`: every completion
equals the reference forward's, each layer exists once in /dev/shm and both ranks map that
one file, both ranks' Engram statistics come back from /server_info, and the last rank to
leave removes the copy. The copy lives in a private directory under /dev/shm, so the test
sees its own files only.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from demo_support import demo_dir, reference, reference_completion
from engram_sglang.demo_corpus import demo_corpus
from engram_sglang.serving.launch import Server, _group_members

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
COPY = re.compile(r"engram-[0-9a-f]+-layer(\d+)\.rows$")


def prompts() -> list[list[int]]:
    """Six prompts of 5..30 tokens cut from the demo corpus at fixed places."""
    ids = reference().tokenizer("\n".join(demo_corpus(20_000)))["input_ids"]
    return [ids[i * 211:][: 5 + 5 * i] for i in range(6)]


def thread_bind() -> str:
    """One core per DP rank (two different ones where the machine lets this process use two)."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[-1]}"


def mapped_copies(pgid: int, shm: Path) -> dict[int, set[str]]:
    """Per process of the server: the files under `shm` it maps."""
    out = {}
    for pid in _group_members(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        files = {line.split(None, 5)[5] for line in maps.splitlines() if f" {shm}/" in line}
        if files:
            out[pid] = files
    return out


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dp")
    shm = Path(tempfile.mkdtemp(prefix="engram-test-dp-", dir="/dev/shm"))
    asked = prompts()
    server = Server(demo_dir(), engram={"placement": "host", "host_shared": "on", "shm_dir": shm},
                    args=("--dp-size", "2"), max_total_tokens=1024, log_path=work / "sglang.log",
                    env={"SGLANG_CPU_OMP_THREADS_BIND": thread_bind()})
    run = {"prompts": asked}
    try:
        with server:
            with ThreadPoolExecutor(len(asked)) as pool:
                run["outputs"] = [o["output_ids"] for o in pool.map(lambda p: server.generate(p, NEW_TOKENS), asked)]
            run["files"] = sorted(p.name for p in shm.iterdir())
            run["maps"] = mapped_copies(server.proc.pid, shm)
            run["states"] = server.get("/server_info")["internal_states"]
        run["left"] = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return run


def test_dp2_completions_equal_the_reference(dp_run):
    want = [list(reference_completion(tuple(p), NEW_TOKENS)) for p in dp_run["prompts"]]
    assert dp_run["outputs"] == want


def test_dp2_serves_one_shared_copy_per_layer_that_both_ranks_map(dp_run):
    layers = reference().engram.layer_ids
    copies = [n for n in dp_run["files"] if COPY.match(n)]
    assert sorted(int(COPY.match(n).group(1)) for n in copies) == sorted(layers), dp_run["files"]
    assert not [n for n in dp_run["files"] if ".tmp" in n], dp_run["files"]
    # Two scheduler processes, each mapping every layer's one copy (not a private one).
    assert len(dp_run["maps"]) == 2, dp_run["maps"]
    for files in dp_run["maps"].values():
        assert {Path(f).name for f in files} == set(copies), dp_run["maps"]


def test_dp2_statistics_of_both_ranks(dp_run):
    engram = [s["engram"] for s in dp_run["states"] if "engram" in s]
    assert len(dp_run["states"]) == 2 and len(engram) == 2, dp_run["states"]
    for stats in engram:
        assert stats["placement"] == "host" and stats["tokens"] > 0, stats
        assert all(t["shared"] and t["rows_held"] == "whole" and t["rows_served"] > 0 for t in stats["tables"]), stats
    # Six requests went to two ranks: together they read every prompt and decode step.
    needed = sum(len(p) + NEW_TOKENS - 1 for p in dp_run["prompts"])
    assert sum(s["tokens"] for s in engram) >= needed, engram


def test_dp2_last_rank_to_leave_removes_the_shared_copy(dp_run):
    assert dp_run["left"] == [], dp_run["left"]
