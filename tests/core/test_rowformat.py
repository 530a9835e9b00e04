"""The packed row codec against torch's own fp8 / e8m0 decodes, over every code."""

from __future__ import annotations

import pytest
import torch

from engram_sglang.core import rowformat
from engram_sglang.core.rowformat import BLOCK, PAYLOAD_BYTES, ROW_BYTES, bf16_bits, dequantize, pack, quantize, split


def all_codes_rows(gen: torch.Generator, n_rows: int = 1024) -> torch.Tensor:
    """Random rows in which every fp8 code meets every scale byte at least once."""
    rows = torch.randint(0, 256, (n_rows, ROW_BYTES), dtype=torch.uint8, generator=gen)
    codes = torch.arange(256, dtype=torch.uint8)
    # Row r: the 256 fp8 codes in a rotated order, and scale byte r % 256 on every block.
    for r in range(256):
        rows[r, :PAYLOAD_BYTES] = codes.roll(r)
        rows[r, PAYLOAD_BYTES:] = r
    return rows


def torch_oracle(rows: torch.Tensor) -> torch.Tensor:
    """The same decode spelled with torch's native fp8 and e8m0 dtypes."""
    weight, scale = split(rows)
    value = weight.to(torch.float32) * scale.to(torch.float32).repeat_interleave(BLOCK, dim=-1)
    out = value.to(torch.bfloat16)
    return torch.where(out == 0, torch.zeros_like(out), out)  # every zero +0.0


def test_bit_level_luts_match_torch_over_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    fp8 = codes.view(torch.float8_e4m3fn).to(torch.float32)
    e8m0 = codes.view(torch.float8_e8m0fnu).to(torch.float32)
    ours_fp8 = torch.tensor([rowformat.e4m3fn_value(c) for c in range(256)])
    ours_e8m0 = torch.tensor([rowformat.e8m0_value(c) for c in range(256)])
    for a, b in ((ours_fp8, fp8), (ours_e8m0, e8m0)):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        keep = ~torch.isnan(a)
        assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))
    assert rowformat.e8m0_value(0) == 2.0**-127  # SGLang's reading of byte 0, not zero
    assert torch.isnan(torch.tensor(rowformat.e4m3fn_value(0x7F))) and torch.isnan(torch.tensor(rowformat.e4m3fn_value(0xFF)))


def test_dequantize_is_bit_exact_against_torch(rng):
    rows = all_codes_rows(rng)
    got = dequantize(rows)
    assert got.dtype == torch.bfloat16 and got.shape == (rows.shape[0], PAYLOAD_BYTES)
    assert torch.equal(bf16_bits(got), bf16_bits(torch_oracle(rows)))


def test_edge_codes():
    row = torch.zeros(1, ROW_BYTES, dtype=torch.uint8)
    row[0, 0], row[0, 1], row[0, 2], row[0, 3] = 0x80, 0x7F, 0xFF, 0x01  # -0, NaN, NaN, min denormal
    row[0, 32], row[0, 64] = 0x7E, 0xFE  # +448, -448
    row[0, PAYLOAD_BYTES + 0] = 0  # scale 2^-127: products are fp32 denormals
    row[0, PAYLOAD_BYTES + 1] = 254  # 2^127: 448 * 2^127 overflows to +inf
    row[0, PAYLOAD_BYTES + 2] = 0xFF  # NaN scale
    bits = dequantize(row).view(torch.int16)[0]
    assert int(bits[0]) == 0  # -0 code written as +0.0
    out = dequantize(row)[0].float()
    assert torch.isnan(out[1]) and torch.isnan(out[2])
    # 2^-9 * 2^-127 = 2^-136 is below bf16's smallest denormal (2^-133): rounds to +0.
    assert int(bits[3]) == 0
    assert out[32] == float("inf") and torch.isnan(out[64])
    # A denormal that bf16 keeps: 448 * 2^-127 = 1.75 * 2^-119 (normal in fp32 and bf16).
    row[0, 4] = 0x7E
    assert dequantize(row)[0, 4].float() == 448 * 2.0**-127


def test_no_negative_zero_anywhere(rng):
    bits = dequantize(all_codes_rows(rng)).view(torch.int16)
    assert not (bits == -32768).any()


def test_quantize_follows_ocp_mx_floor_rule(rng):
    x = torch.randn(300, PAYLOAD_BYTES, generator=rng) * torch.logspace(-20, 20, 300).unsqueeze(1)
    x[0] = 0.0  # all-zero row
    x[1, :BLOCK] = 448.0  # exactly the max: scale 2^0
    x[2, :BLOCK] = 500.0  # amax in [256, 512) * 2^0: saturates to 448
    q = quantize(x)
    assert q.dtype == torch.uint8 and q.shape == (300, ROW_BYTES)
    blocks = x.reshape(300, 8, BLOCK)
    amax = blocks.abs().amax(-1)
    want_exp = torch.floor(torch.log2(amax.double())).long() - 8
    got_exp = q[:, PAYLOAD_BYTES:].long() - 127
    nz = amax > 0
    assert torch.equal(got_exp[nz], want_exp[nz])
    assert (q[0, PAYLOAD_BYTES:] == 127).all()
    assert (dequantize(q)[1, :BLOCK].float() == 448.0).all()
    assert (dequantize(q)[2, :BLOCK].float() == 448.0).all()
    # Every payload value is the round-to-nearest fp8 of the scaled input (saturated).
    scale = torch.exp2(got_exp.double()).repeat_interleave(BLOCK, -1)
    want_payload = (x.double() / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    got_payload = q[:, :PAYLOAD_BYTES].view(torch.float8_e4m3fn)
    assert torch.equal(got_payload.float()[nz.repeat_interleave(BLOCK, -1)], want_payload.float()[nz.repeat_interleave(BLOCK, -1)])


def test_quantize_refuses_non_finite():
    x = torch.zeros(2, PAYLOAD_BYTES)
    x[1, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(x)


def test_split_and_pack_round_trip(rng):
    rows = all_codes_rows(rng, 300)
    weight, scale = split(rows)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(pack(weight, scale), rows)
    assert torch.equal(pack(weight.view(torch.uint8), scale.view(torch.uint8)), rows)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 264\]"):
        dequantize(torch.zeros(3, 263, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pack wants weight"):
        pack(torch.zeros(3, 256, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8))


def test_bf16_bits_is_a_real_bit_test():
    a = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    assert torch.equal(a, b) is False  # NaN != NaN, so torch.equal cannot be used...
    assert not torch.equal(bf16_bits(a), bf16_bits(b))  # ...and -0 differs from +0 here
    assert torch.equal(bf16_bits(a), bf16_bits(a.clone()))


def test_row_checksums_sum_bits_per_token_and_see_one_changed_bit():
    rows = torch.randn(3, 2, rowformat.ROW_VALUES, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sums = rowformat.row_checksums(rows)
    assert sums.dtype == torch.int64 and sums.shape == (3,)
    assert sums.tolist() == [int(bf16_bits(rows[t]).to(torch.int64).sum()) for t in range(3)]
    flipped = rows.clone()
    flipped.view(torch.int16)[1, 0, 5] ^= 1  # one mantissa bit of one value of token 1
    assert rowformat.row_checksums(flipped).tolist() != sums.tolist()
    assert rowformat.row_checksums(flipped)[[0, 2]].tolist() == sums[[0, 2]].tolist()


def test_the_triton_kernels_own_row_constants_are_the_formats():
    # gather_triton.py is loaded by path where the package is not (bench/gpu_check.py), so it
    # spells the row format itself: it must say what rowformat says.
    pytest.importorskip("triton")
    from engram_sglang.core.ops import gather_triton

    assert gather_triton.ROW_VALUES == rowformat.ROW_VALUES == PAYLOAD_BYTES
    assert gather_triton.ROW_BYTES == ROW_BYTES == gather_triton.ROW_WORDS * 8
