"""The plugin refuses to run half patched: every SGLang attribute it patches is declared beside
its hook (the TARGETS of plugin/'s hooks module for that SGLang module), exists in the SGLang
it was checked against, and a missing one stops the process with one line naming it and the
SGLang version."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engram_sglang import plugin
from engram_sglang.plugin import targets as patching
from engram_sglang.plugin.targets import SGLANG_TESTED, Target

TARGETS = plugin.all_targets()

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "engram_sglang"


def test_every_patch_target_exists_in_the_installed_sglang():
    pytest.importorskip("sglang.srt.plugins", reason="needs SGLang (make setup)")
    assert patching.sglang_version() == SGLANG_TESTED, "the venv's SGLang is not the release the targets name"
    assert len(TARGETS) == 23  # the list below, so a target dropped from TARGETS shows up here
    names = sorted(t.name for t in TARGETS)
    assert names == sorted([
        "sglang.srt.server_args.prepare_server_args",
        "sglang.srt.server_args.ServerArgs.add_cli_args",
        "sglang.srt.models.registry.ModelRegistry.models",
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        "sglang.srt.layers.engram.EngramEmbedding",
        "sglang.srt.layers.engram.EngramHasher.forward",
        "sglang.srt.layers.engram.EngramHasher.hash_windows",
        "sglang.srt.models.deepseek_v4.DeepseekV4ForCausalLM.load_weights",
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "sglang.srt.entrypoints.engine._wait_for_scheduler_ready",
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_request",
        "sglang.srt.entrypoints.http_server.serve_generate_request",
        "sglang.srt.entrypoints.http_server._create_error_response",
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components",
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture",
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
        "sglang.srt.disaggregation.prefill.setup_state_kv_args",
        "sglang.srt.disaggregation.decode.setup_state_kv_args",
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums",
    ])
    assert sorted({t.module for t in TARGETS}) == sorted(plugin.HOOKS)
    for name in plugin.HOOKS:
        module = importlib.import_module(name)
        # The plugin may have wrapped them already in this process: they exist either way.
        assert patching.missing_targets(module, TARGETS) == [], name


def test_each_target_sits_in_the_hooks_module_of_its_sglang_module_with_its_hook():
    for name, hooks in plugin.HOOKS.items():
        module = plugin.hooks_module(name)
        assert module.__name__ == f"engram_sglang.plugin.{hooks}" and module.MODULE == name
        for t in module.TARGETS:
            assert t.module == name and (callable(t.hook) or t.action == "use" and t.hook is None), t
            if t.hook is not None:
                assert t.hook.__module__ == module.__name__, f"{t.name}: its hook lives in {t.hook.__module__}"
            # load() registers the HookRegistry targets of server_args alone.
            assert t.on_import or name == "sglang.srt.server_args", t


def test_scheduler_run_batch_is_wrapped_once_in_its_order(monkeypatch):
    """One wrapper of Scheduler.run_batch: modes recorded, read-ahead, the batch, then the fault
    abort (which used to run only inside the read-ahead wrapper)."""
    from types import SimpleNamespace

    from engram_sglang.plugin import scheduler
    from engram_sglang.serving import faults, modes, readahead

    order = []
    monkeypatch.setattr(scheduler, "_settings", ["settings"])
    monkeypatch.setattr(modes, "record_batch", lambda batch, settings: order.append(("modes", batch, settings)))
    monkeypatch.setattr(readahead, "read_ahead_next_chunk", lambda sched, batch: order.append(("read-ahead", batch)))
    monkeypatch.setattr(faults, "abort_failed_requests", lambda sched, batch: order.append(("abort", batch)))

    class Scheduler:
        def run_batch(self, batch):
            order.append(("run", batch))
            return "result"

    fake = SimpleNamespace(Scheduler=Scheduler)
    plugin.patch(fake, "sglang.srt.managers.scheduler")
    plugin.patch(fake, "sglang.srt.managers.scheduler")  # a plugin loaded twice wraps once
    assert Scheduler().run_batch("b") == "result"
    assert order == [("modes", "b", "settings"), ("read-ahead", "b"), ("run", "b"), ("abort", "b")]
    wrapped = [t for t in TARGETS if t.name.endswith("Scheduler.run_batch")]
    assert len(wrapped) == 1


def _patched_in_source() -> list[str]:
    """Every place the package patches SGLang by hand instead of through a declared Target:
    a `wrap_method(...)` call, a `module.X = ...` or setattr, a HookRegistry.register of a literal
    target (tests/test_architecture.py keeps all patching inside plugin/)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "plugin" and path.name in ("targets.py", "__init__.py"):
            continue  # the machinery that applies declared targets
        text = path.read_text()
        found += [f"{path.name}: {m}" for m in re.findall(r"wrap_method\([^)]*\)|^\s*module\.\w+ = |"
                                                        r"setattr\(module|HookRegistry\.register\(\"", text, re.M)]
    return found


def test_every_patch_in_the_source_is_a_declared_target():
    assert _patched_in_source() == []
    # The control: the scan sees a hand-made patch.
    fake = PACKAGE / "plugin" / "scheduler.py"
    text = fake.read_text() + "\n\ndef f(module):\n    wrap_method(module.Scheduler, 'run_batch', f)\n"
    assert re.findall(r"wrap_method\([^)]*\)", text) == ["wrap_method(module.Scheduler, 'run_batch', f)"]


def test_a_missing_target_stops_the_import_with_one_line(tmp_path, monkeypatch, capsys):
    """A stand-in module lacking a declared target: importing it exits 2 with one line, and
    the module's patch never runs (nothing half applied)."""
    (tmp_path / "engram_probe_target.py").write_text("class Thing:\n    def other(self):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ran = []
    plugin._after_import("engram_probe_target", ran.append, (Target("engram_probe_target", "Thing.run", "wrap"),))
    with pytest.raises(SystemExit) as exc:
        import engram_probe_target  # noqa: F401
    assert exc.value.code == 2 and ran == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0] == (f"engram-sglang: error: SGLang {patching.sglang_version()} has no engram_probe_target.Thing.run, "
                      f"which engram-sglang wraps: this engram-sglang was checked against SGLang {SGLANG_TESTED}; "
                      f"install that release (pip install sglang=={SGLANG_TESTED}) or an engram-sglang made for yours")
    sys.modules.pop("engram_probe_target", None)


def test_wrap_method_names_an_undeclared_missing_method():
    from engram_sglang.core.errors import PatchTargetMissing

    class Thing:
        pass

    with pytest.raises(PatchTargetMissing, match=r"has no .*Thing\.run, which engram-sglang wraps"):
        patching.wrap_method(Thing, "run", lambda original, self: None)


# SGLang's own plugin loader catches every Exception a plugin raises (and logs it): the
# refusal has to get through it. A stand-in for sglang.srt.layers.engram whose hasher has no
# forward (as if another release renamed it) is in sys.modules when SGLang loads the plugin.
LOADER = """
    import sys, types
    import sglang.srt.plugins as plugins

    fake = types.ModuleType("sglang.srt.layers.engram")
    class EngramHasher:  # no forward
        pass
    class EngramEmbedding:
        pass
    fake.EngramHasher, fake.EngramEmbedding = EngramHasher, EngramEmbedding
    sys.modules["sglang.srt.layers.engram"] = fake
    plugins.load_plugins()
    print("SERVED HALF PATCHED")
"""


def test_sglangs_plugin_loader_does_not_swallow_the_refusal():
    pytest.importorskip("sglang.srt.plugins", reason="needs SGLang (make setup)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SGLANG_PLUGINS": "engram"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(LOADER)], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert "SERVED HALF PATCHED" not in out.stdout, out.stderr[-2000:]
    assert out.returncode == 2, out.stderr[-2000:]
    ours = [ln for ln in out.stderr.splitlines() if ln.startswith("engram-sglang: error:")]
    assert ours == [f"engram-sglang: error: SGLang {SGLANG_TESTED} has no sglang.srt.layers.engram.EngramHasher.forward, "
                    f"which engram-sglang wraps: this engram-sglang was checked against SGLang {SGLANG_TESTED}; "
                    f"install that release (pip install sglang=={SGLANG_TESTED}) or an engram-sglang made for yours"]
