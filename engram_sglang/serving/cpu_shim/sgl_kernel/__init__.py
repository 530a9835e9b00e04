"""Pure-torch stand-in for `sgl_kernel` when real SGLang serves on a CPU without AMX.

`sgl-kernel` has no CPU wheel: its import fails without libcuda, yet SGLang's CPU engine
(SGLANG_USE_CPU_ENGINE=1) imports a few `*_cpu` symbols from it at start-up. A dense
model on a CPU without AMX calls only `assign_req_to_token_pool_cpu`; the others exist so
the imports succeed and raise if a code path ever reaches them. This directory is put
first on PYTHONPATH for CPU runs only (engram_sglang.serving.launch); GPU runs use the
real package.
"""

from __future__ import annotations

import torch  # noqa: F401  (loaded first, as by the real sgl_kernel)

__version__ = "0.0.0+engram-cpu-shim"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    at = 0
    for row, lo, hi in zip(rows, starts, ends):
        n = hi - lo
        if n > 0:
            req_to_token[row, lo:hi] = out_cache_loc[at : at + n].to(req_to_token.dtype)
        at += n


def _unavailable(name):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in engram-sglang's CPU stand-in (only AMX CPUs or GPUs use it)"
        )

    op.__name__ = name
    return op


for _name in (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
):
    globals()[_name] = _unavailable(_name)
del _name

__all__ = ["assign_req_to_token_pool_cpu"]
