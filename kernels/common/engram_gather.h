// engram_gather.h: the one gather-and-dequantize logic for packed Engram rows.
//
// A packed row is 264 bytes: 256 fp8 e4m3fn (OCP) values, then 8 e8m0 block scales, scale k
// for values 32k..32k+31 (docs/engram.md section 4). Every backend (CUDA, HIP, the host
// library; Triton and torch mirror it in Python) computes
//
//     bf16 = round_to_nearest_even( fp32(e4m3fn(b)) * 2^(e - 127) ),  -0 written as +0
//
// with the fp32 product exact (it always is: 4 significant bits times a power of two; the
// smallest magnitude, 2^-136, is an fp32 denormal) or +-inf. No flush-to-zero anywhere: scale
// byte 0 is 2^-127, itself an fp32 denormal.
//
// Layering: this header has no torch and no vendor API. What differs by target (the native
// fp8 conversion instruction, warp 32 vs wavefront 64, launch shape) lives in the GPU
// launcher's compat header (kernels/cuda/compat.h, with kernels/cuda/vendor.h and
// kernels/hip/vendor.h); the launcher plugs a decoder into the templates below.
// A decoder is a type with
//     static ENGRAM_HD void decode4(uint32_t word, float v[4]);   // 4 fp8 bytes, low first
// returning the exact e4m3fn values (NaN for 0x7F/0xFF). Decoders built on an instruction that
// reads another fp8 flavour fix the difference with the helpers here (fnuz_as_fn), so the
// special-code logic is written once and tested on the host.
#pragma once

#include <stdint.h>
#include <string.h>  // memcpy: the host's well-defined float <-> bits cast

#include "engram_status.h"

// ------------------------------------------------------------------ compat
// The only vendor switch in this header: host/device qualifiers and float<->bits casts.
#if defined(__CUDACC__) || defined(__HIP__)
#define ENGRAM_DEVICE_COMPILER 1
#define ENGRAM_HD __host__ __device__ __forceinline__
#else
#define ENGRAM_DEVICE_COMPILER 0
#define ENGRAM_HD inline __attribute__((always_inline))
#endif
#if defined(__CUDA_ARCH__) || defined(__clang__)
#define ENGRAM_UNROLL _Pragma("unroll")
#elif defined(__CUDACC__)
#define ENGRAM_UNROLL  // nvcc's host pass: gcc and nvcc's front end disagree on the spelling
#else
#define ENGRAM_UNROLL _Pragma("GCC unroll 8")
#endif

namespace engram {

constexpr int kRowBytes = 264;      // bytes of one packed row
constexpr int kRowValues = 256;     // fp8 payload bytes = bf16 values out
constexpr int kRowScales = 8;       // e8m0 scale bytes after the payload
constexpr int kBlockValues = 32;    // values sharing one scale
// GPU work split: a row is 32 "chunks" of 8 values, one 8-byte load and one 16-byte store
// each. Rows are only 8-byte aligned (264 = 8 * 33), so 8 bytes is the widest aligned load.
constexpr int kChunkValues = 8;
constexpr int kChunksPerRow = kRowValues / kChunkValues;  // 32 threads per row
static_assert(kRowBytes == kRowValues + kRowScales, "row layout");
static_assert(kRowValues == kRowScales * kBlockValues, "row layout");

constexpr uint32_t kF32CanonicalNaN = 0x7FC00000u;
constexpr uint32_t kBf16CanonicalNaN = 0x7FC0u;

ENGRAM_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

ENGRAM_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

// ------------------------------------------------------------------ fp8 decodes
// fp32 bits of an fp8 subnormal: mantissa m (0..7) * 2^(e1 - 127), where e1 is the fp32
// exponent field of the smallest subnormal (m = 1). The leading one of m sits at bit p.
ENGRAM_HD uint32_t subnormal_magnitude(uint32_t m, uint32_t e1) {
    const uint32_t p = static_cast<uint32_t>(m >= 2u) + static_cast<uint32_t>(m >= 4u);
    const uint32_t bits = ((e1 + p) << 23) | ((m << (23u - p)) & 0x7FFFFFu);
    return m == 0u ? 0u : bits;
}

// Software OCP e4m3fn decode (1 sign, 4 exponent bits bias 7, 3 mantissa bits; no infinity;
// S.1111.111 is NaN). Branch-free so that host compilers vectorize the row loop.
ENGRAM_HD float e4m3fn_to_f32(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24;
    const uint32_t em = b & 0x7Fu;  // exponent and mantissa
    // Normal: rebias the exponent 7 -> 127 (+120) and move the 3 mantissa bits to the top of
    // fp32's 23: (em + (120 << 3)) << 20 does both at once.
    const uint32_t normal = sign | ((em + (120u << 3)) << 20);
    // Subnormal (exponent 0): mantissa * 2^-9, normalized with integer ops only (no float op
    // under a condition, which host compilers will not if-convert and so not vectorize).
    const uint32_t sub = sign | subnormal_magnitude(em, 118u);
    uint32_t bits = em < 8u ? sub : normal;
    bits = em == 0x7Fu ? kF32CanonicalNaN : bits;
    return f32_from_bits(bits);
}

// Software e4m3fnuz decode (exponent bias 8; 0x80 is the only NaN; no -0). This is what
// gfx942's conversion instructions compute; the host library runs it to test fnuz_as_fn.
ENGRAM_HD float e4m3fnuz_to_f32(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24;
    const uint32_t em = b & 0x7Fu;
    const uint32_t normal = sign | ((em + (119u << 3)) << 20);
    const uint32_t sub = sign | subnormal_magnitude(em, 117u);
    uint32_t bits = em < 8u ? sub : normal;
    bits = b == 0x80u ? kF32CanonicalNaN : bits;
    return f32_from_bits(bits);
}

// e4m3fn value of byte b from its e4m3fnuz value. For every finite non-zero byte
// fnuz(b) = fn(b) / 2, so doubling the *value* is exact (|value| <= 480). Doubling the scale
// instead would overflow at e8m0 byte 254. The codes whose meaning differs are fixed exactly:
// 0x80 (fnuz NaN, fn -0) and 0x7F/0xFF (fnuz +-240, fn NaN).
ENGRAM_HD float fnuz_as_fn(float fnuz_value, uint32_t b) {
    float v = fnuz_value * 2.0f;
    v = b == 0x80u ? 0.0f : v;
    v = (b & 0x7Fu) == 0x7Fu ? f32_from_bits(kF32CanonicalNaN) : v;
    return v;
}

// For native OCP conversions whose NaN handling is not documented for every target: force the
// two NaN codes. Costs two selects, and makes the result independent of that detail.
ENGRAM_HD float fn_nan_codes(float native_value, uint32_t b) {
    return (b & 0x7Fu) == 0x7Fu ? f32_from_bits(kF32CanonicalNaN) : native_value;
}

// e8m0 block scale: 2^(e - 127). Byte 0 is 2^-127, the fp32 denormal 0x00400000 (SGLang's
// reading; vLLM reads it as 0). Byte 0xFF is NaN (OCP MX rule, torch's float8_e8m0fnu).
ENGRAM_HD float e8m0_to_f32(uint32_t e) {
    uint32_t bits = e << 23;
    bits = e == 0u ? 0x00400000u : bits;
    bits = e == 0xFFu ? kF32CanonicalNaN : bits;
    return f32_from_bits(bits);
}

// ------------------------------------------------------------------ one rounding
// fp32 -> bf16 bits, round to nearest even on the fp32 bits (correct for denormals and for
// overflow to inf), NaN -> canonical NaN (the rounding add would carry a NaN with a full
// payload into the sign bit), and -0 -> +0 so that row-range shards summed over ranks
// reproduce the unsharded bits. Returns the 16 bits in the low half.
ENGRAM_HD uint32_t f32_to_bf16_bits(float f) {
    const uint32_t u = f32_bits(f);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    r = nan ? kBf16CanonicalNaN : r;
    r = r == 0x8000u ? 0u : r;
    return r;
}

// One value: exact fp8 value times its block scale (one fp32 product), rounded once.
ENGRAM_HD uint32_t dequant_value(float value, float scale) { return f32_to_bf16_bits(value * scale); }

// ------------------------------------------------------------------ decoders
// Portable decoder: the software decode above. Used by the host library and by any target
// without a native fp8 conversion.
struct SoftE4m3fn {
    static ENGRAM_HD float decode1(uint32_t b) { return e4m3fn_to_f32(b); }
    static ENGRAM_HD void decode4(uint32_t w, float v[4]) {
        v[0] = e4m3fn_to_f32(w & 0xFFu);
        v[1] = e4m3fn_to_f32((w >> 8) & 0xFFu);
        v[2] = e4m3fn_to_f32((w >> 16) & 0xFFu);
        v[3] = e4m3fn_to_f32(w >> 24);
    }
};

// gfx942's path, with the instruction replaced by the software fnuz decode: lets the host
// library check the fnuz -> fn fix-up bit for bit without an MI300X.
struct EmulatedFnuzAsFn {
    static ENGRAM_HD float decode1(uint32_t b) { return fnuz_as_fn(e4m3fnuz_to_f32(b), b); }
    static ENGRAM_HD void decode4(uint32_t w, float v[4]) {
        for (int i = 0; i < 4; ++i) v[i] = decode1((w >> (8 * i)) & 0xFFu);
    }
};

// ------------------------------------------------------------------ row / chunk
// Host form: one whole row (the loop a host compiler vectorizes).
template <class Decoder>
ENGRAM_HD void dequant_row(const uint8_t* __restrict__ row, uint16_t* __restrict__ out) {
    for (int k = 0; k < kRowScales; ++k) {
        const float scale = e8m0_to_f32(row[kRowValues + k]);
        const uint8_t* in = row + k * kBlockValues;
        uint16_t* o = out + k * kBlockValues;
        for (int i = 0; i < kBlockValues; ++i)
            o[i] = static_cast<uint16_t>(dequant_value(Decoder::decode1(in[i]), scale));
    }
}

// ------------------------------------------------------------------ host shortcut
// For a scale byte e in [10, 246] ("plain") every product is exact in bf16 itself: an e4m3fn
// value has at most 4 significant bits, its magnitude lies in [2^-9, 448], so times 2^(e-127)
// it stays within bf16's normal range. Rounding is then a no-op and scaling is an integer add
// to the bf16 exponent field, which host compilers run 16 lanes to a 256-bit register instead
// of 8. Same results as dequant_value(e4m3fn_to_f32(b), e8m0_to_f32(e)) bit for bit: the host
// tests check every (byte, scale) pair; other scale bytes take the general path.
ENGRAM_HD bool plain_scale(uint32_t e) { return e - 10u <= 236u; }

// k16 = ((e - 127) << 7) mod 2^16: the exponent step in bf16 bits.
ENGRAM_HD uint16_t dequant_plain(uint32_t b, uint16_t k16) {
    const uint16_t em = static_cast<uint16_t>(b & 0x7Fu);
    const uint16_t sign = static_cast<uint16_t>((b & 0x80u) << 8);
    // Normal e4m3fn: rebias 7 -> 127 and move the mantissa to bf16's top 3 of 7 bits:
    // (em + (120 << 3)) << 4 = (em << 4) + 0x3C00.
    const uint16_t normal = static_cast<uint16_t>((em << 4) + 0x3C00u);
    // Subnormal m * 2^-9 (m = em = 1..7), normalized per leading-one position.
    const uint16_t sub = static_cast<uint16_t>(em >= 4u   ? (em << 5) + 0x3B80u
                                               : em >= 2u ? (em << 6) + 0x3B00u
                                                          : (em << 7) + 0x3A80u);
    const uint16_t mag = static_cast<uint16_t>((em < 8u ? sub : normal) + k16);
    uint16_t r = static_cast<uint16_t>(sign | mag);
    r = em == 0u ? static_cast<uint16_t>(0u) : r;  // both zero codes -> +0
    r = em == 0x7Fu ? static_cast<uint16_t>(kBf16CanonicalNaN) : r;
    return r;
}

// dequant_plain for a byte known not to be an fp8 subnormal (codes 0x01-0x07, 0x81-0x87):
// most blocks of a real table hold none, and this is half the work.
// kn16 = 0x3C00 + k16: the e4m3 -> bf16 rebias and the scale step in one constant.
ENGRAM_HD uint16_t dequant_plain_normal(uint32_t b, uint16_t kn16) {
    const uint16_t em = static_cast<uint16_t>(b & 0x7Fu);
    const uint16_t sign = static_cast<uint16_t>((b & 0x80u) << 8);
    uint16_t r = static_cast<uint16_t>(sign | static_cast<uint16_t>((em << 4) + kn16));
    r = em == 0u ? static_cast<uint16_t>(0u) : r;
    r = em == 0x7Fu ? static_cast<uint16_t>(kBf16CanonicalNaN) : r;
    return r;
}

// Any fp8 subnormal among n bytes? A byte-wide OR, which compilers vectorize (a bool |= or
// a wider sum they do not, or badly).
ENGRAM_HD bool any_fp8_subnormal(const uint8_t* __restrict__ in, int n) {
    uint8_t any = 0;
    for (int i = 0; i < n; ++i) any |= static_cast<uint8_t>(static_cast<uint8_t>((in[i] & 0x7Fu) - 1u) < 7u);
    return any != 0;
}

// One block of 32 values under scale byte e, host form: the plain shortcut where it applies,
// the general path otherwise. Also the exact fallback of kernels/cpu's AVX-512 row decode.
ENGRAM_HD void dequant_block_host(const uint8_t* __restrict__ in, uint32_t e, uint16_t* __restrict__ o) {
    if (plain_scale(e)) {
        const uint16_t k16 = static_cast<uint16_t>((e - 127u) << 7);
        if (!any_fp8_subnormal(in, kBlockValues)) {
            const uint16_t kn16 = static_cast<uint16_t>(0x3C00u + k16);
            for (int i = 0; i < kBlockValues; ++i) o[i] = dequant_plain_normal(in[i], kn16);
        } else {
            for (int i = 0; i < kBlockValues; ++i) o[i] = dequant_plain(in[i], k16);
        }
    } else {
        const float scale = e8m0_to_f32(e);
        for (int i = 0; i < kBlockValues; ++i) o[i] = static_cast<uint16_t>(dequant_value(e4m3fn_to_f32(in[i]), scale));
    }
}

// The host library's row decode. Rows whose scales are all plain and whose payload holds no
// fp8 subnormal (nearly every row of a real table) take one straight pass; other rows go
// block by block: the plain shortcut where it applies, the general path otherwise.
ENGRAM_HD void dequant_row_host(const uint8_t* __restrict__ row, uint16_t* __restrict__ out) {
    bool all_plain = true;
    for (int k = 0; k < kRowScales; ++k) all_plain &= plain_scale(row[kRowValues + k]);
    if (all_plain && !any_fp8_subnormal(row, kRowValues)) {
        for (int k = 0; k < kRowScales; ++k) {
            const uint16_t kn16 = static_cast<uint16_t>(0x3C00u + ((row[kRowValues + k] - 127u) << 7));
            for (int i = 0; i < kBlockValues; ++i)
                out[k * kBlockValues + i] = dequant_plain_normal(row[k * kBlockValues + i], kn16);
        }
        return;
    }
    for (int k = 0; k < kRowScales; ++k)
        dequant_block_host(row + k * kBlockValues, row[kRowValues + k], out + k * kBlockValues);
}

// Device form: 8 values (two little-endian words of one 8-byte load) sharing one scale ->
// four words of bf16 pairs (one 16-byte store).
template <class Decoder>
ENGRAM_HD void dequant_chunk(uint32_t w0, uint32_t w1, float scale, uint32_t o[4]) {
    float v[8];
    Decoder::decode4(w0, v);
    Decoder::decode4(w1, v + 4);
    ENGRAM_UNROLL
    for (int i = 0; i < 4; ++i) o[i] = dequant_value(v[2 * i], scale) | (dequant_value(v[2 * i + 1], scale) << 16);
}

// The plain-scale shortcut (see plain_scale) on decoded fp32 values, for the device form:
// the product's fp32 bits are the value's bits plus (e - 127) in the exponent field, and its
// low 16 bits are zero, so the bf16 is the high half. Zeros and NaNs keep their own rule.
// About half the integer work of dequant_chunk, which matters when the gather runs at HBM
// speed. k32 = ((e - 127) << 23) mod 2^32.
ENGRAM_HD uint32_t dequant_plain_f32(float value, uint32_t k32) {
    const uint32_t u = f32_bits(value);
    const uint32_t mag = u & 0x7FFFFFFFu;
    uint32_t r = (u + k32) >> 16;
    r = mag == 0u ? 0u : r;
    r = mag > 0x7F800000u ? kBf16CanonicalNaN : r;
    return r;
}

template <class Decoder>
ENGRAM_HD void dequant_chunk_plain(uint32_t w0, uint32_t w1, uint32_t k32, uint32_t o[4]) {
    float v[8];
    Decoder::decode4(w0, v);
    Decoder::decode4(w1, v + 4);
    ENGRAM_UNROLL
    for (int i = 0; i < 4; ++i) o[i] = dequant_plain_f32(v[2 * i], k32) | (dequant_plain_f32(v[2 * i + 1], k32) << 16);
}

// Is global row id inside the shard [lo, hi) this table holds? Other ids read as zeros.
ENGRAM_HD bool id_in_range(int64_t id, int64_t lo, int64_t hi) { return id >= lo && id < hi; }

// ------------------------------------------------------------------ the device gather
// Vendor-neutral 8- and 16-byte words (CUDA's and HIP's uint2/uint4 have the same layout);
// also usable on the host, where the test hook runs this gather thread by thread.
struct alignas(8) Word2 {
    uint32_t x, y;
};
struct alignas(16) Word4 {
    uint32_t x, y, z, w;
};

// Thread `tid` of a block handles chunk tid % 32 of kUnroll rows: slot tid / 32, then every
// rows_per_pass rows after it. 32 consecutive threads cover one row, so each warp (32) or
// wavefront (64 = two rows) reads 256 contiguous payload bytes + the 8 scale bytes per row and
// writes 512 contiguous bytes; all kUnroll rows' loads are issued before the first store, so
// each thread has several rows in flight. Offsets are int64: a 189 GiB table is 7.7e8 rows.
template <class Decoder, int kUnroll, typename IdT>
ENGRAM_HD void gather_dequant_rows(const uint8_t* __restrict__ table, const IdT* __restrict__ ids, int64_t n,
                                   int64_t lo, int64_t hi, uint16_t* __restrict__ out, int64_t first_row,
                                   int rows_per_pass, int tid) {
    const int chunk = tid % kChunksPerRow;
    const int64_t slot = tid / kChunksPerRow;
    // Load every id first, so the kUnroll id loads are in flight together instead of each row's
    // branch waiting on its own id load; rows past n read as id hi, which is out of range.
    int64_t id[kUnroll];
    ENGRAM_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
        const int64_t r = first_row + slot + static_cast<int64_t>(k) * rows_per_pass;
        id[k] = r < n ? static_cast<int64_t>(ids[r]) : hi;
    }
    Word2 w[kUnroll];
    uint32_t sbyte[kUnroll];
    bool live[kUnroll];
    ENGRAM_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
        w[k] = Word2{0u, 0u};
        sbyte[k] = 0u;
        live[k] = id_in_range(id[k], lo, hi);
        if (live[k]) {
            const uint8_t* row = table + (id[k] - lo) * kRowBytes;
            w[k] = reinterpret_cast<const Word2*>(row)[chunk];  // 8 bytes, 8-aligned
            sbyte[k] = row[kRowValues + chunk * kChunkValues / kBlockValues];
        }
    }
    ENGRAM_UNROLL
    for (int k = 0; k < kUnroll; ++k) {
        const int64_t r = first_row + slot + static_cast<int64_t>(k) * rows_per_pass;
        if (r < n) {
            uint32_t o[4] = {0u, 0u, 0u, 0u};
            if (live[k]) {
                // Divergence is rare: real tables' scale bytes are all plain.
                if (plain_scale(sbyte[k]))
                    dequant_chunk_plain<Decoder>(w[k].x, w[k].y, (sbyte[k] - 127u) << 23, o);
                else
                    dequant_chunk<Decoder>(w[k].x, w[k].y, e8m0_to_f32(sbyte[k]), o);
            }
            // Index in 16-byte units so the compiler emits one 16-byte store.
            reinterpret_cast<Word4*>(out)[r * kChunksPerRow + chunk] = Word4{o[0], o[1], o[2], o[3]};
        }
    }
}

// Error codes shared by every launcher's extern "C" entry, by the values of the ABI's
// engram_status.h (vendor runtime errors are passed through as their own positive codes).
enum Status : int {
    kOk = ENGRAM_OK,
    kBadArgument = ENGRAM_BAD_ARGUMENT,
    kMisaligned = ENGRAM_MISALIGNED,
};

}  // namespace engram
