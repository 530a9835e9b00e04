"""Engram n-gram hashing: compressed vocabulary, multipliers, prime layout, hasher, history.

Bit-for-bit what DeepSeek-V4.1-Flash and upstream SGLang compute (docs/engram.md §3);
tests/core/test_hashing.py proves it against the installed sglang on CPU.

Window convention (shared with upstream): a window is [n] raw token ids, column s holding
the s-th predecessor of the token (s = 0 the token itself); `blocked[t, s]` marks a
look-back that runs past the sequence start (position < s), which reads the pad id.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import sympy
import torch

from .config import EngramConfig
from .errors import EngramConfigError, EngramError, TokenizerMismatchError

# Seed of a layer's multiplier RNG is this times the layer id (DeepSeek's demo code).
_MULTIPLIER_SEED = 10007


# --------------------------------------------------------------------------- layout
class EngramLayout:
    """Per-layer table layout: one prime-sized row range per (n-gram order, head) column.

    Primes come from one ascending search shared by all layers, drawn in (layer, order,
    head) order; each (layer, order) restarts just above `vocab_size - 1` and takes the
    next prime not used yet. Column c of a layer owns rows [offsets[c], offsets[c] +
    primes[c]) of that layer's table.
    """

    def __init__(self, cfg: EngramConfig):
        self.cfg = cfg
        self.layer_ids = cfg.layer_ids
        self.max_ngram_size = cfg.max_ngram_size
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.primes = _search_primes(cfg.n_layers, cfg.max_ngram_size - 1, cfg.n_heads, cfg.vocab_size)
        flat = [[p for order in layer for p in order] for layer in self.primes]
        self.offsets: tuple[tuple[int, ...], ...] = tuple(
            tuple(int(x) for x in np.cumsum([0, *cols[:-1]])) for cols in flat
        )
        self.num_embeddings: tuple[int, ...] = tuple(sum(cols) for cols in flat)
        if cfg.num_embeddings is not None and tuple(cfg.num_embeddings) != self.num_embeddings:
            raise EngramConfigError(
                f"{cfg.source}: engram_num_embeddings is {list(cfg.num_embeddings)} but the "
                f"prime layout of this config gives {list(self.num_embeddings)}"
            )

    @classmethod
    def from_config(cls, cfg: EngramConfig) -> "EngramLayout":
        return cls(cfg)

    def rows(self, layer_id: int) -> int:
        """Rows of the table of Engram layer `layer_id` (a model layer index)."""
        return self.num_embeddings[self.layer_index(layer_id)]

    def layer_index(self, layer_id: int) -> int:
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise EngramError(f"layer {layer_id} has no Engram table; Engram layers are {list(self.layer_ids)}") from None

    def column_bounds(self, layer_index: int) -> tuple[int, ...]:
        """Row range boundaries of the columns of one layer: column c owns [b[c], b[c+1])."""
        return (*self.offsets[layer_index], self.num_embeddings[layer_index])

    def table_bytes(self, row_bytes: int) -> int:
        return sum(self.num_embeddings) * row_bytes


@functools.lru_cache(maxsize=32)
def _search_primes(n_layers: int, n_orders: int, n_heads: int, vocab_size: int):
    seen: set[int] = set()
    layers = []
    for _ in range(n_layers):
        orders = []
        for _ in range(n_orders):
            heads, current = [], vocab_size - 1
            for _ in range(n_heads):
                current = sympy.nextprime(current)
                while current in seen:
                    current = sympy.nextprime(current)
                seen.add(current)
                heads.append(int(current))
            orders.append(tuple(heads))
        layers.append(tuple(orders))
    return tuple(layers)


def hash_multipliers(cfg: EngramConfig) -> np.ndarray:
    """Odd multipliers, int64 [n_layers, max_ngram_size]; column s multiplies the token s back.

    The bound keeps compressed_id * multiplier (and their xor) inside int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // cfg.compressed_vocab_size) // 2)
    rows = []
    for layer_id in cfg.layer_ids:
        rng = np.random.default_rng(_MULTIPLIER_SEED * layer_id)
        r = rng.integers(0, bound, size=(cfg.max_ngram_size,), dtype=np.int64)
        rows.append(2 * r + 1)
    return np.stack(rows)


# ----------------------------------------------------------------- compressed vocab
_LONE_SPACE_SENTINEL = "\ue000"  # private use: survives Strip() so " " stays a space


@functools.lru_cache(maxsize=1)
def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed id (int64 array) and the number of distinct keys.

    `tokenizer` is an HF fast tokenizer (anything with `backend_tokenizer`) or a
    `tokenizers.Tokenizer`. Ids are assigned in first-seen order of token id.
    """
    if hasattr(tokenizer, "backend_tokenizer"):
        backend, size = tokenizer.backend_tokenizer, len(tokenizer)
    else:
        backend, size = tokenizer, tokenizer.get_vocab_size(with_added_tokens=True)
    norm = _normalizer()
    keys: dict[str, int] = {}
    out = np.empty(size, dtype=np.int64)
    for tid in range(size):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            # Partial UTF-8: nothing to normalize, the raw token string is the key.
            key = backend.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = keys.setdefault(key, len(keys))
    return out, len(keys)


# ------------------------------------------------------------------------- hasher
class NgramHasher:
    """Row ids of the n-gram windows of tokens, int64 [T, n_layers, (n - 1) * heads].

    Parameters
    ----------
    cfg : the Engram config.
    token_map : int64 tensor, raw token id -> compressed id.
    image_token_id : multimodal models only: once a look-back reaches this token it and
        every older look-back read as pad; ids >= `mm_pad_shift` read as the image token.
    """

    def __init__(
        self,
        cfg: EngramConfig,
        token_map: torch.Tensor | np.ndarray,
        *,
        image_token_id: Optional[int] = None,
        mm_pad_shift: Optional[int] = None,
        layout: Optional[EngramLayout] = None,
    ):
        token_map = torch.as_tensor(token_map, dtype=torch.int64).cpu()
        if token_map.ndim != 1 or token_map.numel() == 0:
            raise EngramConfigError("token_map must be a non-empty 1-D tensor (token id -> compressed id)")
        lo, hi = int(token_map.min()), int(token_map.max())
        if lo < 0 or hi >= cfg.compressed_vocab_size:
            raise TokenizerMismatchError(
                f"{cfg.source}: token_map holds compressed ids in [{lo}, {hi}] but "
                f"engram_compressed_vocab_size is {cfg.compressed_vocab_size}"
            )
        if cfg.pad_token_id >= token_map.numel():
            raise EngramConfigError(
                f"{cfg.source}: engram_pad_token_id {cfg.pad_token_id} is outside the tokenizer's "
                f"{token_map.numel()} tokens"
            )
        self.cfg = cfg
        self.layout = layout or EngramLayout(cfg)
        self.n = cfg.max_ngram_size
        self.token_map = token_map
        self.pad_id = int(token_map[cfg.pad_token_id])
        self.multipliers = torch.from_numpy(hash_multipliers(cfg))  # [L, n]
        self.primes = torch.tensor(self.layout.primes, dtype=torch.int64)  # [L, n-1, H]
        self.offsets = torch.tensor(self.layout.offsets, dtype=torch.int64)  # [L, C]
        self.image_token_id = image_token_id
        self.mm_pad_shift = mm_pad_shift
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def from_tokenizer(cls, cfg: EngramConfig, tokenizer, **kwargs) -> "NgramHasher":
        token_map, size = compressed_token_map(tokenizer)
        if size != cfg.compressed_vocab_size:
            raise TokenizerMismatchError(
                f"{cfg.source}: the tokenizer normalizes to {size} distinct tokens but "
                f"engram_compressed_vocab_size is {cfg.compressed_vocab_size} (every hash multiplier depends on it)"
            )
        return cls(cfg, token_map, **kwargs)

    def _params(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._on_device:
            self._on_device[device] = tuple(
                t.to(device) for t in (self.token_map, self.multipliers, self.primes, self.offsets)
            )
        return self._on_device[device]

    # ---------------------------------------------------------------- core formula
    def hash_windows(self, tokens: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """Row ids int64 [T, n_layers, (n-1)*heads] of windows tokens [T, n] / blocked [T, n]."""
        if tokens.ndim != 2 or tokens.shape[-1] != self.n or blocked.shape != tokens.shape:
            raise EngramError(
                f"hash_windows wants tokens and blocked of shape [T, {self.n}], got "
                f"{tuple(tokens.shape)} and {tuple(blocked.shape)}"
            )
        token_map, mult, primes, offsets = self._params(tokens.device)
        tokens = tokens.to(torch.int64)
        blocked = blocked.to(torch.bool)
        if self.image_token_id is not None:
            if self.mm_pad_shift is not None:
                tokens = tokens.masked_fill(tokens >= self.mm_pad_shift, self.image_token_id)
            # Once a look-back reaches an image token, it and every older one read as pad.
            blocked = (blocked | (tokens == self.image_token_id)).to(torch.int32).cummax(-1).values.bool()
        if tokens.device.type == "cpu" and tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= token_map.numel():
                bad = lo if lo < 0 else hi
                raise EngramError(f"token id {bad} is outside the tokenizer's {token_map.numel()} tokens")
        # Blocked look-backs may hold anything (e.g. the 0 that pads a history row).
        compressed = torch.where(blocked, self.pad_id, token_map[tokens.clamp(0, token_map.numel() - 1)])
        products = compressed.unsqueeze(1) * mult  # [T, L, n]
        rolling = products[..., 0]
        cols = []
        for s in range(1, self.n):
            rolling = rolling ^ products[..., s]
            cols.append(rolling.unsqueeze(-1) % primes[:, s - 1])  # [T, L, H]: the (s+1)-gram
        return torch.cat(cols, dim=-1) + offsets

    # ------------------------------------------------------------- window builders
    def windows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        history_rows: torch.Tensor,
        lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of a batch of runs: request i contributes `lens[i]` consecutive tokens.

        A decode step is the case lens == 1, a speculative verify block lens == k, a
        (chunked) prefill any lens. Look-backs before a run's first token come from its
        history row (raw ids, oldest first, [bs, n-1]); positions are absolute.
        Returns (tokens [T, n], blocked [T, n]).
        """
        n = self.n
        device = input_ids.device
        input_ids = input_ids.to(torch.int64)
        lens = lens.to(device=device, dtype=torch.int64)
        total = input_ids.shape[0]
        row = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=total)
        starts = torch.cumsum(lens, 0) - lens
        t = torch.arange(total, device=device)
        offset = t - starts[row]  # index of the token inside its run
        shifts = torch.arange(n, device=device)
        in_run = shifts.unsqueeze(0) <= offset.unsqueeze(-1)
        from_run = input_ids[(t.unsqueeze(-1) - shifts).clamp_min(0)]
        # Shift s past the run start reads history column n-1-(s-offset) (oldest first).
        hist_col = (n - 1 - (shifts.unsqueeze(0) - offset.unsqueeze(-1))).clamp(0, n - 2)
        from_hist = history_rows.to(device=device, dtype=torch.int64)[row].gather(1, hist_col)
        tokens = torch.where(in_run, from_run, from_hist)
        blocked = positions.to(device=device, dtype=torch.int64).unsqueeze(-1) < shifts
        return tokens, blocked

    def hash_batch(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        history_rows: torch.Tensor,
        lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ids [T, L, C] of a batch of runs (see `windows`), and its windows."""
        tokens, blocked = self.windows(input_ids, positions, history_rows, lens)
        return self.hash_windows(tokens, blocked), tokens

    def hash_sequence(
        self, tokens: Sequence[int] | torch.Tensor, *, history: Sequence[int] = (), start: int = 0
    ) -> torch.Tensor:
        """Row ids [T, L, C] of one request's tokens starting at absolute position `start`,
        with up to n-1 earlier raw tokens in `history` (oldest first)."""
        ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        row = history_row(list(history), self.n)
        positions = torch.arange(start, start + ids.numel(), dtype=torch.int64)
        ids_out, _ = self.hash_batch(ids, positions, torch.tensor([row]), torch.tensor([ids.numel()]))
        return ids_out


def history_row(tokens: Sequence[int], n: int) -> list[int]:
    """The last n-1 tokens, left-padded with 0 (the pad slots are blocked by position)."""
    tail = list(tokens)[-(n - 1):] if n > 1 else []
    return [0] * (n - 1 - len(tail)) + [int(t) for t in tail]


def newest_history(windows: torch.Tensor, last: torch.Tensor, n: int) -> torch.Tensor:
    """The history rows a step leaves: the newest n-1 raw tokens of each request's last
    window, oldest first. `windows` [T, n] as `NgramHasher.windows` builds them (newest
    first), `last` [bs] the index of each request's last token in the batch."""
    return windows[last, : n - 1].flip(-1)


class HashHistory:
    """Per-request raw-token history in upstream's layout: int32 [slots + 1, n - 1].

    Row `slot` holds the last n-1 tokens a request committed, oldest first. The extra row
    (`pad_row`) absorbs commits of padded graph rows harmlessly.
    """

    def __init__(self, num_slots: int, max_ngram_size: int, device: torch.device | str = "cpu"):
        self.n = max_ngram_size
        self.pad_row = num_slots
        self.table = torch.zeros(num_slots + 1, max_ngram_size - 1, dtype=torch.int32, device=device)

    def seed(self, slot: int, prefix: Sequence[int]) -> None:
        """Seed a request at (chunked) prefill, prefix-cache hit, retraction or P/D handoff
        from the tokens before its next run."""
        self.table[slot] = torch.tensor(history_row(prefix, self.n), dtype=torch.int32)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.table[slots.to(self.table.device, torch.int64)]

    def commit(self, slots: torch.Tensor, windows: torch.Tensor, last: torch.Tensor) -> None:
        """After a step: each request keeps the newest n-1 tokens of its last window.

        `windows` [T, n] as built by `NgramHasher.windows`, `last` [bs] the index of each
        request's last token in the batch.
        """
        newest = newest_history(windows, last.to(windows.device, torch.int64), self.n)
        self.table[slots.to(self.table.device, torch.int64)] = newest.to(self.table.dtype).to(self.table.device)

    def commit_after_verify(self, slots: torch.Tensor, verify_ids: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Speculative decoding: keep only the accepted tokens of each verify block.

        verify_ids [bs, k] is the anchor followed by the drafts; commit_lens [bs] counts the
        anchor plus the accepted drafts (the bonus token is the next block's anchor).
        """
        slots = slots.to(self.table.device, torch.int64)
        window = torch.cat([self.table[slots], verify_ids.to(self.table)], dim=1)
        cols = commit_lens.to(self.table.device, torch.int64).unsqueeze(-1) + torch.arange(
            self.n - 1, device=self.table.device
        )
        self.table[slots] = window.gather(1, cols)
