// Host build of the Engram gather: kernels/common/engram_gather.h's row decode, run on the
// CPU cores. Used for CPU serving and by the disk tier's staging; torch-free, loaded with
// ctypes (engram_sglang/core/ops/native.py).
//
// Built without -ffast-math (which would link crtfastmath and turn flush-to-zero on for the
// whole process) and without -march: ISA variants come from target_clones, picked by the
// loader on the machine that runs it.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <sched.h>
#include <unistd.h>

#include "../common/engram_denormals.h"
#include "../common/engram_gather.h"
#include "engram_cpu_abi.h"
#include "engram_decode_avx512.h"

namespace {

using engram::kRowBytes;
using engram::kRowValues;

using engram::DenormalGuard;  // FTZ/DAZ off while decoding (the 2^-127 scale is a denormal)

// ---------------------------------------------------------------- row loops
struct Job {
    const uint8_t* table;
    const void* ids;
    int id_bytes;
    int64_t n, lo, hi;
    uint16_t* out;
    int decoder;  // a Decoder value
    bool stream;  // write the decoded rows with non-temporal stores (see kStreamBytes)
};

// Outputs at least this large are written past the cache (non-temporal stores, no read for
// ownership) by the AVX-512 decode: they do not stay cached until they are read anyway (a
// server L3 is 32-64 MiB per socket or slice; a prefill chunk's rows are ~100 MB), and a
// written line then costs one transfer instead of two. Decode-step outputs (a few MB) are
// written through the cache, where the next op reads them.
constexpr int64_t kStreamBytes = int64_t{32} << 20;

// What the test hook can run besides production, to check on the host the logic the GPU
// launchers run (with only their conversion instruction replaced by its software twin).
enum Decoder : int {
    kHostSoft = 0,        // production: dequant_row_avx512 where the CPU has VBMI, else kHostPortable
    kHostFnuz = 1,        // host form, gfx942's fnuz decode + fix-up
    kDeviceSoft = 2,      // device form (gather_dequant_rows) thread by thread, OCP decode
    kDeviceFnuz = 3,      // device form with gfx942's fnuz decode + fix-up
    kRawRows = 4,         // no decode: the packed rows themselves (bench/gather.py's limit)
    kHostPortable = 5,    // dequant_row_host in the ISA clones below (CPUs without AVX-512 VBMI)
};

#if ENGRAM_HAVE_AVX512_DECODE
const bool g_avx512_decode = engram::avx512_decode_supported();
#else
constexpr bool g_avx512_decode = false;
#endif

// Row decoder tags for rows_body besides the Decoder types of engram_gather.h.
struct PortableRows {};  // dequant_row_host, vectorized by the compiler for the clone's ISA
template <bool kStream>
struct Avx512Rows {};    // dequant_row_avx512<kStream>

// The GPU launchers' launch shape, emulated block by block.
constexpr int kEmuBlockThreads = 256;
constexpr int kEmuUnroll = 4;
constexpr int kEmuRowsPerPass = kEmuBlockThreads / engram::kChunksPerRow;
constexpr int64_t kEmuRowsPerBlock = kEmuRowsPerPass * kEmuUnroll;

template <class Dec, typename IdT>
void device_form(const Job& j, int64_t begin, int64_t end) {
    // begin is a multiple of kEmuRowsPerBlock (kGrainRows is), so blocks line up with a launch.
    const IdT* ids = static_cast<const IdT*>(j.ids) + begin;
    uint16_t* out = j.out + begin * kRowValues;
    for (int64_t first = 0; first < end - begin; first += kEmuRowsPerBlock)
        for (int tid = 0; tid < kEmuBlockThreads; ++tid)
            engram::gather_dequant_rows<Dec, kEmuUnroll, IdT>(j.table, ids, end - begin, j.lo, j.hi, out, first,
                                                              kEmuRowsPerPass, tid);
}

// Rows ahead to prefetch: ids are random, so the hardware prefetcher cannot guess the next
// row; 16 rows (5 cache lines each) ahead measured best here (8: +7% time, 32: +25%).
constexpr int64_t kPrefetchAhead = 16;

template <typename IdT>
inline int64_t id_at(const Job& j, int64_t r) {
    return static_cast<int64_t>(static_cast<const IdT*>(j.ids)[r]);
}

// The row kPrefetchAhead after r, every cache line of it (5 or 6: rows are 264 bytes apart).
template <typename IdT>
inline __attribute__((always_inline)) void prefetch_ahead(const Job& j, int64_t r, int64_t end) {
    if (r + kPrefetchAhead >= end) return;
    const int64_t pid = id_at<IdT>(j, r + kPrefetchAhead);
    if (!engram::id_in_range(pid, j.lo, j.hi)) return;
    const char* p = reinterpret_cast<const char*>(j.table + (pid - j.lo) * kRowBytes);
    for (int off = 0; off < kRowBytes; off += 64) __builtin_prefetch(p + off);
    __builtin_prefetch(p + kRowBytes - 1);
}

// Decoder PortableRows or Avx512Rows: a host row decode; else that decoder's general path.
// Always inlined: each ISA clone below must hold its own copy of the loop (a called body is
// compiled once, for the baseline ISA, and the clones would only jump to it).
template <class Decoder, typename IdT>
inline __attribute__((always_inline)) void rows_body(const Job& j, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
        prefetch_ahead<IdT>(j, r, end);
        const int64_t id = id_at<IdT>(j, r);
        uint16_t* o = j.out + r * kRowValues;
        if (engram::id_in_range(id, j.lo, j.hi)) {
            const uint8_t* row = j.table + (id - j.lo) * kRowBytes;
            // clang-format off: one if-else chain across the #if (clang-format would join its first line)
            if constexpr (std::is_same<Decoder, PortableRows>::value)
                engram::dequant_row_host(row, o);
#if ENGRAM_HAVE_AVX512_DECODE
            else if constexpr (std::is_same<Decoder, Avx512Rows<false>>::value)
                engram::dequant_row_avx512<false>(row, o);
            else if constexpr (std::is_same<Decoder, Avx512Rows<true>>::value)
                engram::dequant_row_avx512<true>(row, o);
#endif
            else
                engram::dequant_row<Decoder>(row, o);
            // clang-format on
        } else {
            for (int i = 0; i < kRowValues; ++i) o[i] = 0;
        }
    }
}

// The portable loop, cloned per x86 ISA level so the decode vectorizes 8 or 16 wide
// without building the library for one CPU. CPUs with AVX-512 VBMI take rows_avx512 instead,
// whose decode is written for that ISA (engram_decode_avx512.h); AVX2-only CPUs keep the
// x86-64-v3 clone here.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ENGRAM_ISA_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define ENGRAM_ISA_CLONES
#endif

ENGRAM_ISA_CLONES void rows_soft_i32(const Job& j, int64_t b, int64_t e) { rows_body<PortableRows, int32_t>(j, b, e); }
ENGRAM_ISA_CLONES void rows_soft_i64(const Job& j, int64_t b, int64_t e) { rows_body<PortableRows, int64_t>(j, b, e); }

#if ENGRAM_HAVE_AVX512_DECODE
// The loop built for the decode's ISA, so that the row decode and its constants are inlined
// into it rather than called (and reloaded) row by row.
template <typename IdT>
ENGRAM_AVX512_DECODE_TARGET void rows_avx512(const Job& j, int64_t b, int64_t e) {
    if (!j.stream) return rows_body<Avx512Rows<false>, IdT>(j, b, e);
    rows_body<Avx512Rows<true>, IdT>(j, b, e);
    _mm_sfence();  // the non-temporal stores are visible before the task counts as done
}
#endif

// The production decode: the AVX-512 row decode where the CPU has it.
template <typename IdT>
void rows_production(const Job& j, int64_t b, int64_t e) {
#if ENGRAM_HAVE_AVX512_DECODE
    if (g_avx512_decode) return rows_avx512<IdT>(j, b, e);
#endif
    if constexpr (std::is_same<IdT, int32_t>::value)
        rows_soft_i32(j, b, e);
    else
        rows_soft_i64(j, b, e);
}

// The same loop (ids, prefetch, threads) copying each packed row as it is: what a gather of
// these rows costs with no decode, the limit bench/gather.py holds the decode against.
template <typename IdT>
void rows_raw(const Job& j, int64_t begin, int64_t end) {
    uint8_t* out = reinterpret_cast<uint8_t*>(j.out);
    for (int64_t r = begin; r < end; ++r) {
        prefetch_ahead<IdT>(j, r, end);
        const int64_t id = id_at<IdT>(j, r);
        if (engram::id_in_range(id, j.lo, j.hi))
            memcpy(out + r * kRowBytes, j.table + (id - j.lo) * kRowBytes, kRowBytes);
        else
            memset(out + r * kRowBytes, 0, kRowBytes);
    }
}

void run_rows(const Job& j, int64_t begin, int64_t end) {
    DenormalGuard guard;
    const bool i32 = j.id_bytes == 4;
    switch (j.decoder) {
        case kHostSoft:
            return i32 ? rows_production<int32_t>(j, begin, end) : rows_production<int64_t>(j, begin, end);
        case kHostPortable:
            return i32 ? rows_soft_i32(j, begin, end) : rows_soft_i64(j, begin, end);
        case kHostFnuz:
            return i32 ? rows_body<engram::EmulatedFnuzAsFn, int32_t>(j, begin, end)
                       : rows_body<engram::EmulatedFnuzAsFn, int64_t>(j, begin, end);
        case kDeviceSoft:
            return i32 ? device_form<engram::SoftE4m3fn, int32_t>(j, begin, end)
                       : device_form<engram::SoftE4m3fn, int64_t>(j, begin, end);
        case kDeviceFnuz:
            return i32 ? device_form<engram::EmulatedFnuzAsFn, int32_t>(j, begin, end)
                       : device_form<engram::EmulatedFnuzAsFn, int64_t>(j, begin, end);
        case kRawRows:
            return i32 ? rows_raw<int32_t>(j, begin, end) : rows_raw<int64_t>(j, begin, end);
    }
}

// ---------------------------------------------------------------- thread pool
// A small persistent pool whose idle workers block on a condition variable after a short spin.
// Not OpenMP: torch ships its own libgomp, and two OpenMP runtimes spinning on two cores starve
// each other (libgomp spins up to 300k rounds by default); this pool spins for kSpinNs at most.
constexpr int64_t kGrainRows = 64;      // ~50 KB moved per task
static_assert(kGrainRows % kEmuRowsPerBlock == 0, "tasks hold whole emulated blocks");
// Below this many rows (~20 us of work on one thread) a call runs on the caller alone: a worker
// asleep since the last call joins 20-25 us late (more when its wake-up lands on the caller's
// core), so two threads lose under ~600 rows; measured on 2 vCPUs: 144-576 rows took 1.2-1.35x
// longer on two threads than on one, back to back and 1 ms apart.
constexpr int64_t kSerialRows = 512;

// How long a worker that ran out of tasks, and a caller waiting for its workers' last tasks,
// spin before they block. A futex wake-up costs 10-50 us on a VM (an inter-processor interrupt
// to an idle vCPU), a third of a decode-shaped call (~6k rows, ~150 us on two threads): a
// call that follows within kSpinNs (the next layer's, a Python op call's ~10 us apart) finds
// the workers awake, and the caller's wait for the last task (a few us) never sleeps. Calls
// further apart pay one wake-up, as before, and the spin costs that core kSpinNs a call.
constexpr int64_t kSpinNs = 50'000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Spins until done() or until ns have passed; returns done().
template <class Done>
bool spin_for(Done done, int64_t ns) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    for (;;) {
        for (int i = 0; i < 32; ++i) {  // ~1 us between clock reads
            if (done()) return true;
            cpu_relax();
        }
        if (std::chrono::steady_clock::now() >= until) return done();
    }
}

int default_threads() {
    if (const char* env = std::getenv("ENGRAM_CPU_THREADS")) {
        const int v = std::atoi(env);
        if (v > 0) return v;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    const unsigned hc = std::thread::hardware_concurrency();
    return hc ? static_cast<int>(hc) : 1;
}

class Pool {
  public:
    explicit Pool(int workers) : pid_(getpid()) {
        for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { worker(); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
        }
        cv_work_.notify_all();
        for (auto& t : threads_) t.join();
    }
    int workers() const { return static_cast<int>(threads_.size()); }
    pid_t pid() const { return pid_; }

    // Runs j over [0, n) in kGrainRows tasks on the caller plus up to `helpers` workers.
    void run(const Job& j, int helpers) {
        std::lock_guard<std::mutex> call(call_mu_);  // one job at a time
        {
            std::lock_guard<std::mutex> lk(mu_);
            job_ = &j;
            next_.store(0, std::memory_order_relaxed);
            tasks_ = (j.n + kGrainRows - 1) / kGrainRows;
            seats_ = helpers;
            busy_ = 0;
            ++generation_;
        }
        // Wake at most `helpers` sleepers (a worker still spinning from the last call needs no
        // wake-up, and one woken beyond the seats would only go back to sleep).
        for (int i = 0; i < helpers; ++i) cv_work_.notify_one();
        drain();
        std::unique_lock<std::mutex> lk(mu_);
        seats_ = 0;  // late wakers find no seat
        if (busy_.load(std::memory_order_relaxed) != 0) {
            lk.unlock();
            spin_for([this] { return busy_.load(std::memory_order_acquire) == 0; }, kSpinNs);
            lk.lock();
            cv_done_.wait(lk, [this] { return busy_.load(std::memory_order_relaxed) == 0; });
        }
        job_ = nullptr;
    }

  private:
    void drain() {
        const Job& j = *job_;
        for (;;) {
            const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
            if (t >= tasks_) return;
            const int64_t b = t * kGrainRows;
            run_rows(j, b, b + kGrainRows < j.n ? b + kGrainRows : j.n);
        }
    }
    void worker() {
        uint64_t seen = 0;
        // Spin for the next job only after a job that seated this worker: a pool wider than the
        // calls' thread counts would otherwise burn kSpinNs a call in every worker without a seat.
        bool seated = false;
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
            if (seated && !stop_ && generation_.load(std::memory_order_relaxed) == seen) {
                lk.unlock();
                spin_for([&] { return generation_.load(std::memory_order_acquire) != seen; }, kSpinNs);
                lk.lock();
            }
            cv_work_.wait(lk, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
            if (stop_) return;
            seen = generation_;
            seated = seats_ > 0 && job_ != nullptr;
            if (!seated) continue;
            --seats_;
            ++busy_;
            lk.unlock();
            drain();
            lk.lock();
            if (busy_.fetch_sub(1, std::memory_order_release) == 1) cv_done_.notify_all();
        }
    }

    pid_t pid_;
    std::vector<std::thread> threads_;
    std::mutex call_mu_, mu_;
    std::condition_variable cv_work_, cv_done_;
    const Job* job_ = nullptr;
    std::atomic<int64_t> next_{0};
    int64_t tasks_ = 0;
    int seats_ = 0;
    // Changed under mu_ only; atomic for the spins, which read them without it.
    std::atomic<int> busy_{0};
    std::atomic<uint64_t> generation_{0};
    bool stop_ = false;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // never destroyed: workers must not be joined during exit

Pool& pool_for(int threads) {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    // A forked child inherits the Pool object but none of its threads: start a new one and
    // leak the old (its mutexes may be held by threads that no longer exist).
    if (g_pool == nullptr || g_pool->pid() != getpid()) {
        const int size = threads > default_threads() ? threads : default_threads();
        g_pool = new Pool(size - 1);
    }
    return *g_pool;
}

// The threads a call of n rows runs on, given the caller's count (<= 0: all usable cores):
// one below kSerialRows, never more than it has tasks.
int threads_for(int64_t n, int threads) {
    if (n < kSerialRows) return 1;
    if (threads <= 0) threads = default_threads();
    const int64_t tasks = (n + kGrainRows - 1) / kGrainRows;
    return static_cast<int>(threads < tasks ? threads : tasks);
}

int gather(const uint8_t* table, const void* ids, int id_bytes, int64_t n, int64_t lo, int64_t hi, uint16_t* out,
           int threads, int decoder) {
    if (n < 0 || lo < 0 || lo > hi || (id_bytes != 4 && id_bytes != 8)) return engram::kBadArgument;
    if (n == 0) return engram::kOk;
    if (ids == nullptr || out == nullptr || (table == nullptr && hi > lo)) return engram::kBadArgument;
    const bool stream = n * kRowValues * 2 >= kStreamBytes && (reinterpret_cast<uintptr_t>(out) & 63u) == 0;
    const Job j{table, ids, id_bytes, n, lo, hi, out, decoder, stream};
    threads = threads_for(n, threads);
    if (threads == 1) {
        run_rows(j, 0, n);
        return engram::kOk;
    }
    Pool& pool = pool_for(threads);
    pool.run(j, threads - 1 < pool.workers() ? threads - 1 : pool.workers());
    return engram::kOk;
}

}  // namespace

extern "C" {

// The entry points of engram_cpu_abi.h (their meaning is documented there).
int engram_cpu_abi_version(void) { return ENGRAM_CPU_ABI_VERSION; }

int engram_cpu_default_threads(void) { return default_threads(); }

int engram_cpu_threads_for(int64_t n, int threads) { return threads_for(n, threads); }

int engram_cpu_decode_avx512(void) { return g_avx512_decode ? 1 : 0; }

int engram_cpu_gather_dequant(const uint8_t* table, const void* ids, int id_bytes, int64_t n, int64_t lo, int64_t hi,
                              uint16_t* out, int threads) {
    return gather(table, ids, id_bytes, n, lo, hi, out, threads, 0);
}

// `decoder`: an enum Decoder value above (conversion instructions replaced by software decodes).
int engram_cpu_gather_dequant_emulated(const uint8_t* table, const void* ids, int id_bytes, int64_t n, int64_t lo,
                                       int64_t hi, uint16_t* out, int threads, int decoder) {
    if (decoder != kHostPortable && (decoder < kHostSoft || decoder > kDeviceFnuz)) return engram::kBadArgument;
    return gather(table, ids, id_bytes, n, lo, hi, out, threads, decoder);
}

int engram_cpu_gather_raw(const uint8_t* table, const void* ids, int id_bytes, int64_t n, int64_t lo, int64_t hi,
                          uint8_t* out, int threads) {
    return gather(table, ids, id_bytes, n, lo, hi, reinterpret_cast<uint16_t*>(out), threads, kRawRows);
}

}  // extern "C"
