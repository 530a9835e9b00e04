"""Prometheus series for a fleet: every engram_* series names its rank (tp/dp/pp), none a
`pid`, and what used to be only in /server_info (DRAM row cache hits and lookups, read
faults, the per-step Engram wait, the plugin version and the tables) is a series too, its
counters present at 0 from start-up.

Scraped as SGLang scrapes: prometheus_client's multiprocess collector over the files two
real processes (two DP ranks) wrote, and the runtime's own series in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

import engram_sglang
from engram_sglang.core.hashing import NgramHasher
from engram_sglang.core.stores import maintenance
from engram_sglang.core.tablefile import DATA_OFFSET
from engram_sglang.serving import runtime as runtime_mod
from engram_sglang.serving.settings import ServeSettings
from tests.support.tables import random_table_dir, small_config

ROOT = Path(__file__).resolve().parents[2]
CFG = small_config(300, layer_ids=(1, 3), n_heads=2)
RANKS = ("tp_rank", "dp_rank", "pp_rank")

# One DP rank's process: PROMETHEUS_MULTIPROC_DIR set before prometheus_client is imported,
# as SGLang's launcher does; disk tier with a DRAM row cache, host tier with a hot-row cache.
RANK = """
    import json, os, sys
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
    import torch
    from engram_sglang.core.stores import maintenance, open_store

    root, dp = sys.argv[2], int(sys.argv[3])
    disk = open_store(root, "disk", ranks={"dp_rank": dp}, dram_cache_bytes=1 << 20)
    host = open_store(root, "host", ranks={"dp_rank": dp}, cache_bytes=1 << 20, shared=False)
    ids = torch.arange(40).view(8, 5)
    for _ in range(3):  # the same rows again: DRAM-cache hits from the second call on
        for s in (*disk.values(), *host.values()):
            s.gather(ids)
    for _ in range(maintenance.DEFAULT_EVERY):
        maintenance.between_steps()
    print(json.dumps({str(L): s.stats() for L, s in disk.items()}))
"""


def scrape(directory: Path) -> list:
    """The samples SGLang's /metrics would serve from `directory` (its multiprocess collector)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    text = generate_latest(registry).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name.startswith("engram_")]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return random_table_dir(tmp_path_factory.mktemp("tables"), CFG)[0]


@pytest.fixture(scope="module")
def two_ranks(tables, tmp_path_factory):
    directory = tmp_path_factory.mktemp("prometheus")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    stats = {}
    for dp in (0, 1):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(RANK), str(directory), str(tables), str(dp)],
                             capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        stats[dp] = json.loads(out.stdout.strip().splitlines()[-1])
    return scrape(directory), stats


def test_every_series_names_its_rank_and_none_its_pid(two_ranks):
    samples, _ = two_ranks
    assert samples
    for s in samples:
        assert all(name in s.labels for name in RANKS), s
        assert "pid" not in s.labels, s  # a gauge left in prometheus_client's default mode "all"
    # Each rank keeps its own gauges (not one process's value over the other's) and counters
    # (not the sum of both).
    for name in ("engram_resident_bytes", "engram_cache_rows", "engram_rows_served_total"):
        ranks = sorted({s.labels["dp_rank"] for s in samples if s.name == name})
        assert ranks == ["0", "1"], (name, ranks)


def test_dram_cache_hits_and_lookups_are_series(two_ranks):
    samples, stats = two_ranks

    def value(name, dp, layer):
        got = [s.value for s in samples if s.name == name and s.labels["dp_rank"] == str(dp)
               and s.labels["layer"] == layer and s.labels["placement"] == "disk"]
        assert len(got) == 1, (name, dp, layer, got)
        return got[0]

    for dp, layers in stats.items():
        for layer, t in layers.items():
            assert value("engram_dram_cache_lookups_total", dp, layer) == t["dram_cache_lookups"] > 0
            assert value("engram_dram_cache_hits_total", dp, layer) == t["dram_cache_hits"] > 0
            assert value("engram_read_errors_total", dp, layer) == 0  # present before the first error


def test_the_runtime_series_and_server_info(tables, tmp_path, rng):
    """A runtime whose ranks SGLang published (TP rank 1, DP rank 1, PP rank 1; the runtime
    itself opens the tables as TP 1, as under attention DP), disk tier with a DRAM cache:
    its stores' series carry SGLang's ranks; read faults are 0 from start-up and count a
    contained fault; each step with tokens observes its wait; the version and the tables
    are a series and in /server_info."""
    import shutil

    from sglang.srt.runtime_context import get_parallel

    root = tmp_path / "t"
    shutil.copytree(tables, root)  # a private copy: the fault below writes over a layer file
    hasher = NgramHasher(CFG, torch.randint(0, CFG.compressed_vocab_size, (CFG.vocab_size,), generator=rng))
    settings = ServeSettings(placement="disk", disk_dram_cache_mib=1, disk_retries=0, prefetch=False)
    with get_parallel().override(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2, pp_rank=1, pp_size=2):
        runtime = runtime_mod.EngramRuntime(CFG, hasher, settings, root, torch.device("cpu"))
    step_labels = {"placement": "disk", "tp_rank": "1", "dp_rank": "1", "pp_rank": "1"}

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, {**step_labels, **labels})

    try:
        stats = runtime.stats()
        manifest = json.loads((root / "manifest.json").read_text())
        assert stats["engram_version"] == engram_sglang.__version__
        assert stats["table_fingerprint"] == manifest["config_fingerprint"]
        assert value("engram_build_info", version=engram_sglang.__version__, table_identity=stats["table_identity"],
                     table_fingerprint=stats["table_fingerprint"]) == 1
        faults0, waits0 = value("engram_read_faults_total"), value("engram_step_wait_seconds_count")
        assert faults0 is not None and waits0 is not None  # present before the first fault and step
        L = CFG.layer_ids[0]
        assert value("engram_read_errors_total", layer=str(L)) is not None
        tokens = torch.randint(0, CFG.vocab_size, (6,), generator=rng)
        ids = hasher.hash_sequence(tokens.tolist())
        for _ in range(2):
            step = runtime.begin(ids, torch.zeros(6, dtype=torch.int64), torch.arange(6), tokens, "extend")
            for layer in CFG.layer_ids:
                runtime.rows(step, layer)
            runtime.end(step, 0.0, 0.0, 2)
        assert value("engram_step_wait_seconds_count") - waits0 == 2
        before = value("engram_dram_cache_hits_total", layer=str(L)) or 0.0
        for _ in range(maintenance.DEFAULT_EVERY):
            maintenance.between_steps()
        hits = runtime.stats()["tables"][0]["dram_cache_hits"]
        assert hits > 0 and value("engram_dram_cache_hits_total", layer=str(L)) - before == hits
        # A real fault: the layer file rewritten in place under the store fails every lookup.
        with open(root / f"layer-{L}.rows", "r+b") as f:
            f.seek(DATA_OFFSET)
            row = f.read(264)
            f.seek(DATA_OFFSET)
            f.write(bytes(b ^ 0x5A for b in row))
        time.sleep(0.2)  # the store looks at its file at most every 100 ms
        step = runtime.begin(ids, torch.zeros(6, dtype=torch.int64), torch.arange(6), tokens, "extend")
        runtime.rows(step, L)
        runtime.end(step, 0.0, 0.0, 1)
        assert runtime.stats()["read_faults"] == 1 and value("engram_read_faults_total") - faults0 == 1
    finally:
        runtime.close()
