"""`--engram-host-whole-rows auto`: the planner's whole-rows-or-shard pick per GPU SKU and TP
size, taken at start-up from the GPU's name (no GPU needed to test the decision)."""

from __future__ import annotations

import logging

import pytest
import torch

from engram_sglang.core.config import EngramConfig
from engram_sglang.core.planning.data import load_gpus
from engram_sglang.core.planning.whole_rows import sku_for_device
from engram_sglang.serving.settings import ServeSettings
from engram_sglang.serving.whole_rows_auto import choose, resolve
from engram_sglang.tools.planner import plan

CFG = EngramConfig.from_preset("deepseek-v4.1-flash")
GPUS = load_gpus()

# What torch.cuda.get_device_name reports on each SKU (public nvidia-smi / rocm-smi logs).
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200", "NVIDIA H200 NVL": "H200", "NVIDIA B200": "B200",
    "NVIDIA B300 SXM6 AC": "B300", "NVIDIA GB200": "GB200", "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI300X VF": "MI300X", "AMD Instinct MI355X": "MI355X",
    "NVIDIA H100 PCIe": None, "NVIDIA A100-SXM4-80GB": None, "AMD Radeon PRO W7900": None,
}


@pytest.mark.parametrize("name, key", DEVICE_NAMES.items())
def test_a_device_name_names_its_sku(name, key):
    sku = sku_for_device(name, GPUS)
    assert (sku.key if sku else None) == key


@pytest.mark.parametrize("key", sorted(GPUS))
def test_auto_takes_the_planners_pick_for_every_sku_and_tp(key):
    for tp in (1, 2, 4, 8):
        whole, reason = choose(cfg=CFG, tp=tp, device_name=GPUS[key].name)
        nnodes = -(-tp // GPUS[key].gpus_per_node)  # GB200's 4-GPU trays need two for TP 8
        picked = plan(model="deepseek-v4.1-flash", gpu=key, tp=tp, placement="host",
                      nnodes=nnodes)["rows_per_rank"]["recommend"]
        assert whole == (picked in ("whole", None)), (key, tp, reason)
        assert reason and "\n" not in reason


def test_the_decisions_the_planner_documents():
    picks = {(k, tp): choose(cfg=CFG, tp=tp, device_name=GPUS[k].name)[0] for k in ("H100", "H200", "GB200")
             for tp in (2, 4, 8)}
    # PCIe Gen5 SKUs: whole at TP 2, sharded from TP 4; GB200's NVLink-C2C host link: whole everywhere.
    assert picks == {("H100", 2): True, ("H100", 4): False, ("H100", 8): False,
                     ("H200", 2): True, ("H200", 4): False, ("H200", 8): False,
                     ("GB200", 2): True, ("GB200", 4): True, ("GB200", 8): True}
    for name, why in ((None, "no GPU"), ("NVIDIA A100-SXM4-80GB", "not a SKU")):
        whole, reason = choose(cfg=CFG, tp=8, device_name=name)
        assert whole and why in reason
    assert choose(cfg=CFG, tp=1, device_name="NVIDIA H200") == (True, "TP 1: one rank holds every row")


def test_resolve_keeps_explicit_choices_and_logs_auto(caplog):
    base = dict(placement="host", host_shared=True)
    for explicit in (True, False):
        s = ServeSettings(**base, host_whole_rows=explicit)
        assert resolve(s, CFG, 8, torch.device("cpu"), device_name="NVIDIA H200") is s
    # Nothing to choose (no shared copy, other placements): whole, silently.
    for s in (ServeSettings(placement="host"), ServeSettings(placement="disk"), ServeSettings()):
        assert resolve(s, CFG, 8, torch.device("cpu"), device_name="NVIDIA H200").host_whole_rows is True
    with caplog.at_level(logging.INFO, logger="engram_sglang.serving.whole_rows_auto"):
        auto = ServeSettings(**base)
        assert auto.host_whole_rows == "auto"  # the default
        assert resolve(auto, CFG, 8, torch.device("cpu"), device_name="NVIDIA H200").host_whole_rows is False
        assert resolve(auto, CFG, 8, torch.device("cpu")).host_whole_rows is True  # the CPU: as before auto
        assert resolve(auto, CFG, 8, torch.device("cpu"), tp_rank=1, device_name="NVIDIA H200").host_whole_rows is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # rank 0 only
    assert "auto -> off" in lines[0] and "H200" in lines[0] and "TP8" in lines[0]
    assert "auto -> on" in lines[1] and "no GPU" in lines[1]


def test_the_flag_takes_auto_on_and_off():
    for raw, want in (("auto", "auto"), ("AUTO", "auto"), ("on", True), ("0", False)):
        assert ServeSettings.from_env({"ENGRAM_HOST_WHOLE_ROWS": raw}).host_whole_rows == want
    with pytest.raises(Exception, match=r"ENGRAM_HOST_WHOLE_ROWS \(--engram-host-whole-rows\) must be on/off .*or auto"):
        ServeSettings.from_env({"ENGRAM_HOST_WHOLE_ROWS": "sometimes"})


def test_start_up_uses_the_planners_arithmetic_not_its_command_or_report():
    """`auto` at start-up imports the planning modules that hold the arithmetic, never the
    planner's command line (engram_sglang.tools.planner) or its text report (planning.report):
    those are tools. A fresh process, so that this test session's imports do not count."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import json, sys\n"
            "from engram_sglang.core.config import EngramConfig\n"
            "from engram_sglang.serving.whole_rows_auto import choose\n"
            "choose(cfg=EngramConfig.from_preset('deepseek-v4.1-flash'), tp=4, device_name='NVIDIA H200')\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('engram_sglang.core.planning', 'engram_sglang.tools')))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "engram_sglang.core.planning.whole_rows" in loaded  # the control: what `choose` imports is seen
    assert "engram_sglang.tools.planner" not in loaded and "engram_sglang.tools.planner_report" not in loaded
