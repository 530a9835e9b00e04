"""Taking over DeepSeek-V4.1's Engram table lookup in SGLang (`sglang.srt.layers.engram`).

Upstream's `EngramEmbedding` holds each layer's table as two parameters (fp8 rows, e8m0
scales) that the checkpoint loader fills: 189 GiB read into device or host memory, with a
Triton kernel on CUDA and gfx950 and a slow torch path elsewhere (MI300X included). When a
packed table directory is configured (`--engram-table-dir`, or MODEL_PATH/engram_tables
exists), the plugin swaps in `StoreEngramEmbedding`: the same call
(`forward(indices, forward_batch, cp_all_tokens=...)` -> bf16 [*indices.shape, dim]), served
by our TableStore in the configured placement with our gather kernels, and the loader
skips the checkpoint's `.engram.embed.{weight,scale}` tensors. Everything else of upstream's
Engram (hashing, history, wkv, gate) is unchanged.

Prefetch: upstream hashes every Engram layer's ids once per step (`EngramHasher.forward`,
before the decoder layers). The hook wraps that call to start every served layer's gather
right away (`TableStore.prefetch`: a side stream on a GPU, a worker thread on the CPU), and
each layer's lookup waits on its own handle, so host and disk reads overlap the layers
before it. Not while a CUDA graph is being captured: there the lookup stays in the layer.
"""

from __future__ import annotations

import logging
import re
import weakref
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..errors import EngramError
from ..patching import wrap_method
from ..rowformat import ROW_VALUES

logger = logging.getLogger(__name__)

_EMBED_TENSOR = re.compile(r"(^|\.)engram\.embed\.(weight|scale)$")
_STORES: dict = {}
_EMBEDS: "weakref.WeakSet[StoreEngramEmbedding]" = weakref.WeakSet()  # this process's, for prefetch


class StoreEngramEmbedding(nn.Module):
    """Drop-in for upstream's EngramEmbedding, reading rows from a TableStore.

    Rows this rank's store does not hold come back as +0.0, so under tensor parallelism
    the all-reduce reassembles every row exactly (each row lives on one rank).
    """

    def __init__(self, num_embeddings: int, dim: int, layer_id: int, column_bounds: tuple[int, ...], *, store,
                 tp_size: int = 1, hash_index: Optional[int] = None, prefetch: bool = True):
        super().__init__()
        if store.rows != num_embeddings:
            raise EngramError(f"{store.path}: layer {layer_id} table has {store.rows} rows, the model's config wants "
                              f"{num_embeddings}; convert the tables again for this model")
        if dim != ROW_VALUES:
            raise EngramError(f"engram_head_dim is {dim}; packed tables hold {ROW_VALUES} values per row")
        self.dim, self.layer_id, self.store = dim, layer_id, store
        self.num_embeddings = num_embeddings
        self.row_start, row_end = store.row_range
        self.rows = row_end - self.row_start
        self.tp_size = tp_size
        # Upstream's staging and peer-shard paths stay off: our store does the reading.
        self.host_table = None
        self.peer = None
        self.staged_by_scheduler = False
        self.shared_host_table_without_ats = False
        # Prefetch: this layer's column of the step's hash ids, and the gather started for it.
        self.hash_index = hash_index if prefetch else None
        self._pending = None
        _EMBEDS.add(self)

    def finish_load(self, label: str) -> None:
        logger.info("engram %s: served by engram-sglang (%s)", label, self.store.describe())

    def new_rows(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.empty(*indices.shape, self.dim, dtype=torch.bfloat16, device=indices.device)

    def prefetch(self, indices: torch.Tensor) -> None:
        """Start the gather of this step's ids (a view of the step's hash ids)."""
        self.release_pending()
        self._pending = (indices, self.store.prefetch(indices))

    def release_pending(self) -> None:
        """Order a prefetch nobody will use before what comes next (see Prefetch.release)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].release()

    def forward(self, indices: torch.Tensor, forward_batch=None, *, cp_all_tokens: bool = False) -> torch.Tensor:
        pending = self._pending
        if pending is not None and indices.shape[0] and _same_view(pending[0], indices):
            self._pending = None
            rows = pending[1].wait()
        else:
            self.release_pending()
            if indices.shape[0] == 0:
                return self.new_rows(indices)
            rows = self.store.gather(indices)
        if self.tp_size > 1:
            from sglang.srt.distributed import tensor_model_parallel_all_reduce

            rows = tensor_model_parallel_all_reduce(rows)
        return rows


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b is the very view a prefetch was started for (same memory, shape, strides)."""
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def prefetch_step(hash_ids: torch.Tensor) -> int:
    """Start every served layer's gather for this step's hash ids [T, n_layers, cols];
    returns how many. A layer whose lookup then gets other ids (e.g. a context-parallel
    slice) gathers them itself; every step replaces what the previous one left."""
    capturing = hash_ids.is_cuda and torch.cuda.is_current_stream_capturing()
    started = 0
    for emb in list(_EMBEDS):
        emb.release_pending()
        if capturing or emb.hash_index is None or hash_ids.dim() != 3 or not hash_ids.shape[0]:
            continue
        if emb.hash_index < hash_ids.shape[1]:
            emb.prefetch(hash_ids[:, emb.hash_index])
            started += 1
    return started


def patch_engram_hasher(module) -> None:
    """Wrap upstream's `EngramHasher.forward` (the step's hashing) to prefetch every served
    layer's rows as soon as the ids exist. Subclasses with their own forward (our Qwen3
    family's StepHasher) are not affected."""

    def forward(original, self, input_ids, forward_batch, *args, **kwargs):
        hash_ids = original(self, input_ids, forward_batch, *args, **kwargs)
        if _EMBEDS:
            prefetch_step(hash_ids)
        return hash_ids

    wrap_method(module.EngramHasher, "forward", forward)


def open_layer_store(layer_id: int, *, settings=None, model_path: Optional[str] = None, device=None,
                     tp_rank: int = 0, tp_size: int = 1):
    """The TableStore of one Engram layer (every layer of the directory opened once per process),
    or None when no table directory is configured and MODEL_PATH/engram_tables is absent."""
    from ..config import EngramConfig
    from ..serving.graphs import check_capturable
    from ..serving.settings import ServeSettings
    from ..stores import open_store

    settings = settings or ServeSettings.from_env()
    if settings.table_dir:
        table_dir = Path(settings.table_dir)
    elif model_path and (Path(model_path) / "engram_tables").is_dir():
        table_dir = Path(model_path) / "engram_tables"
    else:
        return None
    device = torch.device(device if device is not None else torch.get_default_device())
    key = (str(table_dir), settings.placement, str(device), tp_rank, tp_size)
    if key not in _STORES:
        cfg = None
        if model_path and (Path(model_path) / "config.json").is_file():
            cfg = EngramConfig.from_pretrained(model_path)
        try:
            stores = open_store(table_dir, settings.placement, device, cfg=cfg, tp_rank=tp_rank, tp_size=tp_size,
                                backend=settings.backend, **settings.store_options())
            check_capturable(stores.values(), device)
        except EngramError as e:
            logger.error("engram-sglang: %s", e)
            raise
        _STORES[key] = stores
    stores = _STORES[key]
    if layer_id not in stores:
        raise EngramError(f"{table_dir}: no table for Engram layer {layer_id} (it holds layers {sorted(stores)})")
    return stores[layer_id]


def patch_engram_module(module) -> None:
    """Replace `EngramEmbedding` in sglang.srt.layers.engram by a factory that returns
    StoreEngramEmbedding when tables are configured, else upstream's own class."""
    upstream = module.EngramEmbedding
    if getattr(upstream, "_engram_sglang_factory", False):
        return

    def EngramEmbedding(num_embeddings, dim, layer_id, column_bounds):
        from sglang.srt.runtime_context import get_model, get_parallel

        try:
            model_path = get_model().model_path
        except (AttributeError, ValueError):
            model_path = None
        parallel = get_parallel()
        if parallel.tp_size > 1 and (parallel.attn_cp_size > 1 or parallel.attn_dp_size > 1):
            raise EngramError("engram-sglang serves DeepSeek-V4.1's tables with plain tensor parallelism; "
                              "attention CP/DP is not supported yet (drop --engram-table-dir to use upstream's)")
        store = open_layer_store(layer_id, model_path=model_path, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size)
        if store is None:
            return upstream(num_embeddings, dim, layer_id, column_bounds)
        from ..serving.settings import ServeSettings

        return StoreEngramEmbedding(num_embeddings, dim, layer_id, column_bounds, store=store, tp_size=parallel.tp_size,
                                    hash_index=_hash_index(layer_id, model_path),
                                    prefetch=ServeSettings.from_env().prefetch)

    EngramEmbedding._engram_sglang_factory = True
    EngramEmbedding.upstream = upstream
    module.EngramEmbedding = EngramEmbedding
    patch_engram_hasher(module)


def _hash_index(layer_id: int, model_path: Optional[str]) -> Optional[int]:
    """The layer's column of the hasher's output: its place in the config's engram_layer_ids
    (upstream's order); None (no prefetch) without a readable config."""
    from ..config import EngramConfig

    try:
        return EngramConfig.from_pretrained(model_path).layer_ids.index(layer_id) if model_path else None
    except (EngramError, OSError, ValueError):
        return None


def patch_deepseek_v4(module) -> None:
    """The loader skips `.engram.embed.{weight,scale}` when our store serves the tables."""

    def load_weights(original, self, weights, *args, **kwargs):
        if any(isinstance(m, StoreEngramEmbedding) for m in self.modules()):
            weights = ((name, w) for name, w in weights if not _EMBED_TENSOR.search(name))
        return original(self, weights, *args, **kwargs)

    wrap_method(module.DeepseekV4ForCausalLM, "load_weights", load_weights)
