// engram_disk_step.h: the disk tier's step in one native call per layer (included by
// engram_rowio.cpp, whose row reads it uses).
//
// One call takes a step's row ids and buffers and does what engram_sglang/core/stores/disk.py does
// per call in numpy: dedupe the ids (sorted, this shard's only), look them up in the DRAM row
// cache, copy the hits, read the misses (mapping, O_DIRECT by io_uring or native AIO, or pread,
// as the store reads; O_DIRECT reads are issued first and the rest runs while they fly),
// admit them (engram_dram_policy.h: the Python cache's own policy and state), and where the
// compute device is the CPU decode every id's row to bf16 (the host gather's row decode,
// dequant_row_host, on the pool's threads when it pays). On a GPU the packed rows and each
// id's staging index land in the caller's pinned buffers and the GPU decodes them.
//
// A read that fails (or a truncated file, or no AIO here) returns kStepUnread with the hits
// copied, the misses listed and nothing admitted or decoded: the Python store reads the misses
// again (retries, pread's errno, which rows fail) and finishes the call as its Python path does.
#pragma once

#include <sched.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "../common/engram_denormals.h"
#include "../common/engram_gather.h"
#include "../cpu/engram_decode_avx512.h"
#include "engram_dram_policy.h"
#include "engram_rowio_abi.h"

namespace engram_io {

// The ABI's modes, statuses and structures (engram_rowio_abi.h), by this code's names.
enum ReadMode : int32_t {
    kReadMapped = ENGRAM_READ_MAPPED,
    kReadAio = ENGRAM_READ_AIO,
    kReadPread = ENGRAM_READ_PREAD,
    kReadNone = ENGRAM_READ_NONE,
};
enum StepStatus : int {
    kStepOk = ENGRAM_STEP_OK,
    kStepUnread = ENGRAM_STEP_UNREAD,
    kStepBadArgument = ENGRAM_STEP_BAD_ARGUMENT,
    kStepAioUnavailable = ENGRAM_STEP_AIO_UNAVAILABLE,
};
static_assert(kStepAioUnavailable == ENGRAM_AIO_UNAVAILABLE, "the step passes the reads' code on");

using DiskFile = engram_disk_file;
using StepResult = engram_step_result;

// Rows decoded per task, and below how many ids one thread does it all (as the host gather).
constexpr int64_t kDecodeGrain = 64;
constexpr int64_t kDecodeSerial = 128;
// Misses found by the lookup between additions to the reads in flight: small, so the disk
// starts early (a batch-256 step's lookup takes ~1 ms), large enough that the syscall each
// costs stays a small share of its reads' CPU.
constexpr int64_t kIssueBatch = 16;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ENGRAM_IO_ISA_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define ENGRAM_IO_ISA_CLONES
#endif

// The row decode: the host gather's AVX-512 one where the CPU has it (VBMI; same bits, about
// 3x fewer instructions a value), else the portable one in ISA clones, as in
// kernels/cpu/engram_gather.cpp. Each loop below is built once per decode, with the row decode
// inlined into it (a called decode would be compiled for the baseline ISA only).
struct PortableRow {
    static inline __attribute__((always_inline)) void decode(const uint8_t* row, uint16_t* out) {
        engram::dequant_row_host(row, out);
    }
};
#if ENGRAM_HAVE_AVX512_DECODE
struct Avx512Row {  // inlined into decode_*_avx512 (flatten: the same target)
    static inline void decode(const uint8_t* row, uint16_t* out) { engram::dequant_row_avx512<false>(row, out); }
};
#endif

// bf16 rows of ids [b, e): staging row local[i], or +0 for an id outside the shard (local == unique).
template <class Row>
inline __attribute__((always_inline)) void decode_rows_body(const uint8_t* packed, const int64_t* local, int64_t unique,
                                                            int64_t b, int64_t e, uint16_t* out) {
    engram::DenormalGuard guard;
    for (int64_t i = b; i < e; ++i) {
        uint16_t* o = out + i * engram::kRowValues;
        if (local[i] < unique)
            Row::decode(packed + local[i] * engram::kRowBytes, o);
        else
            for (int k = 0; k < engram::kRowValues; ++k) o[k] = 0;
    }
}

// Positions grouped by staging row: the positions whose local is u are order[start[u] ..
// start[u + 1]) for u in [0, unique] (u == unique: ids outside the shard). A counting sort.
inline void group_positions(const int64_t* local, int64_t n, int64_t unique, std::vector<int64_t>& start,
                            std::vector<int64_t>& order) {
    start.assign(static_cast<size_t>(unique + 2), 0);
    order.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ++start[static_cast<size_t>(local[i] + 1)];
    for (int64_t u = 0; u <= unique; ++u) start[u + 1] += start[u];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(fill[static_cast<size_t>(local[i])]++)] = i;
}

// bf16 rows of every position of staging rows units[0..count): the row is decoded once into its
// first position and copied to the others (the same bits); +0 for u == unique.
template <class Row>
inline __attribute__((always_inline)) void decode_units_body(const uint8_t* packed, const int64_t* start,
                                                             const int64_t* order, int64_t unique, const int64_t* units,
                                                             int64_t count, uint16_t* out) {
    engram::DenormalGuard guard;
    constexpr size_t kOutRow = engram::kRowValues * sizeof(uint16_t);
    for (int64_t k = 0; k < count; ++k) {
        const int64_t u = units[k];
        const int64_t b = start[u], e = start[u + 1];
        if (b == e) continue;
        uint16_t* first = out + order[b] * engram::kRowValues;
        if (u < unique)
            Row::decode(packed + u * engram::kRowBytes, first);
        else
            std::memset(first, 0, kOutRow);
        for (int64_t j = b + 1; j < e; ++j) std::memcpy(out + order[j] * engram::kRowValues, first, kOutRow);
    }
}

ENGRAM_IO_ISA_CLONES inline void decode_rows_portable(const uint8_t* packed, const int64_t* local, int64_t unique,
                                                      int64_t b, int64_t e, uint16_t* out) {
    decode_rows_body<PortableRow>(packed, local, unique, b, e, out);
}
ENGRAM_IO_ISA_CLONES inline void decode_units_portable(const uint8_t* packed, const int64_t* start,
                                                       const int64_t* order, int64_t unique, const int64_t* units,
                                                       int64_t count, uint16_t* out) {
    decode_units_body<PortableRow>(packed, start, order, unique, units, count, out);
}
#if ENGRAM_HAVE_AVX512_DECODE
ENGRAM_AVX512_DECODE_TARGET __attribute__((flatten)) inline void decode_rows_avx512(const uint8_t* packed,
                                                                                    const int64_t* local,
                                                                                    int64_t unique, int64_t b,
                                                                                    int64_t e, uint16_t* out) {
    decode_rows_body<Avx512Row>(packed, local, unique, b, e, out);
}
ENGRAM_AVX512_DECODE_TARGET __attribute__((flatten)) inline void decode_units_avx512(
    const uint8_t* packed, const int64_t* start, const int64_t* order, int64_t unique, const int64_t* units,
    int64_t count, uint16_t* out) {
    decode_units_body<Avx512Row>(packed, start, order, unique, units, count, out);
}
#endif

// Which decode the step runs: the AVX-512 one where this CPU has it; the test hook
// (engram_disk_step_decode) can force the portable one so that both are checked here.
inline std::atomic<bool>& use_avx512_decode() {
#if ENGRAM_HAVE_AVX512_DECODE
    static std::atomic<bool> on{engram::avx512_decode_supported()};
#else
    static std::atomic<bool> on{false};
#endif
    return on;
}

inline void decode_rows(const uint8_t* packed, const int64_t* local, int64_t unique, int64_t b, int64_t e,
                        uint16_t* out) {
#if ENGRAM_HAVE_AVX512_DECODE
    if (use_avx512_decode().load(std::memory_order_relaxed))
        return decode_rows_avx512(packed, local, unique, b, e, out);
#endif
    decode_rows_portable(packed, local, unique, b, e, out);
}

inline void decode_units(const uint8_t* packed, const int64_t* start, const int64_t* order, int64_t unique,
                         const int64_t* units, int64_t count, uint16_t* out) {
#if ENGRAM_HAVE_AVX512_DECODE
    if (use_avx512_decode().load(std::memory_order_relaxed))
        return decode_units_avx512(packed, start, order, unique, units, count, out);
#endif
    decode_units_portable(packed, start, order, unique, units, count, out);
}

inline int default_decode_threads() {
    if (const char* env = std::getenv("ENGRAM_CPU_THREADS")) {
        const int v = std::atoi(env);
        if (v > 0) return v;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    return 1;
}

using IdPos = std::pair<int64_t, int64_t>;

// (id, position) pairs [0, n) sorted by id (ids >= 0). LSD radix sort, 11 bits a pass over
// the ids' significant bits: a decode step's few thousand ids in ~3 linear passes, where a
// comparison sort took ~0.3 ms here (a quarter of the step's host work).
inline void sort_by_id(std::vector<IdPos>& a, int64_t n) {
    constexpr int kBits = 11;
    if (n < 256) {
        std::sort(a.begin(), a.begin() + n);
        return;
    }
    static thread_local std::vector<IdPos> tmp;
    tmp.resize(static_cast<size_t>(n));
    uint64_t all = 0;
    for (int64_t i = 0; i < n; ++i) all |= static_cast<uint64_t>(a[i].first);
    const int bits = all == 0 ? 0 : 64 - __builtin_clzll(all);
    IdPos* src = a.data();
    IdPos* dst = tmp.data();
    for (int shift = 0; shift < bits; shift += kBits) {
        int64_t count[(1 << kBits) + 1] = {};
        for (int64_t i = 0; i < n; ++i)
            ++count[((static_cast<uint64_t>(src[i].first) >> shift) & ((1 << kBits) - 1)) + 1];
        for (int k = 0; k < (1 << kBits); ++k) count[k + 1] += count[k];
        for (int64_t i = 0; i < n; ++i)
            dst[count[(static_cast<uint64_t>(src[i].first) >> shift) & ((1 << kBits) - 1)]++] = src[i];
        std::swap(src, dst);
    }
    if (src != a.data()) std::copy(src, src + n, a.data());
}

// Sorted distinct ids of [lo, hi) into `wanted`, each id's index in it into `local` (unique
// for ids outside); returns unique. One sort of (id, position) pairs gives both.
inline int64_t dedupe(const int64_t* ids, int64_t n, int64_t lo, int64_t hi, int64_t* wanted, int64_t* local) {
    static thread_local std::vector<IdPos> pairs;
    pairs.resize(static_cast<size_t>(n));
    int64_t live = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (ids[i] >= lo && ids[i] < hi)
            pairs[static_cast<size_t>(live++)] = {ids[i], i};
        else
            local[i] = -1;  // set to `unique` below
    }
    sort_by_id(pairs, live);
    int64_t unique = 0;
    for (int64_t k = 0; k < live; ++k) {
        if (unique == 0 || wanted[unique - 1] != pairs[static_cast<size_t>(k)].first)
            wanted[unique++] = pairs[static_cast<size_t>(k)].first;
        local[pairs[static_cast<size_t>(k)].second] = unique - 1;
    }
    for (int64_t i = 0; i < n; ++i)
        if (local[i] < 0) local[i] = unique;
    return unique;
}

// Reads rows `rows[0..m)` (ascending, all in the file) to out by the file's mode. 0, or an errno
// / -1 (short read) with *failed, or kStepAioUnavailable.
int read_misses(const DiskFile& f, const int64_t* rows, int64_t m, uint8_t* out, int64_t* failed);

}  // namespace engram_io
