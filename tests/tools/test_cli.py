"""The operators' CLI on real files, and the SGLang plugin entry point's registration."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engram_sglang import EngramLayout
from engram_sglang.core.rowformat import ROW_BYTES, split
from engram_sglang.core.tablefile import MANIFEST, layer_file_name, open_tables
from engram_sglang.tools.cli import main
from tests.support.tables import small_config

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
        [sys.executable, "-m", "engram_sglang.tools.cli", "tables", "verify", str(out)], capture_output=True, text=True
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
    """`make demo` with two placements (it serves three): builds the demo model, serves it
    with real SGLang (tables on disk, in host memory, and with Engram off), all prompts at
    once, prints tokens/s and per-step costs, Engram on vs off, agrees with the reference,
    stops the servers."""
    import os
    import re

    assert main(["demo", "--workdir", str(tmp_path), "--placements", "disk,host"]) == 0
    out = capsys.readouterr().out
    assert "total 188.83 GiB" in out and "TP4 47.21" in out
    assert "Engram tables placement disk, host, and once with Engram off" in out and "servers stopped" in out
    assert "8 prompts served at once, 32 new tokens each" in out
    for name in ("disk", "host", r"off \(device\)"):  # tokens/s, step, Engram, wait, gather, layer, load
        assert re.search(rf"^ +{name}" + r" +[\d.]+" * 7 + "$", out, re.M), name
    assert "every placement served the same tokens: yes" in out
    assert "the PyTorch reference forward gives the same tokens for 8 of 8 prompts" in out
    # What Engram adds: with it the completions follow the corpus far more often than without.
    on, off = map(int, re.search(r"tokens equal to the chain: on (\d+) of 256, off (\d+) of 256", out).groups())
    assert on > 2 * off + 32, (on, off)
    # Nothing of the server is left: no process still runs from the demo's model directory.
    model = str(tmp_path / "model")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        assert model not in cmdline, cmdline


# ------------------------------------------------------------ hostile inputs: exit 2, one line
def _hostile_cases(tmp_path, gen):
    """(name, argv) of bad inputs to every command; each must exit 2 with one line."""
    ckpt, _ = checkpoint(tmp_path, gen)
    good = tmp_path / "tables"
    assert main(["tables", "convert", str(ckpt), str(good)]) == 0
    cases = []

    def table_dir(name, edit):
        d = tmp_path / name
        shutil.copytree(good, d)
        edit(d)
        cases.append((f"verify {name}", ["tables", "verify", str(d)]))
        cases.append((f"inspect {name}", ["tables", "inspect", str(d)]))

    def manifest(change):
        def edit(d):
            m = json.loads((d / MANIFEST).read_text())
            (d / MANIFEST).write_text(json.dumps(change(m)))
        return edit

    table_dir("manifest-list", lambda d: (d / MANIFEST).write_text("[]"))
    table_dir("manifest-binary", lambda d: (d / MANIFEST).write_bytes(b"\xff\xfe\x00"))
    table_dir("layers-empty", manifest(lambda m: {**m, "layers": []}))
    table_dir("layers-str", manifest(lambda m: {**m, "layers": "x"}))
    table_dir("rows-str", manifest(lambda m: {**m, "layers": [{**m["layers"][0], "rows": "890"}]}))
    table_dir("file-escape", manifest(lambda m: {**m, "layers": [{**m["layers"][0], "file": "../tables/layer-2.rows"}]}))
    table_dir("config-edited", manifest(lambda m: {**m, "config": {**m["config"], "engram_n_heads": 3}}))
    table_dir("header-garbage", lambda d: (d / layer_file_name(2)).write_bytes(
        b"ENGRAMRW\x01\x00\x00\x00\x05\x00\x00\x00[1,2]".ljust(4096, b"\0") + (d / layer_file_name(2)).read_bytes()[4096:]))
    table_dir("layer-fifo", lambda d: ((d / layer_file_name(2)).unlink(), os.mkfifo(d / layer_file_name(2))))
    cases.append(("verify missing dir", ["tables", "verify", str(tmp_path / "nowhere")]))
    cases.append(("verify bad --config", ["tables", "verify", str(good), "--config", str(tmp_path / "none.json")]))

    def bad_ckpt(name, edit):
        d = tmp_path / name
        shutil.copytree(ckpt, d)
        edit(d)
        cases.append((f"convert {name}", ["tables", "convert", str(d), str(good)]))

    bad_ckpt("index-list", lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'))
    bad_ckpt("index-escape", lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.layers.2.engram.embed.weight": "../x.safetensors"}})))
    bad_ckpt("index-binary", lambda d: (d / "model.safetensors.index.json").write_bytes(b"\xff\xff"))
    bad_ckpt("shard-garbage", lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 100))
    bad_ckpt("shard-empty", lambda d: (d / "model.safetensors").write_bytes(b""))
    bad_ckpt("shard-dir", lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir(),
                                     (d / "x.safetensors").write_bytes(b"\0" * 8)))
    bad_ckpt("config-missing", lambda d: (d / "config.json").unlink())
    bad_ckpt("config-huge-heads", lambda d: (d / "config.json").write_text(
        json.dumps({**CFG.hash_fields(), "engram_n_heads": 10**9})))
    (tmp_path / "a-file").write_text("x")
    cases.append(("convert onto a file", ["tables", "convert", str(ckpt), str(tmp_path / "a-file")]))
    cases.append(("convert onto a non-table dir", ["tables", "convert", str(ckpt), str(tmp_path)]))
    cases.append(("convert missing ckpt", ["tables", "convert", str(tmp_path / "no-ckpt"), str(good)]))
    for flag, value in (("--hot-cache-gib", "inf"), ("--weights-gib", "nan"), ("--reserve-gib", "-1"),
                        ("--kv-bytes-per-token", "1e-300"), ("--tp", "1000000000")):
        cases.append((f"plan {flag} {value}", ["plan", "--model", "deepseek-v4.1-flash", "--gpu", "H100", flag, value]))
    cases.append(("profile no model", ["profile", "--model", str(tmp_path / "nope"), str(tmp_path), "--out", "x.npz"]))
    cases.append(("profile keep-share nan", ["profile", "--model", str(ckpt), str(tmp_path), "--out", "x.npz",
                                             "--keep-share", "nan"]))
    return good, cases


def test_hostile_inputs_exit_2_with_one_line(tmp_path, rng, capsys):
    import signal

    good, cases = _hostile_cases(tmp_path, rng)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    capsys.readouterr()

    class Hung(Exception):  # not TimeoutError: that is an OSError, which the code may catch
        pass

    def fire(*_):
        raise Hung()

    signal.signal(signal.SIGALRM, fire)
    try:
        for name, argv in cases:
            signal.alarm(20)
            assert main(argv) == 2, name
            signal.alarm(0)
            err = capsys.readouterr().err
            assert err.startswith("engram-sglang") and err.count("\n") == 1 and "Traceback" not in err, (name, err)
    finally:
        signal.alarm(0)
    # Not one failed convert touched the good directory.
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
