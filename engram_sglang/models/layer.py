"""The Engram layer in the paper's form (docs/engram.md §5), in plain PyTorch.

For token t with retrieved rows e_t (every hash column of every n-gram order, concatenated):

    k = W_K e_t,  v = W_V e_t
    a_t = sigmoid(signed_sqrt(RMSNorm_h(h_t) . RMSNorm_k(k) / sqrt(D)))
    value_t = a_t * v
    x_t = RMSNorm_v(value_t)                                  (the conv input)
    out_t = value_t + SiLU(sum_j w_j * x_{t - (K-1-j) * dilation})   (causal depthwise conv)

and the residual stream becomes h_t + out_t. The conv reaches (K-1) * dilation tokens back
(12 for kernel 4 and 4-grams), so a serving engine needs the conv inputs of earlier tokens:
`conv_window` takes them however the caller stores them (the reference slices one
sequence; the SGLang model keeps them per KV-cache slot, so prefix-cache hits and chunked
prefill see the same values as one pass over the whole sequence).

Both the reference forward and the SGLang model call this module, so the two differ only
in how they batch and where rows come from. Arithmetic runs in float32; the conv input is
rounded to the model's dtype once (that is what a serving engine stores), then mixed in
float32, and the output is rounded to the model's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import EngramConfig
from ..core.errors import EngramConfigError

SIGNED_SQRT_FLOOR = 1e-6
CONV_KERNEL = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the last dim, times a learned gain (float32 result)."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.sqrt(x.abs().clamp_min(SIGNED_SQRT_FLOOR))


class Gain(nn.Module):
    """The learned gain of an RMSNorm (checkpoint name `<norm>.weight`)."""

    def __init__(self, dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))


class EngramLayer(nn.Module):
    """One Engram layer of a dense model (no hyper-connections).

    Parameters
    ----------
    hidden_size : the model's hidden size D.
    n_columns : hash columns per token, (max_ngram_size - 1) * n_heads.
    head_dim : values per retrieved row (256).
    dilation : the conv's dilation, the largest n-gram order.
    eps : RMSNorm epsilon.

    Checkpoint tensors (under `model.layers.{L}.engram.`): `key_proj.weight` [D, C*256],
    `value_proj.weight` [D, C*256], `norm_h.weight`, `norm_k.weight`, `norm_v.weight` [D],
    `conv.weight` [D, 1, kernel].
    """

    def __init__(self, hidden_size: int, n_columns: int, head_dim: int, dilation: int, eps: float = 1e-6,
                 kernel_size: int = CONV_KERNEL, dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size, self.n_columns, self.head_dim = hidden_size, n_columns, head_dim
        self.dilation, self.kernel_size, self.eps = dilation, kernel_size, eps
        in_features = n_columns * head_dim
        factory = {"dtype": dtype}
        self.key_proj = nn.Linear(in_features, hidden_size, bias=False, **factory)
        self.value_proj = nn.Linear(in_features, hidden_size, bias=False, **factory)
        self.norm_h, self.norm_k, self.norm_v = (Gain(hidden_size, dtype) for _ in range(3))
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False, **factory)

    @classmethod
    def from_config(cls, hf_config, engram: EngramConfig, dtype: torch.dtype | None = None) -> "EngramLayer":
        if engram.hc_mult != 1:
            raise EngramConfigError(
                f"{engram.source}: hc_mult is {engram.hc_mult}, but the Qwen3 Engram family has no hyper-connections "
                f"(hc_mult must be 1)"
            )
        return cls(hf_config.hidden_size, engram.hash_columns, engram.head_dim, engram.max_ngram_size,
                   eps=getattr(hf_config, "rms_norm_eps", 1e-6), dtype=dtype)

    @property
    def reach(self) -> int:
        """How many tokens back the conv reads."""
        return (self.kernel_size - 1) * self.dilation

    # ------------------------------------------------------------------ the pieces
    def gate(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """a_t, float32 [T]: how far the token's retrieved rows open (`engram-sglang scan` reads it)."""
        e = rows.reshape(rows.shape[0], self.n_columns * self.head_dim).float()
        k = F.linear(e, self.key_proj.weight.float())
        dot = (rms_norm(h, self.norm_h.weight, self.eps) * rms_norm(k, self.norm_k.weight, self.eps)).sum(-1)
        return torch.sigmoid(signed_sqrt(dot / math.sqrt(self.hidden_size)))

    def gated_value(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """value_t = a_t * W_V e_t, float32 [T, D]; h [T, D], rows [T, C, head_dim]."""
        e = rows.reshape(rows.shape[0], self.n_columns * self.head_dim).float()
        v = F.linear(e, self.value_proj.weight.float())
        return self.gate(h, rows).unsqueeze(-1) * v

    def conv_input(self, value: torch.Tensor, dtype: torch.dtype, on: torch.Tensor | None = None) -> torch.Tensor:
        """x_t = RMSNorm_v(value_t), rounded to `dtype` (what a serving engine stores per token);
        0 for a token with Engram off (`on` bool [T], None: every token on)."""
        x = rms_norm(value, self.norm_v.weight, self.eps).to(dtype)
        return x if on is None else x.masked_fill(~on.unsqueeze(-1), 0)

    def finish(self, value: torch.Tensor, window: torch.Tensor, dtype: torch.dtype,
               on: torch.Tensor | None = None) -> torch.Tensor:
        """out_t = value_t + SiLU(conv); window [T, kernel, D] holds x at t - (K-1-j)*dilation
        in slot j (oldest first, the token itself last; zeros before the sequence start).
        Exactly 0 for a token with Engram off (`on` bool [T], None: every token on)."""
        w = self.conv.weight.float().squeeze(1).t()  # [kernel, D]
        y = (window.float() * w).sum(1)
        out = (value + F.silu(y)).to(dtype)
        return out if on is None else out.masked_fill(~on.unsqueeze(-1), 0)

    # ---------------------------------------------------------- one whole sequence
    def forward(self, h: torch.Tensor, rows: torch.Tensor, on: torch.Tensor | None = None) -> torch.Tensor:
        """The Engram output (to add to h) of one sequence: h [T, D], rows [T, C, head_dim];
        `on` bool [T] switches Engram off for some tokens (serving/modes.py), None: all on."""
        value = self.gated_value(h, rows)
        x = self.conv_input(value, h.dtype, on)
        return self.finish(value, self.sequence_window(x), h.dtype, on)

    def sequence_window(self, x: torch.Tensor) -> torch.Tensor:
        """[T, kernel, D] conv windows of one sequence's conv inputs x [T, D]."""
        t = torch.arange(x.shape[0], device=x.device)
        back = (self.kernel_size - 1 - torch.arange(self.kernel_size, device=x.device)) * self.dilation
        src = t.unsqueeze(-1) - back  # [T, kernel]
        window = x[src.clamp_min(0)]
        return window.masked_fill((src < 0).unsqueeze(-1), 0)
