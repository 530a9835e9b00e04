"""Serving settings (`--engram-*` flags, `ENGRAM_*` variables) and the plugin's lazy patches."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from engram_sglang import EngramConfigError
from engram_sglang.serving.settings import KNOBS, ServeSettings, add_arguments, export_flags


def test_defaults_and_environment():
    s = ServeSettings.from_env({})
    assert (s.placement, s.backend, s.prefetch, s.table_dir, s.debug) == ("device", "auto", True, None, ())
    assert s.store_options() == {}
    s = ServeSettings.from_env({"ENGRAM_PLACEMENT": "disk", "ENGRAM_DISK_THREADS": "8", "ENGRAM_DISK_DIRECT": "on",
                                "ENGRAM_PREFETCH": "0", "ENGRAM_DEBUG": "skip-wait"})
    assert s.store_options() == {"threads": 8, "direct": True, "retries": 2, "native_step": True}
    assert not s.prefetch and s.debug == ("skip-wait",)
    s = ServeSettings.from_env({"ENGRAM_PLACEMENT": "host", "ENGRAM_HOST_SHARED": "yes", "ENGRAM_HUGE_PAGES": "off"})
    assert s.store_options() == {"shared": True, "shm_dir": "/dev/shm", "huge_pages": False, "numa": "auto",
                                 "whole_rows": "auto"}  # resolved by the runtime (serving/whole_rows_auto.py)


@pytest.mark.parametrize("env, message", [
    ({"ENGRAM_PLACEMENT": "ssd"}, "ENGRAM_PLACEMENT (--engram-placement) must be one of device, host, disk, got 'ssd'"),
    ({"ENGRAM_DISK_THREADS": "many"}, "ENGRAM_DISK_THREADS (--engram-disk-threads) must be an integer, got 'many'"),
    ({"ENGRAM_DISK_THREADS": "0"}, "ENGRAM_DISK_THREADS (--engram-disk-threads) must be >= 1, got 0"),
    ({"ENGRAM_HOST_NUMA": "near"}, "ENGRAM_HOST_NUMA (--engram-host-numa) must be auto, interleave, off or a NUMA node "
                                   "number (0..1023), got 'near'"),
    ({"ENGRAM_HOST_NUMA": "-1"}, "ENGRAM_HOST_NUMA (--engram-host-numa) must be auto, interleave, off or a NUMA node "
                                 "number (0..1023), got '-1'"),
    ({"ENGRAM_DISK_THREADS": "2000"}, "ENGRAM_DISK_THREADS (--engram-disk-threads) must be at most 256 (reads in flight), got 2000"),
    ({"ENGRAM_HUGE_PAGES": "maybe"}, "ENGRAM_HUGE_PAGES (--engram-huge-pages) must be on/off"),
    ({"ENGRAM_DEBUG": "skip-wait,oops"}, "ENGRAM_DEBUG (--engram-debug): unknown value(s) oops"),
])
def test_bad_values_are_one_line(env, message):
    with pytest.raises(EngramConfigError) as e:
        ServeSettings.from_env(env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_flags_become_environment_for_the_processes_sglang_starts(monkeypatch):
    for knob in KNOBS:  # setenv first: monkeypatch then removes what export_flags sets
        monkeypatch.setenv(knob.env, "")
        monkeypatch.delenv(knob.env)
    argv = ["--model-path", "m", "--engram-placement", "host", "--engram-host-shared", "--port", "1",
            "--engram-table-dir", "/t"]
    exported = export_flags(argv)
    assert exported == {"ENGRAM_PLACEMENT": "host", "ENGRAM_HOST_SHARED": "1", "ENGRAM_TABLE_DIR": "/t"}
    s = ServeSettings.from_env()
    assert (s.placement, s.host_shared, s.table_dir) == ("host", True, "/t")
    with pytest.raises(EngramConfigError, match="ENGRAM_DISK_RETRIES"):
        export_flags(["--engram-disk-retries", "-1"])
    assert "ENGRAM_DISK_RETRIES" not in __import__("os").environ  # nothing exported on error


def test_every_knob_is_a_flag_with_its_variable_and_default_in_the_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for knob in KNOBS:
        assert f"--engram-{knob.flag}" in text and knob.env in text


def test_patches_apply_when_sglang_imports_the_module(tmp_path, monkeypatch):
    """The plugin patches modules when SGLang imports them, not at load: a stand-in module
    imported after registration gets patched once, one imported before is patched at once."""
    from engram_sglang import plugin

    (tmp_path / "engram_probe_mod.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    plugin._after_import("engram_probe_mod", lambda m: calls.append(m.value))
    assert calls == []
    import engram_probe_mod  # noqa: F401

    assert calls == [1]
    already = types.ModuleType("engram_probe_loaded")
    already.value = 2
    monkeypatch.setitem(sys.modules, "engram_probe_loaded", already)
    plugin._after_import("engram_probe_loaded", lambda m: calls.append(m.value))
    assert calls == [1, 2]
