// HIP launcher of the Engram gather for AMD Instinct: MI300X (gfx942) and MI355X (gfx950).
// kernels/common/engram_gather.h holds the logic; this file holds only what AMD needs:
// wavefront 64, the native fp8 conversions per target, the launch shape and the HIP calls.
//
// Hand-written rather than hipified from the CUDA launcher: hipify has no fp8 mappings, and
// the two targets read fp8 differently:
//   gfx942 converts only e4m3fnuz natively. For every finite non-zero byte fnuz(b) = fn(b)/2,
//          so decode as fnuz and double the value (engram::fnuz_as_fn), fixing the codes whose
//          meaning differs (0x80, 0x7F, 0xFF) exactly.
//   gfx950 converts OCP e4m3fn natively (the scaled conversion with scale 1.0 is what HIP's
//          own OCP fp8 type uses there); the two NaN codes are forced so the result does not
//          hang on the instruction's NaN details.
// Built with -fno-gpu-flush-denormals-to-zero: the 2^-127 scale is an fp32 denormal
// (tests/test_kernel_builds.py checks .amdhsa_float_denorm_mode_32 in each code object).
//
// Not linked against libamdhip64: its soname changes across ROCm releases (Debian's is .so.5,
// ROCm 6/7 ship .so.6/.so.7). The HIP symbols resolve at load time against the runtime that
// torch already loaded (ops/native.py makes it global first).
#include <hip/hip_runtime.h>
#include <stdint.h>

#include "../common/engram_gather.h"

#ifndef ENGRAM_HIP_TARGETS
#define ENGRAM_HIP_TARGETS "unknown"
#endif

namespace {

constexpr int kWarpSize = 64;                 // CDNA wavefront (gfx942, gfx950)
constexpr int kBlockThreads = 4 * kWarpSize;  // 4 waves: 8 rows per pass
constexpr int kUnroll = 4;                    // rows in flight per thread
constexpr int kRowsPerPass = kBlockThreads / engram::kChunksPerRow;
constexpr int kRowsPerBlock = kRowsPerPass * kUnroll;
static_assert(kWarpSize % engram::kChunksPerRow == 0, "a wavefront covers whole rows");

struct AmdE4m3fn {
    static __device__ __forceinline__ void decode4(uint32_t w, float v[4]) {
#if defined(__gfx942__)
        // Bytes 0-1 (word_sel false) and 2-3 (true), read as e4m3fnuz.
        const auto lo = __builtin_amdgcn_cvt_pk_f32_fp8(static_cast<int>(w), false);
        const auto hi = __builtin_amdgcn_cvt_pk_f32_fp8(static_cast<int>(w), true);
        v[0] = engram::fnuz_as_fn(lo[0], w & 0xFFu);
        v[1] = engram::fnuz_as_fn(lo[1], (w >> 8) & 0xFFu);
        v[2] = engram::fnuz_as_fn(hi[0], (w >> 16) & 0xFFu);
        v[3] = engram::fnuz_as_fn(hi[1], w >> 24);
#elif defined(__gfx950__)
        const auto lo = __builtin_amdgcn_cvt_scalef32_pk_f32_fp8(w, 1.0f, false);
        const auto hi = __builtin_amdgcn_cvt_scalef32_pk_f32_fp8(w, 1.0f, true);
        v[0] = engram::fn_nan_codes(lo[0], w & 0xFFu);
        v[1] = engram::fn_nan_codes(lo[1], (w >> 8) & 0xFFu);
        v[2] = engram::fn_nan_codes(hi[0], (w >> 16) & 0xFFu);
        v[3] = engram::fn_nan_codes(hi[1], w >> 24);
#else
        // Any other target someone adds to the build: the portable decode.
        engram::SoftE4m3fn::decode4(w, v);
#endif
    }
};

template <typename IdT>
__global__ void __launch_bounds__(kBlockThreads)
    engram_gather_kernel(const uint8_t* __restrict__ table, const IdT* __restrict__ ids,
                         int64_t n, int64_t lo, int64_t hi, uint16_t* __restrict__ out) {
    const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
    engram::gather_dequant_rows<AmdE4m3fn, kUnroll, IdT>(table, ids, n, lo, hi, out, first_row,
                                                        kRowsPerPass, threadIdx.x);
}

}  // namespace

extern "C" {

// Bumped when an entry point's signature or meaning changes; ops/native.py checks it.
int engram_hip_abi_version(void) { return 1; }

// Space-separated gfx targets this library holds code objects for.
const char* engram_hip_targets(void) { return ENGRAM_HIP_TARGETS; }

const char* engram_hip_error_string(int code) {
    if (code == engram::kBadArgument) return "engram: bad argument";
    if (code == engram::kMisaligned) return "engram: table must be 8-byte and out 16-byte aligned";
    return hipGetErrorString(static_cast<hipError_t>(code));
}

// Can the gather run on the current device? 0 when a code object fits, else the HIP error
// (hipErrorNoBinaryForGpu when none does).
int engram_hip_check_device(int device) {
    int prev = 0;
    hipError_t err = hipGetDevice(&prev);
    if (err != hipSuccess) return err;
    if ((err = hipSetDevice(device)) != hipSuccess) return err;
    // Padded: hipFuncAttributes may grow in later ROCm releases than the headers built with.
    union {
        hipFuncAttributes attr;
        unsigned char pad[1024];
    } a;
    err = hipFuncGetAttributes(&a.attr, reinterpret_cast<const void*>(&engram_gather_kernel<int64_t>));
    (void)hipSetDevice(prev);
    return err;
}

// Same contract as engram_cuda_gather_dequant: rows ids[0..n) of a packed table holding global
// rows [lo, hi) -> out[n][256] bf16 bits on `stream` (hipStream_t); `table` in device memory or
// in host memory registered with hipHostRegister (mapped); ids outside [lo, hi) give +0 rows.
int engram_hip_gather_dequant(const void* table, const void* ids, int id_bytes, int64_t n,
                              int64_t lo, int64_t hi, void* out, void* stream) {
    if (n < 0 || lo < 0 || lo > hi || (id_bytes != 4 && id_bytes != 8)) return engram::kBadArgument;
    if (n == 0) return 0;
    if (ids == nullptr || out == nullptr || (table == nullptr && hi > lo)) return engram::kBadArgument;
    if ((reinterpret_cast<uintptr_t>(table) & 7u) || (reinterpret_cast<uintptr_t>(out) & 15u))
        return engram::kMisaligned;
    const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    // HIP launches at most 2^32 - 1 threads in a grid dimension (grid x block): 5.4e8 rows.
    if (blocks > int64_t{0xFFFFFFFF} / kBlockThreads) return engram::kBadArgument;
    const dim3 grid(static_cast<unsigned>(blocks)), block(kBlockThreads);
    hipStream_t s = static_cast<hipStream_t>(stream);
    const uint8_t* t = static_cast<const uint8_t*>(table);
    uint16_t* o = static_cast<uint16_t*>(out);
    if (id_bytes == 4)
        engram_gather_kernel<int32_t><<<grid, block, 0, s>>>(t, static_cast<const int32_t*>(ids), n, lo, hi, o);
    else
        engram_gather_kernel<int64_t><<<grid, block, 0, s>>>(t, static_cast<const int64_t*>(ids), n, lo, hi, o);
    return static_cast<int>(hipGetLastError());
}

}  // extern "C"
