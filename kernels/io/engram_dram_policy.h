// engram_dram_policy.h: the DRAM row cache's policy (engram_sglang/core/stores/dram_cache.py), ported
// to run inside the disk tier's native step.
//
// The state is DramRowCache's own numpy arrays (rows, tags, last use, counts, the count-min
// sketch) and its scalars (one int64 array), so the Python policy and this one act on the same
// cache: a read-ahead admitted from Python and a step served here see each other's rows.
// Each function mirrors one method of DramRowCache statement by statement, including numpy's
// tie-breaking (stable sorts, counts computed before any counter is raised), so the two give
// the same hits, admissions and evictions on the same trace (tests/core/test_disk_step.py checks it).
// Called only with the Python cache's lock held by the caller.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engram_rowio_abi.h"

namespace engram_io {

constexpr int64_t kSketchDepth = 4;
constexpr uint64_t kSketchMults[kSketchDepth] = {0xD6E8FEB86659FD93ull, 0xA0761D6478BD642Full,
                                                 0xE7037ED1A0B428DBull, 0x8EBC6AF09C88C6E3ull};
// 4-bit sketch counters: rows 2k and 2k+1 share plane k of `width` bytes (2k low nibbles, 2k+1 high).
constexpr int kCountCap = 15;
// The format of the policy's arrays (counter width and packing). Bumped with any change to it:
// a library built before the change then refuses to load (stores/rowio.py compares it with
// dram_cache.POLICY_FORMAT) instead of reading the new arrays the old way. 2: 4-bit counters.
constexpr int64_t kPolicyFormat = 2;
constexpr int kClockBits = 48;
constexpr int64_t kUsedNow = INT64_MAX;
// Ids ahead whose cache lines are prefetched: a decode step's lookups touch ~7 random lines
// per id (tags, last use, count, 4 sketch counters, the row), each a DRAM miss in a cache of
// gigabytes; one at a time they cost ~240 ns an id here, with several in flight far less.
constexpr int64_t kPrefetchIds = 8;

inline void prefetch_lines(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
    __builtin_prefetch(c + bytes - 1);
}

// Indices of DramRowCache._state (dram_cache.py names the same positions).
enum StateIndex : int { kClock = 0, kSinceAging, kAgings, kAhead, kLookups, kHits, kAdmitted, kRejected, kStateLen };

// What the Python cache hands over (engram_rowio_abi.h; stores/rowio.py's DramCacheView).
using DramCache = engram_dram_cache;

inline uint64_t mix64(int64_t id) {
    uint64_t z = static_cast<uint64_t>(id);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

inline int64_t set_of(const DramCache& c, int64_t id) {
    const uint64_t h = mix64(id) >> 32;
    return static_cast<int64_t>((h * static_cast<uint64_t>(c.sets)) >> 32);
}

inline void sketch_index(const DramCache& c, int64_t id, int64_t where[kSketchDepth]) {
    const uint64_t m = mix64(id);
    for (int64_t d = 0; d < kSketchDepth; ++d) {
        const uint64_t h = (m * kSketchMults[d]) >> 32;
        where[d] = static_cast<int64_t>((h * static_cast<uint64_t>(c.sketch_width)) >> 32) + (d >> 1) * c.sketch_width;
    }
}

// The counter of sketch row d in byte k (dram_cache.py's _SHIFTS).
inline uint8_t counter(const DramCache& c, int64_t k, int64_t d) {
    return static_cast<uint8_t>((c.sketch[k] >> ((d & 1) << 2)) & 15);
}

inline uint8_t estimate(const DramCache& c, int64_t id) {
    int64_t where[kSketchDepth];
    sketch_index(c, id, where);
    uint8_t m = counter(c, where[0], 0);
    for (int64_t d = 1; d < kSketchDepth; ++d) m = std::min(m, counter(c, where[d], d));
    return m;
}

// The slot holding id in the set whose first way is `base`, or -1.
inline int64_t find_in(const DramCache& c, int64_t base, int64_t id) {
    for (int64_t w = 0; w < c.ways; ++w)
        if (c.tags[base + w] == id) return base + w;
    return -1;
}

inline void age(DramCache& c) {
    const int64_t n = kSketchDepth * c.sketch_width / 2;
    for (int64_t i = 0; i < n; ++i) c.sketch[i] = static_cast<uint8_t>((c.sketch[i] >> 1) & 0x77);  // each nibble halved
    for (int64_t i = 0; i < c.slots; ++i) c.count[i] >>= 1;
    c.state[kSinceAging] = 0;
    c.state[kAgings] += 1;
}

// DramRowCache._count: one read of each distinct id, conservative update; every new count is
// computed from the counters as they were before this call (numpy's vectorized order), then
// each counter takes the largest of its value and the new counts of the ids that share it.
inline void count_reads(DramCache& c, const int64_t* ids, int64_t n, uint8_t* counts) {
    std::vector<int64_t> where(static_cast<size_t>(n * kSketchDepth));
    for (int64_t i = 0; i < n; ++i) sketch_index(c, ids[i], where.data() + i * kSketchDepth);
    for (int64_t i = 0; i < n; ++i) {
        if (i + kPrefetchIds < n)
            for (int64_t d = 0; d < kSketchDepth; ++d) __builtin_prefetch(c.sketch + where[(i + kPrefetchIds) * kSketchDepth + d]);
        const int64_t* w = where.data() + i * kSketchDepth;
        uint8_t m = counter(c, w[0], 0);
        for (int64_t d = 1; d < kSketchDepth; ++d) m = std::min(m, counter(c, w[d], d));
        counts[i] = static_cast<uint8_t>(m + (m < kCountCap ? 1 : 0));
    }
    for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < kSketchDepth; ++d) {
            const int shift = static_cast<int>(d & 1) << 2;
            uint8_t& s = c.sketch[where[static_cast<size_t>(i * kSketchDepth + d)]];
            if (counts[i] > ((s >> shift) & 15)) s = static_cast<uint8_t>((s & (0xF0 >> shift)) | (counts[i] << shift));
        }
    c.state[kSinceAging] += n;
    if (c.state[kSinceAging] >= c.sample) age(c);
}

// DramRowCache.lookup of sorted distinct ids: slot[i] (or -1); marks hits used, counts reads.
// Returns the number of hits. found(i) runs as soon as slot[i] is known (before any read is
// counted): the disk step issues the reads of the misses found so far while the rest is looked up.
template <class Found>
inline int64_t lookup(DramCache& c, const int64_t* ids, int64_t n, int64_t* slot, Found&& found) {
    const int64_t clock = ++c.state[kClock];
    c.state[kAhead] = 0;
    int64_t hits = 0;
    std::vector<int64_t> base(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) base[i] = set_of(c, ids[i]) * c.ways;
    for (int64_t i = 0; i < n; ++i) {
        if (i + kPrefetchIds < n) {
            const int64_t b = base[i + kPrefetchIds];
            prefetch_lines(c.tags + b, c.ways * 8);
            prefetch_lines(c.last + b, c.ways * 8);
            __builtin_prefetch(c.count + b);
        }
        slot[i] = find_in(c, base[i], ids[i]);
        if (slot[i] >= 0) {
            c.last[slot[i]] = clock;
            ++hits;
        }
        found(i);
    }
    if (c.frequency && n > 0) {
        std::vector<uint8_t> counts(static_cast<size_t>(n));
        count_reads(c, ids, n, counts.data());
        for (int64_t i = 0; i < n; ++i)
            if (slot[i] >= 0) c.count[slot[i]] = counts[static_cast<size_t>(i)];
    }
    c.state[kLookups] += n;
    c.state[kHits] += hits;
    return hits;
}

inline int64_t lookup(DramCache& c, const int64_t* ids, int64_t n, int64_t* slot) {
    return lookup(c, ids, n, slot, [](int64_t) {});
}

// One admission decided, not yet written: slot <- the src'th id (and row) of the call.
struct AdmitPick {
    int64_t slot, src;
    uint8_t count;
};

// DramRowCache.admit's decisions for distinct uncached ids, right after a lookup (never a
// read-ahead: lookup cleared that flag), made on the state before any write as the vectorized
// Python does. Writes nothing (so the disk step decides while its reads are in flight, and a
// step whose reads fail admits nothing): admit_commit writes them. Returns the rejections.
inline int64_t admit_plan(const DramCache& c, const int64_t* ids, int64_t n, std::vector<AdmitPick>& picks) {
    picks.clear();
    const bool ahead = c.state[kAhead] != 0;
    if (n == 0) return 0;
    const int64_t clock = c.state[kClock];
    const bool frequency = c.frequency != 0;
    std::vector<int64_t> sets(static_cast<size_t>(n));
    std::vector<uint8_t> count(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) {
        sets[i] = set_of(c, ids[i]);
        if (frequency) count[i] = estimate(c, ids[i]);
    }
    // np.lexsort((-count, sets)) (most read first within a set) or argsort(sets, stable).
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    if (frequency && !ahead)
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
            return sets[a] != sets[b] ? sets[a] < sets[b] : count[a] > count[b];
        });
    else
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sets[a] < sets[b]; });
    picks.reserve(static_cast<size_t>(n));
    std::vector<int64_t> key(static_cast<size_t>(c.ways)), by_age(static_cast<size_t>(c.ways));
    int64_t rejected = 0;
    for (int64_t k = 0; k < n;) {
        const int64_t set = sets[order[k]];
        int64_t end = k;
        while (end < n && sets[order[end]] == set) ++end;
        // The set's ways, weakest first (stable argsort of the key), from the state before writes.
        const int64_t base = set * c.ways;
        for (int64_t w = 0; w < c.ways; ++w) {
            const int64_t last = c.last[base + w];
            key[w] = !frequency ? last
                     : last < clock ? (static_cast<int64_t>(c.count[base + w]) << kClockBits) | last
                                    : kUsedNow;
            by_age[w] = w;
        }
        std::stable_sort(by_age.begin(), by_age.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
        for (int64_t rank = 0; rank < end - k && rank < c.ways; ++rank) {
            const int64_t src = order[k + rank];
            const int64_t slot = base + by_age[rank];
            bool free = c.last[slot] < clock || c.tags[slot] < 0;
            uint8_t cnt = count[src];
            if (frequency) {
                if (!ahead) {
                    const bool won = c.tags[slot] < 0 || cnt >= c.count[slot];
                    if (free && !won) ++rejected;
                    free = free && won;
                } else {
                    cnt = std::max<uint8_t>(cnt, 1);
                }
            }
            if (free) picks.push_back({slot, src, cnt});
        }
        k = end;
    }
    return rejected;
}

// Writes admit_plan's picks: the src'th row is at row(src) (264 bytes). Returns the rows admitted.
template <class Row>
inline int64_t admit_commit(DramCache& c, const int64_t* ids, const std::vector<AdmitPick>& picks, int64_t rejected,
                            int64_t row_bytes, Row row) {
    c.state[kAhead] = 0;
    const int64_t clock = c.state[kClock];
    for (const AdmitPick& p : picks) {
        c.tags[p.slot] = ids[p.src];
        c.last[p.slot] = clock;
        if (c.frequency) c.count[p.slot] = p.count;
        std::memcpy(c.rows + p.slot * row_bytes, row(p.src), static_cast<size_t>(row_bytes));
    }
    c.state[kRejected] += rejected;
    c.state[kAdmitted] += static_cast<int64_t>(picks.size());
    return static_cast<int64_t>(picks.size());
}

// DramRowCache.admit of rows[k] (at rows + k * 264) of distinct uncached ids, right after a lookup.
inline int64_t admit(DramCache& c, const int64_t* ids, int64_t n, const uint8_t* rows, int64_t row_bytes) {
    std::vector<AdmitPick> picks;
    const int64_t rejected = admit_plan(c, ids, n, picks);
    return admit_commit(c, ids, picks, rejected, row_bytes, [&](int64_t src) { return rows + src * row_bytes; });
}

}  // namespace engram_io
