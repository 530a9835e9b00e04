"""Nothing silent in the environment: an `ENGRAM_*` variable that is no knob and no declared
non-knob variable gets one warning naming the closest known one (once per process), and every
`ENGRAM_` name in the repository is declared (serving/settings.py), so a new one must be."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engram_sglang.serving import settings
from engram_sglang.serving.settings import KNOBS, NON_KNOB_VARIABLES, OTHER_NAMES, ServeSettings

ROOT = Path(__file__).resolve().parents[2]
# A whole ENGRAM_ name: not the tail of another (SGLANG_DSV41_ENGRAM_...), not a template's
# prefix (ENGRAM_FAULTS_%s_PROB).
NAME = re.compile(r"(?<![A-Za-z0-9_])ENGRAM_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its names are made-up misspellings


def test_a_misspelt_knob_is_warned_once_per_process_naming_the_knob():
    # A real process, its real environment: the settings are read twice (as the plugin and the
    # model do), the warning comes once, and the value is still the default (never a refusal).
    script = ("import logging; logging.basicConfig(format='%(levelname)s %(name)s %(message)s')\n"
              "from engram_sglang.serving.settings import ServeSettings\n"
              "print(ServeSettings.from_env().placement, ServeSettings.from_env().placement)\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")},
           "ENGRAM_PLACMENT": "host", "ENGRAM_FAULTS_SEED": "3", "ENGRAM_DISK_THREADS": "8"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["device", "device"]
    lines = [line for line in proc.stderr.splitlines() if "ENGRAM_" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("WARNING engram_sglang.serving.settings ignoring unknown environment variable(s) "
                               "ENGRAM_PLACMENT (did you mean ENGRAM_PLACEMENT?)"), lines[0]
    assert "ENGRAM_FAULTS_SEED" not in lines[0] and "ENGRAM_DISK_THREADS" not in lines[0]


def test_unknown_names_get_the_closest_known_one_or_none(monkeypatch, caplog):
    monkeypatch.setattr(settings, "_warned", set())
    env = {"ENGRAM_HOST_SHARD": "1", "ENGRAM_FAULT_SEED": "1", "ENGRAM_ZZZZZZZZZZZZ": "1", "ENGRAM_SHM_DIR": "/x",
           "ENGRAM_KERNELS_DIR": "/k", "PATH": "/bin", "SGLANG_DSV41_ENGRAM_HOST_TABLE": "1"}
    assert settings.unknown_variables(env) == {"ENGRAM_FAULT_SEED": "ENGRAM_FAULTS_SEED",
                                               "ENGRAM_HOST_SHARD": "ENGRAM_HOST_SHARED", "ENGRAM_ZZZZZZZZZZZZ": None}
    with caplog.at_level(logging.WARNING, logger=settings.__name__):
        ServeSettings.from_env(env)
        ServeSettings.from_env(env)  # once per process
        ServeSettings.from_env({**env, "ENGRAM_TRACEE": "t"})  # a new name: its own line
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "ENGRAM_HOST_SHARD (did you mean ENGRAM_HOST_SHARED?)" in messages[0]
    assert "ENGRAM_ZZZZZZZZZZZZ:" in messages[0] and "\n" not in messages[0]
    assert "ENGRAM_TRACEE (did you mean ENGRAM_TRACE?)" in messages[1] and "ENGRAM_HOST_SHARD" not in messages[1]


def repository_names() -> dict[str, str]:
    """Every ENGRAM_ name in the tracked files -> the first file it is in."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to walk")
    names: dict[str, str] = {}
    for rel in filter(None, files):
        if rel == THIS:
            continue
        path = ROOT / rel
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for name in NAME.findall(data.decode("utf-8", "replace")):
            names.setdefault(name, rel)
    return names


def test_every_engram_name_in_the_repository_is_declared():
    names = repository_names()
    assert "ENGRAM_PLACEMENT" in names and "ENGRAM_FAULTS_SEED" in names  # the walk sees the knobs and the rest
    knobs = {k.env for k in KNOBS}
    declared = knobs | set(NON_KNOB_VARIABLES) | set(OTHER_NAMES)
    undeclared = {n: f for n, f in names.items() if n not in declared}
    assert not undeclared, (
        f"ENGRAM_ name(s) on no list: {undeclared}; declare a variable read from the environment in "
        f"NON_KNOB_VARIABLES (or make it a knob), any other name in OTHER_NAMES (engram_sglang/serving/settings.py)")
    # Each declared once, and no declaration outlives its name.
    lists = [*knobs, *NON_KNOB_VARIABLES, *OTHER_NAMES]
    assert len(lists) == len(set(lists)), sorted(n for n in lists if lists.count(n) > 1)
    assert not set(NON_KNOB_VARIABLES) - set(names), "declared but in no file: " + str(
        sorted(set(NON_KNOB_VARIABLES) - set(names)))
    assert not set(OTHER_NAMES) - set(names), "declared but in no file: " + str(sorted(set(OTHER_NAMES) - set(names)))
