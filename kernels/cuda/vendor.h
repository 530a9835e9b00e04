// NVIDIA (nvcc) side of the GPU launcher: warp 32, CUDA's launch limit and the native e4m3
// decode of sm_89 and later. Included only by kernels/cuda/compat.h.
#pragma once

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
