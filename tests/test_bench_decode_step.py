"""Smoke test of bench/decode_step.py: tiny sizes on the CPU, in a subprocess.

Checks that the JSON has every variant of every step shape, and that every placement's
Engram outputs of the checked step are bit-identical (bf16 bit patterns) to the device
placement's; and, in-process, that the harness's per-request conv state reproduces
EngramLayer over a whole sequence.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engram_sglang.layer import EngramLayer
from engram_sglang.rowformat import bf16_bits

ROOT = Path(__file__).resolve().parents[1]
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
    cmd = [sys.executable, str(SCRIPT), "--small", "--layers", "4",
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
        assert r["ms_per_step"] > 0 and r["steps_per_s"] > 0 and r["layer_ms"] > 0, r
        seen.setdefault((r["shape"], r["batch"]), set()).add(r["variant"])
        if r["placement"] != "none":
            assert r["vs_device"] > 0 and r["engram_ms"] is not None, r
    assert seen == {g: VARIANTS for g in groups}
    assert report["summary"]["bits_equal_device"] is True
    assert report["summary"]["errors"] == []
    assert report["limits"]["host_copy_GBps"] > 0
    assert "host/device decode throughput" in stdout


@pytest.mark.slow
def test_engram_outputs_bit_identical_to_device_placement(run):
    report, dump, _ = run
    for r in report["results"]:
        if r["placement"] != "none":
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
    sys.path.insert(0, str(ROOT / "bench"))
    from decode_step import engram_decode

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
