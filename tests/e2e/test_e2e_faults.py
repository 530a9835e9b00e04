"""End to end: a table read that fails after its retries fails only its requests.

Real `sglang.launch_server` on the demo model, disk tier by O_DIRECT behind a DRAM row
cache, with build/kernels/libengram_faults.so preloaded: it fails the table files' reads
with EIO inside libc (below the native reader and its retries) while an arm file exists.
A prompt whose rows are all in the DRAM cache is served exactly while a new prompt's reads
fail; the failed request gets HTTP 500 naming the table file and the errno; once the disk
is healthy again the same prompt is served exactly (nothing failed was cached) by the same
server.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engram_sglang.core.tablefile import DATA_OFFSET
from engram_sglang.serving.launch import Server, ServerError
from tests.e2e.test_e2e_serving import corpus_prompts
from tests.support.demo_support import demo_dir, reference_completion, table_dir

pytestmark = pytest.mark.slow

FAULTS_LIB = Path(__file__).resolve().parents[2] / "build" / "kernels" / "libengram_faults.so"


def test_a_failed_read_fails_only_its_request_and_the_server_keeps_serving(tmp_path):
    assert FAULTS_LIB.is_file(), f"{FAULTS_LIB} not built: run `make faults` (make test builds it)"
    arm = tmp_path / "arm"
    cached, fresh, later = corpus_prompts(3, salt=313)
    tables = tmp_path / "tables"  # a private copy: this test writes over one of its files
    shutil.copytree(table_dir(), tables)
    env = {"LD_PRELOAD": str(FAULTS_LIB), "ENGRAM_FAULTS_MATCH": ".rows", "ENGRAM_FAULTS_ARM": str(arm),
           "ENGRAM_FAULTS_EIO_PROB": "1", "ENGRAM_FAULTS_EIO_BURST_MS": "600000",
           "ENGRAM_FAULTS_STATS_DIR": str(tmp_path)}
    server = Server(demo_dir(), engram={"table_dir": tables, "placement": "disk", "disk_direct": "on",
                                        "disk_dram_cache_mib": "64", "disk_retries": "1"},
                    max_total_tokens=4096, log_path=tmp_path / "sglang.log", env=env)
    with server:
        # One new token: a prefill only, whose rows are then all in the DRAM cache.
        assert server.generate(cached, 1)["output_ids"] == list(reference_completion(tuple(cached), 1))
        arm.touch()  # every table read fails from now on
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(server.generate, fresh, 4)
            good = pool.submit(server.generate, cached, 1)
            assert good.result()["output_ids"] == list(reference_completion(tuple(cached), 1))
            with pytest.raises(ServerError) as failed:
                bad.result()
        message = str(failed.value)
        assert "HTTP 500" in message and ".rows" in message and "Input/output error" in message
        arm.unlink()
        assert server.generate(fresh, 4)["output_ids"] == list(reference_completion(tuple(fresh), 4))
        faults = sum(t.get("read_faults", 0) for t in [server.engram_stats()])
        assert faults >= 1
        with open(tables / "layer-3.rows", "r+b") as f:  # same size, same inode, other rows
            f.seek(DATA_OFFSET)
            row = f.read(264)
            f.seek(DATA_OFFSET)
            f.write(bytes(b ^ 0x5A for b in row))
        time.sleep(0.2)  # the store looks at its file at most every 100 ms
        with pytest.raises(ServerError) as changed:
            server.generate(later, 4)
        message = str(changed.value)
        assert "HTTP 500" in message and "layer-3.rows was rewritten in place" in message, message
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
    assert any(p.name.startswith("faults-") for p in tmp_path.iterdir()), "the shim saw no table read"
