"""End to end on CPU: data parallelism (`--dp-size 2`) over the node's one shared host copy.

Two SGLang schedulers (DP ranks, each bound to its own core by SGLANG_CPU_OMP_THREADS_BIND)
serve the demo model with host placement and `--engram-host-shared on`: every completion
equals the reference forward's, each layer exists once in /dev/shm and both ranks map that
one file, both ranks' Engram statistics come back from /server_info, and the last rank to
leave removes the copy. The copy lives in a private directory under /dev/shm, so the test
sees its own files only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from demo_support import demo_dir, reference_completion
from engram_sglang.serving.launch import Server
from parallel_support import check_one_copy_per_layer, copies, mapped_copies, private_shm_dir, prompts, table_rows, \
    thread_bind

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("dp")
    run = {"prompts": prompts()}
    with private_shm_dir("engram-test-dp-") as shm:
        server = Server(demo_dir(), engram={"placement": "host", "host_shared": "on", "shm_dir": shm},
                        args=("--dp-size", "2"), max_total_tokens=1024, log_path=work / "sglang.log",
                        env={"SGLANG_CPU_OMP_THREADS_BIND": thread_bind()})
        with server:
            # Sent at once: SGLang's DP controller hands them to the two ranks in turn.
            with ThreadPoolExecutor(len(run["prompts"])) as pool:
                outs = pool.map(lambda p: server.generate(p, NEW_TOKENS), run["prompts"])
                run["outputs"] = [o["output_ids"] for o in outs]
            run["files"] = copies(shm)
            run["maps"] = mapped_copies(server.proc.pid, shm)
            run["states"] = server.get("/server_info")["internal_states"]
        run["left"] = copies(shm)
    return run


def test_dp2_completions_equal_the_reference(dp_run):
    assert dp_run["outputs"] == [list(reference_completion(tuple(p), NEW_TOKENS)) for p in dp_run["prompts"]]


def test_dp2_serves_one_shared_copy_per_layer_that_both_ranks_map(dp_run):
    check_one_copy_per_layer(dp_run["files"], dp_run["maps"], ranks=2)


def test_dp2_statistics_of_both_ranks(dp_run):
    states = dp_run["states"]
    assert len(states) == 2 and all("engram" in s for s in states), states
    engram = [s["engram"] for s in states]
    rows = table_rows()
    for stats in engram:
        assert stats["placement"] == "host" and stats["tokens"] > 0, stats
        for t in stats["tables"]:  # TP 1 per replica: whole rows of the one shared copy
            assert t["shared"] and t["row_range"] == [0, rows[t["layer_id"]]] and t["rows_served"] > 0, t
    # Together the two ranks ran every prompt token and every decode step but the last.
    needed = sum(len(p) + NEW_TOKENS - 1 for p in dp_run["prompts"])
    assert sum(s["tokens"] for s in engram) >= needed, engram


def test_dp2_last_rank_to_leave_removes_the_shared_copy(dp_run):
    assert dp_run["left"] == [], dp_run["left"]
