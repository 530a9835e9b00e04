// CUDA launcher of the Engram gather (kernels/common/engram_gather.h holds the logic).
//
// What is NVIDIA-specific, and only that: the native e4m3 conversion (cvt.rn.f16x2.e4m3x2,
// sm_89 and later), warp 32, the launch shape, and the CUDA runtime calls. Torch-free: built by
// nvcc into libengram_cuda.so and called through ctypes with raw pointers and the caller's
// stream, so it also runs where torch's own CUDA extension toolchain is absent.
//
// Build flags matter for correctness: no --use_fast_math and -ftz=false, so the 2^-127 scale
// (an fp32 denormal) is not flushed to zero (tests/test_kernel_builds.py checks the PTX).
#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/engram_gather.h"

#ifndef ENGRAM_CUDA_TARGETS
#define ENGRAM_CUDA_TARGETS "unknown"
#endif

namespace {

constexpr int kWarpSize = 32;
constexpr int kBlockThreads = 8 * kWarpSize;  // 8 warps: 8 rows per pass
constexpr int kUnroll = 4;                    // rows in flight per thread
constexpr int kRowsPerPass = kBlockThreads / engram::kChunksPerRow;
constexpr int kRowsPerBlock = kRowsPerPass * kUnroll;
static_assert(kWarpSize % engram::kChunksPerRow == 0, "a warp covers whole rows");

// e4m3fn -> fp32 through the native pair conversion: fp8x2 -> f16x2 (exact: every e4m3 value
// is an f16 normal or zero), then f16 -> f32 (exact). The instruction returns NaN for the NaN
// codes 0x7F/0xFF, which is the OCP meaning.
struct NvE4m3fn {
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

template <typename IdT>
__global__ void __launch_bounds__(kBlockThreads)
    engram_gather_kernel(const uint8_t* __restrict__ table, const IdT* __restrict__ ids,
                         int64_t n, int64_t lo, int64_t hi, uint16_t* __restrict__ out) {
    const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
    engram::gather_dequant_rows<NvE4m3fn, kUnroll, IdT>(table, ids, n, lo, hi, out, first_row,
                                                       kRowsPerPass, threadIdx.x);
}

}  // namespace

extern "C" {

// Bumped when an entry point's signature or meaning changes; ops/native.py checks it.
int engram_cuda_abi_version(void) { return 1; }

// Space-separated targets this library holds (sm_XY SASS, compute_XY PTX).
const char* engram_cuda_targets(void) { return ENGRAM_CUDA_TARGETS; }

const char* engram_cuda_error_string(int code) {
    if (code == engram::kBadArgument) return "engram: bad argument";
    if (code == engram::kMisaligned) return "engram: table must be 8-byte and out 16-byte aligned";
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Can the gather run on `device`? 0 when this library holds code for it, else the CUDA error
// (209 cudaErrorNoKernelImageForDevice when no SASS/PTX fits, 35/100 without driver/device).
// binary_version gets the SASS version that would run (e.g. 90), or 0.
int engram_cuda_check_device(int device, int* binary_version) {
    if (binary_version) *binary_version = 0;
    int prev = 0;
    cudaError_t err = cudaGetDevice(&prev);
    if (err != cudaSuccess) return err;
    if ((err = cudaSetDevice(device)) != cudaSuccess) return err;
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, engram_gather_kernel<int64_t>);
    cudaSetDevice(prev);
    if (err == cudaSuccess && binary_version) *binary_version = attr.binaryVersion;
    return err;
}

// Device facts the probe wants beyond torch's properties: out[0..5] = compute capability
// major, minor, warp size, unified addressing, can use host pointer for registered memory,
// pageable memory access. Returns 0 or a CUDA error.
int engram_cuda_device_info(int device, int* out) {
    const cudaDeviceAttr attrs[6] = {
        cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
        cudaDevAttrWarpSize, cudaDevAttrUnifiedAddressing,
        cudaDevAttrCanUseHostPointerForRegisteredMem, cudaDevAttrPageableMemoryAccess};
    for (int i = 0; i < 6; ++i) {
        const cudaError_t err = cudaDeviceGetAttribute(&out[i], attrs[i], device);
        if (err != cudaSuccess) return err;
    }
    return 0;
}

// Gather rows ids[0..n) (int32 when id_bytes == 4, int64 when 8) of a packed table holding
// global rows [lo, hi) into out[n][256] (bf16 bits) on `stream`. `table` may be device memory
// or host memory mapped into the device's address space (cudaHostRegister, UVA); ids and out
// must be device-accessible. Ids outside [lo, hi) give +0 rows. Asynchronous: returns 0 or the
// launch error; execution errors surface at the next synchronization.
int engram_cuda_gather_dequant(const void* table, const void* ids, int id_bytes, int64_t n,
                               int64_t lo, int64_t hi, void* out, void* stream) {
    if (n < 0 || lo < 0 || lo > hi || (id_bytes != 4 && id_bytes != 8)) return engram::kBadArgument;
    if (n == 0) return 0;
    if (ids == nullptr || out == nullptr || (table == nullptr && hi > lo)) return engram::kBadArgument;
    if ((reinterpret_cast<uintptr_t>(table) & 7u) || (reinterpret_cast<uintptr_t>(out) & 15u))
        return engram::kMisaligned;
    const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    if (blocks > 0x7FFFFFFF) return engram::kBadArgument;  // CUDA's grid x limit (6.8e10 rows)
    const dim3 grid(static_cast<unsigned>(blocks)), block(kBlockThreads);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const uint8_t* t = static_cast<const uint8_t*>(table);
    uint16_t* o = static_cast<uint16_t*>(out);
    if (id_bytes == 4)
        engram_gather_kernel<int32_t><<<grid, block, 0, s>>>(t, static_cast<const int32_t*>(ids), n, lo, hi, o);
    else
        engram_gather_kernel<int64_t><<<grid, block, 0, s>>>(t, static_cast<const int64_t*>(ids), n, lo, hi, o);
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
