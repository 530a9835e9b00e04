"""Opening a model's EngramRuntime at start-up: the one path both model families take.

The Qwen3 Engram family (models/qwen3_engram.py) opens one runtime per model and hashes with
our NgramHasher over the served tokenizer. DeepSeek-V4.1 (models/deepseek_v4_hook.py) opens one
per process, which every Engram layer finds again, and hashes with upstream's EngramHasher
(attached later: `EngramRuntime.use_hasher`); its ranks may run attention data or context
parallelism (`rank_rows`). Both check the checkpoint the tables record against the model
directory (`check_provenance`), open the stores here, refuse what a CUDA graph or the ranks'
tokens cannot serve, and log a configuration error as one line before raising it: the line says
what to fix, and the plugin ends a scheduler that fails so with it and exit status 2 instead of
SGLang's traceback (serving/startup_exit.py).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Optional

import torch

from ..core.config import DEFAULT_TABLE_DIR, EngramConfig
from ..core.errors import EngramConfigError, EngramError
from .runtime import EngramRuntime, active_runtimes
from .settings import ServeSettings

logger = logging.getLogger(__name__)


def resolve_table_dir(settings: ServeSettings, model_path: Optional[str], *, required: bool = True) -> Optional[Path]:
    """The packed table directory: --engram-table-dir (ENGRAM_TABLE_DIR), else
    MODEL_PATH/DEFAULT_TABLE_DIR. `required` (only our stores can serve the model's tables):
    that default whether it exists or not (opening it says what is missing), refused without
    a model path. Else (a checkpoint that may carry its own tables): None where it is absent."""
    if settings.table_dir:
        path = Path(settings.table_dir)
        if path.exists() and not path.is_dir():  # a file or FIFO: "does not exist" would mislead
            raise EngramError(f"--engram-table-dir {path} is not a directory: pass the packed table directory")
        return path
    default = Path(model_path) / DEFAULT_TABLE_DIR if model_path else None
    if not required:
        return default if default is not None and default.is_dir() else None
    if default is None:
        raise EngramError("no Engram table directory: set --engram-table-dir (or ENGRAM_TABLE_DIR)")
    return default


def open_runtime(settings: ServeSettings, *, parallel, table_dir: Optional[Path] = None,
                 model_path: Optional[str] = None, cfg: Optional[EngramConfig] = None,
                 tokenizer_path: Optional[str] = None, device=None, attention_parallel: bool = False,
                 per_process: bool = False) -> EngramRuntime:
    """A model's EngramRuntime, its configuration checked; an EngramError is logged as one line.

    Parameters
    ----------
    settings : the --engram-* settings.
    parallel : SGLang's parallel state (tp_rank, tp_size; attn_dp_size, attn_cp_size where
        `attention_parallel`).
    table_dir : the packed tables; None: `resolve_table_dir(settings, model_path)` (required).
    model_path : the served model's directory.
    cfg : the model's Engram config; None: MODEL_PATH/config.json's, else the tables' own.
    tokenizer_path : hash with our NgramHasher over this tokenizer (the runtime's StepHasher);
        None: the model brings its own hasher, attached once it exists.
    device : where rows are returned (None: torch's default device).
    attention_parallel : the model may run attention data or context parallelism, whose TP ranks
        hold different tokens: they read whole rows or exchange ids (`attention_rows`).
    per_process : one runtime per process for these tables, placement, device and ranks, found
        again by every later call (and by the model's hasher: its `hook_key`).
    """
    device = torch.device(device if device is not None else torch.get_default_device())
    try:
        how = attention_rows(settings, parallel) if attention_parallel else None
        tp_rank, tp_size = rank_rows(parallel, how)
        whole_rows = tp_size < parallel.tp_size  # the TP ranks hold different tokens: each reads whole rows
        context_parallel = how is not None and parallel.attn_cp_size > 1  # lookups of a slice of the prompt
        # Shards under attention DP/CP: "dp" exchanges every lookup's ids, "cp" a prompt slice's.
        exchange = None if how is None or whole_rows else ("dp" if parallel.attn_dp_size > 1 else "cp")
        table_dir = table_dir if table_dir is not None else resolve_table_dir(settings, model_path)
        key = (str(table_dir), settings.placement, str(device), tp_rank, tp_size)
        if per_process:
            for runtime in active_runtimes():
                if getattr(runtime, "hook_key", None) == key:
                    return runtime
        check_provenance(settings, table_dir, model_path)
        cfg = cfg if cfg is not None else _engram_config(model_path, table_dir)
        hasher = _ngram_hasher(cfg, tokenizer_path) if tokenizer_path is not None else None
        runtime = EngramRuntime(cfg, hasher, settings, table_dir, device, tp_rank=tp_rank, tp_size=tp_size)
        runtime.attention_rows, runtime.row_exchange = how, exchange
        try:
            _check_servable(runtime, settings, whole_rows=whole_rows, context_parallel=context_parallel)
        except EngramError:
            runtime.close()
            raise
    except EngramError as e:
        logger.error("engram-sglang: error: %s", e)
        raise
    if how is not None:
        logger.info("%s", attention_rows_line(settings, parallel, how))
    if per_process:
        runtime.hook_key = key  # found again by the next layer's factory call, and by the hasher's wrap
    runtime.context_parallel = context_parallel
    return runtime


def check_provenance(settings: ServeSettings, table_dir: Path, model_path: Optional[str]) -> None:
    """The checkpoint the tables' manifest records (core/tablefile/provenance.py) against the
    model directory's, before anything is opened: another checkpoint's tables would serve
    without a word. Nothing to compare without a model path or checkpoint files there."""
    from ..core.tablefile import MANIFEST, checkpoint_hash, read_manifest

    if settings.skip_provenance or not model_path:
        return
    found = checkpoint_hash(model_path)
    if found is None:
        return
    recorded = read_manifest(table_dir)[0].get("provenance")
    if recorded is None:
        logger.warning("engram-sglang: %s records no checkpoint, so the tables are not checked against %s: record "
                       "it with `engram-sglang tables verify %s --model %s --record`",
                       table_dir / MANIFEST, model_path, table_dir, model_path)
        return
    if recorded["checkpoint_sha256"] != found[0]:
        raise EngramConfigError(
            f"{table_dir}: the tables were converted from checkpoint sha256 {recorded['checkpoint_sha256']} "
            f"({recorded['hashed']}), the model directory {model_path} has sha256 {found[0]} ({found[1]}): convert "
            f"the tables from {model_path} again, or start with --engram-skip-provenance (ENGRAM_SKIP_PROVENANCE=1) "
            f"to serve them anyway")


def _engram_config(model_path: Optional[str], table_dir: Path) -> EngramConfig:
    from ..core.tablefile import open_tables

    if model_path and (Path(model_path) / "config.json").is_file():
        return EngramConfig.from_pretrained(model_path)
    return open_tables(table_dir).config  # the tables' own config (tests, a model directory without one)


def _ngram_hasher(cfg: EngramConfig, tokenizer_path: str):
    from transformers import AutoTokenizer

    from ..core.hashing import NgramHasher

    return NgramHasher.from_tokenizer(cfg, AutoTokenizer.from_pretrained(tokenizer_path))


def _check_servable(runtime: EngramRuntime, settings: ServeSettings, *, whole_rows: bool,
                    context_parallel: bool) -> None:
    """What the opened stores cannot serve: under a CUDA graph (serving/graphs.py), and, where
    every rank reads whole rows, a private copy per rank or Engram modes on a prompt's slice."""
    from .graphs import check_capturable
    from .modes import modes_in_use

    check_write_target("--engram-trace", settings.trace)
    check_write_target("--engram-stats-file", runtime._stats_path)
    check_capturable(runtime.stores.values(), runtime.device, trace=settings.trace,
                     staged=runtime.staged is not None, modes=modes_in_use(settings))
    if modes_in_use(settings) and context_parallel:
        raise EngramError("Engram modes (--engram-mode, --engram-ablation) are not applied to a context-"
                          "parallel rank's slice of the prompt: start without attention context parallelism")
    if not whole_rows:
        return
    from ..core.placement_table import placement

    # A disk store holds no copy: reading whole rows costs it only its caches.
    private = sorted(L for L, s in runtime.stores.items()
                     if not s.node_shared and not placement(s.placement).whole_from_files)
    if private:
        # Each rank would keep a whole private copy: TP x the tables in anonymous memory.
        raise EngramError(
            f"attention data/context parallelism reads whole rows from the node's shared copy, but layer(s) "
            f"{private} fell back to a private copy ({settings.shm_dir} has too little free space, see the "
            f"warning above): give Docker --shm-size or --ipc=host, or free {settings.shm_dir}")


def check_write_target(flag: str, path) -> None:
    """Refuse at start-up a stats/trace target the first forward could not write: a missing or
    read-only directory, a full filesystem, or a target that is not a regular file (a FIFO
    would block the writer, a directory fails). Only stats, never opens: nothing can hang."""
    if not path:
        return
    path = Path(path)
    where = path.parent if str(path.parent) else Path(".")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise EngramError(f"{flag} {path}: cannot stat it ({e.strerror}): give a writable file path")
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise EngramError(f"{flag} {path} is {kind}: give a regular file path (or none)")
    if not where.is_dir():
        raise EngramError(f"{flag} {path}: directory {where} does not exist: create it or give another path")
    if not os.access(where, os.W_OK | os.X_OK) or (mode is not None and not os.access(path, os.W_OK)):
        raise EngramError(f"{flag} {path} is not writable: fix its permissions or give another path")
    if os.statvfs(where).f_bavail == 0:
        raise EngramError(f"{flag} {path}: the filesystem of {where} is full: free space or give another path")


def attention_rows(settings, parallel) -> Optional[str]:
    """How the placement serves ranks of one TP group that hold different tokens (attention
    data or context parallelism, TP > 1): the placement table's SHARED_COPY, FROM_FILES or
    EXCHANGE (core/placement_table.py `Placement.attention_rows`); None: the ranks hold the
    same tokens. Where the exchange cannot serve (`exchange_refused`) the disk tier reads whole
    rows from the files instead; a placement that cannot is refused in one line."""
    from ..core.placement_table import EXCHANGE, placement

    if parallel.tp_size == 1 or (parallel.attn_dp_size == 1 and parallel.attn_cp_size == 1):
        return None
    refused = exchange_refused(settings, parallel)
    # --engram-host-whole-rows auto counts as on with a shared copy: no collective at all.
    how = placement(settings.placement).attention_rows(settings.store_options(), refused and refused[0])
    if how == EXCHANGE and refused:
        raise EngramError(f"{refused[0]} with row shards ({settings.placement} placement) is not supported: "
                          f"{refused[1]}")
    return how


def exchange_refused(settings, parallel) -> Optional[tuple[str, str]]:
    """(why, what to do) where the id exchange cannot serve these attention DP/CP ranks: staged
    disk graphs (each rank's rows are read before a replay, which cannot wait for the other
    ranks' ids), attention DP and CP together, Engram modes on exchanged ids. None: it can."""
    from ..core.placement_table import placement
    from .modes import modes_in_use

    whole = ("serve whole rows: --engram-placement host --engram-host-shared on --engram-host-whole-rows on, or "
             "--engram-placement disk (every rank reads whole rows of its own tokens)")
    if settings.disk_graphs and placement(settings.placement).ids_visit_host:
        return ("--engram-disk-graphs on (each rank stages its own tokens' rows before a decode replay, which "
                "cannot wait for the other ranks' ids)", "start without --engram-disk-graphs")
    if parallel.attn_dp_size > 1 and parallel.attn_cp_size > 1:
        return (f"attention data and context parallelism together (attn-dp-size {parallel.attn_dp_size}, "
                f"attn-cp-size {parallel.attn_cp_size})", whole)
    if parallel.attn_dp_size > 1 and modes_in_use(settings):
        # Modes pick a step's tokens on each rank; an exchanged lookup reads every rank's ids as they come.
        return ("Engram modes (--engram-mode, --engram-ablation) on ids exchanged between attention data-parallel "
                "ranks", "start without them, or " + whole)
    return None


def attention_rows_line(settings, parallel, how: str) -> str:
    """The start-up line saying how this server's attention DP/CP ranks get their rows, and
    why the disk tier reads whole rows where it does (no exchange: `exchange_refused`)."""
    from ..core.placement_table import ATTENTION_ROWS_WHAT, FROM_FILES

    which = "data" if parallel.attn_dp_size > 1 else "context"
    line = (f"engram-sglang: attention {which} parallelism, {settings.placement} placement: rows by {how}: "
            f"{ATTENTION_ROWS_WHAT[how]}")
    refused = exchange_refused(settings, parallel) if how == FROM_FILES else None
    return line + (f"; not exchanged: {refused[0]}" if refused else "")


def rank_rows(parallel, how: Optional[str]) -> tuple[int, int]:
    """(tp_rank, tp_size) the runtime's stores shard rows over, given `how` the placement
    serves attention data or context parallelism (`attention_rows`; None: plain TP). One that
    gives every rank whole rows opens the tables whole (tp_size 1: no collective, whatever the
    other ranks hold); one that keeps shards keeps SGLang's TP ranks, and its ranks exchange
    ids (serving/row_exchange.py)."""
    from ..core.placement_table import EXCHANGE

    if how is None or how == EXCHANGE:
        return parallel.tp_rank, parallel.tp_size
    return 0, 1
