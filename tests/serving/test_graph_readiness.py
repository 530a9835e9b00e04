"""CUDA-graph readiness of the serving model, as far as a machine without a GPU can check it.

* Placements whose stores send row ids to the host (disk), and the per-step trace, keep
  SGLang's CUDA graphs off:
  the launcher adds the flags with one line, or refuses an explicit graph request with one
  line; the scheduler refuses when graphs are still on (GPU only: checked here with the
  phases given, and with a CUDA device that is never touched).
* The per-KV-slot conv caches are counted in the KV pool's per-token cost and allocated
  right after the pool (plugin hooks on SGLang's pool configurator and model runner), not
  on the first forward (which may be a graph capture).

What needs a GPU and is not run here: an actual CUDA-graph capture and replay of the model
(device and host placements), and the refusal firing inside a real scheduler on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from engram_sglang import plugin
from engram_sglang.core.errors import EngramConfigError, EngramError
from engram_sglang.plugin import server_args
from engram_sglang.serving.graphs import check_capturable, graph_args, placement_needs_host_ids
from engram_sglang.serving.launch import CPU_SHIM
from engram_sglang.serving.settings import KNOBS

OFF = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


@pytest.fixture
def clean_env(monkeypatch):
    for knob in KNOBS:  # setenv first: monkeypatch then removes what export_flags sets
        monkeypatch.setenv(knob.env, "")
        monkeypatch.delenv(knob.env)


def test_only_the_disk_placement_needs_host_ids():
    from engram_sglang.core.stores import DeviceStore, DiskStore, HostStore

    assert [placement_needs_host_ids(p) for p in ("device", "host", "disk")] == [False, False, True]
    assert (DeviceStore.needs_host_ids, HostStore.needs_host_ids, DiskStore.needs_host_ids) == (False, False, True)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_graph_capable_placements_leave_sglang_flags_alone(placement):
    assert graph_args(placement, ["--model-path", "m", "--cuda-graph-backend-decode", "full"]) == ([], None)


def test_disk_turns_graphs_off_with_one_line():
    extra, why = graph_args("disk", ["--model-path", "m"])
    assert extra == OFF
    assert "\n" not in why and why.startswith("--engram-placement disk reads each step's row ids on the host")
    assert why.endswith("CUDA graphs off (added " + " ".join(OFF) + ")")


def test_the_step_trace_turns_graphs_off_too():
    extra, why = graph_args("device", ["--model-path", "m"], trace="/tmp/t.jsonl")
    assert extra == OFF and why.startswith("--engram-trace writes each step's ids and rows from the host")
    with pytest.raises(EngramConfigError, match="drop --cuda-graph-backend-decode full"):
        graph_args("host", ["--cuda-graph-backend-decode", "full"], trace="/tmp/t.jsonl")
    with pytest.raises(EngramError, match="^--engram-trace writes"):
        check_capturable([_Store("device", False)], "cuda:0", phases=["decode"], trace="/tmp/t.jsonl")


@pytest.mark.parametrize("argv, extra", [
    (["--cuda-graph-backend-decode", "disabled"], OFF[2:]),
    (["--cuda-graph-backend-prefill=disabled"], OFF[:2]),
    (["--disable-decode-cuda-graph"], OFF[2:]),
    (["--disable-cuda-graph"], []),
    (OFF, []),
])
def test_disk_adds_only_what_is_missing(argv, extra):
    assert graph_args("disk", argv)[0] == extra


@pytest.mark.parametrize("argv, named", [
    (["--cuda-graph-backend-decode", "full"], "--cuda-graph-backend-decode full"),
    (["--cuda-graph-backend-prefill=breakable"], "--cuda-graph-backend-prefill breakable"),
    (["--cuda-graph-config", json.dumps({"decode": {"backend": "full", "max_bs": 8}})], "--cuda-graph-backend-decode full"),
])
def test_disk_refuses_an_explicit_graph_request_in_one_line(argv, named):
    with pytest.raises(EngramConfigError) as e:
        graph_args("disk", ["--model-path", "m", *argv])
    line = str(e.value)
    assert "\n" not in line and f"drop {named}" in line and "CUDA graphs must stay off" in line


def test_launcher_hook_adds_the_flags_and_says_so(clean_env, capsys):
    seen = {}

    def original(argv):
        seen["argv"] = argv
        return "server-args"

    assert server_args.prepare_server_args(original, ["--model-path", "m", "--engram-placement", "disk"]) == "server-args"
    assert seen["argv"] == ["--model-path", "m", "--engram-placement", "disk", *OFF]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("engram-sglang notice: --engram-placement disk reads")
    server_args.prepare_server_args(original, ["--model-path", "m", "--engram-placement", "host"])
    assert seen["argv"] == ["--model-path", "m", "--engram-placement", "host"]


def test_launcher_hook_refuses_with_exit_status_2(clean_env, capsys):
    with pytest.raises(SystemExit) as e:
        server_args.prepare_server_args(lambda argv: None, ["--engram-placement", "disk", "--cuda-graph-backend-decode", "full"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("engram-sglang: error: --engram-placement disk") and "drop --cuda-graph-backend-decode full" in err[0]


class _Store:
    def __init__(self, placement, needs_host_ids):
        self.placement, self.needs_host_ids = placement, needs_host_ids


def test_scheduler_refuses_host_id_stores_only_when_graphs_would_be_captured_on_a_gpu():
    disk, device = [_Store("disk", True)], [_Store("device", False)]
    check_capturable(disk, "cpu", phases=["decode"])  # no CUDA graphs on a CPU
    check_capturable(disk, "cuda:0", phases=[])  # graphs off
    check_capturable(device, "cuda:0", phases=["decode", "prefill"])  # capturable placement
    with pytest.raises(EngramError) as e:
        check_capturable(disk, "cuda:0", phases=["decode", "prefill"])
    line = str(e.value)
    assert "\n" not in line and line.startswith("placement disk reads each step's row ids on the host")
    assert line.endswith("--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled")


# ------------------------------------------------------- per-KV-slot state, eagerly
def test_pool_configurator_hook_adds_the_models_bytes_per_token():
    class DefaultPoolConfigurator:
        def _compute_cell_size(self, kvc, num_layers):
            return 100 * num_layers

    module = types.SimpleNamespace(DefaultPoolConfigurator=DefaultPoolConfigurator)
    plugin.patch(module, "sglang.srt.model_executor.pool_configurator")
    conf = DefaultPoolConfigurator()
    model = types.SimpleNamespace(engram_bytes_per_kv_token=lambda: 1024)
    assert conf._compute_cell_size(types.SimpleNamespace(model=model, is_draft_worker=False), 4) == 400 + 1024
    assert conf._compute_cell_size(types.SimpleNamespace(model=model, is_draft_worker=True), 4) == 400
    assert conf._compute_cell_size(types.SimpleNamespace(model=object()), 4) == 400


def test_model_runner_hook_allocates_after_the_pool():
    calls = []

    class ModelRunner:
        def _init_post_memory_pool_components(self):
            calls.append("sglang")

    module = types.SimpleNamespace(ModelRunner=ModelRunner)
    plugin.patch(module, "sglang.srt.model_executor.model_runner", only="ModelRunner._init_post_memory_pool_components")
    runner = ModelRunner()
    runner.token_to_kv_pool = "pool"
    runner.model = types.SimpleNamespace(init_engram_buffers=lambda pool: calls.append(("engram", pool)))
    runner._init_post_memory_pool_components()
    assert calls == ["sglang", ("engram", "pool")]
    runner.model = object()  # any other model: nothing more
    runner._init_post_memory_pool_components()
    assert calls[-1] == "sglang"


def test_the_hooks_target_what_sglang_calls():
    """The patched names exist in the installed SGLang, and the pool hook runs between the
    pool and the graphs (alloc_memory_pool -> _init_post_memory_pool_components, before
    init_attention_backends / init_cuda_graphs)."""
    import inspect

    from sglang.srt.model_executor import model_runner, pool_configurator

    assert callable(pool_configurator.DefaultPoolConfigurator._compute_cell_size)
    assert "_compute_cell_size" in inspect.getsource(pool_configurator.DefaultPoolConfigurator.__init__)
    assert "self._init_post_memory_pool_components()" in inspect.getsource(model_runner.ModelRunner.alloc_memory_pool)


def test_serving_layer_allocates_eagerly_and_counts_its_bytes():
    from engram_sglang.models.qwen3_engram import Qwen3EngramForCausalLM, ServingEngramLayer

    layer = ServingEngramLayer(64, 24, 256, 4)
    pool = types.SimpleNamespace(size=100, page_size=1)
    cache = layer.allocate_cache(ServingEngramLayer.cache_slots(pool), torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (102, 64) and cache.dtype == torch.bfloat16
    assert layer._conv_cache(torch.bfloat16, torch.device("cpu")) is cache  # no lazy allocation later

    # The model-level methods, on a stand-in holding two Engram layers and one plain layer.
    embed = torch.nn.Embedding(10, 64).to(torch.bfloat16)
    fake = types.SimpleNamespace(model=types.SimpleNamespace(
        embed_tokens=embed, layers=[types.SimpleNamespace(engram=ServingEngramLayer(64, 24, 256, 4), layer_id=0),
                                    types.SimpleNamespace(engram=None, layer_id=1),
                                    types.SimpleNamespace(engram=ServingEngramLayer(64, 24, 256, 4), layer_id=2)]),
        runtime=types.SimpleNamespace(pd_identity=lambda: b"tables"), settings=types.SimpleNamespace(debug=()))
    fake._engram_layers = types.MethodType(Qwen3EngramForCausalLM._engram_layers, fake)
    assert Qwen3EngramForCausalLM.engram_bytes_per_kv_token(fake) == 2 * 64 * 2
    Qwen3EngramForCausalLM.init_engram_buffers(fake, pool)
    caches = [layer.engram._cache for layer in fake.model.layers if layer.engram]
    assert [c.shape for c in caches] == [(102, 64), (102, 64)]
    # ... and registered with the pool for a PD transfer (serving/pd.py), by model layer id.
    from engram_sglang.serving import pd

    state = pd._STATES.pop(id(pool))
    assert state.conv == caches and state.layer_ids == [0, 2] and state.identity == b"tables"


# ------------------------------------------------------------ real SGLang, on the CPU
_RESOLVE = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args(sys.argv[1:])
sa.resolve_once()
c = resolving_view(sa).cuda_graph_config
print("RESOLVED", c.decode.backend, c.prefill.backend,
      sorted(k for k in sa._cuda_graph_config_locked if k[1] == "backend"))
"""


@pytest.mark.slow
def test_sglang_resolves_the_added_flags(tmp_path):
    """SGLang 0.5.23 parses the flags the plugin adds: both phases come out disabled *and*
    locked (set by a flag, so no later default turns them back on)."""
    from tests.support.demo_support import demo_dir

    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_")}
    env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(CPU_SHIM), env.get("PYTHONPATH")])))
    base = [sys.executable, "-c", _RESOLVE, "--model-path", str(demo_dir()), "--device", "cpu",
            "--attention-backend", "torch_native"]
    out = subprocess.run(base + ["--engram-placement", "disk"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESOLVED disabled disabled [('decode', 'backend'), ('prefill', 'backend')]" in out.stdout
    assert sum("engram-sglang notice: --engram-placement disk reads" in line for line in out.stderr.splitlines()) == 1
    out = subprocess.run(base + ["--engram-placement", "device"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "RESOLVED disabled disabled []" in out.stdout  # the CPU's own default, unlocked
    assert "engram-sglang notice" not in out.stderr


def test_launcher_refuses_the_nvidia_megakernel_where_our_tables_serve(clean_env, capsys, tmp_path):
    """Upstream's megakernel reads engram.embed.host_table itself: one line, exit status 2,
    where a table directory resolves; a model without our tables keeps the flag (control)."""
    seen = {}
    original = lambda argv: seen.setdefault("argv", argv)  # noqa: E731
    from engram_sglang.core.config import DEFAULT_TABLE_DIR

    model = tmp_path / "m"
    (model / DEFAULT_TABLE_DIR).mkdir(parents=True)
    for argv in (["--model-path", str(model), "--enable-nvidia-megakernel"],
                 ["--enable-nvidia-megakernel=true", "--engram-table-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            server_args.prepare_server_args(original, argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("engram-sglang: error: --enable-nvidia-megakernel reads "), err
        assert "drop --enable-nvidia-megakernel" in err[0]
    os.environ.pop("ENGRAM_TABLE_DIR", None)  # exported by the last launch (clean_env restores it)
    server_args.prepare_server_args(original, ["--model-path", str(tmp_path / "other"), "--enable-nvidia-megakernel"])
    assert seen["argv"][-1] == "--enable-nvidia-megakernel"
