// engram_decode_avx512.h: the host row decode with AVX-512 VBMI byte permutes (x86-64 only).
//
// Same bits as engram::dequant_row_host (kernels/common/engram_gather.h), about 3x fewer
// instructions a value. Every e4m3fn value is exact in bf16 (at most 4 significant bits,
// magnitudes 2^-9..448), so a 128-entry table gives the bf16 bits of each code's magnitude:
// its low and high bytes are two 128-byte tables, read 64 codes at a time by one vpermi2b
// each (which ignores the index's top bit, the fp8 sign). The sign goes into the high byte,
// two unpacks make 64 bf16 words, and the block scale 2^(e - 127) is an add to the exponent
// field: exact when the scale byte is plain (10..246, see engram::plain_scale) and the code
// is neither zero (its exponent field is 0) nor NaN. Nearly every row of a real table is all
// such blocks and is decoded straight through. In the others a block with a zero or NaN code
// or another scale byte is decoded again by the exact host path (engram::dequant_block_host),
// which rewrites what the fast pass stored there.
//
// Built for the target named below whatever the compiler's flags; the caller checks the CPU
// (engram_decode_avx512_supported) before calling, and keeps the portable path for others.
#pragma once

#include <stdint.h>

#include "../common/engram_gather.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define ENGRAM_HAVE_AVX512_DECODE 1
#include <immintrin.h>

#define ENGRAM_AVX512_DECODE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))

namespace engram {

// bf16 bits of e4m3fn code em (sign dropped, 0..126) at scale 2^0; em 0 and 0x7F never take
// the fast pass, their entries are unused.
constexpr uint16_t avx512_code_bits(uint32_t em) {
    return static_cast<uint16_t>(em >= 8u   ? (em << 4) + 0x3C00u    // normal: rebias 7 -> 127
                                 : em >= 4u ? (em << 5) + 0x3B80u    // subnormal m * 2^-9,
                                 : em >= 2u ? (em << 6) + 0x3B00u    // normalized per position
                                 : em == 1u ? 0x3B00u                // of the leading one
                                            : 0u);
}

struct Avx512DecodeTables {
    alignas(64) uint8_t lo[128];  // low byte of avx512_code_bits(em)
    alignas(64) uint8_t hi[128];  // high byte
    // vpermb order that makes unpacklo/unpackhi (which interleave within 128-bit lanes) give
    // values 0..31 and 32..63 in order: lane L's low 8 bytes are values 8L..8L+7, its high 8
    // bytes values 32+8L..32+8L+7.
    alignas(64) uint8_t order[64];
    constexpr Avx512DecodeTables() : lo(), hi(), order() {
        for (uint32_t em = 0; em < 128; ++em) {
            lo[em] = static_cast<uint8_t>(avx512_code_bits(em) & 0xFFu);
            hi[em] = static_cast<uint8_t>(avx512_code_bits(em) >> 8);
        }
        for (int lane = 0; lane < 4; ++lane)
            for (int j = 0; j < 8; ++j) {
                order[lane * 16 + j] = static_cast<uint8_t>(lane * 8 + j);
                order[lane * 16 + 8 + j] = static_cast<uint8_t>(32 + lane * 8 + j);
            }
    }
};
inline constexpr Avx512DecodeTables kAvx512DecodeTables{};

inline bool avx512_decode_supported() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
}

// The constants of the decode, loaded once a row (five table registers and three masks).
struct Avx512DecodeRegs {
    __m512i lo_a, lo_b, hi_a, hi_b, order, sign, one, x7e;
    ENGRAM_AVX512_DECODE_TARGET __attribute__((always_inline)) Avx512DecodeRegs() {
        const Avx512DecodeTables& t = kAvx512DecodeTables;
        lo_a = _mm512_load_si512(t.lo);
        lo_b = _mm512_load_si512(t.lo + 64);
        hi_a = _mm512_load_si512(t.hi);
        hi_b = _mm512_load_si512(t.hi + 64);
        order = _mm512_load_si512(t.order);
        sign = _mm512_set1_epi8(static_cast<char>(0x80));
        one = _mm512_set1_epi8(1);
        x7e = _mm512_set1_epi8(0x7E);
    }
};

// One bit per code that is +-0 or NaN (em 0 or 0x7F: (em + 1) & 0x7F in {0, 1}).
ENGRAM_AVX512_DECODE_TARGET __attribute__((always_inline)) inline uint64_t avx512_special_codes(
    const Avx512DecodeRegs& r, __m512i b) {
    return _mm512_testn_epi8_mask(_mm512_add_epi8(b, r.one), r.x7e);
}

// kStream: non-temporal stores, for outputs too large to be read back from the cache (no
// read for ownership: half the memory traffic of a written line); o must be 64-byte aligned.
template <bool kStream>
ENGRAM_AVX512_DECODE_TARGET __attribute__((always_inline)) inline void avx512_store(uint16_t* o, __m512i v) {
    if constexpr (kStream)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(o), v);
    else
        _mm512_storeu_si512(o, v);
}

// The fast pass over 64 codes b (two blocks): their bf16 bits plus ka / kb, the two blocks'
// scale steps in bf16 bits mod 2^16. A plain scale keeps every non-zero magnitude inside
// bf16's normal range, so the add neither borrows from nor carries into the sign.
template <bool kStream = false>
ENGRAM_AVX512_DECODE_TARGET __attribute__((always_inline)) inline void avx512_fast_pair(const Avx512DecodeRegs& r,
                                                                                        __m512i b, __m512i ka,
                                                                                        __m512i kb, uint16_t* o) {
    // maskz with all lanes: the unmasked intrinsics trip GCC 12's -Wmaybe-uninitialized.
    const __m512i p = _mm512_maskz_permutexvar_epi8(~uint64_t{0}, r.order, b);
    const __m512i lo = _mm512_permutex2var_epi8(r.lo_a, p, r.lo_b);
    __m512i hi = _mm512_permutex2var_epi8(r.hi_a, p, r.hi_b);
    hi = _mm512_ternarylogic_epi32(hi, p, r.sign, 0xF8);  // hi | (p & 0x80)
    avx512_store<kStream>(o, _mm512_add_epi16(_mm512_unpacklo_epi8(lo, hi), ka));
    avx512_store<kStream>(o + kBlockValues, _mm512_add_epi16(_mm512_unpackhi_epi8(lo, hi), kb));
}

// Rows with a zero or NaN code or a scale byte outside 10..246: pair by pair, the fast pass
// where one of the two blocks can take it, then the exact path over each block that cannot.
ENGRAM_AVX512_DECODE_TARGET inline void dequant_row_avx512_mixed(const uint8_t* __restrict__ row,
                                                                 uint16_t* __restrict__ out) {
    const Avx512DecodeRegs r;
    const uint8_t* scales = row + kRowValues;
    for (int q = 0; q < kRowScales / 2; ++q) {
        const uint8_t* in = row + q * 2 * kBlockValues;
        uint16_t* o = out + q * 2 * kBlockValues;
        const uint32_t ea = scales[2 * q], eb = scales[2 * q + 1];
        const __m512i b = _mm512_loadu_si512(in);
        const uint64_t special = avx512_special_codes(r, b);
        const bool bad_a = static_cast<uint32_t>(special) != 0u || !plain_scale(ea);
        const bool bad_b = (special >> 32) != 0u || !plain_scale(eb);
        if (!(bad_a && bad_b))
            avx512_fast_pair(r, b, _mm512_set1_epi16(static_cast<short>((ea - 127u) << 7)),
                             _mm512_set1_epi16(static_cast<short>((eb - 127u) << 7)), o);
        if (bad_a) dequant_block_host(in, ea, o);
        if (bad_b) dequant_block_host(in + kBlockValues, eb, o + kBlockValues);
    }
}

// One packed row -> 256 bf16 words. One test for the whole row (codes and scales), then the
// fast pass straight through; other rows go pair by pair (dequant_row_avx512_mixed, with
// ordinary stores). kStream: see avx512_store; the caller fences (_mm_sfence) after its rows.
template <bool kStream = false>
ENGRAM_AVX512_DECODE_TARGET inline void dequant_row_avx512(const uint8_t* __restrict__ row,
                                                           uint16_t* __restrict__ out) {
    const Avx512DecodeRegs r;
    __m512i b[kRowScales / 2];
    uint64_t special = 0;
    for (int q = 0; q < kRowScales / 2; ++q) {
        b[q] = _mm512_loadu_si512(row + q * 2 * kBlockValues);
        special |= avx512_special_codes(r, b[q]);
    }
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + kRowValues));
    // plain_scale for all 8 bytes at once: e - 10 <= 236 unsigned.
    const __mmask16 plain =
        _mm_cmple_epu8_mask(_mm_sub_epi8(s, _mm_set1_epi8(10)), _mm_set1_epi8(static_cast<char>(236)));
    if (special != 0 || (plain & 0xFFu) != 0xFFu) return dequant_row_avx512_mixed(row, out);
    // The 8 scale steps (e - 127) << 7 as words; block k's is broadcast from word 0 after k shifts.
    __m128i k = _mm_slli_epi16(_mm_sub_epi16(_mm_cvtepu8_epi16(s), _mm_set1_epi16(127)), 7);
    for (int q = 0; q < kRowScales / 2; ++q) {
        // maskz with all lanes, as in avx512_fast_pair.
        const __m512i ka = _mm512_maskz_broadcastw_epi16(~0u, k);
        k = _mm_srli_si128(k, 2);
        const __m512i kb = _mm512_maskz_broadcastw_epi16(~0u, k);
        k = _mm_srli_si128(k, 2);
        avx512_fast_pair<kStream>(r, b[q], ka, kb, out + q * 2 * kBlockValues);
    }
}

}  // namespace engram

#else
#define ENGRAM_HAVE_AVX512_DECODE 0
#endif
