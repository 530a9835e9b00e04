"""End to end on CPU: tensor parallelism (`--tp-size 2`) through gloo.

SGLang 0.5.23 cannot start TP > 1 on its in-tree CPU platform (every model-parallel group
builds a PyNccl communicator: "Expected a cuda device"). The test server runs on an
out-of-tree copy of that platform with PyNccl switched off (tests/support/cpu_gloo_platform/), so
the all-reduce goes to torch.distributed's gloo group; nothing of it ships.

Two servers with host placement: private copies, where each rank holds half of every
layer's rows and the ranks sum their rows (the runtime's all-reduce), and the node's one
shared copy, which both ranks map and read whole rows from. Completions equal the
reference forward's in both.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engram_sglang.serving.launch import Server
from tests.support import parallel_support as par
from tests.support.demo_support import demo_dir, reference, reference_completion

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
N_PROMPTS = 4


def serve_tp2(tmp_path_factory, layout: str) -> dict:
    """One TP 2 server with host placement (`layout`: private copies or the shared one): its
    completions, the shared copies while it serves and after, rank 0's statistics (/server_info)
    and both ranks' (their stats files)."""
    work = tmp_path_factory.mktemp(f"tp-{layout}")
    with par.private_shm_dir(f"engram-test-tp-{layout}-") as shm:
        engram = {"placement": "host", "shm_dir": shm, "host_shared": "on" if layout == "shared" else "off",
                  "stats_file": work / "stats.json"}
        server = par.use_gloo_platform(Server(demo_dir(), engram=engram, args=("--tp-size", "2"), max_total_tokens=1024,
                                              log_path=work / "sglang.log",
                                              env={"SGLANG_CPU_OMP_THREADS_BIND": par.thread_bind()}))
        run = par.serve_and_collect(server, shm, par.prompts(N_PROMPTS), NEW_TOKENS,
                                    stats_files=str(work / "stats*.json"))
    run["stats"] = run["states"][0]
    return run


@pytest.fixture(scope="module")
def private_run(tmp_path_factory):
    return serve_tp2(tmp_path_factory, "private")


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    return serve_tp2(tmp_path_factory, "shared")


def test_sglang_resolves_the_gloo_platform_without_pynccl(tmp_path):
    """Seconds, where a server that does not start takes minutes: SGLang finds the test
    platform through its entry point, and it is the CPU platform out of tree, without PyNccl."""
    server = par.use_gloo_platform(Server(tmp_path, log_path=tmp_path / "unused.log"))  # only its environment
    probe = ("from sglang.srt.platforms import current_platform as p; "
             "print(type(p).__name__, p.is_out_of_tree(), p.is_cpu(), p.capabilities.supports_pynccl, "
             "p.get_torch_distributed_backend_str())")
    out = subprocess.run([sys.executable, "-c", probe], env=server.env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["CpuGlooPlatform", "True", "True", "False", "gloo"], (out.stdout, par.GLOO_PLATFORM_DIR)


@pytest.mark.parametrize("run", ["private_run", "shared_run"])
def test_tp2_completions_equal_the_reference(run, request):
    got = request.getfixturevalue(run)
    assert got["outputs"] == [list(reference_completion(tuple(p), NEW_TOKENS)) for p in got["prompts"]]


def test_tp2_private_copies_hold_half_the_rows_and_sum_them_across_ranks(private_run):
    """Rank 0 holds its balanced shard of each layer's rows (every other column), rank 1 the
    rest, and the prompts read rows of both: their exact completions (above) needed rank 1's
    rows, i.e. the sum."""
    rows = par.table_rows()
    assert private_run["files"] == [] and private_run["maps"] == {}, (private_run["files"], private_run["maps"])
    # /server_info answers for TP rank 0; each rank writes its own stats file, labelled.
    assert (private_run["stats"]["tp_rank"], private_run["stats"]["tp_size"]) == (0, 2)
    files = private_run["stats_files"]
    assert sorted(files) == ["stats.tp0.dp0.json", "stats.tp1.dp0.json"], files
    assert [files[f"stats.tp{r}.dp0.json"]["tp_rank"] for r in (0, 1)] == [0, 1]
    ref = reference()
    for i, layer in enumerate(ref.engram.layer_ids):
        table = next(t for t in private_run["stats"]["tables"] if t["layer_id"] == layer)
        mine = [tuple(r) for r in table["row_ranges"]]
        assert mine[0][0] == 0 and 0 < sum(b - a for a, b in mine) < rows[layer] and not table["shared"], table
        rank1 = next(t for t in files["stats.tp1.dp0.json"]["tables"] if t["layer_id"] == layer)
        theirs = [tuple(r) for r in rank1["row_ranges"]]  # the other columns: rank 1's own file
        every = sorted(mine + theirs)
        assert every[0][0] == 0 and every[-1][1] == rows[layer], (mine, theirs)
        assert all(a[1] == b[0] for a, b in zip(every, every[1:])), (mine, theirs)  # every row once
        ids = [int(x) for p in private_run["prompts"] for x in ref.forward(p).hash_ids[:, i].flatten()]
        assert any(any(a <= x < b for a, b in mine) for x in ids)
        assert any(any(a <= x < b for a, b in theirs) for x in ids)


def test_tp2_shared_copy_is_one_per_node_read_whole_and_removed_after(shared_run):
    par.check_one_copy_per_layer(shared_run["files"], shared_run["maps"], ranks=2)
    rows = par.table_rows()
    for table in shared_run["stats"]["tables"]:
        assert table["shared"] and table["row_range"] == [0, rows[table["layer_id"]]], table
    assert shared_run["left"] == []
