"""End to end on CPU: tensor parallelism across two nodes (`--nnodes 2 --node-rank 0/1`).

Two simulated hosts on one machine (tests/support/hosts.py: network namespaces on a bridge,
each with its own /dev/shm), one TP rank on each, gloo over the bridge (`--dist-init-addr`,
`GLOO_SOCKET_IFNAME`), SGLang's CPU platform without PyNccl (tests/support/cpu_gloo_platform/,
as test_e2e_tp.py), host placement with one shared copy per node. Each node fills and frees
its own copy; the ranks agree on whole rows (every rank reads its node's copy whole: no row
all-reduce) and on the table identity (one all-gather: a node with another Engram mode stops
start-up in one line); completions equal the reference; each node's statistics name it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engram_sglang.serving.launch import Server, ServerError, free_port
from tests.support import hosts as sim
from tests.support import parallel_support as par
from tests.support.demo_support import demo_dir, reference_completion

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
N_PROMPTS = 3

if sim.unavailable():
    pytest.skip(sim.unavailable(), allow_module_level=True)


def two_nodes(hosts, work, engram: dict, node_engram=({}, {})) -> list[Server]:
    """Node 0 and node 1 of one TP 2 server: node 0 serves HTTP; node 1 runs its scheduler only
    (SGLang answers /health there)."""
    init = f"{hosts[0].address}:{free_port()}"
    servers = []
    for rank, host in enumerate(hosts):
        cpu = sorted(par.thread_bind().split("|"))[rank % 2]  # a core each, where there are two
        server = par.use_gloo_platform(Server(
            demo_dir(), engram={**engram, **node_engram[rank]}, max_total_tokens=1024, host=host.address,
            wrap=host.wrap(), log_path=work / f"node{rank}.log",
            args=("--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", init),
            env={"GLOO_SOCKET_IFNAME": host.ifname, "SGLANG_HOST_IP": host.address,
                 "SGLANG_CPU_OMP_THREADS_BIND": cpu}))
        servers.append(server)
    return servers


def engram_files(shm: Path) -> list[str]:
    """Our copies and their sidecars in a node's /dev/shm (SGLang keeps files of its own there)."""
    return [n for n in par.copies(shm) if n.startswith("engram-")]


def start_all(servers: list[Server]) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        for f in [pool.submit(s.start) for s in servers]:
            f.result()


def stop_all(servers: list[Server]) -> None:
    for s in servers:  # node 0 first: it tells the schedulers to exit
        s.stop()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("multinode")
    out = {}
    with sim.simulated_hosts(2) as hosts:
        servers = two_nodes(hosts, work, {"placement": "host", "host_shared": "on",
                                          "stats_file": work / "stats.json"})
        try:
            start_all(servers)
            out["files"] = [engram_files(h.shm) for h in hosts]
            # Inside its mount namespace a node's copies are under /dev/shm.
            out["maps"] = [{pid: {n for n in names if par.COPY.match(n)}
                            for pid, names in par.mapped_copies(s.proc.pid, Path("/dev/shm")).items()}
                           for s in servers]
            out["prompts"] = par.prompts(N_PROMPTS)
            with ThreadPoolExecutor(N_PROMPTS) as pool:
                done = pool.map(lambda p: servers[0].generate(p, NEW_TOKENS), out["prompts"])
                out["outputs"] = [o["output_ids"] for o in done]
            out["info"] = [s.get("engram", {}) for s in servers[0].get("/server_info")["internal_states"]]
        finally:
            stop_all(servers)
        out["left"] = [engram_files(h.shm) for h in hosts]
        # The same two nodes, one with another Engram mode: start-up stops on both, one line.
        bad = two_nodes(hosts, work, {"placement": "host", "host_shared": "on"}, ({}, {"mode": "off"}))
        try:
            with pytest.raises(ServerError) as e:
                start_all(bad)
            out["mismatch"] = str(e.value)
            out["mismatch_logs"] = [s.log_path.read_text(errors="replace") for s in bad]
        finally:
            stop_all(bad)
    out["leftovers"] = sim.leftovers()
    out["stats"] = {p.name: p.read_text() for p in sorted(work.glob("stats*.json"))}
    return out


def test_multinode_tp2_completions_equal_the_reference(run):
    assert run["outputs"] == [list(reference_completion(tuple(p), NEW_TOKENS)) for p in run["prompts"]]


def test_each_node_fills_serves_and_frees_its_own_copy(run):
    for node in range(2):
        par.check_one_copy_per_layer(run["files"][node], run["maps"][node], ranks=1)
    assert run["files"][0] == run["files"][1]  # the same tables: the same copies, one per node
    assert run["left"] == [[], []], run["left"]  # the last (only) server of each node removed its copy


def test_the_nodes_agree_on_whole_rows_and_the_table_identity(run):
    import json

    stats = {name: json.loads(text) for name, text in run["stats"].items()}
    assert sorted(stats) == ["stats.tp0.dp0.json", "stats.tp1.dp0.json"], sorted(stats)
    nodes = {s["tp_rank"]: s["node_rank"] for s in stats.values()}
    assert nodes == {0: 0, 1: 1}, nodes  # each rank's statistics name its node
    assert {s["table_identity"] for s in stats.values()} == {run["info"][0]["table_identity"]}
    assert not any(s["rows_all_reduced"] for s in stats.values())  # whole rows from each node's copy
    assert all(s["steps"] > 0 for s in stats.values())


def test_a_node_with_another_engram_mode_stops_start_up_in_one_line(run):
    line = run["mismatch"]
    assert line.startswith("engram-sglang: error: the tensor-parallel ranks serve different Engram tables or "
                           "settings: rank 1 (node 1) differ from rank 0 (node 0)"), line
    assert "\n" not in line
    assert "mode=off" in run["mismatch_logs"][1] and "mode=on" in run["mismatch_logs"][0]


def test_namespaces_mounts_and_shm_dirs_are_removed(run):
    assert run["leftovers"] == [], run["leftovers"]
