// The GPU launcher of the Engram gather, one source for CUDA (nvcc) and HIP (clang -x hip).
//
// kernels/common/engram_gather.h holds the logic; kernels/cuda/compat.h renames the CUDA runtime
// calls to HIP's and holds what the hardware makes different (native fp8 decoders, wavefront
// width, launch limit). Torch-free: called through ctypes with raw pointers and the caller's
// stream, so it also runs where torch's own extension toolchain is absent.
//
// Runtime binding: the CUDA build links the shared libcudart by soname (-cudart shared), the HIP
// build leaves its HIP symbols unresolved (libamdhip64's soname changes across ROCm releases);
// either way they resolve against the runtime torch already loaded (ops/native.py checks it).
//
// Build flags matter for correctness: no fast math and denormals kept (nvcc -ftz=false, clang
// -fno-gpu-flush-denormals-to-zero), so the 2^-127 scale (an fp32 denormal) is not flushed to
// zero (tests/kernels/test_kernel_builds.py checks the PTX and each code object).
#include <stdint.h>

#include "compat.h"

#ifndef ENGRAM_TARGETS
#define ENGRAM_TARGETS "unknown"
#endif

namespace {

using engram_gpu::kBlockThreads;
constexpr int kUnroll = 4;  // rows in flight per thread
constexpr int kRowsPerPass = kBlockThreads / engram::kChunksPerRow;
constexpr int kRowsPerBlock = kRowsPerPass * kUnroll;
static_assert(engram_gpu::kWarpSize % engram::kChunksPerRow == 0, "a warp covers whole rows");

template <typename IdT>
__global__ void __launch_bounds__(kBlockThreads)
    engram_gather_kernel(const uint8_t* __restrict__ table, const IdT* __restrict__ ids,
                         int64_t n, int64_t lo, int64_t hi, uint16_t* __restrict__ out) {
    const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
    engram::gather_dequant_rows<engram_gpu::NativeE4m3fn, kUnroll, IdT>(table, ids, n, lo, hi, out, first_row,
                                                                       kRowsPerPass, threadIdx.x);
}

}  // namespace

extern "C" {

// The entry points of engram_gpu_abi.h (their meaning is documented there).
int ENGRAM_GPU_API(abi_version)(void) { return ENGRAM_GPU_ABI_VERSION; }

const char* ENGRAM_GPU_API(targets)(void) { return ENGRAM_TARGETS; }

const char* ENGRAM_GPU_API(error_string)(int code) {
    if (code == engram::kBadArgument) return "engram: bad argument";
    if (code == engram::kMisaligned) return "engram: table must be 8-byte and out 16-byte aligned";
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int ENGRAM_GPU_API(check_device)(int device, int* binary_version) {
    if (binary_version) *binary_version = 0;
    int prev = 0;
    cudaError_t err = cudaGetDevice(&prev);
    if (err != cudaSuccess) return err;
    if ((err = cudaSetDevice(device)) != cudaSuccess) return err;
    // Padded: the attribute struct may grow in later runtime releases than the headers built with.
    union {
        cudaFuncAttributes attr;
        unsigned char pad[1024];
    } a;
    err = cudaFuncGetAttributes(&a.attr, engram_gather_kernel<int64_t>);
    (void)cudaSetDevice(prev);
    if (err == cudaSuccess && binary_version) *binary_version = a.attr.binaryVersion;
    return err;
}

int ENGRAM_GPU_API(device_info)(int device, int* out) {
    const cudaDeviceAttr attrs[7] = {
        cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
        cudaDevAttrWarpSize, cudaDevAttrUnifiedAddressing,
        cudaDevAttrCanUseHostPointerForRegisteredMem, cudaDevAttrPageableMemoryAccess,
        cudaDevAttrCanMapHostMemory};
    for (int i = 0; i < 7; ++i) {
        const cudaError_t err = cudaDeviceGetAttribute(&out[i], attrs[i], device);
        if (err != cudaSuccess) return err;
    }
    return 0;
}

int ENGRAM_GPU_API(gather_dequant)(const void* table, const void* ids, int id_bytes, int64_t n, int64_t lo,
                               int64_t hi, void* out, void* stream) {
    if (n < 0 || lo < 0 || lo > hi || (id_bytes != 4 && id_bytes != 8)) return engram::kBadArgument;
    if (n == 0) return 0;
    if (ids == nullptr || out == nullptr || (table == nullptr && hi > lo)) return engram::kBadArgument;
    if ((reinterpret_cast<uintptr_t>(table) & 7u) || (reinterpret_cast<uintptr_t>(out) & 15u))
        return engram::kMisaligned;
    const int64_t blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
    if (blocks > engram_gpu::kMaxBlocks) return engram::kBadArgument;
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
