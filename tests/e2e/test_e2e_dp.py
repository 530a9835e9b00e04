"""End to end on CPU: data parallelism (`--dp-size 2`) over the node's one shared host copy.

Two SGLang schedulers (DP ranks, each bound to its own core by SGLANG_CPU_OMP_THREADS_BIND)
serve the demo model with host placement and `--engram-host-shared on`: every completion
equals the reference forward's, each layer exists once in /dev/shm and both ranks map that
one file, both ranks' Engram statistics come back from /server_info, and the last rank to
leave removes the copy. The copy lives in a private directory under /dev/shm, so the test
sees its own files only.
"""

from __future__ import annotations

import pytest

from engram_sglang.serving.launch import Server
from tests.support import parallel_support as par
from tests.support.demo_support import demo_dir, reference_completion

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dp")
    with par.private_shm_dir("engram-test-dp-") as shm:
        engram = {"placement": "host", "host_shared": "on", "shm_dir": shm, "stats_file": work / "stats.json"}
        server = Server(demo_dir(), engram=engram, args=("--dp-size", "2"), max_total_tokens=1024,
                        log_path=work / "sglang.log", env={"SGLANG_CPU_OMP_THREADS_BIND": par.thread_bind()})
        return par.serve_and_collect(server, shm, par.prompts(), NEW_TOKENS, stats_files=str(work / "stats*.json"))


def test_dp2_completions_equal_the_reference(dp_run):
    assert dp_run["outputs"] == [list(reference_completion(tuple(p), NEW_TOKENS)) for p in dp_run["prompts"]]


def test_dp2_serves_one_shared_copy_per_layer_that_both_ranks_map(dp_run):
    par.check_one_copy_per_layer(dp_run["files"], dp_run["maps"], ranks=2)


def test_dp2_statistics_of_both_ranks(dp_run):
    engram = dp_run["states"]
    assert len(engram) == 2 and all(engram), engram
    # Each entry names its replica; each replica keeps its own stats file (serving/ranks.py).
    ranks = sorted((s["dp_rank"], s["dp_size"], s["tp_rank"], s["tp_size"]) for s in engram)
    assert ranks == [(0, 2, 0, 1), (1, 2, 0, 1)], ranks
    files = dp_run["stats_files"]
    assert sorted(files) == ["stats.tp0.dp0.json", "stats.tp0.dp1.json"], files
    assert all(f["dp_rank"] == int(name[len("stats.tp0.dp")]) for name, f in files.items()), files
    rows = par.table_rows()
    for stats in engram:
        assert stats["placement"] == "host" and stats["tokens"] > 0, stats
        for t in stats["tables"]:  # TP 1 per replica: whole rows of the one shared copy
            assert t["shared"] and t["row_range"] == [0, rows[t["layer_id"]]] and t["rows_served"] > 0, t
    # Together the two ranks ran every prompt token and every decode step but the last.
    needed = sum(len(p) + NEW_TOKENS - 1 for p in dp_run["prompts"])
    assert sum(s["tokens"] for s in engram) >= needed, engram


def test_dp2_last_rank_to_leave_removes_the_shared_copy(dp_run):
    assert dp_run["left"] == [], dp_run["left"]
