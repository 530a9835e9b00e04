"""What an Engram model needs at serving time, behind one object: `EngramRuntime`.

Per forward step: hash every token (decode look-backs from the per-request history that
SGLang's scheduler keeps, see `history.py`), issue every Engram layer's gather at once
(`TableStore.prefetch`), and hand each Engram layer its rows when it asks (`rows`, which
waits on that layer's own handle). The tables sit wherever the placement says; the model
never knows. Also: the start-up line per table, the per-step trace for tests, and the
statistics SGLang's /server_info reports (`internal_states[i]["engram"]`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import __version__
from ..core.config import EngramConfig
from ..core.errors import EngramError
from ..core.rowformat import row_checksums
from ..core.stores import maintenance
from ..core.stores.base import TableIOError
from ..core.stores.metrics import METRICS, RANKS
from . import pd
from .identity import agree_over_tp_group, serving_identity
from .modes import SLOTS
from .ranks import rank_labels, stats_path
from .row_exchange import context_rows, exact_sum_, exchange_rows
from .settings import ServeSettings

logger = logging.getLogger(__name__)

# Live runtimes of this process (the scheduler's), for the /server_info hook.
_RUNTIMES: "weakref.WeakSet[EngramRuntime]" = weakref.WeakSet()


def active_runtimes() -> list["EngramRuntime"]:
    return list(_RUNTIMES)


def agree_over_tp(flag: bool) -> bool:
    """True only if `flag` is true on every rank of SGLang's tensor-parallel group (the group
    `rows` all-reduces over), by one all-reduce over its CPU group at start-up."""
    from sglang.srt.distributed import get_tp_group

    # On the CPU explicitly: SGLang opens the stores under a torch.device("cuda") context, and
    # gloo (the CPU group) all-reduces host tensors only.
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device="cpu")
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return bool(value.item())


@dataclasses.dataclass
class EngramStep:
    """One forward step's lookups."""

    hash_ids: torch.Tensor  # int64 [T, n_layers, C]
    token_req: torch.Tensor  # int64 [T]: each token's request slot
    positions: torch.Tensor  # int64 [T]
    input_ids: torch.Tensor
    mode: str
    handles: dict  # layer id -> Prefetch (or None when prefetch is off)
    rows: dict = dataclasses.field(default_factory=dict)  # layer id -> rows the layer used
    windows: dict = dataclasses.field(default_factory=dict)  # layer id -> int64 [T, kernel] conv window sums
    wait_seconds: float = 0.0
    engram_seconds: float = 0.0  # time in the Engram layers, where the model does not time them (DeepSeek)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    captured: bool = False  # begun inside a CUDA-graph capture
    # Engram modes (serving/modes.py): bool [T], the tokens with Engram on, and the indices of
    # those tokens, whose rows alone are read; None when every token of the step is on.
    on: Optional[torch.Tensor] = None
    keep: Optional[torch.Tensor] = None
    # bool [T]: CUDA-graph padding tokens, whose ids reach no store as row ids (-1: +0 rows,
    # never counted nor admitted by a hot-row cache); None: the step has no padding to mask.
    padding: Optional[torch.Tensor] = None

    def read_ids(self, column: int) -> torch.Tensor:
        """The hash ids [K, C] of one layer that reach a store (the tokens with Engram on)."""
        ids = mask_padding(self.hash_ids[:, column], self.padding)
        return ids if self.keep is None else ids[self.keep]


def padding_tokens(token_req: torch.Tensor, forward_batch) -> Optional[torch.Tensor]:
    """bool [T] of a step's graph padding, on the device (no host sync, so a replay at a padded
    batch size masks its own padding): tokens of no request (slot -1, `step_tokens`) and
    decode rows SGLang pads with KV slot 0 (`out_cache_loc` 0, as history.py commits them)."""
    pad = token_req < 0
    out_loc = getattr(forward_batch, "out_cache_loc", None) if forward_batch is not None else None
    if isinstance(out_loc, torch.Tensor) and out_loc.shape == token_req.shape:
        pad = pad | (out_loc.to(pad.device) == 0)
    return pad


def mask_padding(ids: torch.Tensor, padding: Optional[torch.Tensor]) -> torch.Tensor:
    """`ids` [T, ...] with the padding tokens' ids -1 (outside every row range)."""
    if padding is None:
        return ids
    return ids.masked_fill(padding.view(-1, *([1] * (ids.dim() - 1))), -1)


def step_tokens(forward_batch, num_tokens: int) -> tuple[torch.Tensor, str]:
    """Each token's request slot (int64 [T]) and the step's mode name, from an SGLang forward
    batch: idle (no tokens), decode (one token per request), target verify (one block of
    `draft_token_num` tokens per request: DeepSeek's MTP) or extend (`extend_seq_lens` per
    request; tokens past their sum are graph padding and get slot -1)."""
    mode = forward_batch.forward_mode
    slots = forward_batch.req_pool_indices.to(torch.int64)
    if num_tokens == 0 or mode.is_idle():
        return torch.full((num_tokens,), -1, dtype=torch.int64, device=slots.device), "idle"
    if mode.is_decode():
        if slots.shape[0] != num_tokens:
            raise EngramError(f"a decode step of {num_tokens} tokens for {slots.shape[0]} requests")
        return slots, "decode"
    if mode.is_target_verify():
        block = int(forward_batch.spec_info.draft_token_num)
        if slots.shape[0] * block != num_tokens:
            raise EngramError(f"a target-verify step of {num_tokens} tokens for {slots.shape[0]} requests "
                              f"of {block} draft tokens each")
        # No repeat_interleave (a host sync under the fake capture): verify steps are captured.
        return slots.unsqueeze(1).expand(-1, block).reshape(-1), "verify"
    if not mode.is_extend():
        raise EngramError(f"Engram serves extend, target-verify and decode steps, not {mode.name}")
    lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
    real = int(sum(lens_cpu)) if lens_cpu is not None else num_tokens  # the host sum: no sync
    token_req = torch.repeat_interleave(slots, forward_batch.extend_seq_lens.to(torch.int64), output_size=real)
    if real < num_tokens:
        token_req = torch.cat([token_req, token_req.new_full((num_tokens - real,), -1)])
    return token_req, "extend"


class EngramRuntime:
    """Stores, hasher and step bookkeeping of one model (one per TP rank).

    Parameters
    ----------
    cfg : the model's Engram config (tables must have been built for it).
    hasher : an NgramHasher for the served tokenizer.
    settings : placement, table directory, options (ServeSettings).
    device : where rows are returned (the model's device).
    """

    def __init__(self, cfg: EngramConfig, hasher, settings: ServeSettings, table_dir: Path, device: torch.device,
                 tp_rank: int = 0, tp_size: int = 1, *, step_hasher=None):
        from ..core.stores import open_store
        from .whole_rows_auto import resolve

        # --engram-host-whole-rows auto: the planner's pick for this TP size and GPU (logged).
        settings = resolve(settings, cfg, tp_size, torch.device(device), tp_rank=tp_rank)
        self.cfg, self.hasher, self.settings = cfg, hasher, settings
        # The module that hashes a forward batch (an upstream EngramHasher: SGLang keeps its
        # per-request history). Ours over `hasher` unless the model brings its own (DeepSeek:
        # upstream's, attached with `use_hasher`).
        if step_hasher is None and hasher is not None:
            from .history import StepHasher

            step_hasher = StepHasher(hasher, corrupt_history="corrupt-history" in settings.debug)
        self.step_hasher = step_hasher
        self.device, self.tp_rank, self.tp_size = torch.device(device), tp_rank, tp_size
        self.table_dir = table_dir
        # Which rank this is (SGLang's ranks where it publishes them): every statistics entry
        # and the stats file carry it, one file per rank (serving/ranks.py).
        self.rank_labels = rank_labels(tp_rank, tp_size)
        # Every TP rank (on every node) serves the same tables and output-changing settings,
        # checked before any store opens (serving/identity.py).
        self.identity = serving_identity(table_dir, settings)
        agree_over_tp_group(self.identity, self.rank_labels["node_rank"])
        ranks = {name: self.rank_labels[name] for name in RANKS}  # every Prometheus series carries them
        self.stores = open_store(table_dir, settings.placement, self.device, cfg=cfg, tp_rank=tp_rank,
                                 tp_size=tp_size, backend=settings.backend, agree=agree_over_tp, ranks=ranks,
                                 **settings.store_options())
        # This rank's step series (read faults at 0 from now on) and its version and tables.
        self._metric_key = (settings.placement, *(str(ranks[name]) for name in RANKS))
        self._faults_metric, self._wait_metric = METRICS.step(self._metric_key)
        METRICS.build_info(self._metric_key, __version__, self.identity["tables"], cfg.fingerprint())
        # Rows are summed over the TP ranks only where some store holds a shard: with one host
        # copy per node every rank reads whole rows (the ranks agreed on it in open_store).
        self.reduce_rows = tp_size > 1 and not all(s.holds_whole_rows for s in self.stores.values())
        # Under attention DP/CP (serving/startup.py `attention_rows`): how the placement serves ranks
        # that hold different tokens, and with shards which lookups exchange ids ("dp": every one;
        # "cp": a prompt slice's), through serving/row_exchange.py. None: plain TP.
        self.attention_rows: Optional[str] = None
        self.row_exchange: Optional[str] = None
        self.layer_index = {L: i for i, L in enumerate(cfg.layer_ids)}
        # --engram-disk-graphs: fixed buffers the captured decode forward reads for the layers
        # whose stores read on the host, filled before each replay (serving/staged_rows.py).
        self.staged = None
        if settings.disk_graphs:
            from .staged_rows import StagedRows

            self.staged = StagedRows.for_runtime(self)
        # Hash column -> the store that keeps rows read ahead (a disk store's DRAM cache).
        self._ahead = {i: self.stores[L] for L, i in self.layer_index.items() if self.stores[L].reads_ahead}
        self._trace = _TraceWriter(settings.trace) if settings.trace else None
        self._lock = threading.Lock()
        self._steps = self._tokens = 0
        self._off_tokens = 0  # tokens with Engram off (serving/modes.py): they read no rows
        self._forward_seconds = self._engram_seconds = self._wait_seconds = 0.0
        self._layer_seconds, self._layer_calls = 0.0, 0
        self._stats_path = stats_path(settings.stats_file, self.rank_labels) if settings.stats_file else None
        self._stats_guard = WriteGuard(self._stats_path) if self._stats_path else None
        self._stats_written = 0.0
        self._open_step: Optional[EngramStep] = None
        self._current: Optional[EngramStep] = None
        self._failed: dict[int, str] = {}  # request slot -> why its rows could not be read
        self._forward_steps = 0  # between_steps calls: every step, replayed or eager
        self._faults = 0
        if settings.debug:
            logger.warning("engram-sglang DEBUG controls on (%s): outputs are deliberately wrong",
                           ", ".join(settings.debug))
        _RUNTIMES.add(self)
        maintenance.register(self, last=True)  # the stats file, after the stores' maintenance

    # ------------------------------------------------------------------ per step
    def begin_step(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, *,
                   hash_ids: Optional[torch.Tensor] = None, prefetch: bool = True) -> EngramStep:
        """One forward step: hash its tokens with the step hasher (or take `hash_ids` a
        model's own hasher computed: DeepSeek's upstream hasher), then `begin`. `prefetch`
        False: the layers will ask for other ids than these (a context-parallel slice)."""
        if hash_ids is None:
            input_ids = self.refuse_unknown_tokens(input_ids, forward_batch)
            hash_ids = self.step_hasher(input_ids, forward_batch)
        token_req, mode = step_tokens(forward_batch, hash_ids.shape[0])
        step = self.begin(hash_ids, token_req, positions, input_ids, mode, forward_batch=forward_batch,
                          prefetch=prefetch, padding=padding_tokens(token_req, forward_batch))
        # For layers the step cannot be handed to (DeepSeek's, inside upstream's model); not
        # inside a capture, where no Python state of the runtime changes (a replay runs none).
        if not step.captured:
            self._current = step
        return step

    def refuse_unknown_tokens(self, input_ids: torch.Tensor, forward_batch) -> torch.Tensor:
        """The step's ids with every id the hasher's tokenizer does not know replaced by the pad
        token; the requests that sent one fail, as a failed read does (their slots are kept for
        the scheduler, which aborts them after this batch: serving/faults.py), never the server.
        The tokenizer manager refused ids outside the model's vocabulary already
        (serving/request_check.py): this is for a path that skips it, or an id the model embeds
        but the tokenizer's compressed vocabulary lacks. Host ids only (a device tensor's
        min/max would sync every step; the hasher checks host ids only, too)."""
        token_map = getattr(self.hasher, "token_map", None)
        if token_map is None or input_ids.device.type != "cpu" or not input_ids.numel():
            return input_ids
        known = token_map.numel()
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo >= 0 and hi < known:
            return input_ids
        bad = (input_ids < 0) | (input_ids >= known)
        token_req, _ = step_tokens(forward_batch, input_ids.shape[0])
        with self._lock:
            for slot, token in zip(token_req[bad].tolist(), input_ids[bad].tolist()):
                if slot >= 0:
                    self._failed.setdefault(int(slot), f"engram: token id {token} is outside the tokenizer's "
                                                       f"{known} tokens")
        logger.error("engram-sglang: %d token id(s) outside the tokenizer's %d tokens (e.g. %d); failing the "
                     "request(s) that sent them, serving the rest", int(bad.sum()), known, lo if lo < 0 else hi)
        return input_ids.masked_fill(bad, self.cfg.pad_token_id)

    @property
    def current_step(self) -> Optional[EngramStep]:
        """The step `begin_step` began last outside a CUDA-graph capture (None before the first)."""
        return self._current

    @staticmethod
    def capturing() -> bool:
        """Whether a CUDA graph is being captured on this thread's stream (stores/maintenance.py;
        for the models, which reach the stores' modules only through the runtime)."""
        return maintenance.capturing()

    def layer_rows(self, layer_id: int, ids: torch.Tensor, *, slice_of_step: bool = False,
                   forward_batch=None) -> torch.Tensor:
        """`rows` for a layer the step cannot be handed to (DeepSeek's, inside upstream's
        model): the current step's prefetched rows when `ids` are its own column, else a gather
        of `ids` as they come: a slice of the step's ids (`slice_of_step`: a context-parallel
        rank's), or a lookup being captured into a CUDA graph, which must gather the graph's own
        ids at every replay (its hashing ran in the capture, with no prefetch, or eagerly
        outside it: the prefill graph). Shards under attention DP (every lookup) or CP (a
        prompt slice's) exchange ids with the other ranks instead (`_exchanged_rows`)."""
        t0 = time.perf_counter()
        step = None if self.capturing() else self._current
        if self.row_exchange == "dp" or (self.row_exchange == "cp" and slice_of_step):
            rows = self._exchanged_rows(step, layer_id, ids, forward_batch, context=slice_of_step)
            if step is not None:
                step.engram_seconds += time.perf_counter() - t0
            return rows
        staged = self.staged
        if step is None and staged is not None and layer_id in staged.layers and not slice_of_step and self.capturing():
            # A decode or target-verify graph captured with staged rows (--engram-disk-graphs):
            # its lookup reads the fixed buffer the plugin fills before every replay with the
            # rows of the step's own ids (`peek_step`), the eager gather's bits. Only the step's
            # own ids reach a captured lookup: a late-layer tail's subset is refused at load.
            rows = staged.view(layer_id, ids.shape[0])
            return exact_sum_(rows) if self.reduce_rows else rows
        # The step's own column is the very view the hasher returned (same memory, shape and
        # strides): ids of the same shape with other contents are gathered as they come.
        col = step.hash_ids[:, self.layer_index[layer_id]] if step is not None else None
        own = (col is not None and not slice_of_step and col.shape == ids.shape and col.device == ids.device
               and col.dtype == ids.dtype and col.data_ptr() == ids.data_ptr() and col.stride() == ids.stride())
        rows = self.rows(step, layer_id, None if own else ids)
        if step is not None:
            step.engram_seconds += time.perf_counter() - t0
        return rows

    def _exchanged_rows(self, step: Optional[EngramStep], layer_id: int, ids: torch.Tensor, forward_batch, *,
                        context: bool) -> torch.Tensor:
        """Rows of this rank's `ids` from shards whose ranks hold different tokens
        (serving/row_exchange.py): a collective every rank joins for every Engram layer, an idle
        rank included, so nothing here may skip it. The step's own column reads its graph
        padding as -1 (+0 rows, as the step's own gather does); no prefetch was issued for it
        (deepseek_v4_hook `_layers_read_these_ids`). A store that reads files joins with its
        failed reads contained and flagged: each rank fails its own tokens' requests that lacked
        a row, whichever rank failed to read it (`_contain_exchanged`)."""
        own = False
        if step is not None and not context:
            col = step.hash_ids[:, self.layer_index[layer_id]]
            own = col.data_ptr() == ids.data_ptr() and col.shape == ids.shape and col.stride() == ids.stride()
            if own:
                ids = mask_padding(ids, step.padding)
        store = self.stores[layer_id]
        can_fail = store.needs_host_ids  # (the same on every rank: they serve one placement)
        t0 = time.perf_counter()
        if context:
            rows = context_rows(store.gather, ids, can_fail=can_fail)
        else:
            rows = exchange_rows(store.gather, ids, forward_batch, can_fail=can_fail)
        if can_fail:
            # A host sync per layer, on a store whose ids visit the host anyway (never captured).
            rows, failed, fault = rows
            if fault is not None or bool(failed.any()):
                self._contain_exchanged(step, layer_id, failed, fault, own=own)
        if step is not None:
            step.wait_seconds += time.perf_counter() - t0
            if self._trace is not None and own:
                step.rows[layer_id] = rows
        return rows

    def _contain_exchanged(self, step: Optional[EngramStep], layer_id: int, failed: torch.Tensor,
                           fault: Optional[TableIOError], *, own: bool) -> None:
        """The exchange's faults, after the collective every rank joined: this rank's own failed
        read is logged and counted here (its rows may be other ranks' tokens'), and the requests
        of this rank's tokens flagged `failed` fail (every request of the step where the ids are
        not its own column), as `_contain` fails them; their rows are +0, never served. Without a
        step (a lookup no step began) a flagged token raises, as a failed read does there."""
        if fault is not None:
            with self._lock:
                self._faults += 1
            self._faults_metric.inc()
            logger.error("engram-sglang: engram layer %d: %s; the ranks whose tokens needed those rows fail "
                         "their requests", layer_id, fault)
        where = f"engram layer {layer_id}: " + (str(fault) if fault is not None else
                                                  "a row read by another attention rank failed after its retries "
                                                  "(that rank's log names the table file and errno)")
        bad = failed.cpu()
        if not bool(bad.any()):
            return
        if step is None:
            raise TableIOError(where)
        owners = step.token_req.cpu()
        slots = sorted(s for s in set((owners[bad] if own else owners).tolist()) if s >= 0)
        with self._lock:
            for slot in slots:
                self._failed.setdefault(int(slot), where)
        logger.error("engram-sglang: %s; failing the %d request(s) of this rank that needed those rows, serving "
                     "the rest", where, len(slots))

    def peek_step(self, input_ids: torch.Tensor, forward_batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(row ids [T, L, C], each token's request slot [T]) of a decode step (and, with a
        model's own upstream hasher, a target-verify step) as its forward will hash them, the
        hasher's history left as it is: what staged rows read before a CUDA-graph replay."""
        from .history import SequenceHasher

        mode = forward_batch.forward_mode
        peek = getattr(self.step_hasher, "peek_decode", None)
        if peek is not None and mode.is_decode():
            return peek(input_ids, forward_batch), forward_batch.req_pool_indices.to(torch.int64)
        if peek is None and isinstance(self.hasher, SequenceHasher):
            return self.hasher.peek_step(input_ids, forward_batch)
        what = f"a {mode.name} batch" if peek is not None else "a hasher that cannot peek at a step"
        raise EngramError(f"staged Engram rows serve replayed decode steps; got {what}: start without "
                          f"--engram-disk-graphs")

    def use_hasher(self, module) -> None:
        """Take a model's own step hasher (an upstream EngramHasher: DeepSeek-V4.1's, whose hash
        the checkpoint was trained with) for its steps' ids and for prefill read-ahead."""
        from .history import SequenceHasher

        layers, n = int(module.primes.shape[0]), int(module.max_ngram_size)
        if (layers, n) != (len(self.cfg.layer_ids), self.cfg.max_ngram_size):
            raise EngramError(f"the model's Engram hasher hashes {layers} layers of up to {n}-grams; the tables "
                              f"{self.table_dir} are for {len(self.cfg.layer_ids)} layers of up to "
                              f"{self.cfg.max_ngram_size}-grams")
        self.step_hasher, self.hasher = module, SequenceHasher(module)

    def begin(self, hash_ids: torch.Tensor, token_req: torch.Tensor, positions: torch.Tensor,
              input_ids: torch.Tensor, mode: str, *, forward_batch=None, prefetch: bool = True,
              padding: Optional[torch.Tensor] = None) -> EngramStep:
        """Issue every layer's gather for this step's hash ids [T, L, C] (`padding` bool [T]:
        graph padding, read as -1). Inside a CUDA-graph capture no Python state of the runtime
        changes (a replay would not change it)."""
        capturing = maintenance.capturing()
        if not capturing:
            self._release(self._open_step)  # a step that never reached end() (its forward raised)
        handles = {}
        # Modes apply to the step's own ids (not to a context-parallel rank's slice: prefetch False).
        use = not capturing and prefetch and hash_ids.shape[0]
        on, keep = self._engram_on(token_req, positions) if use else (None, None)
        reads = mask_padding(hash_ids, padding)
        reads = reads if keep is None else reads[keep]
        # A captured decode forward reads the host-reading layers' rows from the staged
        # buffers, which the plugin fills before every replay.
        staged = self.staged if capturing and prefetch and self.staged is not None else None
        if (self.settings.prefetch or staged is not None) and prefetch and hash_ids.shape[0]:
            # No host sync here: a store that reads on the host (disk) copies its column of
            # ids to pinned memory on this stream and its worker waits for that copy's event.
            for L, i in self.layer_index.items():
                if staged is not None and L in staged.layers:
                    handles[L] = staged.handle(L, hash_ids.shape[0])
                elif self.settings.prefetch:
                    handles[L] = self.stores[L].prefetch(reads[:, i])
        step = EngramStep(hash_ids, token_req, positions, input_ids, mode, handles, on=on, keep=keep,
                          captured=capturing, padding=padding)
        if not capturing:
            self._open_step = step
        return step

    @staticmethod
    def _engram_on(token_req: torch.Tensor, positions: torch.Tensor):
        """(on bool [T], indices of the on tokens) of a step where some token has Engram off,
        else (None, None). A host sync (how many tokens read), only in such a step: a server
        without modes never has one (and captures no CUDA graph with modes: serving/graphs.py)."""
        on = SLOTS.token_mask(token_req, positions)
        if on is None:
            return None, None
        keep = on.nonzero().squeeze(1)
        return (None, None) if keep.numel() == on.numel() else (on, keep)

    @staticmethod
    def _release(step: Optional[EngramStep]) -> None:
        """Order every handle of `step` nobody waited on (a layer that did not run, an
        exception) before the consumer stream's next work; see Prefetch.release."""
        if step is None:
            return
        handles, step.handles = step.handles, {}
        for handle in handles.values():
            handle.release()

    def rows(self, step: Optional[EngramStep], layer_id: int, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """bf16 rows [T, C, 256] of Engram layer `layer_id` for this step (waiting on its
        prefetch), or of `ids` when the layer was handed other ids than the step's (a
        context-parallel rank's slice of them, or a copy a CUDA graph reads): those are
        gathered here and now. Without a step (a lookup no step began) a failed read raises.
        The one place rows are all-reduced over tensor-parallel ranks."""
        i = self.layer_index[layer_id]
        own = ids is None
        if own:
            ids = step.read_ids(i)
        t0 = time.perf_counter()
        handle = step.handles.pop(layer_id, None) if step is not None else None
        if handle is not None and not own:
            handle.release()
            handle = None
        try:
            if "skip-wait" in self.settings.debug:
                # Negative control: read the row buffer before the gather has filled it.
                rows = torch.zeros(*ids.shape, self.cfg.head_dim, dtype=torch.bfloat16, device=self.device)
                if handle is not None:
                    handle.wait()
            elif handle is not None:
                rows = handle.wait()
            else:
                rows = self.stores[layer_id].gather(ids) if ids.shape[0] else torch.zeros(
                    *ids.shape, self.cfg.head_dim, dtype=torch.bfloat16, device=self.device)
        except TableIOError as fault:
            if step is None:
                raise
            rows = self._contain(step, layer_id, ids, fault, own=own)
        if step is not None:
            step.wait_seconds += time.perf_counter() - t0
        if self.reduce_rows:
            rows = exact_sum_(rows)
        if own and step.keep is not None:
            # Tokens with Engram off read nothing: +0.0 rows (what the reference uses).
            full = rows.new_zeros(step.hash_ids.shape[0], *rows.shape[1:])
            full[step.keep] = rows
            rows = full
        if self._trace is not None and own:
            step.rows[layer_id] = rows
        return rows

    def end(self, step: EngramStep, engram_seconds: float, layer_seconds: float, layer_calls: int) -> None:
        """Account the step; write the trace line. (The stats file is written between steps.)
        Inside a capture only the handles are ordered: what a replay skips (this Python) must
        not count, so steps are also counted between steps (`forward_steps`, replays too)."""
        self._release(step)
        if maintenance.capturing():
            return
        if self._open_step is step:
            self._open_step = None
        if self._current is step:
            self._current = None  # a lookup after its step's end is not of its ids
        now = time.perf_counter()
        with self._lock:
            self._steps += 1
            self._tokens += int(step.hash_ids.shape[0])
            if step.keep is not None:
                self._off_tokens += int(step.hash_ids.shape[0]) - int(step.keep.numel())
            self._forward_seconds += now - step.started
            self._engram_seconds += engram_seconds
            self._wait_seconds += step.wait_seconds
            self._layer_seconds += layer_seconds
            self._layer_calls += layer_calls
        if step.hash_ids.shape[0]:  # (an idle DP rank's empty steps wait for nothing)
            self._wait_metric.observe(step.wait_seconds)
        if self._trace is not None and self.tp_rank == 0 and step.hash_ids.shape[0]:
            self._trace.write(step, self.cfg.layer_ids)

    def end_open_step(self) -> None:
        """A step its model does not end (DeepSeek-V4.1's: upstream's forward) ends after the
        forward, its Engram time the time its layers spent in the runtime. Called by
        `maintenance.between_steps()` before any store maintains: a prefetch no layer waited
        on (a layer the forward did not reach in Python) is then ordered before a hot-row
        cache's admissions and evictions, not racing them on another stream."""
        if self._open_step is not None:
            self.end(self._open_step, self._open_step.engram_seconds, 0.0, 0)

    def between_steps(self, step: int) -> None:
        """Once per forward step, outside any graph (stores/maintenance.py): the stats file,
        at most every 0.2 s (the statistics read device counters: a host sync, which inside
        the forward would break a graph capture and count captures instead of replays).
        A step still open is ended before the stores' maintenance (`end_open_step`)."""
        self._forward_steps += 1
        self.end_open_step()
        now = time.perf_counter()
        if self._stats_path is not None and now - self._stats_written > 0.2:
            self._stats_written = now
            self.write_stats()

    def _contain(self, step: EngramStep, layer_id: int, ids: torch.Tensor, fault: TableIOError, *,
                 own: bool = True) -> torch.Tensor:
        """A read that failed after its retries fails only the requests whose tokens needed
        a failed row: their request slots are kept for the scheduler, which aborts them
        after this batch (serving/faults.py); every other token gets its exact rows. A call
        that failed as a whole (e.g. a file truncated under the store) fails the step's
        requests, and so does a failed read of ids that are not the step's own (their tokens'
        requests are not known here). The failed rows are +0 for the rest of this forward,
        never served."""
        rows = getattr(fault, "rows", None)
        owners = step.token_req
        if rows is None or not own:
            bad = torch.ones(step.token_req.shape[0], dtype=torch.bool)
            rows = torch.zeros(*ids.shape, self.cfg.head_dim, dtype=torch.bfloat16, device=self.device)
        else:
            flat = ids.reshape(ids.shape[0], -1).cpu().numpy()
            bad = torch.from_numpy(np.isin(flat, fault.failed_ids).any(-1))
            if step.keep is not None:
                owners = owners[step.keep]  # the ids are those of the tokens with Engram on
        # Graph padding rows carry slot -1 (step_tokens): no request to fail.
        slots = sorted(s for s in set(owners.cpu()[bad].tolist()) if s >= 0)
        message = f"engram layer {layer_id}: {fault}"
        with self._lock:
            for slot in slots:
                self._failed.setdefault(int(slot), message)
            self._faults += 1
        self._faults_metric.inc()
        logger.error("engram-sglang: %s; failing the %d request(s) that needed those rows, serving the rest",
                     message, len(slots))
        return rows

    def take_failed_requests(self) -> dict[int, str]:
        """Request slots (req_pool_idx) whose tokens needed rows that could not be read
        since the last call, with the reason; the scheduler aborts them."""
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    # ------------------------------------------------------------------ read-ahead
    @property
    def reads_ahead(self) -> bool:
        """Whether any layer keeps rows read ahead (a disk store with a DRAM row cache) and
        the runtime can hash a request's tokens (a model's own hasher is attached)."""
        return bool(self._ahead) and self.hasher is not None

    def read_ahead(self, tokens, *, history=(), start: int = 0) -> int:
        """Start reading the rows of one request's coming tokens (absolute position `start`,
        `history` the raw tokens before them) into the DRAM row caches. Returns the rows
        submitted (before each store drops what it holds already)."""
        ids = self.hasher.hash_sequence(list(tokens), history=list(history), start=start)
        for i, store in self._ahead.items():
            store.read_ahead(ids[:, i])
        return ids.shape[0] * ids.shape[2] * len(self._ahead)

    # ------------------------------------------------------------------ reports
    def stats(self) -> dict:
        with self._lock:
            steps = max(self._steps, 1)
            out = {
                **self.rank_labels,  # tp/dp/pp rank and size, attn_dp_rank, attn_cp_rank (serving/ranks.py)
                "engram_version": __version__,
                "placement": self.settings.placement,
                "table_dir": str(self.table_dir),
                "table_identity": self.identity["tables"],  # agreed by every TP rank (serving/identity.py)
                "table_fingerprint": self.cfg.fingerprint(),  # the Engram config they are for (manifest)
                "prefetch": self.settings.prefetch,
                "rows_all_reduced": self.reduce_rows,  # False: every rank reads whole rows (or TP 1)
                # Under attention DP/CP: shared-copy, files or exchange (core/placement_table.py); None: plain TP.
                "attention_rows": self.attention_rows,
                "steps": self._steps,  # eager forwards (tokens, seconds below are theirs)
                "forward_steps": self._forward_steps,  # every step, CUDA-graph replays included
                "tokens": self._tokens,
                "engram_off_tokens": self._off_tokens,
                "forward_seconds_per_step": self._forward_seconds / steps,
                "engram_seconds_per_step": self._engram_seconds / steps,
                "wait_seconds_per_step": self._wait_seconds / steps,
                "layer_seconds": self._layer_seconds / max(self._layer_calls, 1),
                "read_faults": self._faults,
            }
        out["tables"] = [self.stores[L].stats() for L in self.cfg.layer_ids]
        return out

    def write_stats(self) -> None:
        if self._stats_path is None:
            return
        tmp = self._stats_path.with_name(self._stats_path.name + f".tmp{os.getpid()}")
        text = json.dumps(self.stats(), indent=1)
        try:
            tmp.write_text(text)
            os.replace(tmp, self._stats_path)
        except OSError as e:
            tmp.unlink(missing_ok=True)  # never leave the temp file beside the target
            self._stats_guard.failed(e)
        else:
            self._stats_guard.succeeded()

    def describe(self) -> list[str]:
        return [self.stores[L].describe() for L in self.cfg.layer_ids]

    def pd_identity(self) -> bytes:
        """What a PD pair must agree on (serving/pd.py): the tables' content and the settings
        that change outputs, as the TP ranks agree on them (serving/identity.py)."""
        return pd.identity_line(self.identity["tables"], self.settings.mode, self.settings.ablation)

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    def close(self) -> None:
        _RUNTIMES.discard(self)  # no longer reported, nor found by a model's hook
        maintenance.unregister(self)
        self._release(self._open_step)
        self._open_step = None
        for store in self.stores.values():
            store.close()


class WriteGuard:
    """Contains failed writes of one target (stats file, trace): serving goes on, and a
    WARNING naming the target and errno is logged at most once per `interval` seconds,
    with the count of writes dropped since the last one; the first success after a
    failure logs one INFO."""

    def __init__(self, path, interval: float = 60.0, clock=time.monotonic):
        self.path, self.interval, self.clock = Path(path), interval, clock
        self.failing = False
        self.dropped = 0  # failures not yet reported
        self._last_warn: Optional[float] = None

    def failed(self, e: OSError) -> None:
        self.failing = True
        self.dropped += 1
        now = self.clock()
        if self._last_warn is not None and now - self._last_warn < self.interval:
            return
        extra = f" ({self.dropped - 1} more writes dropped since the last warning)" if self.dropped > 1 else ""
        name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "unknown"
        logger.warning(
            "engram-sglang: write to %s failed (%s: %s); serving goes on without it%s; "
            "free space or fix the target",
            self.path, name, e.strerror or e, extra,
        )
        self._last_warn, self.dropped = now, 0

    def succeeded(self) -> None:
        if self.failing:
            self.failing, self.dropped, self._last_warn = False, 0, None
            logger.info("engram-sglang: writes to %s resumed", self.path)


class _TraceWriter:
    """One JSON line per step: per token its request slot, position, token id, and per
    Engram layer its hash ids, the checksum of the rows the layer used and, where the model
    keeps conv inputs (Qwen3 family), the checksum of each entry of its conv window."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.step = 0
        self.guard = WriteGuard(self.path)

    def write(self, step: EngramStep, layer_ids) -> None:
        line = {
            "step": self.step,
            "pid": os.getpid(),
            "mode": step.mode,
            "on": [1] * len(step.positions) if step.on is None else step.on.int().tolist(),
            "req": step.token_req.tolist(),
            "pos": step.positions.tolist(),
            "tok": step.input_ids.tolist(),
            "ids": {str(L): step.hash_ids[:, i].tolist() for i, L in enumerate(layer_ids)},
            "sum": {str(L): row_checksums(step.rows[L]).tolist() for L in layer_ids if L in step.rows},
            # per token, per entry of its conv window (oldest first, its own conv input last)
            "conv": {str(L): step.windows[L].tolist() for L in layer_ids if L in step.windows},
        }
        self.step += 1
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as e:  # a full or failing disk must never end the scheduler
            self.guard.failed(e)
        else:
            self.guard.succeeded()
