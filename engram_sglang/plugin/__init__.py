"""SGLang plugin entry point (group `sglang.srt.plugins`, name `engram`).

SGLang calls `load()` in every one of its processes (main, scheduler, detokenizer) before
it parses arguments. Loading stays cheap: nothing heavy is imported here; each patch is
applied when SGLang itself imports the module it patches (`_after_import`), so a
detokenizer never pays for the model registry. SGLang swallows exceptions raised while a
plugin loads, so configuration errors surface where the model and its tables are built.

Every SGLang attribute patched is declared in patching.TARGETS and checked when its module
is imported, before any patch of it: a missing one (another SGLang release) or a patch that
fails stops the process with one line and exit status 2 (SystemExit, which SGLang's plugin
loader does not catch), never a half-patched server.

What it installs:
* `--engram-*` flags on SGLang's command line (shown by --help), each exported to its
  `ENGRAM_*` variable for the processes SGLang starts (serving/settings.py);
* the `Qwen3EngramForCausalLM` architecture in SGLang's model registry;
* Engram table statistics in the scheduler's internal state (`/server_info` ->
  `internal_states[i]["engram"]`);
* DeepSeek-V4.1's Engram table lookup served by an EngramRuntime (as the Qwen3 family's)
  when a table directory is configured, every layer's rows prefetched once upstream's
  hasher has run (models/deepseek_v4_hook.py);
* read-ahead of a chunked prefill's next chunk into the disk tier's DRAM row cache
  (serving/readahead.py);
* Engram modes (serving/modes.py): a request's mode checked where SGLang checks its
  sampling params (HTTP 400) and made part of its prefix-cache key; each batch's modes
  recorded per request slot before it runs;
* per-KV-slot Engram state (the conv inputs of Qwen3EngramForCausalLM) counted in the KV
  pool's per-token cost and allocated right after the pool, before CUDA-graph capture;
* CUDA graphs off, with one line, for a placement that reads row ids on the host (disk)
  and for the per-step trace: serving/graphs.py;
* with `--engram-disk-graphs on`, decode graphs kept for disk: buffers reserved before SGLang's
  decode graphs are captured, each step's rows staged into them before the replay
  (serving/staged_rows.py);
* the stores' host work (hot-row cache maintenance, statistics) after each forward step,
  outside any CUDA graph (stores/maintenance.py).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Callable

from .targets import wrap_method

logger = logging.getLogger(__name__)

_loaded = False
ARCHITECTURE = "Qwen3EngramForCausalLM"


def load() -> None:
    """Install engram-sglang's hooks into this SGLang process (idempotent)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from .. import __version__

    _register_cli_hooks()
    _after_import("sglang.srt.models.registry", _register_model)
    _after_import("sglang.srt.managers.scheduler_components.internal_state", _report_internal_state)
    _after_import("sglang.srt.layers.engram", _take_over_deepseek_engram)
    _after_import("sglang.srt.models.deepseek_v4", _skip_deepseek_engram_tensors)
    _after_import("sglang.srt.managers.scheduler", _patch_scheduler)
    _after_import("sglang.srt.managers.tokenizer_manager", _check_engram_modes)
    _after_import("sglang.srt.model_executor.pool_configurator", _count_engram_bytes_per_kv_token)
    _after_import("sglang.srt.model_executor.model_runner", _patch_model_runner)
    _after_import("sglang.srt.model_executor.runner.decode_cuda_graph_runner", _stage_disk_rows_before_replays)
    logger.info("engram-sglang %s plugin loaded", __version__)


# ----------------------------------------------------------------- command line
def _register_cli_hooks() -> None:
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:  # an SGLang without the hook registry: ENGRAM_* variables still work
        logger.warning("engram-sglang: this SGLang has no plugin hook registry; use ENGRAM_* variables, not --engram-*")
        return
    HookRegistry.register("sglang.srt.server_args.prepare_server_args", _prepare_server_args, HookType.AROUND)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AFTER)
    # The registry logs a hook it cannot apply and goes on: check both targets first.
    _after_import("sglang.srt.server_args", _check_only)


def _check_only(module) -> None:
    """No patch of ours: _apply's check of the module's declared targets is the point."""


def _prepare_server_args(original, argv, *args, **kwargs):
    from ..core.errors import EngramError
    from ..serving.graphs import graph_args
    from ..serving.settings import ServeSettings, export_flags

    try:
        export_flags(list(argv))
        settings = ServeSettings.from_env()
        modes = (f"--engram-mode {settings.mode}" if settings.mode != "on"
                 else "--engram-ablation on" if settings.ablation else None)
        extra, why = graph_args(settings.placement, list(argv), trace=settings.trace, modes=modes,
                                disk_graphs=settings.disk_graphs)
    except EngramError as e:
        print(f"engram-sglang: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if extra:
        # Not "engram-sglang: ", which marks the line that says why start-up failed.
        print(f"engram-sglang notice: {why}", file=sys.stderr, flush=True)
        argv = list(argv) + extra
    return original(argv, *args, **kwargs)


def _add_cli_args(result, parser, *args, **kwargs):
    from ..serving.settings import add_arguments

    if "--engram-placement" not in getattr(parser, "_option_string_actions", {}):
        add_arguments(parser)
    return result


# ------------------------------------------------------------ lazy module patches
def _register_model(registry_module) -> None:
    from ..models.qwen3_engram import Qwen3EngramForCausalLM

    registry_module.ModelRegistry.models.setdefault(ARCHITECTURE, Qwen3EngramForCausalLM)


def _take_over_deepseek_engram(module) -> None:
    from ..models.deepseek_v4_hook import patch_engram_module

    patch_engram_module(module)


def _skip_deepseek_engram_tensors(module) -> None:
    from ..models.deepseek_v4_hook import patch_deepseek_v4

    patch_deepseek_v4(module)


def _patch_scheduler(module) -> None:
    from ..serving import modes, readahead

    readahead.patch_scheduler(module)
    modes.patch_scheduler(module)


def _check_engram_modes(module) -> None:
    from ..serving.modes import patch_tokenizer_manager

    patch_tokenizer_manager(module)


def _count_engram_bytes_per_kv_token(module) -> None:
    """SGLang sizes the KV pool as free memory / bytes per token: a model that keeps state
    per KV slot (Qwen3EngramForCausalLM's conv inputs) adds its bytes to that cost, so the
    pool and the state fit together."""
    said = set()  # SGLang builds the configurator more than once: one line per size

    def _compute_cell_size(original, self, kvc, num_layers):
        cell = original(self, kvc, num_layers)
        extra = getattr(getattr(kvc, "model", None), "engram_bytes_per_kv_token", None)
        if callable(extra) and not getattr(kvc, "is_draft_worker", False):
            add = int(extra())
            if add and (add, cell) not in said:
                said.add((add, cell))
                logger.info("engram KV sizing: each KV-cache token also holds %d B of Engram state (%d B with the KV)",
                            add, cell + add)
            cell += add
        return cell

    wrap_method(module.DefaultPoolConfigurator, "_compute_cell_size", _compute_cell_size)


def _allocate_engram_buffers_with_kv_pool(module) -> None:
    """Per-KV-slot Engram state is allocated once the KV pool exists: before the attention
    backends and before any CUDA graph is captured (never inside a capture)."""

    def _init_post_memory_pool_components(original, self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        init = getattr(getattr(self, "model", None), "init_engram_buffers", None)
        if callable(init):
            init(self.token_to_kv_pool)
        return out

    wrap_method(module.ModelRunner, "_init_post_memory_pool_components", _init_post_memory_pool_components)


def _stage_disk_rows_before_replays(module) -> None:
    """--engram-disk-graphs: the staged rows' buffers are made before the decode graphs are
    captured (sized for the largest), and filled before every replay (serving/staged_rows.py).
    A runtime without staged rows makes both a no-op."""

    def capture(original, self, *args, **kwargs):
        from ..serving import staged_rows

        staged_rows.reserve_for_capture(self.model_runner.model, self.max_bs * self.captured_req_width)
        return original(self, *args, **kwargs)

    def execute(original, self, forward_batch, *args, **kwargs):
        from ..serving import staged_rows

        staged_rows.stage_before_replay(self.model_runner.model, forward_batch)
        return original(self, forward_batch, *args, **kwargs)

    wrap_method(module.DecodeCudaGraphRunner, "capture", capture)
    wrap_method(module.DecodeCudaGraphRunner, "execute", execute)


def _patch_model_runner(module) -> None:
    _allocate_engram_buffers_with_kv_pool(module)
    _maintain_between_steps(module)


def _maintain_between_steps(module) -> None:
    """Host work of the stores (hot-row cache admission, statistics from device counters,
    the stats file) runs after each forward step, never inside it: `ModelRunner.forward`
    runs for eager and replayed steps alike and is never captured (SGLang captures the
    model's forward), so replays count and no capture ever syncs (stores/maintenance.py)."""

    def forward(original, self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        # Every store registers there when it opens: not imported yet, nothing to do (a
        # model without Engram layers never imports the stores).
        steps = sys.modules.get("engram_sglang.core.stores.maintenance")
        if steps is not None:
            steps.between_steps()
        return out

    wrap_method(module.ModelRunner, "forward", forward)


def _report_internal_state(module) -> None:
    def get_internal_state(original, self, recv_req):
        out = original(self, recv_req)
        from ..serving.runtime import active_runtimes

        runtimes = active_runtimes()
        if runtimes and isinstance(getattr(out, "internal_state", None), dict):
            out.internal_state["engram"] = runtimes[0].stats()
        return out

    wrap_method(module.SchedulerInternalStateController, "get_internal_state", get_internal_state)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch; everything else goes to the real loader."""

    def __init__(self, loader, patch: Callable):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _apply(self._patch, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.patches: dict[str, Callable] = {}

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            del self.patches[name]
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


_FINDER = _AfterImportFinder()


def _apply(patch: Callable, module) -> None:
    """Check every declared target of `module`, then patch it. A missing target or a failed
    patch stops the process: one line on stderr, exit status 2. Not an exception SGLang's
    loader swallows (it catches Exception) and not a log line: a server half patched would
    run upstream's Engram layer, which loads every table into GPU memory itself."""
    from .targets import check_module

    try:
        check_module(module)
        patch(module)
        logger.debug("engram-sglang patched %s", module.__name__)
    except Exception as e:
        from ..core.errors import PatchTargetMissing

        if isinstance(e, PatchTargetMissing):
            why = str(e)
        else:  # our bug, or an SGLang that changed under a target's name: the traceback helps
            logger.exception("engram-sglang: patching %s failed", module.__name__)
            why = f"patching {module.__name__} failed ({type(e).__name__}: {e}); the server would run half patched"
        print(f"engram-sglang: error: {why}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _after_import(module_name: str, patch: Callable) -> None:
    """Apply `patch(module)` once `module_name` is imported (now, if it already is)."""
    module = sys.modules.get(module_name)
    if module is not None:
        _apply(patch, module)
        return
    _FINDER.patches[module_name] = patch
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
