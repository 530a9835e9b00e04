// compat.h: where CUDA and HIP differ for the GPU launcher (engram_gather.cu), and only there.
//
// llama.cpp's way: the launcher is written once against the CUDA runtime API; built as HIP,
// kernels/hip/vendor.h renames it to HIP's. Each vendor header (kernels/cuda/vendor.h,
// kernels/hip/vendor.h) holds only what the hardware makes different: the native fp8 decoder
// of each target, the warp/wavefront width, the launch limit, and the prefix of the exported
// entry points (engram_cuda_* / engram_hip_*, one ABI).
#pragma once

#include <stdint.h>

// The runtime header first: it defines the qualifiers the shared logic uses.
#if defined(__HIP__)
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>
#endif

#include "../common/engram_gather.h"

#if defined(__HIP__)  // clang -x hip (AMD)
#include "../hip/vendor.h"
#else  // nvcc (NVIDIA)
#include "vendor.h"
#endif

// engram_cuda_<name> / engram_hip_<name>: the same entry points and signatures for both, declared
// once in the ABI header (ENGRAM_GPU_API names them for the vendor above).
#include "engram_gpu_abi.h"
