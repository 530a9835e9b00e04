"""SGLang plugin entry point (group `sglang.srt.plugins`, name `engram`).

SGLang calls `load()` in every one of its processes (main, scheduler, detokenizer) before
it parses arguments. Loading stays cheap: nothing heavy is imported here; each patch is
applied when SGLang itself imports the module it patches (`_after_import`), so a
detokenizer never pays for the model registry. SGLang swallows exceptions raised while a
plugin loads, so configuration errors surface where the model and its tables are built.

Every SGLang attribute patched is declared beside its hook in the hooks module of this
package named after the SGLang module (`HOOKS`; each module's `TARGETS`, plugin/targets.py),
and checked when that module is imported, before any patch of it: a missing one (another
SGLang release) or a patch that fails stops the process with one line and exit status 2
(SystemExit, which SGLang's plugin loader does not catch), never a half-patched server.
Only this package patches SGLang (tests/test_architecture.py holds it to that).

What it installs (one hooks module each):
* `--engram-*` flags on SGLang's command line (shown by --help), each exported to its
  `ENGRAM_*` variable for the processes SGLang starts (server_args.py);
* the `Qwen3EngramForCausalLM` architecture in SGLang's model registry (model_registry.py);
* Engram table statistics in the scheduler's internal state (`/server_info` ->
  `internal_states[i]["engram"]`; internal_state.py);
* DeepSeek-V4.1's Engram table lookup served by an EngramRuntime (as the Qwen3 family's)
  when a table directory is configured, every layer's rows prefetched once upstream's
  hasher has run (engram_layer.py, deepseek_v4.py; models/deepseek_v4_hook.py);
* around each batch, in one order: its Engram modes recorded per request slot, the next
  prefill chunk read ahead into the disk tier's DRAM row cache, and the requests whose rows
  could not be read aborted afterwards (scheduler.py);
* an EngramError while a scheduler is built ends start-up with its one line, last, and exit
  status 2, not inside SGLang's traceback and SIGKILL of the tree (scheduler.py, engine.py;
  serving/startup_exit.py);
* a request's Engram mode checked where SGLang checks its sampling params (HTTP 400) and
  made part of its prefix-cache key (tokenizer_manager.py);
* a streamed `/generate` request checked so before its stream starts, so a bad one is HTTP
  400 as unstreamed (http_server.py);
* per-KV-slot Engram state (the conv inputs of Qwen3EngramForCausalLM) counted in the KV
  pool's per-token cost (pool_configurator.py) and allocated right after the pool, before
  CUDA-graph capture; the stores' host work (hot-row cache maintenance, statistics) after
  each forward step, outside any CUDA graph (model_runner.py);
* with `--engram-disk-graphs on`, decode graphs kept for disk: buffers reserved before SGLang's
  decode graphs are captured, each step's rows staged into them before the replay
  (decode_cuda_graph_runner.py);
* under PD disaggregation, the per-KV-slot conv inputs and the Engram identity registered as
  state components of SGLang's KV transfer on both sides, the transfer backend checked
  (disaggregation_prefill.py, disaggregation_decode.py; serving/pd.py);
* CUDA graphs off, with one line, for a placement that reads row ids on the host (disk)
  and for the per-step trace (server_args.py, serving/graphs.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from typing import Callable, Optional

logger = logging.getLogger(__name__)

_loaded = False

# SGLang module -> the hooks module of this package that patches it, in the order load()
# installs them. A hooks module declares its targets, each beside its hook, in TARGETS.
HOOKS = {
    "sglang.srt.server_args": "server_args",
    "sglang.srt.models.registry": "model_registry",
    "sglang.srt.managers.scheduler_components.internal_state": "internal_state",
    "sglang.srt.layers.engram": "engram_layer",
    "sglang.srt.models.deepseek_v4": "deepseek_v4",
    "sglang.srt.managers.scheduler": "scheduler",
    "sglang.srt.entrypoints.engine": "engine",
    "sglang.srt.managers.tokenizer_manager": "tokenizer_manager",
    "sglang.srt.entrypoints.http_server": "http_server",
    "sglang.srt.model_executor.pool_configurator": "pool_configurator",
    "sglang.srt.model_executor.model_runner": "model_runner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner": "decode_cuda_graph_runner",
    "sglang.srt.disaggregation.prefill": "disaggregation_prefill",
    "sglang.srt.disaggregation.decode": "disaggregation_decode",
}


def hooks_module(sglang_module: str):
    """The hooks module of this package that patches `sglang_module`."""
    return importlib.import_module(f"{__name__}.{HOOKS[sglang_module]}")


def all_targets() -> tuple:
    """Every target of every hooks module (imports them all: for checks and tests, not load())."""
    return tuple(t for name in HOOKS for t in hooks_module(name).TARGETS)


def load() -> None:
    """Install engram-sglang's hooks into this SGLang process (idempotent)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from .. import __version__

    _register_cli_hooks()
    for name in HOOKS:
        _after_import(name, patch)
    logger.info("engram-sglang %s plugin loaded", __version__)


def _register_cli_hooks() -> None:
    """The targets SGLang's own HookRegistry applies (the command line's)."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:  # an SGLang without the hook registry: ENGRAM_* variables still work
        logger.warning("engram-sglang: this SGLang has no plugin hook registry; use ENGRAM_* variables, not --engram-*")
        return
    types = {"hook-around": HookType.AROUND, "hook-after": HookType.AFTER}
    # Only the command line's module has such targets (tests/plugin/test_patch_targets.py checks).
    for target in hooks_module("sglang.srt.server_args").TARGETS:
        # The registry logs a hook it cannot apply and goes on: _apply checks the module's targets first.
        HookRegistry.register(target.name, target.hook, types[target.action])


def patch(module, sglang_module: Optional[str] = None, *, only: Optional[str] = None) -> None:
    """Patch `module` (SGLang's `sglang_module`, or a stand-in for it) with the targets of its
    hooks module (only the one whose attr is `only`, when given)."""
    from . import targets

    targets.apply(hooks_module(sglang_module or module.__name__).TARGETS, module, only=only)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch; everything else goes to the real loader."""

    def __init__(self, loader, patch: Callable, targets: Optional[tuple]):
        self._loader, self._patch, self._targets = loader, patch, targets

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _apply(self._patch, module, self._targets)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.patches: dict[str, tuple[Callable, Optional[tuple]]] = {}

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
            spec.loader = _PatchingLoader(spec.loader, *patch)
        return spec


_FINDER = _AfterImportFinder()


def _apply(patch: Callable, module, targets: Optional[tuple] = None) -> None:
    """Check every declared target of `module` (`targets`; by default its hooks module's), then
    patch it. A missing target or a failed patch stops the process: one line on stderr, exit
    status 2. Not an exception SGLang's loader swallows (it catches Exception) and not a log
    line: a server half patched would run upstream's Engram layer, which loads every table
    into GPU memory itself."""
    try:
        from . import targets as checks

        if targets is None:
            targets = hooks_module(module.__name__).TARGETS if module.__name__ in HOOKS else ()
        checks.check_module(module, targets)
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


def _after_import(module_name: str, patch: Callable, targets: Optional[tuple] = None) -> None:
    """Apply `patch(module)` once `module_name` is imported (now, if it already is), after
    checking its `targets` (by default those of its hooks module)."""
    module = sys.modules.get(module_name)
    if module is not None:
        _apply(patch, module, targets)
        return
    _FINDER.patches[module_name] = (patch, targets)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
