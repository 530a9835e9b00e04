// engram_denormals.h: the host decode's floating-point environment (host builds only).
//
// Another library in the process may have set flush-to-zero / denormals-are-zero (anything
// built with -ffast-math does, at load). The 2^-127 scale is a denormal, so each thread that
// decodes runs with both off, and the caller's mode is restored afterwards. Shared by the
// host gather (kernels/cpu) and the disk tier's native step (kernels/io), which decodes too.
#pragma once

#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace engram {

class DenormalGuard {
  public:
    DenormalGuard() {
#if defined(__x86_64__) || defined(__i386__)
        saved_ = _mm_getcsr();
        _mm_setcsr(saved_ & ~(kFtz | kDaz));
#elif defined(__aarch64__)
        __asm__ volatile("mrs %0, fpcr" : "=r"(saved_));
        __asm__ volatile("msr fpcr, %0" ::"r"(saved_ & ~(uint64_t{1} << 24)));  // FZ bit
#endif
    }
    ~DenormalGuard() {
#if defined(__x86_64__) || defined(__i386__)
        _mm_setcsr(saved_);
#elif defined(__aarch64__)
        __asm__ volatile("msr fpcr, %0" ::"r"(saved_));
#endif
    }
    DenormalGuard(const DenormalGuard&) = delete;
    DenormalGuard& operator=(const DenormalGuard&) = delete;

  private:
#if defined(__x86_64__) || defined(__i386__)
    static constexpr unsigned kFtz = 1u << 15, kDaz = 1u << 6;
    unsigned saved_ = 0;
#else
    uint64_t saved_ = 0;
#endif
};

}  // namespace engram
