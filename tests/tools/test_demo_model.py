"""`engram-sglang demo-model DIR`: what it writes, and that its Engram matters."""

from __future__ import annotations

import argparse
import hashlib
import json

import pytest

from engram_sglang import EngramConfig, EngramError
from engram_sglang.core.config import DEFAULT_TABLE_DIR
from engram_sglang.core.tablefile import open_tables, verify_tables
from engram_sglang.tools.demo.model import DEMO_PROMPTS, add_parser, build_demo_model
from tests.support.demo_support import demo_dir, reference, table_dir

NEW_TOKENS = 16


def test_writes_a_qwen3_engram_model_with_packed_tables(tmp_path):
    d = demo_dir()
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["Qwen3EngramForCausalLM"] and config["model_type"] == "qwen3"
    cfg = EngramConfig.from_pretrained(d)
    assert cfg.layer_ids == (1, 3) and cfg.hash_columns == 12
    # The tables were built for exactly this config (fingerprint) and every chunk checks out.
    assert verify_tables(table_dir(), cfg, progress=False) == {1: cfg.num_embeddings[0], 3: cfg.num_embeddings[1]}
    assert set(open_tables(table_dir(), cfg)) == {1, 3}
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file()
    # They record the checkpoint, which the Engram-off copy the demo serves from them shares.
    from engram_sglang.core.tablefile import checkpoint_hash, read_manifest
    from engram_sglang.tools.demo.serve import engram_off_model

    recorded = read_manifest(table_dir())[0]["provenance"]["checkpoint_sha256"]
    assert recorded == checkpoint_hash(d)[0] == checkpoint_hash(engram_off_model(d, tmp_path / "off"))[0]


@pytest.mark.slow
def test_zeroing_engram_changes_every_demo_completion():
    """The demo model's completions come from its Engram rows: with the Engram output
    zeroed, greedy decoding of every demo prompt gives other tokens."""
    on, off = reference(1.0), reference(0.0)
    for prompt in DEMO_PROMPTS:
        ids = on.tokenizer(prompt)["input_ids"]
        with_engram, _ = on.generate(ids, NEW_TOKENS)
        without, _ = off.generate(ids, NEW_TOKENS)
        assert with_engram != without, prompt


@pytest.mark.slow
def test_build_is_deterministic(tmp_path):
    """A second build gives the same weights, tokenizer and tables, byte for byte."""
    again = build_demo_model(tmp_path / "again")

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("config.json", "model.safetensors", "tokenizer.json", f"{DEFAULT_TABLE_DIR}/layer-1.rows",
                 f"{DEFAULT_TABLE_DIR}/layer-3.rows"):
        assert digest(again / name) == digest(demo_dir() / name), name


def test_refuses_to_overwrite_and_cli_parser(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(EngramError, match="exists and is not empty; pass --overwrite"):
        build_demo_model(tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo-model", str(tmp_path / "y"), "--overwrite"])
    assert args.out_dir == str(tmp_path / "y") and args.overwrite and callable(args.func)


# ------------------------------------------------------------ targets it cannot write: one line, nothing left
class _Run:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


@pytest.fixture
def _demo_model_cli(capsys):
    from engram_sglang.tools.cli import main

    def run(target):
        try:
            code = main(["demo-model", str(target)])
        except Exception as e:  # a traceback in a real run
            code = repr(e)
        return _Run(code, capsys.readouterr().err)
    return run


def _one_line(run):
    assert run.returncode == 2 and run.stderr.count("\n") == 1, (run.returncode, run.stderr)
    return run.stderr


def test_onto_a_file_is_one_line(tmp_path, _demo_model_cli):
    (tmp_path / "f").write_text("x")
    assert "exists and is not a directory" in _one_line(_demo_model_cli(tmp_path / "f"))
    assert "is not a directory" in _one_line(_demo_model_cli(tmp_path / "f" / "model"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where it cannot be mounted), unmounted afterwards."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_read_only_filesystem_is_one_line_and_nothing_left(tiny_tmpfs, _demo_model_cli):
    import subprocess

    if subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], capture_output=True).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")
    assert "not writable" in _one_line(_demo_model_cli(tiny_tmpfs / "model"))
    assert list(tiny_tmpfs.iterdir()) == []


def test_a_full_filesystem_is_one_line_and_nothing_left(tiny_tmpfs, _demo_model_cli):
    assert "No space left on device" in _one_line(_demo_model_cli(tiny_tmpfs / "model"))
    assert list(tiny_tmpfs.iterdir()) == []  # no partial model directory, no hidden sibling
