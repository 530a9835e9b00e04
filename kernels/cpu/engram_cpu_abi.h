// engram_cpu_abi.h: the C ABI of libengram_cpu.so (kernels/cpu/engram_gather.cpp), the host
// gather. engram_gather.cpp includes it, so the compiler checks every definition against these
// prototypes; engram_sglang/core/ops/native.py binds them with ctypes, and tests/kernels/test_native_abi.py
// checks that binding against this file. Torch-free, C and C++.
#pragma once

#include <stdint.h>

#include "../common/engram_status.h"

// What engram_cpu_abi_version() returns: bumped when an entry point's signature or meaning
// changes (ops/native.py's ABI_VERSION["cpu"]).
#define ENGRAM_CPU_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

int engram_cpu_abi_version(void);

// The threads a gather runs on when asked for 0 (all usable cores, or ENGRAM_CPU_THREADS).
int engram_cpu_default_threads(void);

// The threads a gather of n rows runs on when asked for `threads` (<= 0: all usable cores).
int engram_cpu_threads_for(int64_t n, int threads);

// Which row decode the production gather runs here: 1 the AVX-512 VBMI decode, 0 the portable
// one (ISA clones of engram::dequant_row_host). For tests and benchmark reports.
int engram_cpu_decode_avx512(void);

// Gather rows `ids[0..n)` (int32 when id_bytes == 4, int64 when 8) of a packed table holding
// global rows [lo, hi) and write bf16 bits to out[n][256]; ids outside [lo, hi) give +0 rows.
// threads <= 0 means all usable cores (or ENGRAM_CPU_THREADS). Returns ENGRAM_OK or a negative
// engram_status.
int engram_cpu_gather_dequant(const uint8_t* table, const void* ids, int id_bytes, int64_t n, int64_t lo,
                              int64_t hi, uint16_t* out, int threads);

// Test hook: the same gather through another decode path (`decoder`: 1 the host form with
// gfx942's fnuz -> fn fix-up, 2 the GPU launchers' device form run thread by thread, 3 the
// device form with the fix-up, 5 the portable host decode). Other values: ENGRAM_BAD_ARGUMENT.
int engram_cpu_gather_dequant_emulated(const uint8_t* table, const void* ids, int id_bytes, int64_t n,
                                       int64_t lo, int64_t hi, uint16_t* out, int threads, int decoder);

// Benchmark limit: the packed rows of `ids` copied to out[n][264] (+0 rows outside [lo, hi)),
// by the production gather's loop and threads minus the decode.
int engram_cpu_gather_raw(const uint8_t* table, const void* ids, int id_bytes, int64_t n, int64_t lo,
                          int64_t hi, uint8_t* out, int threads);

#ifdef __cplusplus
}  // extern "C"
#endif
