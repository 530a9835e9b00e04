"""Triton backend of the Engram gather: the same logic as kernels/common/engram_gather.h.

Self-contained (torch and triton only, no package imports) so that bench/gpu_check.py can
load this file by path on a machine without the package's other dependencies; written for
Triton 3.6 and later.

The fp8 decode is bit-level integer arithmetic rather than Triton's fp8 casts: the
interpreter's casts get the special codes wrong (docs/toolchain.md), and Triton's software
conversion on targets without native e4m3fn (gfx942) is not ours to vouch for. On a GPU the
gather is memory-bound either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BYTES = 264
ROW_WORDS = ROW_BYTES // 8  # the table is read as int64 words: rows are 8-byte aligned
ROW_VALUES = 256
ROWS_PER_PROGRAM = 16


@triton.jit
def _e4m3fn_bits(b):
    """fp32 bits (uint32) of e4m3fn bytes b (uint32, 0..255); NaN codes -> 0x7FC00000."""
    sign = (b & 0x80) << 24
    em = b & 0x7F
    normal = sign | ((em + (120 << 3)) << 20)
    # Subnormal m * 2^-9 (m = em = 1..7): leading one at bit p, fp32 exponent field 118 + p.
    p = (em >= 2).to(tl.uint32) + (em >= 4).to(tl.uint32)
    sub = ((118 + p) << 23) | ((em << (23 - p)) & 0x7FFFFF)
    sub = tl.where(em == 0, 0, sub)
    bits = tl.where(em < 8, sign | sub, normal)
    return tl.where(em == 0x7F, 0x7FC00000, bits)


@triton.jit
def _gather_dequant_kernel(table_ptr, ids_ptr, out_ptr, n, lo, hi, ROWS: tl.constexpr):
    # table_ptr: int64 words [R, 33]; out_ptr: int16 [n, 256] (bf16 bits).
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    rmask = r < n
    ids = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
    live = rmask & (ids >= lo) & (ids < hi)
    base = tl.where(live, ids - lo, 0) * 33  # int64 offsets: tables beyond 2 GiB
    j = tl.arange(0, 32)  # payload word: values 8j .. 8j+7
    k = tl.arange(0, 8)  # byte within the word
    words = tl.load(table_ptr + base[:, None] + j[None, :], mask=live[:, None], other=0)
    sword = tl.load(table_ptr + base + 32, mask=live, other=0)  # the 8 scale bytes
    b = ((words[:, :, None] >> (k * 8)[None, None, :]) & 0xFF).to(tl.uint32)  # [ROWS, 32, 8]
    e = ((sword[:, None] >> ((j // 4) * 8)[None, :]) & 0xFF).to(tl.uint32)  # [ROWS, 32]
    # e8m0: 2^(e-127); byte 0 is the fp32 denormal 2^-127, 0xFF is NaN.
    s_bits = tl.where(e == 0, 0x00400000, e << 23)
    s_bits = tl.where(e == 0xFF, 0x7FC00000, s_bits)
    scale = s_bits.to(tl.float32, bitcast=True)
    value = _e4m3fn_bits(b).to(tl.float32, bitcast=True)
    u = (value * scale[:, :, None]).to(tl.uint32, bitcast=True)  # one fp32 product
    # One rounding to bf16 (nearest even), canonical NaN, -0 -> +0.
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rb = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rb = tl.where(nan, 0x7FC0, rb)
    rb = tl.where(rb == 0x8000, 0, rb)
    rb = tl.where(live[:, None, None], rb, 0)
    offs = r[:, None, None] * 256 + (j * 8)[None, :, None] + k[None, None, :]
    tl.store(out_ptr + offs, rb.to(tl.int16), mask=rmask[:, None, None])


def gather_dequant_triton(table: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
                          words=None) -> None:
    """Rows ids (int32/int64, 1-D, contiguous) of a packed uint8 [R, 264] table holding global
    rows [lo, hi) -> out bf16 [n, 256] (contiguous). Launches on the current stream. `words`:
    what the kernel reads the table by instead (an int64 pointer object: a host table's
    device address)."""
    n = ids.numel()
    if n == 0:
        return
    if words is None:
        words = table.view(torch.int64) if table.numel() else table.new_zeros((1, ROW_WORDS), dtype=torch.int64)
    grid = (triton.cdiv(n, ROWS_PER_PROGRAM),)
    _gather_dequant_kernel[grid](words, ids, out.view(torch.int16), n, lo, hi, ROWS=ROWS_PER_PROGRAM, num_warps=4)
