"""--engram-stats-file / --engram-trace targets are checked at start-up, in one line, never opened."""

import os
import types

import pytest

from engram_sglang.core.errors import EngramError
from engram_sglang.serving import startup
from engram_sglang.serving.startup import check_write_target


def test_a_new_or_regular_file_in_a_writable_dir_passes(tmp_path):
    check_write_target("--engram-trace", tmp_path / "new.jsonl")
    (tmp_path / "old.json").write_text("{}")
    check_write_target("--engram-stats-file", tmp_path / "old.json")
    check_write_target("--engram-trace", None)


@pytest.mark.parametrize("case, why", [("missing", "does not exist"), ("dir", "is a directory"),
                                       ("fifo", "is a FIFO")])
def test_bad_targets_are_refused_in_one_line(tmp_path, case, why):
    target = tmp_path / "t"
    if case == "missing":
        target = tmp_path / "nope" / "t"
    elif case == "dir":
        target.mkdir()
    else:
        os.mkfifo(target)  # must be refused without blocking (the test would hang otherwise)
    with pytest.raises(EngramError, match=f"^--engram-trace {target}.*{why}") as e:
        check_write_target("--engram-trace", target)
    assert "\n" not in str(e.value)


def test_a_full_filesystem_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(startup.os, "statvfs", lambda p: types.SimpleNamespace(f_bavail=0))
    with pytest.raises(EngramError, match="is full"):
        check_write_target("--engram-stats-file", tmp_path / "s.json")
