"""Pure-PyTorch reference forward of the Qwen3 + Engram family, for tests.

Independent of SGLang's serving machinery: no paged KV cache, no batching, no per-request
history. Each greedy step recomputes the whole sequence, hashes it in one shot
(`NgramHasher.hash_sequence`), reads rows straight from the table files and decodes them
with `rowformat.dequantize` (the codec's reference), then runs a textbook Qwen3 decoder
with the Engram layer (engram_sglang.models.layer) added to the residual stream before the
attention of each Engram layer. Weight names are Hugging Face Qwen3's plus
`model.layers.{L}.engram.*`.

Engram off for a token (an Engram mode, serving/modes.py) is defined here: the token reads
no rows (its rows are +0.0), its Engram layers add exactly 0 to the residual stream, and its
short-conv input is 0 for the tokens after it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..core.config import EngramConfig
from ..core.hashing import NgramHasher, compressed_token_map
from ..core.rowformat import dequantize, row_checksums
from ..core.tablefile import open_tables
from .layer import EngramLayer, rms_norm


@dataclasses.dataclass
class Step:
    """What the reference computed for every token of a sequence."""

    hash_ids: torch.Tensor  # int64 [T, n_layers, C]
    checksums: torch.Tensor  # int64 [T, n_layers]
    logits: torch.Tensor  # float32 [T, vocab]


class ReferenceModel:
    """Qwen3 + Engram from a model directory (config.json, *.safetensors, tokenizer) and a
    packed table directory.

    Parameters
    ----------
    engram_scale : multiplies every Engram layer's output (0 switches Engram off: the
        control that proves Engram changes the completions).
    dtype : compute dtype of the backbone (default: the config's `torch_dtype`/`dtype`).
    """

    def __init__(self, model_dir: str | os.PathLike, table_dir: str | os.PathLike, *,
                 engram_scale: float = 1.0, dtype: Optional[torch.dtype] = None, tokenizer=None):
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        c = self.config
        self.engram = EngramConfig.from_pretrained(model_dir)
        if dtype is None:
            dtype = getattr(torch, c.get("dtype") or c.get("torch_dtype") or "float32")
        self.dtype = dtype
        self.engram_scale = engram_scale
        self.weights: dict[str, torch.Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            self.weights.update(load_file(str(f)))
        self.weights = {k: v.to(dtype) for k, v in self.weights.items()}
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        token_map, _ = compressed_token_map(tokenizer)
        self.hasher = NgramHasher(self.engram, token_map)
        self.tables = open_tables(table_dir, self.engram)
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        rope = c.get("rope_parameters") or {}
        self.rope_theta = rope.get("rope_theta", c.get("rope_theta", 1_000_000.0))
        self.layers: dict[int, EngramLayer] = {}
        for layer_id in self.engram.layer_ids:
            layer = EngramLayer(c["hidden_size"], self.engram.hash_columns, self.engram.head_dim,
                                self.engram.max_ngram_size, eps=self.eps)
            prefix = f"model.layers.{layer_id}.engram."
            state = {k[len(prefix):]: v for k, v in self.weights.items() if k.startswith(prefix)}
            layer.load_state_dict(state)
            self.layers[layer_id] = layer.to(dtype)

    # --------------------------------------------------------------------- pieces
    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def rows(self, hash_ids: torch.Tensor, on: Optional[torch.Tensor] = None) -> dict[int, torch.Tensor]:
        """bf16 rows [T, C, 256] of every Engram layer, read from the table files; a token
        with Engram off (`on` bool [T]) reads nothing and gets +0.0 rows."""
        out = {}
        keep = torch.arange(hash_ids.shape[0]) if on is None else on.nonzero().squeeze(1)
        for i, layer_id in enumerate(self.engram.layer_ids):
            ids = hash_ids[keep, i].reshape(-1).numpy()
            packed = torch.from_numpy(self.tables[layer_id][ids])
            rows = torch.zeros(*hash_ids[:, i].shape, self.engram.head_dim, dtype=torch.bfloat16)
            rows[keep] = dequantize(packed).view(keep.numel(), hash_ids.shape[2], self.engram.head_dim)
            out[layer_id] = rows
        return out

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self._w(name), self.eps).to(self.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding, x [T, heads, head_dim]."""
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / self.head_dim))
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, half]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(self.dtype)

    def _attention(self, x: torch.Tensor, i: int, positions: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        q = F.linear(x, self._w(p + "q_proj.weight")).view(T, self.n_heads, self.head_dim)
        k = F.linear(x, self._w(p + "k_proj.weight")).view(T, self.n_kv, self.head_dim)
        v = F.linear(x, self._w(p + "v_proj.weight")).view(T, self.n_kv, self.head_dim)
        q = self._rope(rms_norm(q, self._w(p + "q_norm.weight"), self.eps).to(self.dtype), positions)
        k = self._rope(rms_norm(k, self._w(p + "k_norm.weight"), self.eps).to(self.dtype), positions)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                           scale=self.head_dim**-0.5)
        return F.linear(o.transpose(0, 1).reshape(T, -1), self._w(p + "o_proj.weight"))

    def _mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        return F.linear(F.silu(F.linear(x, self._w(p + "gate_proj.weight"))) * F.linear(x, self._w(p + "up_proj.weight")),
                        self._w(p + "down_proj.weight"))

    # ---------------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, tokens: Sequence[int], engram_on: Optional[Sequence[bool]] = None) -> Step:
        """Logits and Engram lookups of every position of one sequence; `engram_on`: per
        position whether Engram is on (None: everywhere; serving/modes.py `mask_for`)."""
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        positions = torch.arange(ids.numel())
        on = None if engram_on is None else torch.as_tensor(list(engram_on), dtype=torch.bool)
        if on is not None and on.shape != ids.shape:
            raise ValueError(f"engram_on has {on.numel()} entries for {ids.numel()} tokens")
        hash_ids = self.hasher.hash_sequence(ids)
        rows = self.rows(hash_ids, on)
        checksums = torch.stack([row_checksums(rows[L]) for L in self.engram.layer_ids], dim=1)
        h = self._w("model.embed_tokens.weight")[ids]
        for i in range(self.n_layers):
            if i in self.layers:
                h = h + self.layers[i](h, rows[i], on) * self.engram_scale
            h = h + self._attention(self._norm(h, f"model.layers.{i}.input_layernorm.weight"), i, positions)
            h = h + self._mlp(self._norm(h, f"model.layers.{i}.post_attention_layernorm.weight"), i)
        h = self._norm(h, "model.norm.weight")
        head = self.weights.get("lm_head.weight", self._w("model.embed_tokens.weight"))
        return Step(hash_ids, checksums, F.linear(h, head).float())

    def generate(self, prompt: Sequence[int], max_new_tokens: int, mode=None) -> tuple[list[int], Step]:
        """Greedy completion (no stop tokens); returns the new tokens and the lookups of
        the whole final sequence (prompt + completion minus the last token). `mode`: an
        Engram mode (serving.modes.Mode, or a request's custom_params value), None: on."""
        from ..serving.modes import Mode, mask_for, parse_mode

        if mode is not None and not isinstance(mode, Mode):
            mode = parse_mode(mode)
        tokens = list(prompt)
        step = None
        for _ in range(max_new_tokens):
            on = None if mode is None else mask_for(mode, len(prompt), len(tokens))
            step = self.forward(tokens, on)
            tokens.append(int(step.logits[-1].argmax()))
        return tokens[len(prompt):], step

    def margins(self, prompt: Sequence[int], max_new_tokens: int) -> list[float]:
        """Top-1 minus top-2 logit at every greedy step: how far each choice is from a tie."""
        new, step = self.generate(prompt, max_new_tokens)
        top = step.logits[len(prompt) - 1:].topk(2, dim=-1).values
        return (top[:, 0] - top[:, 1]).tolist()
