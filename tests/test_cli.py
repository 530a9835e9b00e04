"""The operators' CLI on real files, and the SGLang plugin entry point's registration."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import small_config
from engram_sglang import EngramLayout
from engram_sglang.cli import main
from engram_sglang.rowformat import ROW_BYTES, split
from engram_sglang.tablefile import MANIFEST, layer_file_name, open_tables

CFG = small_config(300, layer_ids=(2,), n_heads=2)


def checkpoint(tmp_path, gen):
    rows = torch.randint(0, 256, (EngramLayout(CFG).rows(2), ROW_BYTES), dtype=torch.uint8, generator=gen)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CFG.hash_fields()))
    w, s = split(rows)
    save_file({"model.layers.2.engram.embed.weight": w, "model.layers.2.engram.embed.scale": s}, ckpt / "model.safetensors")
    return ckpt, rows


def test_convert_verify_inspect(tmp_path, rng, capsys):
    ckpt, rows = checkpoint(tmp_path, rng)
    out = tmp_path / "tables"
    assert main(["tables", "convert", str(ckpt), str(out)]) == 0
    assert np.array_equal(open_tables(out)[2], rows.numpy())
    assert main(["tables", "verify", str(out), "--config", str(ckpt)]) == 0
    assert "OK (layer 2:" in capsys.readouterr().out
    assert main(["tables", "inspect", str(out)]) == 0
    assert "layer   2:" in capsys.readouterr().out


def test_errors_are_one_line_and_exit_2(tmp_path, rng):
    ckpt, _ = checkpoint(tmp_path, rng)
    out = tmp_path / "tables"
    assert main(["tables", "convert", str(ckpt), str(out)]) == 0
    path = out / layer_file_name(2)
    path.write_bytes(path.read_bytes()[:-1])
    proc = subprocess.run(
        [sys.executable, "-m", "engram_sglang.cli", "tables", "verify", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "layer-2.rows: truncated" in proc.stderr
    (out / MANIFEST).unlink()
    assert main(["tables", "inspect", str(out)]) == 2


def test_sglang_plugin_entry_point_is_registered():
    eps = {ep.name: ep for ep in entry_points(group="sglang.srt.plugins")}
    assert "engram" in eps and eps["engram"].value == "engram_sglang.plugin:load"
    load = eps["engram"].load()
    load()
    load()  # idempotent: SGLang may call it in the same process twice


@pytest.mark.slow
def test_demo_runs(tmp_path, capsys):
    """`make demo`: builds the demo model, serves it with real SGLang (tables on disk),
    prints completions and table statistics, agrees with the reference, stops the server."""
    import os

    assert main(["demo", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "total 188.83 GiB" in out and "TP4 47.21" in out
    assert "Engram tables placement disk" in out and "server stopped" in out
    assert "'def __init__(self' -> " in out
    assert "layer 1: disk," in out and "layer 3: disk," in out
    assert "PyTorch reference forward gives the same tokens for 6 of 6 prompts" in out
    assert "with Engram switched off 6 of 6 completions change" in out
    # Nothing of the server is left: no process still runs from the demo's model directory.
    model = str(tmp_path / "model")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        assert model not in cmdline, cmdline
