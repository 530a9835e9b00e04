"""What the tests and the benchmarks share: the bit-level oracle of the gather and the
model-shaped id sets. Part of the tools room: nothing in the package imports it.

Loadable where only torch is (the lent GPU runs bench/gpu_check.py with no SGLang, no
transformers): numpy at import, torch handed in by the caller, nothing else of the package.
"""

from __future__ import annotations

import numpy as np

ROW_BYTES = 264  # 256 fp8 payload bytes + 8 e8m0 scale bytes (docs/engram.md section 4)
PAYLOAD = 256
# Model-shaped id batches (docs/architecture.md's performance model): 24 rows per token and layer.
DECODE_IDS = (256, 24)  # a 256-request decode step
PREFILL_IDS = (8192, 24)  # an 8192-token prefill chunk


def oracle_lut(torch):
    """int16 bf16 bits [scale byte, fp8 byte] for all 65536 pairs, from the definitions
    (docs/engram.md section 4): e4m3fn value x 2^(e8m0 - 127), rounded once to bf16;
    NaN -> 0x7FC0, every zero +0. The one oracle of every gather test and GPU check."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    value = sign * np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    value[(b & 0x7F) == 0x7F] = np.nan
    scale = 2.0 ** (np.arange(256) - 127.0)
    scale[255] = np.nan
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (scale[:, None] * value[None, :]).astype(np.float32)
    bf = torch.from_numpy(prod).to(torch.bfloat16)
    bits = bf.view(torch.int16).clone()
    bits[torch.isnan(bf)] = 0x7FC0
    bits[bits == -32768] = 0
    return bits


def raw_bits(torch, x):
    """Raw int16 bit patterns [n, 256] on the CPU (no NaN canonicalization: the op promises it)."""
    return x.reshape(-1, PAYLOAD).view(torch.int16).cpu()


def check_bits(torch, got, want, ids, label: str) -> None:
    """Raise naming the first differing ids unless `got`'s raw bits equal `want` exactly."""
    g = raw_bits(torch, got)
    if not torch.equal(g, want):
        bad = (g != want).any(1).nonzero().flatten()
        some = ids.reshape(-1).cpu()[bad[:5]].tolist()
        raise AssertionError(f"{label}: {bad.numel()} of {want.shape[0]} rows differ from the oracle (ids {some} ...)")
