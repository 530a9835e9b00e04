"""The operators' CLI on real files, and the SGLang plugin entry point's registration."""

from __future__ import annotations

import json
import os
import re
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


def test_verify_checks_and_records_the_checkpoint(tmp_path, rng, capsys):
    """`tables verify --model DIR`: the checkpoint the manifest records against DIR's, a mismatch
    exit 2; `--record` writes DIR's into it (tables converted before it was recorded)."""
    from engram_sglang.core.config import DEFAULT_TABLE_DIR
    from engram_sglang.core.tablefile import checkpoint_hash, read_manifest

    ckpt, _ = checkpoint(tmp_path, rng)
    out = ckpt / DEFAULT_TABLE_DIR  # the model's own: --model alone finds it
    assert main(["tables", "convert", str(ckpt), str(out)]) == 0
    assert f"checkpoint sha256 {checkpoint_hash(ckpt)[0]} (safetensors headers), 1 shard(s)" in capsys.readouterr().out
    assert main(["tables", "verify", "--model", str(ckpt)]) == 0
    assert f"{out}: checkpoint matches {ckpt}" in capsys.readouterr().out
    # Another checkpoint of the same config (its shard holds one more tensor): exit 2, one line.
    other = tmp_path / "other"
    shutil.copytree(ckpt, other, ignore=shutil.ignore_patterns(DEFAULT_TABLE_DIR))
    w, s = split(torch.zeros(EngramLayout(CFG).rows(2), ROW_BYTES, dtype=torch.uint8))
    save_file({"model.layers.2.engram.embed.weight": w, "model.layers.2.engram.embed.scale": s,
               "lm_head.weight": torch.zeros(2)}, other / "model.safetensors")
    assert main(["tables", "verify", str(out), "--model", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and checkpoint_hash(ckpt)[0] in err and checkpoint_hash(other)[0] in err, err
    # --record vouches for it: the manifest then names `other`, and verify agrees.
    before = {p.name: p.read_bytes() for p in out.glob("layer-*")}
    assert main(["tables", "verify", str(out), "--model", str(other), "--record"]) == 0
    assert f"recorded checkpoint sha256 {checkpoint_hash(other)[0]}" in capsys.readouterr().out
    assert read_manifest(out)[0]["provenance"]["checkpoint_sha256"] == checkpoint_hash(other)[0]
    assert {p.name: p.read_bytes() for p in out.glob("layer-*")} == before
    assert main(["tables", "verify", str(out), "--model", str(other)]) == 0
    # Corrupt rows are never vouched for: the checksums are checked before anything is recorded.
    manifest = (out / MANIFEST).read_bytes()
    layer = out / layer_file_name(2)
    raw = bytearray(layer.read_bytes())
    raw[-1] ^= 0xFF
    layer.write_bytes(bytes(raw))
    assert main(["tables", "verify", str(out), "--model", str(ckpt), "--record"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err and (out / MANIFEST).read_bytes() == manifest


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
    """`make demo` with one placement (it serves three; the placements' agreement is
    tests/e2e/test_e2e_serving.py's): builds the demo model, serves it with real SGLang
    (tables on disk, and with Engram off), all prompts at once, prints tokens/s and per-step
    costs, Engram on vs off, agrees with the reference, stops the servers."""
    import os
    import re

    assert main(["demo", "--workdir", str(tmp_path), "--placements", "disk"]) == 0
    out = capsys.readouterr().out
    assert "total 188.83 GiB" in out and "TP4 47.21" in out
    assert "Engram tables placement disk, and once with Engram off" in out and "servers stopped" in out
    assert "8 prompts served at once, 32 new tokens each" in out
    for name in ("disk", r"off \(device\)"):  # tokens/s, step, Engram, wait, gather, layer, load
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
    table_dir("provenance-str", manifest(lambda m: {**m, "provenance": "x"}))
    table_dir("provenance-sha", manifest(lambda m: {**m, "provenance": {**m["provenance"], "checkpoint_sha256": 1}}))
    cases.append(("verify neither dir nor --model", ["tables", "verify"]))
    cases.append(("verify --record without --model", ["tables", "verify", str(good), "--record"]))
    cases.append(("verify --model of a dir without config.json", ["tables", "verify", str(good), "--model", str(tmp_path)]))
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


# ------------------------------------------ standard output: /dev/full and a closed pipe
def _leaf_commands(parser, prefix=()):
    """Every command of the parser as its words: ("tables", "convert"), ..., ("plan",)."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix}
    return {leaf for a in subs for name, p in a.choices.items() for leaf in _leaf_commands(p, prefix + (name,))}


def _table_dir(tmp_path):
    from tests.support.tables import random_table_dir

    return random_table_dir(tmp_path, CFG)[0]


def _fresh_shm_copy(tmp_path, n):
    d = tmp_path / f"shm-{n}"
    d.mkdir()
    (d / "engram-0123456789abcdef-layer2.rows").write_bytes(b"\0" * 4096)
    return ["--shm-dir", str(d), "engram-0123456789abcdef-layer2.rows"]


# A cheap run of each command that prints something, as argv(tmp_path, n) (n: a fresh name per
# run); `--help` where a real run starts servers or needs a model (demo, demo-model, profile,
# ablate, scan): argparse writes it before exiting, which the guard must flush and report too.
STDOUT_CASES = {
    ("tables", "convert"): lambda t, n: ["tables", "convert", str(checkpoint(t, torch.Generator().manual_seed(n))[0]
                                                                   if not (t / "ckpt").exists() else t / "ckpt"),
                                         str(t / f"converted-{n}")],
    ("tables", "verify"): lambda t, n: ["tables", "verify", str(_table_dir(t) if n == 0 else t / "t")],
    ("tables", "inspect"): lambda t, n: ["tables", "inspect", str(_table_dir(t) if n == 0 else t / "t")],
    ("shm", "ls"): lambda t, n: ["shm", "ls", "--shm-dir", str(t)],
    ("shm", "rm"): lambda t, n: ["shm", "rm", *_fresh_shm_copy(t, n)],
    ("shm", "prune"): lambda t, n: ["shm", "prune", "--dry-run", "--shm-dir", str(t)],
    ("demo",): lambda t, n: ["demo", "--help"],
    ("demo-model",): lambda t, n: ["demo-model", "--help"],
    ("plan",): lambda t, n: ["plan", "--model", "deepseek-v4.1-flash", "--gpu", "H200"],
    ("profile",): lambda t, n: ["profile", "--help"],
    ("ablate",): lambda t, n: ["ablate", "--help"],
    ("scan",): lambda t, n: ["scan", "--help"],
    (): lambda t, n: ["--help"],
}
CLI = [sys.executable, "-m", "engram_sglang.tools.cli"]


def _popen(cmd, stdout):
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)


def _into_dev_full(cmd):
    """Start `cmd` with its standard output on /dev/full (every write fails with ENOSPC)."""
    with open("/dev/full", "w") as full:
        return _popen(cmd, full)


def _into_closed_pipe(cmd):
    """Start `cmd` writing into a pipe whose only reader has left (as `| head -c0`)."""
    proc = _popen(cmd, subprocess.PIPE)
    proc.stdout.close()
    return proc


def _finish(proc):
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _check_dev_full(rc, err):
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and err.startswith("engram-sglang: error: cannot write to standard output: "), err
    assert "No space left on device" in err, err


def _check_closed_pipe(rc, err):
    assert rc == 141, (rc, err)  # 128 + SIGPIPE, the cli's EXIT_BROKEN_PIPE
    assert err == "", err  # no traceback, no "Exception ignored ... BrokenPipeError"


def test_every_command_has_a_stdout_case():
    from engram_sglang.tools.cli import build_parser

    assert _leaf_commands(build_parser()) == set(STDOUT_CASES) - {()}


def _main_on(stdout_file, argv):
    """main(argv) in this process with standard output on `stdout_file` (a real descriptor;
    None: as it is, pytest's capture)."""
    saved = sys.stdout
    sys.stdout = stdout_file or saved
    try:
        return main(argv)
    except SystemExit as e:  # --help: argparse exits after the guard flushed (or failed)
        return e.code or 0
    finally:
        sys.stdout = saved
        if stdout_file is not None:
            stdout_file.close()


def _closed_pipe_file():
    read, write = os.pipe()
    os.close(read)  # the reader left, as after `| head -1`: a write gets EPIPE (Python ignores SIGPIPE)
    return os.fdopen(write, "w")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", list(STDOUT_CASES), ids=lambda c: " ".join(c) or "engram-sglang")
def test_stdout_full_is_one_line_exit_2_and_closed_pipe_is_quiet_141(command, tmp_path, capsys):
    """Every command, in this process (cheap): its output on a real /dev/full and a real pipe
    without a reader. How the interpreter ends after it is checked below on three as processes."""
    from engram_sglang.tools.cli import EXIT_BROKEN_PIPE

    assert EXIT_BROKEN_PIPE == 141
    make = STDOUT_CASES[command]
    # The case prints when stdout can be written: the failures below are the guard's, not the case's.
    assert _main_on(None, make(tmp_path, 0)) == 0
    ok = capsys.readouterr()
    assert ok.out.strip(), ok.err
    assert _main_on(open("/dev/full", "w"), make(tmp_path, 1)) == 2
    _check_dev_full(2, capsys.readouterr().err)
    assert _main_on(_closed_pipe_file(), make(tmp_path, 2)) == 141
    _check_closed_pipe(141, capsys.readouterr().err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", [(), ("plan",), ("tables", "convert")], ids=lambda c: " ".join(c) or "engram-sglang")
def test_as_a_process_stdout_full_is_one_line_exit_2_and_closed_pipe_is_quiet_141(command, tmp_path):
    """The same as real processes: nothing buffered fails again at the interpreter's exit (a
    second message, exit 120, "Exception ignored ... BrokenPipeError"). --help (no torch), one
    command that prints a report, one that writes files."""
    make = STDOUT_CASES[command]
    ok = subprocess.run(CLI + make(tmp_path, 0), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip(), (ok.returncode, ok.stderr)
    full, pipe = _into_dev_full(CLI + make(tmp_path, 1)), _into_closed_pipe(CLI + make(tmp_path, 2))
    _check_dev_full(*_finish(full))
    _check_closed_pipe(*_finish(pipe))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_checks_fail_a_plain_print_without_the_guard():
    """Negative control: Python's own behaviour, which the checks above must reject."""
    plain = [sys.executable, "-c", "import time; time.sleep(0.3); print('x' * 100000)"]
    rc, err = _finish(_into_dev_full(plain))
    assert rc == 1 and "Traceback" in err and "OSError: [Errno 28]" in err, (rc, err)
    with pytest.raises(AssertionError):
        _check_dev_full(rc, err)
    rc, err = _finish(_into_closed_pipe(plain))
    assert rc == 1 and "BrokenPipeError" in err, (rc, err)
    with pytest.raises(AssertionError):
        _check_closed_pipe(rc, err)


class _FailingStdout:
    """An in-memory standard output whose writes fail with `error`, once `failing`."""

    def __init__(self, error):
        self.error, self.failing, self.text = error, True, ""

    def write(self, text):
        if self.failing:
            raise self.error
        self.text += text
        return len(text)

    def flush(self):
        pass


@pytest.mark.parametrize("error, code", [(BrokenPipeError(32, "Broken pipe"), 141),
                                         (OSError(5, "Input/output error"), 2)])
def test_stdout_errors_in_process(tmp_path, monkeypatch, capsys, error, code):
    """The guard in main itself: the stream's error decides the exit, sys.stdout comes back."""
    fake = _FailingStdout(error)
    monkeypatch.setattr(sys, "stdout", fake)
    assert main(["shm", "ls", "--shm-dir", str(tmp_path)]) == code
    assert sys.stdout is fake
    err = capsys.readouterr().err
    assert err == ("" if code == 141 else "engram-sglang: error: cannot write to standard output: Input/output error\n")


def test_a_commands_own_oserror_is_not_taken_for_stdout(monkeypatch, capsys, tmp_path):
    """ENOSPC writing a table file, EPIPE on a server's socket: the command's errors, not stdout's."""
    import errno

    from engram_sglang.tools import cli

    for error in (OSError(errno.ENOSPC, "No space left on device"), BrokenPipeError(errno.EPIPE, "Broken pipe")):
        def fail(args, error=error):
            raise error

        monkeypatch.setattr(cli, "_cmd_inspect", fail)
        with pytest.raises(type(error)):
            main(["tables", "inspect", str(tmp_path)])
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------ start-up: no torch before a command runs
@pytest.mark.parametrize("argv", [["--help"], ["tables", "inspect"], ["scan"], ["no-such-command"]],
                         ids=lambda a: " ".join(a))
def test_help_and_usage_errors_do_not_import_torch(argv):
    code = ("import sys\nfrom engram_sglang.tools.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nsys.stderr.write('torch imported: %s\\n' % ('torch' in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stderr.endswith("torch imported: False\n"), proc.stderr


def test_lazy_commands_help_lines_are_their_modules():
    """The help line cli.py lists for a command imported on use is the one its add_parser gives."""
    import argparse
    import importlib

    from engram_sglang.tools import cli

    for name, (module, help_text) in cli.LAZY_COMMANDS.items():
        sub = argparse.ArgumentParser(prog="engram-sglang").add_subparsers()
        importlib.import_module(module, "engram_sglang.tools").add_parser(sub)
        (action,) = [a for a in sub._choices_actions if a.dest == name]
        assert action.help == help_text, name


# ------------------------------------------------------------ output targets: refused before the run
def _output_cases(t):
    """(argv, the target named in the one line) of unwritable output targets; the model does not
    exist, so a target found only after loading it (or at the end of the run) fails the case."""
    (t / "a-file").write_text("x")
    (t / "a-dir").mkdir()
    corpus = str(t / "a-file")
    nope = str(t / "no-model")
    return [
        (["profile", "--model", nope, corpus, "--out", str(t / "a-file" / "x.npz")], "--out"),
        (["profile", "--model", nope, corpus, "--out", str(t / "missing" / "d" / "x.npz")], "--out"),
        (["profile", "--model", nope, corpus, "--out", str(t / "a-dir")], "--out"),
        (["profile", "--model", nope, corpus, "--out", str(t / "x.npz"), "--trace", str(t / "a-dir")], "--trace"),
        (["scan", "--model", nope, corpus, "--gate-stats", str(t / "a-dir")], "--gate-stats"),
        (["scan", "--model", nope, corpus, "--json", str(t / "a-file" / "x.json")], "--json"),
        (["ablate", "--model", nope, "--domain", f"d={corpus}", "--png", str(t / "a-dir")], "--png"),
        (["ablate", "--model", nope, "--domain", f"d={corpus}", "--json", str(t / "missing" / "x.json")], "--json"),
    ]


def test_output_targets_are_checked_before_the_run(tmp_path, capsys):
    for argv, flag in _output_cases(tmp_path):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"engram-sglang: error: {flag} "), (argv, err)
    assert not (tmp_path / "missing").exists()  # profile --out under a missing directory made none
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"] and not any((tmp_path / "a-dir").iterdir())


def test_check_output_says_what_is_wrong(tmp_path):
    from engram_sglang.core.errors import EngramError
    from engram_sglang.tools.outputs import check_output

    (tmp_path / "f").write_text("x")
    assert check_output(tmp_path / "new.npz", "--out") == tmp_path / "new.npz"
    assert check_output(tmp_path / "d" / "e" / "m", "", directory=True, parents=True) == tmp_path / "d" / "e" / "m"
    for path, kw, want in ((tmp_path / "f" / "x", {}, f"{tmp_path / 'f'} is not a directory"),
                           (tmp_path / "f" / "s" / "x", {}, f"{tmp_path / 'f'} is not a directory"),
                           (tmp_path / "m" / "x", {}, f"no such directory {tmp_path / 'm'}"),
                           (tmp_path, {}, "is a directory"),
                           (tmp_path / "f", {"directory": True}, "exists and is not a directory")):
        with pytest.raises(EngramError, match=re.escape(want)):
            check_output(path, "--out", **kw)


# ------------------------------------------------------------ tables convert: the output path
def test_convert_into_dot_and_dotdot_paths_and_long_names(tmp_path, rng, monkeypatch, capsys):
    ckpt, rows = checkpoint(tmp_path, rng)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["tables", "convert", "../ckpt", "."]) == 0  # `.` is replaced: the summary reads what was written
    assert "layer   2:" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    assert main(["tables", "convert", str(ckpt), "./sub/../sub2"]) == 0  # no `sub`: the kernel cannot walk `..`
    assert "layer   2:" in capsys.readouterr().out and np.array_equal(open_tables(tmp_path / "sub2")[2], rows.numpy())
    for n in (235, 255):  # the longest names the filesystem takes; the hidden sibling must still fit
        assert main(["tables", "convert", str(ckpt), "t" * n]) == 0, capsys.readouterr().err
        assert np.array_equal(open_tables(tmp_path / ("t" * n))[2], rows.numpy())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no sibling left


def test_convert_under_a_file_says_it_is_not_a_directory(tmp_path, rng, capsys):
    ckpt, _ = checkpoint(tmp_path, rng)
    (tmp_path / "f").write_text("x")
    assert main(["tables", "convert", str(ckpt), str(tmp_path / "f" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'f'} is not a directory" in err and "File exists" not in err, err
