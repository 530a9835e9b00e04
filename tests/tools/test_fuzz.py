"""The fuzz harnesses (fuzz/) in `make test`: a short libFuzzer run per target, fixed seed,
from its seed corpus; every regression case of the corpus replayed; and each finding built
by hand, checked for the one line naming the file it now gives (exit 2 in the CLI).
`make fuzz` runs the same harnesses for longer."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from engram_sglang.core.config import EngramConfig
from engram_sglang.core.errors import EngramConfigError, TableFormatError
from engram_sglang.core.hashing import EngramLayout
from engram_sglang.core.tablefile import MANIFEST, convert_checkpoint, verify_tables, write_tables
from engram_sglang.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "fuzz"
# Inputs per target (the corpus replays first, then mutations), a few seconds each.
RUNS = {"tables": 2000, "config": 4000, "convert": 800}
# Regression cases: fuzz/corpus/TARGET/regression-NAME, each replayed below and rebuilt by hand
# in the test named after it.
REGRESSIONS = sorted((p.parent.name, p.name) for p in FUZZ.glob("corpus/*/regression-*"))

TINY = EngramConfig(layer_ids=(0, 2), max_ngram_size=2, n_heads=2, head_dim=256, vocab_size=3,
                    compressed_vocab_size=3, pad_token_id=0)
DIGITS = "9" * 5000  # more digits than Python turns into an int (4300): json.loads raises ValueError


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """fuzz/fuzz_TARGET.py imported in this process (atheris from requirements/dev.txt)."""
    pytest.importorskip("atheris", reason="requirements/dev.txt installs atheris from Python 3.11 on")
    os.environ["FUZZ_SCRATCH"] = str(tmp_path_factory.mktemp("fuzz-scratch"))
    yield lambda target: importlib.import_module(f"fuzz.fuzz_{target}")


def _runner():
    from fuzz import runner

    return runner


@pytest.mark.parametrize("target", sorted(RUNS))
def test_bounded_fuzz_run(target, tmp_path):
    pytest.importorskip("atheris", reason="requirements/dev.txt installs atheris from Python 3.11 on")
    assert (FUZZ / "corpus" / target).is_dir() and any((FUZZ / "corpus" / target).iterdir())
    result = _runner().run(target, tmp_path, runs=RUNS[target], seed=1, env={"FUZZ_SCRATCH": str(tmp_path / "scratch")})
    print(result.summary())
    assert result.ok, result.summary()


def test_a_finding_fails_the_run(tmp_path):
    """The negative control: a harness whose every input is a finding fails the run, and the
    runner names the input it left."""
    pytest.importorskip("atheris", reason="requirements/dev.txt installs atheris from Python 3.11 on")
    runner = _runner()
    result = runner.run("tables", tmp_path, runs=1, seed=1,
                        env={"FUZZ_SCRATCH": str(tmp_path / "scratch"), "FUZZ_SELF_TEST": "1"})
    assert not result.ok and result.findings, result.summary()
    assert "FUZZ_SELF_TEST" in result.log.read_text()


@pytest.mark.parametrize("target,name", REGRESSIONS)
def test_regression_replays(harness, target, name):
    """Each regression input, through its harness (which raises on any finding)."""
    harness(target).test_one_input((FUZZ / "corpus" / target / name).read_bytes())


def test_every_regression_has_a_test_by_hand():
    """Each corpus regression is named by the test below that builds its finding by hand."""
    assert REGRESSIONS, "no fuzz/corpus/*/regression-* files"
    source = Path(__file__).read_text()
    assert [f"{t}/{n}" for t, n in REGRESSIONS if f"{t}/{n}" not in source] == []


# ------------------------------------------------------------------ findings, built by hand
def _one_line_exit_2(capsys, argv, *expect):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("engram-sglang: error: "), err
    for e in expect:
        assert e in err, err
    return err


def _table_dir(tmp_path):
    rng = np.random.default_rng(0)
    rows = {L: rng.integers(0, 256, (n, 264), dtype=np.uint8) for L, n in zip(TINY.layer_ids, EngramLayout(TINY).num_embeddings)}
    return write_tables(tmp_path / "t", TINY, rows, progress=False)


def _edit_manifest(table_dir, edit):
    m = json.loads((table_dir / MANIFEST).read_text())
    edit(m)
    (table_dir / MANIFEST).write_text(json.dumps(m))


def test_config_with_an_integer_of_5000_digits(tmp_path, capsys):
    """config/regression-int-digits, convert/regression-config-int-digits: json.loads raised
    ValueError (not JSONDecodeError) for an integer of more digits than Python converts."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY.hash_fields(), "engram_n_heads": 0}).replace('"engram_n_heads": 0', f'"engram_n_heads": {DIGITS}'))
    with pytest.raises(EngramConfigError, match=r"config.json: not a JSON text \(Exceeds the limit \(4300 digits\)"):
        EngramConfig.from_file(path)
    _one_line_exit_2(capsys, ["tables", "verify", str(_table_dir(tmp_path)), "--config", str(path)], str(path))


def test_manifest_with_an_integer_of_5000_digits(tmp_path, capsys):
    """tables/regression-int-digits: the same ValueError from the manifest (a layer header's
    JSON cannot hold 4300 digits: it has 4080 bytes)."""
    t = _table_dir(tmp_path)
    good = (t / MANIFEST).read_text()
    (t / MANIFEST).write_text(good.replace('"version": 1', f'"version": {DIGITS}'))
    with pytest.raises(TableFormatError, match=r"manifest.json: not valid JSON \(ValueError: Exceeds the limit"):
        verify_tables(t, progress=False)
    _one_line_exit_2(capsys, ["tables", "inspect", str(t)], str(t / MANIFEST))


@pytest.mark.parametrize("name", ["\ud800", "layer-0.rows\n", "\udc80layer", "layer-0.rows\x00", "\x1b[2J"])
def test_manifest_file_name_not_printable(tmp_path, capsys, name):
    """tables/regression-file-name-surrogate: a lone surrogate raised UnicodeEncodeError from
    os.open; a newline split the 'one line' naming the file."""
    t = _table_dir(tmp_path)
    _edit_manifest(t, lambda m: m["layers"][0].__setitem__("file", name))
    with pytest.raises(TableFormatError, match=r"layer 0: file must be a plain file name inside .*, found ") as e:
        verify_tables(t, progress=False)
    assert "\n" not in str(e.value)
    _one_line_exit_2(capsys, ["tables", "verify", str(t)], str(t / MANIFEST))


def test_manifest_fingerprint_with_a_newline(tmp_path, capsys):
    """tables/regression-fingerprint-newline: the stated fingerprint went into the message
    as it was, so a newline in it split the one line."""
    t = _table_dir(tmp_path)
    _edit_manifest(t, lambda m: m.__setitem__("config_fingerprint", "x\ny"))
    with pytest.raises(TableFormatError, match=r"config_fingerprint says 'x\\ny' \(the manifest was edited") as e:
        verify_tables(t, progress=False)
    assert "\n" not in str(e.value)
    _one_line_exit_2(capsys, ["tables", "verify", str(t)], str(t / MANIFEST))


def _checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    from engram_sglang.core.rowformat import split

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY.hash_fields()))
    rng = np.random.default_rng(1)
    tensors = {}
    for L, n in zip(TINY.layer_ids, EngramLayout(TINY).num_embeddings):
        w, s = split(torch.from_numpy(rng.integers(0, 256, (n, 264), dtype=np.uint8)))
        tensors[f"model.layers.{L}.engram.embed.weight"], tensors[f"model.layers.{L}.engram.embed.scale"] = w, s
    save_file(tensors, ckpt / "model.safetensors")
    index = {"weight_map": {k: "model.safetensors" for k in tensors}}
    return ckpt, index


@pytest.mark.parametrize("shard", ["model.safetensors\n", "\ud800", "a\x00b"])
def test_checkpoint_index_shard_name_not_printable(tmp_path, capsys, shard):
    """convert/regression-shard-name-nul, convert/regression-shard-name-newline: the index's
    shard names (ValueError from os.open; a message over two lines), held to the same rule."""
    ckpt, index = _checkpoint(tmp_path)
    index["weight_map"]["model.layers.0.engram.embed.weight"] = shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TableFormatError, match=r"index.json: tensor 'model.layers.0.engram.embed.weight' maps to .*, not a shard file name") as e:
        convert_checkpoint(ckpt, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value)
    _one_line_exit_2(capsys, ["tables", "convert", str(ckpt), str(tmp_path / "out")], str(ckpt))


def test_checkpoint_index_dangling_symlink_and_digits(tmp_path, capsys):
    """convert/regression-index-symlink: an index that is a symlink to nowhere raised
    FileNotFoundError; an index with a 5000-digit integer raised ValueError."""
    ckpt, index = _checkpoint(tmp_path)
    (ckpt / "model.safetensors.index.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(TableFormatError, match=r"index.json: a symlink to a missing file"):
        convert_checkpoint(ckpt, tmp_path / "out", progress=False)
    _one_line_exit_2(capsys, ["tables", "convert", str(ckpt), str(tmp_path / "out")], str(ckpt))
    (ckpt / "model.safetensors.index.json").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({**index, "metadata": {"total_size": 0}}).replace('"total_size": 0', f'"total_size": {DIGITS}'))
    with pytest.raises(TableFormatError, match=r"index.json: unreadable index \(ValueError\)"):
        convert_checkpoint(ckpt, tmp_path / "out", progress=False)


def test_shard_header_dtype_with_a_newline(tmp_path, capsys):
    """convert/regression-shard-dtype-newline: safetensors' error quotes the header's dtype,
    and its newline went into our one line."""
    ckpt, _ = _checkpoint(tmp_path)
    shard = ckpt / "model.safetensors"
    data = shard.read_bytes()
    (hlen,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + hlen])
    header["model.layers.0.engram.embed.weight"]["dtype"] = "x\ny"
    blob = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + hlen :])
    with pytest.raises(TableFormatError, match=r"model.safetensors: not a readable safetensors file \(.*x\\ny") as e:
        convert_checkpoint(ckpt, tmp_path / "out", progress=False)
    assert "\n" not in str(e.value)
    _one_line_exit_2(capsys, ["tables", "convert", str(ckpt), str(tmp_path / "out")], str(shard))
