"""Smoke test of bench/decode_step.py: tiny sizes on the CPU, in a subprocess.

Checks that the JSON has every variant of every step shape, and that every placement's
Engram outputs of the checked step are bit-identical (bf16 bit patterns) to the device
placement's; and, in-process, that the harness's per-request conv state reproduces
EngramLayer over a whole sequence, and that its staged disk graph step (rows staged before
each replay, the captured forward reading only the buffers) equals the device placement's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram_sglang.core.rowformat import bf16_bits
from engram_sglang.models.layer import EngramLayer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "decode_step.py"
BATCHES = (8, 32)
PREFILL = 16
ENGRAM_LAYERS = (1, 3)
VARIANTS = {"baseline", "device prefetch", "device inline", "host prefetch", "host inline", "disk prefetch",
            "disk inline"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode_step")
    dump = tmp / "outputs.pt"
    cmd = [sys.executable, "-m", "bench.decode_step", "--small", "--layers", "4",
           "--engram-layers", ",".join(map(str, ENGRAM_LAYERS)), "--batches", ",".join(map(str, BATCHES)),
           "--prefill", str(PREFILL), "--disk", "--table-gib", "0.01",
           "--steps", "1", "--repeats", "1", "--warmup", "0", "--table-dir", str(tmp / "tables"), "--out", str(tmp),
           "--dump-outputs", str(dump)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp / "decode_step.json").read_text())
    assert (tmp / "decode_step.png").stat().st_size > 0
    return report, torch.load(dump), proc.stdout


@pytest.mark.slow
def test_every_variant_of_every_shape_is_timed(run):
    report, _, stdout = run
    groups = {("decode", b) for b in BATCHES} | {("prefill", PREFILL)}
    seen = {}
    for r in report["results"]:
        assert not r["error"], r
        if r.get("na"):  # the captured variants, which a CPU run lists but cannot time
            assert r["na"] == "needs a GPU" and r["graphs"] and r["shape"] == "decode", r
            seen.setdefault(("graph", r["batch"]), set()).add(r["variant"])
            continue
        assert r["ms_per_step"] > 0 and r["steps_per_s"] > 0 and r["layer_ms"] > 0, r
        seen.setdefault((r["shape"], r["batch"]), set()).add(r["variant"])
        if r["placement"] != "none":
            assert r["vs_device"] > 0 and r["engram_ms"] is not None, r
    graphed = {f"{v} graph" for v in VARIANTS - {"disk inline"}}  # disk's captured step is staged: a prefetch
    assert seen == {**{g: VARIANTS for g in groups}, **{("graph", b): graphed for b in BATCHES}}
    assert f"disk staged graph, decode {BATCHES[0]}: needs a GPU" in stdout
    assert report["summary"]["bits_equal_device"] is True
    assert report["summary"]["errors"] == []
    assert report["limits"]["host_copy_GBps"] > 0
    assert "host/device decode throughput" in stdout


@pytest.mark.slow
def test_engram_outputs_bit_identical_to_device_placement(run):
    report, dump, _ = run
    for r in report["results"]:
        if r["placement"] != "none" and not r.get("na"):
            assert r["bits_equal_device"] is True and r["engram_finite"] is True, r
    compared = 0
    for shape, batch in [("decode", b) for b in BATCHES] + [("prefill", PREFILL)]:
        for layer in ENGRAM_LAYERS:
            ref = dump[f"{shape}/{batch}/device prefetch/layer{layer}"]
            assert ref.dtype == torch.bfloat16 and ref.shape[0] == batch
            assert torch.isfinite(ref.float()).all() and ref.float().abs().sum() > 0
            for variant in VARIANTS - {"baseline", "device prefetch"}:
                got = dump[f"{shape}/{batch}/{variant}/layer{layer}"]
                assert torch.equal(bf16_bits(got), bf16_bits(ref)), (shape, batch, variant, layer)
                compared += 1
        # The check compares something: the two Engram layers' outputs differ, and one
        # flipped bit is seen.
        a = dump[f"{shape}/{batch}/device prefetch/layer{ENGRAM_LAYERS[0]}"]
        b = dump[f"{shape}/{batch}/device prefetch/layer{ENGRAM_LAYERS[1]}"]
        assert not torch.equal(bf16_bits(a), bf16_bits(b))
        flipped = a.clone()
        flipped.view(torch.int16)[0, 0] ^= 1
        assert not torch.equal(bf16_bits(flipped), bf16_bits(a))
    assert compared == 3 * len(ENGRAM_LAYERS) * (len(VARIANTS) - 2)


def test_decode_conv_state_matches_the_sequence_layer():
    """Token by token through the harness's conv state == EngramLayer.forward over the sequence."""
    from bench.decode_step import engram_decode

    torch.manual_seed(0)
    layer = EngramLayer(32, 6, 256, 4)  # float32: differences would be arithmetic, not rounding
    with torch.no_grad():
        layer.conv.weight.normal_()
        t = 20
        h = torch.randn(t, 32)
        rows = torch.randn(t, 6, 256)
        want = layer(h, rows)
        state = torch.zeros(1, layer.reach, 32)
        got = torch.cat([engram_decode(layer, h[i : i + 1], rows[i : i + 1], state) for i in range(t)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # A state that forgets (e.g. no shift) must not pass: the conv reaches 12 tokens back.
    with torch.no_grad():
        stale = torch.cat([engram_decode(layer, h[i : i + 1], rows[i : i + 1], torch.zeros(1, layer.reach, 32))
                           for i in range(t)])
    assert not torch.allclose(stale, want, rtol=1e-3, atol=1e-3)


def test_the_staged_disk_graph_variant_matches_device_placement(tmp_path, monkeypatch):
    """The harness's captured disk step, on the CPU: its "graph" is forward() run as a capture
    sees it (maintenance.capturing() True: no hashing on the host, rows from the staged
    buffers), replayed after step() hashed the tokens on the host and staged the rows. Step
    by step, its Engram outputs equal the device placement's eager ones bit for bit; a
    replay without the staging (negative control) does not."""
    from types import SimpleNamespace

    from bench import decode_step as ds
    from engram_sglang.core.stores import maintenance, open_store

    torch.set_grad_enabled(False)
    args = SimpleNamespace(layers=4, hidden=64, intermediate=128, heads=2, kv_heads=1, head_dim=32, context=8,
                           vocab=512, batch_list=[8], prefill=0)
    cfg = ds.harness_config("deepseek-v4.1-flash", ENGRAM_LAYERS, 0.005, args.vocab)
    table_dir, _ = ds.ensure_tables(cfg, tmp_path / "tables")
    hz = ds.Harness(args, cfg, torch.device("cpu"))
    for p in ("device", "disk"):
        hz.stores[p] = open_store(table_dir, p, "cpu", cfg=cfg)
    try:
        ref = ds.Variant(hz, "decode", 8, "device", True, False)
        disk = ds.Variant(hz, "decode", 8, "disk", True, True)
        assert disk.staged is not None and sorted(disk.staged.layers) == list(ENGRAM_LAYERS)

        def replay():
            with monkeypatch.context() as m:
                m.setattr(maintenance, "capturing", lambda: True)
                disk.forward()

        disk.graph = SimpleNamespace(replay=replay)
        for k in range(4):
            ref.step()
            disk.step()
            for L in ENGRAM_LAYERS:
                assert torch.equal(bf16_bits(disk.last[L]), bf16_bits(ref.last[L])), (k, L)
        stage, disk.staged.stage = disk.staged.stage, lambda ids: None  # the rows of the previous step stay
        ref.step()
        disk.step()
        assert not all(torch.equal(bf16_bits(disk.last[L]), bf16_bits(ref.last[L])) for L in ENGRAM_LAYERS)
        disk.staged.stage = stage
    finally:
        for stores in hz.stores.values():
            for s in stores.values():
                s.close()


def test_the_disk_graph_summary_reports_a_failed_capture_as_such():
    """On a GPU a failed staged capture must read as its error, not as "needs a GPU"."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_step_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = [
        {"shape": "decode", "batch": 8, "variant": "disk prefetch", "ms_per_step": 2.0},
        {"shape": "decode", "batch": 8, "variant": "disk prefetch graph", "error": "CUDA error: operation not permitted"},
        {"shape": "decode", "batch": 32, "variant": "disk prefetch", "ms_per_step": 4.0},
        {"shape": "decode", "batch": 32, "variant": "disk prefetch graph", "ms_per_step": 2.0},
    ]
    lines = bench.disk_graph_summary(results)["lines"]
    assert lines[0] == "disk staged graph, decode 8: CUDA error: operation not permitted"
    assert lines[1].startswith("disk staged graph, decode 32: 2.000 ms/step, x2.000 vs disk eager")
