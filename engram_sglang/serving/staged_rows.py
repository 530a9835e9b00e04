"""Decode CUDA graphs kept with the disk tier: each step's rows staged into fixed device
buffers before the graph replays (`--engram-disk-graphs on`, with SGLang's
`--disable-overlap-schedule`).

A store that reads on the host (the disk tier, or a hot-row cache over it) cannot run
inside a captured graph: a replay re-runs the device kernels, never the host reads. Here
the reads happen before the replay instead, and the captured forward reads only memory
whose address never changes:

1. SGLang's decode graph runner is about to replay a step (the plugin wraps
   `DecodeCudaGraphRunner.execute`: `stage_before_replay`). The model's own hasher computes
   the step's row ids eagerly, without committing its history (`EngramRuntime.peek_step`:
   the Qwen3 family's `StepHasher.peek_decode`; DeepSeek-V4.1's decode and target-verify
   windows over upstream's hasher history, hashed by its `hash_windows`,
   `SequenceHasher.peek_step`: the very ids the graph will compute).
2. `StagedRows.stage`: every host-reading layer's gather is issued at once through the
   store's own prefetch, with the ids where they are (the eager path, so the rows are the
   eager path's bits: the disk store copies the ids to pinned memory and its worker reads
   once that copy landed), then each is waited on and copied into that layer's fixed
   buffer [max graph tokens, C, 256] bf16. The wait is the step's one host sync; without
   the overlap scheduler the host has waited for the previous step's tokens already, so
   beyond the reads it waits only for the few hash kernels.
   Rows past the step's tokens are +0.0: a padded graph row never reads a previous step's.
3. During capture, `EngramRuntime.begin` handed every host-reading layer a view of its
   buffer (`StagedRows.handle`) instead of a prefetch, so the replay reads those views.

Eager steps (prefill, batches larger than any captured size) keep the stores' usual path.
The cost, the step's reads no longer overlapped with the layers before the first Engram
layer, is in docs/architecture.md.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from ..core.errors import EngramError
from ..core.rowformat import ROW_VALUES
from ..core.stores import maintenance
from ..core.stores.base import Prefetch, TableIOError

# (layer id, the layer's ids [T, C], the read's fault) -> the rows to use (the runtime's containment).
OnFault = Callable[[int, torch.Tensor, TableIOError], torch.Tensor]


class StagedRows:
    """Fixed device buffers of the host-reading layers' rows for captured decode graphs.

    stores : layer id -> store (the runtime's); only stores with `needs_host_ids` are staged.
    layer_index : layer id -> its column in the step's hash ids [T, n_layers, C].
    columns : hash columns per token (C).
    """

    def __init__(self, stores: Mapping[int, object], layer_index: Mapping[int, int], columns: int,
                 device: torch.device):
        self.stores = stores
        self.layers = {L: i for L, i in layer_index.items() if getattr(stores[L], "needs_host_ids", False)}
        self.columns, self.device = columns, torch.device(device)
        self.buffers: dict[int, torch.Tensor] = {}
        self.capacity = 0  # tokens per buffer
        self._filled = 0  # rows [0, _filled) of the buffers may be non-zero
        self.staged_steps = 0

    @classmethod
    def for_runtime(cls, runtime) -> Optional["StagedRows"]:
        """The staging of a runtime's stores, or None when no store reads on the host."""
        staged = cls(runtime.stores, runtime.layer_index, runtime.cfg.hash_columns, runtime.device)
        return staged if staged.layers else None

    # ------------------------------------------------------------ before capture
    def reserve(self, tokens: int) -> None:
        """Buffers for up to `tokens` tokens per step (the largest captured graph's), made
        before any capture: a captured graph holds their addresses, so they never move."""
        if maintenance.capturing():
            raise EngramError("staged Engram rows: reserve the buffers before the CUDA-graph capture, not inside it")
        if tokens <= self.capacity:
            return
        if self.buffers:
            raise EngramError(f"staged Engram rows: buffers for {self.capacity} tokens already exist (a captured "
                              f"graph may hold them); {tokens} tokens asked later: capture the largest size first")
        self.buffers = {L: torch.zeros(tokens, self.columns, ROW_VALUES, dtype=torch.bfloat16, device=self.device)
                        for L in self.layers}
        self.capacity, self._filled = tokens, 0

    # ------------------------------------------------------------ inside capture
    def view(self, layer_id: int, tokens: int) -> torch.Tensor:
        """Rows [tokens, C, 256] of `layer_id` as the captured forward reads them: a fixed
        slice of the buffer (no host work, no Python state)."""
        if tokens > self.capacity:
            raise EngramError(f"staged Engram rows: a step of {tokens} tokens, but the buffers hold {self.capacity} "
                              f"(reserve() them for the largest captured batch)")
        return self.buffers[layer_id][:tokens]

    def handle(self, layer_id: int, tokens: int) -> Prefetch:
        """A finished prefetch whose rows are the fixed view (what `EngramRuntime.rows` waits on)."""
        return Prefetch(rows=self.view(layer_id, tokens))

    # ------------------------------------------------------------ before each replay
    def stage(self, hash_ids: torch.Tensor, on_fault: Optional[OnFault] = None) -> int:
        """Read the rows of this step's hash ids [T, n_layers, C] (any device) into the
        buffers, eagerly, on the current stream; rows T.. become +0.0. Returns T.

        A read that fails after its retries goes to `on_fault` (which fails the requests
        that needed the rows and returns the rows to use); without one it raises."""
        if maintenance.capturing():
            raise EngramError("staged Engram rows are read before a replay, never inside a CUDA-graph capture")
        tokens = int(hash_ids.shape[0])
        if tokens > self.capacity:
            raise EngramError(f"staged Engram rows: a step of {tokens} tokens, but the buffers hold {self.capacity}")
        # Every layer's read in flight at once, each through its store's own prefetch with the
        # ids where they are, as the eager step issues them (device ids: the store copies them to
        # pinned memory and its worker waits for that copy; wait() waits for the worker).
        handles = {L: self.stores[L].prefetch(hash_ids[:, i]) for L, i in self.layers.items()} if tokens else {}
        # Rows up to here may be written below even if a later layer's read raises: the next
        # step must still zero them (rows past the step are +0.0).
        self._filled = max(self._filled, tokens)
        try:
            for L, i in self.layers.items():
                buf = self.buffers[L]
                if tokens:
                    try:
                        rows = handles[L].wait()
                    except TableIOError as fault:
                        if on_fault is None:
                            raise
                        rows = on_fault(L, hash_ids[:, i], fault)
                    buf[:tokens].copy_(rows)
                if self._filled > tokens:
                    buf[tokens:self._filled].zero_()
        finally:
            for h in handles.values():  # handles an exception left unwaited: ordered, never dropped
                h.release()
        self._filled = tokens
        self.staged_steps += 1
        return tokens

    def describe(self) -> str:
        mib = sum(b.numel() * b.element_size() for b in self.buffers.values()) / 2**20
        return (f"decode CUDA graphs with rows staged before each replay: layers {sorted(self.layers)}, "
                f"{self.capacity} tokens, {mib:.1f} MiB of device buffers")


# ------------------------------------------------------------------ SGLang glue
def _runtime_of(model):
    """The runtime serving `model`: the Qwen3 family's own attribute, or the one the DeepSeek
    hook attaches to upstream's model when its weights load (models/deepseek_v4_hook.py)."""
    return getattr(model, "runtime", None) or getattr(model, "engram_runtime", None)


def _staged_of(model) -> Optional[StagedRows]:
    return getattr(_runtime_of(model), "staged", None)


def reserve_for_capture(model, tokens: int) -> None:
    """The decode graph runner is about to capture graphs of up to `tokens` tokens."""
    staged = _staged_of(model)
    if staged is not None:
        staged.reserve(tokens)


def stage_before_replay(model, forward_batch) -> None:
    """The decode graph runner is about to replay `forward_batch`: hash its tokens with the
    model's hasher (history not committed: the graph commits it) and stage the rows."""
    staged = _staged_of(model)
    if staged is None:
        return
    runtime = _runtime_of(model)
    if forward_batch.forward_mode.is_idle():  # a data-parallel rank with no requests this step: nothing to read
        staged.stage(torch.zeros(0, len(runtime.layer_index), staged.columns, dtype=torch.int64))
        return
    ids, token_req = runtime.peek_step(forward_batch.input_ids, forward_batch)
    # What the runtime's fault containment reads of a step: each token's request slot.
    step = _StepSlots(token_req)

    def contain(layer_id: int, layer_ids: torch.Tensor, fault: TableIOError) -> torch.Tensor:
        return runtime._contain(step, layer_id, layer_ids, fault)

    staged.stage(ids, on_fault=contain)


class _StepSlots:
    def __init__(self, token_req: torch.Tensor):
        self.token_req = token_req
        self.keep = None  # every token's ids were read (captured graphs run with Engram on for all)
