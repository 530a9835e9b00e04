"""Serving settings (`--engram-*` flags, `ENGRAM_*` variables) and the plugin's lazy patches."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types

import pytest

from engram_sglang import EngramConfigError
from engram_sglang.serving import settings
from engram_sglang.serving.settings import KNOBS, Knob, ServeSettings, add_arguments, export_flags


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
    ({"ENGRAM_DISK_RETRIES": "-1"}, "ENGRAM_DISK_RETRIES (--engram-disk-retries) must be >= 0, got -1"),
    ({"ENGRAM_HOST_NUMA": "1024"}, "ENGRAM_HOST_NUMA (--engram-host-numa) must be auto, interleave, off or a NUMA node "
                                   "number (0..1023), got '1024'"),
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


def _as_env(value) -> str:
    """A knob's value as its ENGRAM_* variable spells it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _disagreements(cls, knobs) -> list[str]:
    """Where a settings class and a knob table differ: field names (in order), types, defaults,
    and defaults the knob's own declaration (kind, bounds, choices) would refuse."""
    fields = dataclasses.fields(cls)
    out = [] if [f.name for f in fields] == [k.field for k in knobs] else ["fields differ from the knobs"]
    for f, k in zip(fields, knobs):
        if f.default != k.default or f.type != k.field_type:
            out.append(f"{f.name}: {f.type} = {f.default!r}, knob {k.flag}: {k.field_type} = {k.default!r}")
            continue
        try:
            taken = settings._parse(k, _as_env(k.default)) == k.default
        except EngramConfigError:
            taken = False
        if not taken:
            out.append(f"{k.flag}: default {k.default!r} is not a value the knob takes")
    return out


def test_settings_fields_are_the_knobs_name_for_name_and_default_for_default():
    assert _disagreements(ServeSettings, KNOBS) == []
    assert ServeSettings() == ServeSettings.from_env({})
    # Negative control: a hand-kept copy gone stale (a default changed, the last knob missing) is caught.
    stale = dataclasses.make_dataclass("Stale", [(k.field, k.field_type, dataclasses.field(
        default=32 if k.flag == "disk-threads" else k.default)) for k in KNOBS[:-1]], frozen=True)
    assert any("disk_threads" in d for d in _disagreements(stale, KNOBS))
    assert "fields differ from the knobs" in _disagreements(stale, KNOBS)
    # ... and so is a default outside its knob's own bounds.
    low = tuple(dataclasses.replace(k, low=65) if k.flag == "disk-threads" else k for k in KNOBS)
    assert _disagreements(ServeSettings, low) == ["disk-threads: default 64 is not a value the knob takes"]


def test_the_numa_bounds_are_stores_numa_s():
    from engram_sglang.core.stores import numa

    assert settings.NUMA_MODES == numa.MODES and settings.MAX_NUMA_NODES == numa.MAX_NODES
    knob = next(k for k in KNOBS if k.kind == "numa")
    assert (knob.choices, knob.low, knob.high) == (numa.MODES, 0, numa.MAX_NODES - 1)


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.kind == "int"], ids=lambda k: k.flag)
def test_an_int_knob_takes_its_bounds_and_refuses_one_past_them(knob):
    where = f"{knob.env} (--engram-{knob.flag})"
    edges = [knob.low] + ([knob.high] if knob.high is not None else [])
    for n in edges:
        assert getattr(ServeSettings.from_env({knob.env: str(n)}), knob.field) == n
    outside = [(knob.low - 1, f"{where} must be >= {knob.low}, got {knob.low - 1}")]
    if knob.high is not None:
        why = f" ({knob.high_why})" if knob.high_why else ""
        outside.append((knob.high + 1, f"{where} must be at most {knob.high}{why}, got {knob.high + 1}"))
    for n, message in outside:
        with pytest.raises(EngramConfigError) as e:
            ServeSettings.from_env({knob.env: str(n)})
        assert str(e.value) == message


def test_a_flag_out_of_its_bounds_is_refused_in_one_line_naming_the_flag_and_the_bound(monkeypatch):
    monkeypatch.delenv("ENGRAM_DISK_THREADS", raising=False)
    with pytest.raises(EngramConfigError) as e:
        export_flags(["--engram-disk-threads", "257"])
    assert str(e.value) == "ENGRAM_DISK_THREADS (--engram-disk-threads) must be at most 256 (reads in flight), got 257"
    assert "ENGRAM_DISK_THREADS" not in __import__("os").environ


def test_a_knob_added_to_the_table_alone_is_a_field_a_flag_a_variable_and_a_bound(monkeypatch):
    probe = Knob("probe-depth", "int", 3, "a knob for this test only", low=1, high=9, high_why="probe levels")
    assert not hasattr(ServeSettings(), "probe_depth")  # control: not a field before it is in the table
    knobs = KNOBS + (probe,)
    monkeypatch.setattr(settings, "KNOBS", knobs)
    monkeypatch.setattr(settings, "ServeSettings", settings._fields_from(knobs)(
        type("ServeSettings", (ServeSettings,), {})))
    monkeypatch.setenv(probe.env, "")
    monkeypatch.delenv(probe.env)  # setenv first: monkeypatch then removes what export_flags sets
    built = settings.ServeSettings
    assert _disagreements(built, knobs) == []
    assert built().probe_depth == 3 and built.from_env({"ENGRAM_PROBE_DEPTH": "5"}).probe_depth == 5
    with pytest.raises(EngramConfigError) as e:
        built.from_env({"ENGRAM_PROBE_DEPTH": "10"})
    assert str(e.value) == "ENGRAM_PROBE_DEPTH (--engram-probe-depth) must be at most 9 (probe levels), got 10"
    with pytest.raises(EngramConfigError, match=r"--engram-probe-depth\) must be >= 1, got 0"):
        export_flags(["--engram-probe-depth", "0"])
    assert export_flags(["--model-path", "m", "--engram-probe-depth", "4"]) == {"ENGRAM_PROBE_DEPTH": "4"}
    assert built.from_env().probe_depth == 4
    row = "| `--engram-probe-depth` | `ENGRAM_PROBE_DEPTH` | 3 | a knob for this test only |"
    assert row in settings.knobs_markdown()
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    assert "--engram-probe-depth" in parser.format_help()


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
