"""Packed Engram rows: 256 fp8 e4m3fn values + 8 e8m0 block scales = 264 bytes a row.

One row is one contiguous run of memory (one read on disk for 93.75% of rows), unlike the
checkpoint's two arrays. This module is the torch reference of the format: every gather
backend must return exactly `dequantize`'s bf16 bits (NaNs aside, which are canonical).

Decoding (docs/engram.md §4): value = fp32(e4m3fn byte) * 2^(scale byte - 127), with
scale byte 0 = 2^-127 (an fp32 denormal; never flushed) and 0xFF = NaN, rounded once to
bf16 (round to nearest even); every zero is written +0.0 so row-range shards summed over
ranks reproduce the unsharded bits.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

ROW_VALUES = 256  # bf16 values a packed row decodes to: the width of every gathered row
PAYLOAD_BYTES = ROW_VALUES  # one e4m3fn byte per value
SCALE_BYTES = 8
ROW_BYTES = PAYLOAD_BYTES + SCALE_BYTES
BLOCK = PAYLOAD_BYTES // SCALE_BYTES  # values per e8m0 scale
FP8_MAX = 448.0  # largest finite e4m3fn magnitude
_E4M3_EMAX = 8  # exponent of FP8_MAX: the OCP MX scale rule subtracts it


# ------------------------------------------------------------------ decode tables
def e4m3fn_value(code: int) -> float:
    """Bit-level decode of one OCP e4m3fn byte (1 sign, 4 exponent bits bias 7, 3 mantissa)."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")  # e4m3fn has no infinities; S.1111.111 is NaN
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: man/8 * 2^(1-7)
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def e8m0_value(code: int) -> float:
    """Bit-level decode of one e8m0 scale byte: 2^(code - 127); 0xFF is NaN."""
    return float("nan") if code == 0xFF else 2.0 ** (code - 127)


@functools.lru_cache(maxsize=None)
def _luts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    fp8 = torch.tensor([e4m3fn_value(c) for c in range(256)], dtype=torch.float32)
    e8m0 = torch.tensor([e8m0_value(c) for c in range(256)], dtype=torch.float32)
    return fp8.to(device), e8m0.to(device)


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dtype != torch.uint8 or rows.ndim < 1 or rows.shape[-1] != ROW_BYTES:
        raise ValueError(
            f"packed Engram rows must be uint8 [..., {ROW_BYTES}], got {rows.dtype} {tuple(rows.shape)}"
        )


# ------------------------------------------------------------------------ decode
def dequantize(rows: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Packed rows uint8 [..., 264] -> bf16 [..., 256] (the reference decode)."""
    rows = torch.as_tensor(rows)
    _check_rows(rows)
    fp8, e8m0 = _luts(rows.device)
    values = fp8[rows[..., :PAYLOAD_BYTES].long()]
    scales = e8m0[rows[..., PAYLOAD_BYTES:].long()].repeat_interleave(BLOCK, dim=-1)
    # One fp32 product (exact, or a denormal, or inf), then one rounding to bf16.
    out = (values * scales).to(torch.bfloat16)
    # -0 (code 0x80, or a negative product that rounds to zero) becomes +0.
    return out.view(torch.int16).masked_fill_(out.view(torch.int16) == -32768, 0).view(torch.bfloat16)


# ------------------------------------------------------------------------ encode
def quantize(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Float rows [N, 256] -> packed uint8 [N, 264] by the OCP MX rule.

    Per block of 32 values the scale exponent is floor(log2(amax)) - 8 (8 = exponent of
    e4m3fn's max), clamped to the e8m0 range; values are divided by the scale, saturated
    to +-448 and rounded to nearest even. An all-zero block gets scale byte 127 (2^0), so
    readers that disagree on byte 0 agree on it.
    """
    x = torch.as_tensor(x)
    if x.ndim < 1 or x.shape[-1] != PAYLOAD_BYTES:
        raise ValueError(f"quantize wants float rows [..., {PAYLOAD_BYTES}], got {tuple(x.shape)}")
    x = x.to(torch.float32)
    if not torch.isfinite(x).all():
        raise ValueError("quantize: rows hold NaN or infinite values; an Engram table must be finite")
    blocks = x.reshape(*x.shape[:-1], SCALE_BYTES, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    scale_exp = (exp - 1 - _E4M3_EMAX).clamp(-127, 127)
    scale_exp = torch.where(amax > 0, scale_exp, torch.zeros_like(scale_exp))
    scaled = blocks * torch.exp2(-scale_exp.to(torch.float32)).unsqueeze(-1)
    # torch's fp8 cast does not saturate (448 < x -> NaN): clamp first.
    payload = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    payload = payload.reshape(*x.shape[:-1], PAYLOAD_BYTES)
    scale_bytes = (scale_exp + 127).to(torch.uint8)
    return torch.cat([payload, scale_bytes], dim=-1).contiguous()


# ------------------------------------------------------------- split <-> packed
def pack(weight: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Checkpoint layout (fp8 weight [R, 256], e8m0 scale [R, 8]; or their uint8 bytes)
    -> packed rows uint8 [R, 264]."""
    w, s = _as_bytes(weight), _as_bytes(scale)
    if w.ndim != 2 or w.shape[1] != PAYLOAD_BYTES or s.ndim != 2 or s.shape[1] != SCALE_BYTES or s.shape[0] != w.shape[0]:
        raise ValueError(
            f"pack wants weight [R, {PAYLOAD_BYTES}] and scale [R, {SCALE_BYTES}], got "
            f"{tuple(w.shape)} and {tuple(s.shape)}"
        )
    return torch.cat([w, s], dim=1)


def split(rows: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows [R, 264] -> (fp8 e4m3fn weight [R, 256], e8m0 scale [R, 8]) as upstream stores them."""
    rows = torch.as_tensor(rows)
    _check_rows(rows)
    weight = rows[..., :PAYLOAD_BYTES].contiguous().view(torch.float8_e4m3fn)
    scale = rows[..., PAYLOAD_BYTES:].contiguous().view(torch.float8_e8m0fnu)
    return weight, scale


def _as_bytes(t: torch.Tensor | np.ndarray) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise ValueError(f"expected a 1-byte dtype (fp8, e8m0 or uint8), got {t.dtype}")
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ test helper
def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as int16 with every NaN mapped to one canonical NaN: the bit test
    (torch.equal treats NaN != NaN and -0 == +0)."""
    bits = x.to(torch.bfloat16).view(torch.int16).clone()
    bits[torch.isnan(x.to(torch.bfloat16))] = 0x7FC0
    return bits


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """Per-token checksum of gathered bf16 rows [T, C, ROW_VALUES]: the sum of their bit
    patterns (NaNs canonical) as int64 [T]. Equal bits give equal sums; the serving trace
    and the reference model both write it, and the tests compare the two."""
    return bf16_bits(rows).to(torch.int64).reshape(rows.shape[0], -1).sum(-1)
