// AMD (HIP, clang -x hip) side of the GPU launcher: the CUDA runtime names renamed to HIP's,
// wavefront 64, HIP's launch limit and the native fp8 decode of gfx942 / gfx950. Included
// only by kernels/cuda/compat.h.
#pragma once

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
