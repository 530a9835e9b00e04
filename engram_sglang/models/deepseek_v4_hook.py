"""Taking over DeepSeek-V4.1's Engram table lookup in SGLang (`sglang.srt.layers.engram`).

Upstream's `EngramEmbedding` holds each layer's table as two parameters (fp8 rows, e8m0
scales) that the checkpoint loader fills: 189 GiB read into device or host memory, with a
Triton kernel on CUDA and gfx950 and a slow torch path elsewhere (MI300X included). When a
packed table directory is configured (`--engram-table-dir`, or MODEL_PATH/engram_tables
exists), the plugin swaps in `StoreEngramEmbedding`: the same call
(`forward(indices, forward_batch, cp_all_tokens=...)` -> bf16 [*indices.shape, dim]), served
by the process's one `EngramRuntime` (serving/runtime.py), as for the Qwen3 family: its
stores in the configured placement, statistics in /server_info, --engram-trace, prefill
read-ahead, hot-row cache maintenance between steps, and faults that fail only the requests
that needed a row. The loader skips the checkpoint's `.engram.embed.{weight,scale}` tensors.
Everything else of upstream's Engram (wkv, gate) is unchanged.

Hashing stays upstream's: `EngramHasher.forward` (wrapped) computes the step's row ids with
the hash the checkpoint was trained with (image tokens, the CUDA hash kernels, MTP
target-verify blocks, its history commits), then hands them to the runtime
(`begin_step(..., hash_ids=...)`), which starts every layer's gather at once. Each layer's
lookup then asks the runtime for its rows and waits on its own gather. A lookup whose ids are
not the step's own is gathered as it comes: a context-parallel rank's slice of the prompt
(`cp_all_tokens`), or a lookup captured into a CUDA graph while the step's hashing ran
outside it (the prefill graph's eager hashing segment; a replay reads the graph's copy).
With the disk tier and `--engram-disk-graphs on`, decode graphs stay: before each replay the
step's ids are peeked over the hasher's history (decode and target-verify windows, upstream's
`hash_windows`: serving/history.py) and their rows staged into fixed buffers, which the
captured lookups read (serving/staged_rows.py); DSpark and encoder SWA bounded replay are
refused in one line (`staged_graphs_refusal`), an Engram layer in the late-layer tail at load.

Parallelism: under plain tensor parallelism a rank holds a shard of every table and the
runtime sums the rows over the TP ranks (their int32 view: exact on every vendor), or reads
whole rows where the placement's node copy allows it. Under attention data or context
parallelism the ranks of the TP group hold different tokens, so a plain sum would mix requests;
the placement table says what each placement does instead (`Placement.attention_rows`,
serving/startup.py `attention_rows`): the node's one shared host copy (`--engram-placement host
--engram-host-shared on`) gives every rank whole rows of its own tokens with no collective;
device, private host and disk shards exchange ids as upstream does (serving/row_exchange.py;
for disk, cheaper than whole rows at DP 2/4/8: docs/measurements.md section 13): per Engram layer, every
attention-DP rank's ids are gathered with SGLang's `dp_gather_replicate`, each rank reads the
rows its shard owns for all of them, and each rank's rows come back through an int32
reduce-scatter (or all-reduce and `dp_scatter`, as SGLang's padding mode allows); a context-
parallel prompt slice gathers the CP group's slices first. The exchange is per layer, not once
per step for all layers: every rank must issue the same collectives in the same order, and a
step's prefetch decision differs between ranks (an idle rank, an extend beside a decode, a
prefill graph), while every rank runs every Engram layer's lookup (upstream's contract), in a
CUDA graph too (host integers only: no sync). A disk read that fails on one rank still joins
the exchange, with a flag per token that reaches the rank owning it, which fails that request.
Where the exchange cannot serve (`exchange_refused`: `--engram-disk-graphs on`, whose staged rows
are read per rank before a replay that cannot wait for other ranks' ids; Engram modes; attention
DP and CP together) the disk tier reads whole rows of each rank's own tokens from the table
files (each rank its own DRAM cache), as the start-up line says; other shards are refused there
in one line.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from ..core.config import DEFAULT_TABLE_DIR
from ..core.errors import EngramError
from ..core.planning.graphs import unstaged_reason
from ..core.rowformat import ROW_VALUES

logger = logging.getLogger(__name__)

_EMBED_TENSOR = re.compile(r"(^|\.)engram\.embed\.(weight|scale)$")


class StoreEngramEmbedding(nn.Module):
    """Drop-in for upstream's EngramEmbedding: one layer's rows from the process's runtime."""

    def __init__(self, num_embeddings: int, dim: int, layer_id: int, column_bounds: tuple[int, ...], *, runtime):
        super().__init__()
        store = runtime.stores.get(layer_id)
        if store is None:
            raise EngramError(f"{runtime.table_dir}: no table for Engram layer {layer_id} "
                              f"(it holds layers {sorted(runtime.stores)})")
        if store.rows != num_embeddings:
            raise EngramError(f"{store.path}: layer {layer_id} table has {store.rows} rows, the model's config wants "
                              f"{num_embeddings}; convert the tables again for this model")
        if dim != ROW_VALUES:
            raise EngramError(f"engram_head_dim is {dim}; packed tables hold {ROW_VALUES} values per row")
        self.dim, self.layer_id, self.store = dim, layer_id, store
        self.runtime = runtime  # not a submodule: one runtime serves every layer
        self.num_embeddings = num_embeddings
        self.row_start, row_end = store.row_range
        self.rows = row_end - self.row_start
        self.tp_size = runtime.tp_size
        # Upstream's staging and peer-shard paths stay off: our store does the reading.
        self.host_table = None
        self.peer = None
        self.staged_by_scheduler = False
        self.shared_host_table_without_ats = False

    def finish_load(self, label: str) -> None:
        logger.info("engram %s: served by engram-sglang (%s)", label, self.store.describe())

    def new_rows(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.empty(*indices.shape, self.dim, dtype=torch.bfloat16, device=indices.device)

    def forward(self, indices: torch.Tensor, forward_batch=None, *, cp_all_tokens: bool = False) -> torch.Tensor:
        # cp_all_tokens: upstream hashed the whole prompt and hands this rank its slice.
        return self.runtime.layer_rows(self.layer_id, indices, slice_of_step=cp_all_tokens, forward_batch=forward_batch)


def begin_step_after_hashing(hasher, input_ids, forward_batch, hash_ids) -> None:
    """After upstream's `EngramHasher.forward` (the step's hashing; plugin/engram_layer.py):
    its ids begin the runtime's step, which starts every layer's gather right away."""
    runtime = runtime_of(hasher)
    if runtime is not None:
        runtime.begin_step(input_ids, forward_batch.positions, forward_batch, hash_ids=hash_ids,
                           prefetch=_layers_read_these_ids(runtime, forward_batch, in_breakable_cuda_graph()))


_BREAKABLE_GRAPH = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context"


@functools.cache
def in_breakable_cuda_graph():
    """SGLang's `is_in_breakable_cuda_graph` (whether a prefill graph is being captured or
    replayed), looked up once: when the plugin patches upstream's Engram module, so that an
    SGLang without it fails start-up in one line naming the module."""
    import importlib

    from ..serving.upstream import SGLANG_TESTED, sglang_version

    try:
        return importlib.import_module(_BREAKABLE_GRAPH).is_in_breakable_cuda_graph
    except (ImportError, AttributeError) as e:
        raise EngramError(f"engram-sglang needs {_BREAKABLE_GRAPH}.is_in_breakable_cuda_graph, which SGLang "
                          f"{sglang_version()} lacks ({e}); it was checked against SGLang {SGLANG_TESTED}") from None


def _layers_read_these_ids(runtime, forward_batch, in_breakable_graph) -> bool:
    """Whether the layers will look up the very ids the hasher returned (else a prefetch
    would read rows nobody uses): not in a context-parallel prefill (each rank keeps a slice),
    not in a prefill CUDA graph (the hashing runs eagerly, the lookups were captured), not in
    a capture (the step cannot reach the layers without Python state a replay would skip), not
    where shards exchange ids under attention DP (each layer reads every rank's ids)."""
    extend = forward_batch.forward_mode.is_extend()
    return not (runtime.capturing() or runtime.row_exchange == "dp"
                or extend and (runtime.context_parallel or in_breakable_graph()))


def runtime_of(hasher):
    """The runtime that serves the model of this upstream hasher (attaching the hasher to the
    process's runtime the first time), or None when upstream's own tables serve."""
    from ..serving.runtime import active_runtimes

    ours = [r for r in active_runtimes() if getattr(r, "hook_key", None) is not None]
    for runtime in ours:
        if runtime.step_hasher is hasher:
            return runtime
    waiting = [r for r in ours if r.step_hasher is None]
    if len(waiting) != 1 or waiting[0].capturing():  # (a capture changes no runtime's state)
        return None
    waiting[0].use_hasher(hasher)
    return waiting[0]


# Upstream's own DeepSeek-V4.1 table options (sglang/srt/environ.py), which our stores replace.
UPSTREAM_TABLE_VARS = {
    "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "--engram-placement host",
    "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "--engram-host-shared on (shared) or off (per_rank)",
    "SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING": "the plugin's prefill read-ahead (always on)",
    "SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS": "--engram-placement device (a row shard per rank)",
}
_FALSE = ("", "0", "false", "no", "off")
_said: set[str] = set()


def upstream_vars_set(env: Mapping[str, str]) -> list[str]:
    """Upstream's table variables that change what it does: a bool set true, a layout set at all."""
    return [v for v in UPSTREAM_TABLE_VARS
            if env.get(v) is not None and (env[v].strip().lower() not in _FALSE if "LAYOUT" not in v else env[v])]


def who_serves(settings, model_path: Optional[str], env: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """The start-up decision for DeepSeek-V4.1's tables (docs/deploy-deepseek.md's table): our
    table directory (our stores serve), or None (upstream's own tables serve, said in one line).
    Raises EngramError (one line) where a choice would be silent: one of our knobs set with no
    table directory found, ENGRAM_TABLE_DIR naming a missing directory, or upstream's table
    variables set while ours serve."""
    from ..serving.settings import KNOBS, ServeSettings
    from ..serving.startup import resolve_table_dir

    env = os.environ if env is None else env
    if settings.table_dir and not Path(settings.table_dir).exists():
        raise EngramError(f"ENGRAM_TABLE_DIR (--engram-table-dir) {settings.table_dir} does not exist: mount the "
                          f"converted tables there, or pass -e ENGRAM_TABLE_DIR= to serve upstream's own tables")
    table_dir = resolve_table_dir(settings, model_path, required=False)
    upstream = upstream_vars_set(env)
    if table_dir is not None:
        if upstream:
            raise EngramError(f"{upstream[0]} is upstream's own table option, which engram-sglang replaces when its "
                              f"tables ({table_dir}) serve: unset it (ours: {UPSTREAM_TABLE_VARS[upstream[0]]}), or "
                              f"pass -e ENGRAM_TABLE_DIR= and no --engram-* flag to serve upstream's tables")
        return table_dir
    defaults = ServeSettings()
    ours = [k.env for k in KNOBS if env.get(k.env) or getattr(settings, k.field) != getattr(defaults, k.field)]
    if ours:
        where = f"{Path(model_path) / DEFAULT_TABLE_DIR}" if model_path else "no model path"
        raise EngramError(f"{ours[0]} is set but no Engram table directory was found (ENGRAM_TABLE_DIR unset, "
                          f"{where} absent): convert the tables (engram-sglang convert) or unset the ENGRAM_* "
                          f"variables and --engram-* flags to serve upstream's own tables")
    line = ("engram-sglang: no table directory configured or in the model directory: upstream's own Engram tables "
            f"serve DeepSeek-V4.1 ({', '.join(upstream) + ' set' if upstream else 'loaded from the checkpoint'})")
    if line not in _said:
        _said.add(line)
        logger.warning(line)
    return None


def process_runtime(*, settings=None, model_path: Optional[str] = None, device=None, parallel=None):
    """This process's EngramRuntime for DeepSeek-V4.1's tables (opened on the first Engram
    layer, shared by the others: serving/startup.py), or None when no table directory is
    configured and the model directory has none (upstream's own tables serve)."""
    from ..serving.settings import ServeSettings
    from ..serving.startup import open_runtime

    settings = settings or ServeSettings.from_env()
    table_dir = who_serves(settings, model_path)
    if table_dir is None:
        return None
    if settings.disk_graphs:
        # Staged rows are filled before each replay from a peek at the step's ids over upstream's
        # hasher history (serving/history.py `SequenceHasher.peek_step`): decode and target-verify.
        why = unstaged_reason("deepseek_v4") or staged_graphs_refusal()
        if why:
            raise EngramError(f"--engram-disk-graphs on: {why}: start without it")
    # Upstream's hasher (tokenizer_path None), attached by `runtime_of`; attention DP/CP: `attention_rows`.
    return open_runtime(settings, parallel=parallel, table_dir=table_dir, model_path=model_path, device=device,
                        attention_parallel=True, per_process=True)


def staged_graphs_refusal(spec=None, features=None) -> Optional[str]:
    """Why this server's DeepSeek-V4.1 decode graphs cannot read staged rows (None: they can).
    Covered: decode and MTP/EAGLE target-verify steps (image tokens: upstream's hash_windows).
    Not covered: DSpark (its draft/verify commits Engram history its own way) and encoder SWA
    bounded replay (its graphs run the layers over request windows, not the step's tokens).
    `spec`, `features`: SGLang's published spec and exec.features namespaces (asked when None)."""
    if spec is None or features is None:
        from sglang.srt.runtime_context import get_exec, get_spec

        try:
            spec, features = get_spec(), get_exec().features
        except (AttributeError, RuntimeError, ValueError):  # nothing published: a module-level caller
            return None
    algorithm = str(getattr(spec, "speculative_algorithm", None) or "").upper()
    if "DSPARK" in algorithm:
        return "DSpark speculative decoding commits Engram history in its own draft and verify steps, which staged rows do not peek at"
    if getattr(features, "enable_encoder_swa_bounded_replay", False):
        return ("encoder SWA bounded replay (--enable-encoder-swa-bounded-replay) replays the layers over request "
                "windows, not the step's tokens")
    return None


def embedding_factory(upstream):
    """What replaces upstream's `EngramEmbedding` class (plugin/engram_layer.py): a factory that
    returns StoreEngramEmbedding when tables are configured, else upstream's own layer."""

    def EngramEmbedding(num_embeddings, dim, layer_id, column_bounds):
        from sglang.srt.runtime_context import get_model, get_parallel

        try:
            model_path = get_model().model_path
        except (AttributeError, ValueError):
            model_path = None
        runtime = process_runtime(model_path=model_path, parallel=get_parallel())
        if runtime is None:
            return upstream(num_embeddings, dim, layer_id, column_bounds)
        return StoreEngramEmbedding(num_embeddings, dim, layer_id, column_bounds, runtime=runtime)

    EngramEmbedding.upstream = upstream
    return EngramEmbedding


def load_weights(original, model, weights, *args, **kwargs):
    """DeepseekV4ForCausalLM.load_weights (plugin/deepseek_v4.py): the loader skips
    `.engram.embed.{weight,scale}` when our store serves the tables; the model's hasher is
    attached to the runtime once the weights are in (read-ahead hashes with it before the
    first forward)."""
    embeds = [m for m in model.modules() if isinstance(m, StoreEngramEmbedding)]
    if embeds:
        check_late_layer_tail(getattr(model, "model", None), embeds)  # before 286 GiB of weights
        weights = ((name, w) for name, w in weights if not _EMBED_TENSOR.search(name))
    out = original(model, weights, *args, **kwargs)
    hasher = getattr(getattr(model, "model", None), "engram_hasher", None)
    if embeds:
        # The decode graph runner's wraps find the runtime here (serving/staged_rows.py).
        model.engram_runtime = getattr(embeds[0], "runtime", None)
        if hasher is not None:
            runtime_of(hasher)
    return out


def check_late_layer_tail(model, embeds) -> None:
    """Decoder SWA bounded replay (upstream's default on CUDA and HIP) runs the layers from
    `late_layer_start` on over each request's last tokens only: an Engram layer there is
    handed `tail.rows(hash_ids)`, a subset of the step's ids, which the runtime gathers as
    they come, so Engram modes are not applied to them (a token with Engram off would read
    real rows there). Refused in one line, as for a context-parallel slice. (Upstream's CUDA
    tail graph asserts that no Engram layer is in the tail; HIP has no tail graph.)"""
    from ..serving.modes import modes_in_use

    late = getattr(model, "late_layer_start", None)
    if late is None:
        return
    runtime = embeds[0].runtime
    tail = sorted(e.layer_id for e in embeds if e.layer_id >= late)
    if tail and runtime.staged is not None:
        e = EngramError(f"--engram-disk-graphs on: decoder SWA bounded replay runs Engram layer(s) {tail} over each "
                        f"request's last tokens only (layers from {late} on), a subset of the step's staged rows: "
                        f"start SGLang with --no-enable-decoder-swa-bounded-replay, or without --engram-disk-graphs")
        logger.error("engram-sglang: error: %s", e)
        raise e
    if tail and modes_in_use(runtime.settings):
        e = EngramError(f"Engram modes (--engram-mode, --engram-ablation) are not applied to the late-layer tail of "
                        f"decoder SWA bounded replay (layers from {late} on), where Engram layer(s) {tail} run: start "
                        f"SGLang with --no-enable-decoder-swa-bounded-replay, or without Engram modes")
        logger.error("engram-sglang: error: %s", e)  # serving/launch.py ERROR_MARK: the launcher's failure line
        raise e
