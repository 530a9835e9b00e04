// compat.h: the one place where CUDA and HIP differ for the GPU launcher (engram_gather.cu).
//
// llama.cpp's way: the launcher is written once against the CUDA runtime API; under HIP the
// names below rename it to HIP's. Besides the renames, only what the hardware makes different
// lives here: the native fp8 decoder of each target, the wavefront width, the launch limit,
// and the prefix of the exported entry points (engram_cuda_* / engram_hip_*, one ABI).
#pragma once

#include <stdint.h>

// The runtime header first: it defines the qualifiers the shared logic uses.
#if defined(__HIP__)
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>
#endif

#include "../common/engram_gather.h"

#if defined(__HIP__)  // clang -x hip (AMD) ------------------------------------------------
#define ENGRAM_VENDOR hip
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaStream_t hipStream_t
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaGetLastError hipGetLastError
#define cudaGetErrorString hipGetErrorString
#define cudaFuncAttributes hipFuncAttributes
#define cudaFuncGetAttributes(attr, fn) hipFuncGetAttributes((attr), reinterpret_cast<const void*>(fn))
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDeviceAttr hipDeviceAttribute_t
#define cudaDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define cudaDevAttrComputeCapabilityMinor hipDeviceAttributeComputeCapabilityMinor
#define cudaDevAttrWarpSize hipDeviceAttributeWarpSize
#define cudaDevAttrUnifiedAddressing hipDeviceAttributeUnifiedAddressing
#define cudaDevAttrCanUseHostPointerForRegisteredMem hipDeviceAttributeCanUseHostPointerForRegisteredMem
#define cudaDevAttrPageableMemoryAccess hipDeviceAttributePageableMemoryAccess
#define cudaDevAttrCanMapHostMemory hipDeviceAttributeCanMapHostMemory

namespace engram_gpu {
constexpr int kWarpSize = 64;                 // CDNA wavefront (gfx942, gfx950)
constexpr int kBlockThreads = 4 * kWarpSize;  // 4 wavefronts: 8 rows per pass
// HIP launches fewer than 2^32 threads in a grid dimension (grid x block): 5.4e8 rows.
constexpr int64_t kMaxBlocks = 0xFFFFFFFFll / kBlockThreads;

// Native e4m3fn decode per gfx target:
//   gfx942 converts only e4m3fnuz natively. For every finite non-zero byte fnuz(b) = fn(b)/2,
//          so decode as fnuz and double the value (engram::fnuz_as_fn), fixing the codes whose
//          meaning differs (0x80, 0x7F, 0xFF) exactly.
//   gfx950 converts OCP e4m3fn natively (the scaled conversion with scale 1.0 is what HIP's own
//          OCP fp8 type uses there); the two NaN codes are forced so the result does not hang
//          on the instruction's NaN details.
// (hipify has no fp8 mappings, which is why this is written by hand.)
struct NativeE4m3fn {
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
        // Any other target someone adds to the build (and the host pass): the portable decode.
        engram::SoftE4m3fn::decode4(w, v);
#endif
    }
};
}  // namespace engram_gpu

#else  // nvcc (NVIDIA) ---------------------------------------------------------------------
#define ENGRAM_VENDOR cuda

namespace engram_gpu {
constexpr int kWarpSize = 32;
constexpr int kBlockThreads = 8 * kWarpSize;  // 8 warps: 8 rows per pass
constexpr int64_t kMaxBlocks = 0x7FFFFFFFll;  // CUDA's grid x limit (6.8e10 rows)

// e4m3fn -> fp32 through the native pair conversion (sm_89 and later): fp8x2 -> f16x2 (exact:
// every e4m3 value is an f16 normal or zero), then f16 -> f32 (exact). The instruction returns
// NaN for the NaN codes 0x7F/0xFF, which is the OCP meaning.
struct NativeE4m3fn {
    static __device__ __forceinline__ void decode2(uint32_t pair, float& a, float& b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        uint32_t h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<unsigned short>(pair)));
        asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
            "cvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
            : "=f"(a), "=f"(b)
            : "r"(h2));
#else
        // Older targets (only if someone adds them to the build): the portable decode.
        a = engram::e4m3fn_to_f32(pair & 0xFFu);
        b = engram::e4m3fn_to_f32((pair >> 8) & 0xFFu);
#endif
    }
    static __device__ __forceinline__ void decode4(uint32_t w, float v[4]) {
        decode2(w & 0xFFFFu, v[0], v[1]);
        decode2(w >> 16, v[2], v[3]);
    }
};
}  // namespace engram_gpu
#endif

// engram_cuda_<name> / engram_hip_<name>: the same entry points and signatures for both.
#define ENGRAM_CAT2(a, b, c) a##b##c
#define ENGRAM_CAT(a, b, c) ENGRAM_CAT2(a, b, c)
#define ENGRAM_API(name) ENGRAM_CAT(engram_, ENGRAM_VENDOR, _##name)
