// engram_status.h: the status codes of the gather libraries' C entry points (libengram_cpu.so,
// libengram_cuda.so, libengram_hip.so). 0 or a negative code; the GPU libraries pass their
// runtime's errors through as that runtime's own positive codes. engram_gather.h's
// engram::Status names the same values; ops/native.py reads them through the library
// (engram_{cuda,hip}_error_string) or its table for the CPU library, which
// tests/kernels/test_native_abi.py checks against this file.
#pragma once

enum engram_status {
    ENGRAM_OK = 0,
    ENGRAM_BAD_ARGUMENT = -1,  // null pointer, n < 0, lo > hi, bad id width
    ENGRAM_MISALIGNED = -2,    // table not 8-byte aligned or out not 16-byte aligned
};
