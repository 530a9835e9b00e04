"""Step hashing with the per-request history that SGLang's scheduler keeps.

SGLang 0.5.23 maintains Engram history only for models holding an upstream `EngramHasher`
(`ngram_embedding_manager.NgramEmbeddingManager`): it finds that module, calls
`init_history(req_slots, device)`, refills `forward_batch.engram_history` for every
extend batch from each request's fill ids (so chunked prefill, radix-cache prefix hits,
retraction and P/D handoff all see the right predecessors), and commits the accepted
tokens after speculative verification through `commit_after_verify`. `StepHasher` is
such a module: SGLang does the bookkeeping, our NgramHasher does the hashing, and the
history rows keep upstream's layout (int32 [slots + 1, n - 1], raw ids, oldest first; the
extra row absorbs commits of padded graph rows).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.engram import EngramHasher
from torch import nn

from ..core.errors import EngramError
from ..core.hashing import newest_history


class StepHasher(EngramHasher):
    """Row ids [T, n_layers, C] of a forward batch; commits each request's newest n-1 tokens.

    Built from our NgramHasher (upstream's constructor, which rebuilds the token map from
    the tokenizer, is not run). `corrupt_history` is a negative control for tests: it
    hashes with empty history, as a scheduler that lost track would.
    """

    def __init__(self, hasher, *, corrupt_history: bool = False):
        nn.Module.__init__(self)
        self.ngram = hasher
        self.max_ngram_size = hasher.n
        self.image_token_id = None
        self.history = None
        self.pad_row = 0
        self.corrupt_history = corrupt_history

    def forward(self, input_ids: torch.Tensor, forward_batch) -> torch.Tensor:
        """Row ids [T, L, C], as upstream's EngramHasher returns them (the runtime reads each
        token's request slot from the batch: runtime.step_tokens)."""
        if self.history is None:
            raise EngramError("engram history was not set up: SGLang did not find the model's Engram hasher "
                              "(is engram_layer_ids in config.json?)")
        n = self.max_ngram_size
        mode = forward_batch.forward_mode
        T = input_ids.shape[0]
        device = input_ids.device
        n_layers, cols = self.ngram.multipliers.shape[0], self.ngram.offsets.shape[1]
        slots = forward_batch.req_pool_indices.to(torch.int64)
        if T == 0 or mode.is_idle():
            return torch.zeros(T, n_layers, cols, dtype=torch.int64, device=device)
        if mode.is_decode():
            lens = torch.ones_like(slots)
            history = self.history[slots]
        elif mode.is_extend() and not mode.is_target_verify():
            lens = forward_batch.extend_seq_lens.to(torch.int64)
            given = forward_batch.engram_history
            history = self.history[slots] if given is None else given
        else:
            raise EngramError(f"the Qwen3 Engram family serves extend and decode steps, not {mode.name} "
                              f"(speculative decoding is not supported yet)")
        if self.corrupt_history:
            history = torch.zeros_like(history)
        ids, windows = self.ngram.hash_batch(input_ids, forward_batch.positions, history, lens)
        # Commit each request's newest n-1 tokens; requests without tokens and padded
        # graph rows (out_cache_loc 0) write the spare row instead.
        last = (torch.cumsum(lens, 0) - 1).clamp(0, T - 1)
        rows = torch.where(lens > 0, slots, self.pad_row)
        out_loc = forward_batch.out_cache_loc
        if out_loc is not None and out_loc.numel() == T:
            rows = torch.where(out_loc[last] == 0, self.pad_row, rows)
        self.history[rows] = newest_history(windows, last, n).to(self.history.dtype)
        return ids

    def peek_decode(self, input_ids: torch.Tensor, forward_batch) -> torch.Tensor:
        """Row ids [T, L, C] of a decode batch exactly as `forward` computes them, with the
        history left as it is: the disk tier's staged rows read them before a CUDA-graph
        replay whose forward then hashes (and commits) the same tokens (serving/staged_rows.py)."""
        if self.history is None or not forward_batch.forward_mode.is_decode():
            raise EngramError("peek_decode needs the history set up and a decode batch")
        slots = forward_batch.req_pool_indices.to(torch.int64)
        history = self.history[slots]
        if self.corrupt_history:
            history = torch.zeros_like(history)
        return self.ngram.hash_batch(input_ids, forward_batch.positions, history, torch.ones_like(slots))[0]


class SequenceHasher:
    """One request's tokens hashed by a model's own step hasher (DeepSeek-V4.1: upstream's
    EngramHasher, whose hash the checkpoint was trained with), for prefill read-ahead: the
    host twin of the windows the step builds (upstream's EngramRowStager builds the same),
    hashed by the module's own `hash_windows`, so read-ahead asks for the rows the step will."""

    def __init__(self, module: EngramHasher):
        self.module = module
        self.n = module.max_ngram_size

    def hash_sequence(self, tokens, *, history=(), start: int = 0) -> torch.Tensor:
        """Row ids [T, L, C] of `tokens` at absolute positions start.., `history` the raw
        tokens before them (oldest first; only the last n-1 are read)."""
        lookback = self.n - 1
        before = [int(t) for t in history][-lookback:] if lookback else []
        seg = torch.tensor([0] * (lookback - len(before)) + before + [int(t) for t in tokens], dtype=torch.int64)
        windows = seg.unfold(0, self.n, 1).flip(-1)  # [T, n]: column s is the s-th predecessor
        positions = torch.arange(start, start + windows.shape[0], dtype=torch.int64)
        blocked = positions.unsqueeze(-1) < torch.arange(self.n)
        ids, _ = self.module.hash_windows(windows, blocked)
        return ids

    def peek_step(self, input_ids: torch.Tensor, forward_batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(row ids [T, L, C], each token's request slot [T]) of a decode or target-verify batch,
        exactly as the module's forward computes them inside a CUDA graph, with its history
        (oldest first, on the device) left as it is: the disk tier stages these rows before the
        replay, whose forward then hashes and commits the same tokens (serving/staged_rows.py).
        The windows are the module's own (its reference path's, a block of `draft_token_num`
        tokens per request for target-verify), hashed by its `hash_windows`; device work only."""
        module, n = self.module, self.n
        mode = forward_batch.forward_mode
        if module.history is None or not (mode.is_decode() or mode.is_target_verify()):
            what = "its history is not set up" if module.history is None else f"a {mode.name} batch"
            raise EngramError(f"staged Engram rows peek at decode and target-verify steps; got {what}")
        slots = forward_batch.req_pool_indices.to(torch.int64)
        bs, tokens = slots.shape[0], input_ids.shape[0]
        block = int(forward_batch.spec_info.draft_token_num) if mode.is_target_verify() else 1
        if tokens != bs * block:
            raise EngramError(f"staged Engram rows: {tokens} tokens for {bs} requests of {block}")
        # Per request: its n-1 history tokens, then the step's; token o's s-th predecessor is
        # seq[n-1+o-s] (the history where o < s, as the module's reference path reads it).
        seq = torch.cat([module.history[slots].to(torch.int64), input_ids.view(bs, block).to(torch.int64)], dim=1)
        windows = seq.unfold(1, n, 1).flip(-1).reshape(tokens, n)
        positions = forward_batch.positions.to(torch.int64)
        blocked = positions.unsqueeze(-1) < torch.arange(n, device=positions.device)
        ids, _ = module.hash_windows(windows, blocked)
        return ids, slots.repeat_interleave(block, output_size=tokens) if block > 1 else slots

