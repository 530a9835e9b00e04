"""/server_info's host tables carry their pages: the page size and measured huge-page share per
table, and the mount (its huge= value) or THP knob behind them, as the plugin's hook on the
scheduler's internal state reports them (module level: a real runtime over real stores)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engram_sglang.core.stores import thp
from engram_sglang.core.tablefile import write_tables
from tests.support.tables import random_rows, small_config

pytest.importorskip("sglang.srt.managers.scheduler_components.internal_state", reason="needs the installed sglang")

CFG = small_config(400)
SERIAL = SimpleNamespace(tp_rank=0, tp_size=1, attn_dp_size=1, attn_cp_size=1)


def server_info_tables(table_dir, **settings) -> list[dict]:
    from engram_sglang import plugin
    from engram_sglang.serving.settings import ServeSettings
    from engram_sglang.serving.startup import open_runtime

    runtime = open_runtime(ServeSettings(placement="host", table_dir=str(table_dir), **settings), parallel=SERIAL,
                           table_dir=table_dir, device="cpu")
    try:
        class Controller:
            def get_internal_state(self, recv_req):
                return SimpleNamespace(internal_state={})

        plugin.patch(SimpleNamespace(SchedulerInternalStateController=Controller),
                     "sglang.srt.managers.scheduler_components.internal_state")
        return Controller().get_internal_state(None).internal_state["engram"]["tables"]
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def table_dir(tmp_path_factory):
    return write_tables(tmp_path_factory.mktemp("tables") / "t", CFG, random_rows(CFG), progress=False)


def test_a_shared_copy_reports_its_mount_and_pages(table_dir, tmp_path):
    tables = server_info_tables(table_dir, host_shared=True, shm_dir=str(tmp_path))
    plan = thp.probe_dir(tmp_path)
    assert [t["layer_id"] for t in tables] == list(CFG.layer_ids)
    for t in tables:
        assert t["shared"] and t["page_memory"] == plan.memory and t["shmem_enabled"] == (plan.shmem_enabled or None)
        assert t["mount_huge"] == (plan.huge_option or None)  # None: not a tmpfs (ext4 here)
        # Nothing mapped on the CPU (no GPU registration faults the copy in): no share measured,
        # the page size is the one the mount gives.
        assert not t["pages_measured"] and t["huge_page_coverage"] is None
        assert t["page_size_kib"] == {True: 2048, False: 4, None: None}[plan.huge]
        assert t["page_fix"] == (plan.fix if plan.huge is False else None)


def test_a_private_copy_reports_its_measured_share(table_dir):
    tables = server_info_tables(table_dir)
    for t in tables:
        assert not t["shared"] and t["page_memory"] == "anonymous memory" and t["mount_huge"] is None
        assert t["pages_measured"] and 0.0 <= t["huge_page_coverage"] <= 1.0
        assert t["page_size_kib"] == (2048 if t["huge_page_coverage"] >= thp.COVERAGE_FLOOR else 4)
        assert t["thp_enabled"] == (thp.probe_anonymous().thp_enabled or None)
