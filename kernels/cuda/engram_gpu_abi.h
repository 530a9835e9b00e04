// engram_gpu_abi.h: the C ABI of the GPU gather libraries, one for both vendors:
// libengram_cuda.so (engram_cuda_*, nvcc) and libengram_hip.so (engram_hip_*, clang -x hip),
// both built from kernels/cuda/engram_gather.cu. ENGRAM_GPU_API(name) is engram_<vendor>_<name>
// for ENGRAM_VENDOR (cuda or hip: kernels/cuda/vendor.h or kernels/hip/vendor.h defines it in
// the build; a C caller defines it before including this file). engram_gather.cu includes it,
// so the compiler checks every definition against these prototypes; engram_sglang/core/ops/native.py
// binds them with ctypes, and tests/kernels/test_native_abi.py checks that binding against this file.
// Torch-free and runtime-free: streams are passed as void*.
#pragma once

#include <stdint.h>

#include "../common/engram_status.h"

#ifndef ENGRAM_VENDOR
#error "define ENGRAM_VENDOR (cuda or hip) before including engram_gpu_abi.h"
#endif

// What ENGRAM_GPU_API(abi_version)() returns: bumped when an entry point's signature or meaning
// changes (ops/native.py's ABI_VERSION["cuda"], ["hip"]). 2: one ABI for both vendors (HIP
// gained device_info and check_device's binary version).
#define ENGRAM_GPU_ABI_VERSION 2

#define ENGRAM_GPU_CAT2(a, b, c) a##b##c
#define ENGRAM_GPU_CAT(a, b, c) ENGRAM_GPU_CAT2(a, b, c)
#define ENGRAM_GPU_API(name) ENGRAM_GPU_CAT(engram_, ENGRAM_VENDOR, _##name)

#ifdef __cplusplus
extern "C" {
#endif

int ENGRAM_GPU_API(abi_version)(void);

// Space-separated targets the library holds (sm_XY SASS and compute_XY PTX, or gfx targets).
const char* ENGRAM_GPU_API(targets)(void);

// A message for a code any entry point returned (engram_status or the runtime's own).
const char* ENGRAM_GPU_API(error_string)(int code);

// Can the gather run on `device`? 0 when this library holds code for it, else the runtime's
// error (no kernel image / no binary for the GPU, or no driver/device). *binary_version (may
// be null) gets the version of the code that would run (CUDA: SASS version, e.g. 90), or 0.
int ENGRAM_GPU_API(check_device)(int device, int* binary_version);

// Device facts for the probe: out[0..6] = compute capability major, minor, warp size, unified
// addressing, can use host pointer for registered memory, pageable memory access, can map host
// memory. Returns 0 or the runtime's error.
int ENGRAM_GPU_API(device_info)(int device, int* out);

// Gather rows ids[0..n) (int32 when id_bytes == 4, int64 when 8) of a packed table holding
// global rows [lo, hi) into out[n][256] (bf16 bits) on `stream` (a cudaStream_t/hipStream_t).
// `table` is device memory, or the device address of registered host memory (what
// HostGetDevicePointer returned: on ROCm it may differ from the host pointer); ids and out must
// be device-accessible. Ids outside [lo, hi) give +0 rows. Asynchronous: returns 0, a negative
// engram_status, or the launch error; execution errors surface at the next synchronization. A
// grid beyond the runtime's launch limit is ENGRAM_BAD_ARGUMENT.
int ENGRAM_GPU_API(gather_dequant)(const void* table, const void* ids, int id_bytes, int64_t n, int64_t lo,
                                   int64_t hi, void* out, void* stream);

#ifdef __cplusplus
}  // extern "C"
#endif
