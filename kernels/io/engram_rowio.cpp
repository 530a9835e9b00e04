// engram_rowio.cpp: the disk tier's row reads, with many reads in flight.
//
// Two ways to copy packed 264-byte rows (row ids already deduplicated by the caller) out of a
// layer file into a staging buffer:
//
//  * mapped: memcpy from a persistent read-only mapping of the file. Rows in the page cache
//    cost a memory read; a row that is not faults in on the thread that touches it, so N
//    worker threads keep N page-cache misses in flight (with MADV_RANDOM each miss reads one
//    page, not a read-around window). A mapping turns I/O errors and truncation into SIGBUS:
//    a thread-local sigsetjmp guard turns that into an error return for this call only.
//  * pread: one pread per row (optionally O_DIRECT through an aligned per-thread buffer),
//    spread over N threads. Slower for cached rows, but it reports the real errno; the
//    caller uses it to retry and to name what failed.
//  * aio: O_DIRECT reads by io_uring (engram_uring.h) or, where it is unavailable, Linux
//    native AIO, from the calling thread, `depth` in flight (what fio's engines do). A blocking
//    pread per row costs a thread switch per row: on a 2-core VM 64 threads burned ~10 us of
//    CPU per row and reached half the disk's IOPS.
//    Sorted rows whose pages touch are merged into one read of up to 64 KiB.
//
// No torch, no Python: loaded with ctypes. Built without -ffast-math like every kernel here.
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <algorithm>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include <linux/aio_abi.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "engram_rowio_abi.h"
#include "engram_uring.h"

namespace {

constexpr int64_t kRowBytes = 264;
constexpr int64_t kPage = 4096;
// Rows per work item: small, so a thread blocked on a cold page holds back few rows.
constexpr int64_t kRowsPerItem = 4;
// The calling thread's serial start (copy_mapped): rows between checks for major faults.
constexpr int64_t kSerialStep = 64;
// Past this many rows even cached ones go faster on every core (a prefill chunk's rows).
constexpr int64_t kSerialMax = 8192;

long major_faults() {
    struct rusage usage;
    getrusage(RUSAGE_THREAD, &usage);
    return usage.ru_majflt;
}

// ------------------------------------------------------------------ SIGBUS guard
// volatile: the copy loop never reads it, so without it the compiler may drop the store
// that arms the guard (the only reader is the signal handler).
thread_local sigjmp_buf* volatile t_guard = nullptr;
struct sigaction g_previous;
std::mutex g_guard_mutex;

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
    if (t_guard != nullptr) siglongjmp(*t_guard, 1);  // a fault inside our copy loop
    // Not ours: hand it to whoever had the signal before us (or die as the default would).
    if (g_previous.sa_flags & SA_SIGINFO) {
        if (g_previous.sa_sigaction != nullptr) return g_previous.sa_sigaction(sig, info, ctx);
    } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
        return g_previous.sa_handler(sig);
    }
    signal(SIGBUS, SIG_DFL);
    raise(SIGBUS);
}

// Checked on every call: a handler installed after ours (faulthandler, a runtime) would
// otherwise turn a truncated file back into a crash.
void ensure_guard() {
    struct sigaction current;
    sigaction(SIGBUS, nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
    std::lock_guard<std::mutex> lock(g_guard_mutex);
    sigaction(SIGBUS, nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) return;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    sigaction(SIGBUS, &ours, &g_previous);
}

// ------------------------------------------------------------------ worker pool
// Threads of one call, at most (the ABI's, which rowio.MAX_THREADS mirrors; the Python side
// refuses more). Past a few hundred reads in flight a disk gains nothing, and thousands of
// threads under a memory limit fail to start.
constexpr int kMaxThreads = ENGRAM_ROWIO_MAX_THREADS;

// Persistent threads: creating dozens of threads per decode step would cost more than the
// rows. A call hands out work items through an atomic counter; the caller works too.
class Pool {
  public:
    pid_t pid() const { return pid_; }

    void run(int threads, int64_t items, const std::function<void(int64_t)>& fn) {
        threads = std::min(threads, kMaxThreads);
        if (threads <= 1 || items <= 1) {
            for (int64_t k = 0; k < items; ++k) fn(k);
            return;
        }
        std::lock_guard<std::mutex> call_lock(call_mutex_);  // one call at a time per pool
        const int helpers = grow(static_cast<int>(std::min<int64_t>(threads - 1, items - 1)));
        {
            std::lock_guard<std::mutex> lock(mutex_);
            fn_ = &fn;
            items_ = items;
            next_.store(0);
            wanted_ = helpers;
            busy_ = helpers;
            ++generation_;
        }
        wake_.notify_all();
        drain();
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return busy_ == 0; });
        fn_ = nullptr;
    }

    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        for (auto& t : threads_) t.join();
    }

  private:
    // Start helpers up to n; returns how many there are. A thread the system refuses (out of
    // memory or of tasks) is not fatal: the call runs with those it has (the caller always works).
    int grow(int n) {
        try {
            while (static_cast<int>(threads_.size()) < n) {
                const int index = static_cast<int>(threads_.size());
                threads_.emplace_back([this, index] { loop(index); });
            }
        } catch (const std::system_error&) {
        } catch (const std::bad_alloc&) {
        }
        return std::min(n, static_cast<int>(threads_.size()));
    }

    void drain() {
        for (int64_t k; (k = next_.fetch_add(1)) < items_;) (*fn_)(k);
    }

    void loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return stop_ || (generation_ != seen && index < wanted_); });
                if (stop_) return;
                seen = generation_;
            }
            drain();
            std::lock_guard<std::mutex> lock(mutex_);
            if (--busy_ == 0) done_.notify_all();
        }
    }

    const pid_t pid_ = getpid();
    std::mutex call_mutex_, mutex_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> threads_;
    const std::function<void(int64_t)>* fn_ = nullptr;
    int64_t items_ = 0;
    std::atomic<int64_t> next_{0};
    int wanted_ = 0, busy_ = 0;
    uint64_t generation_ = 0;
    bool stop_ = false;
};

std::mutex g_pool_mutex;
Pool* g_pool = nullptr;  // never destroyed: workers may outlive static teardown

Pool& pool() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    // A forked child inherits the Pool object but none of its threads (a call would wait for
    // helpers that do not exist): start a new one and leak the old, whose mutexes may be held
    // by threads that are gone.
    if (g_pool == nullptr || g_pool->pid() != getpid()) g_pool = new Pool();
    return *g_pool;
}

void record_failure(std::atomic<int64_t>& first, int64_t index) {
    int64_t cur = first.load();
    while ((cur < 0 || index < cur) && !first.compare_exchange_weak(cur, index)) {
    }
}

// Rows ahead whose lines the mapped copy prefetches: page-cached rows of a large table are
// random 4 KiB pages, each a TLB and a cache miss; one at a time they cost ~0.25 us a row
// here, with several in flight far less. A prefetch never faults (a page not in memory is
// skipped), so the SIGBUS guard sees the same accesses as without it.
constexpr int64_t kCopyAhead = 8;

// Copies rows [lo, hi) of the request; returns the index of a faulting row, or -1.
int64_t copy_guarded(const uint8_t* base, const int64_t* rows, int64_t lo, int64_t hi, uint8_t* out) {
    for (int64_t k = lo; k < std::min(hi, lo + kCopyAhead); ++k) {  // before the guard: nothing longjmp clobbers
        __builtin_prefetch(base + rows[k] * kRowBytes);
        __builtin_prefetch(base + rows[k] * kRowBytes + kRowBytes - 1);
    }
    sigjmp_buf guard;
    volatile int64_t i = lo;
    if (sigsetjmp(guard, 1) != 0) {
        t_guard = nullptr;
        return i;
    }
    t_guard = &guard;
    for (; i < hi; i = i + 1) {
        if (i + kCopyAhead < hi) {
            const uint8_t* ahead = base + rows[i + kCopyAhead] * kRowBytes;
            for (int64_t off = 0; off < kRowBytes; off += 64) __builtin_prefetch(ahead + off);
            __builtin_prefetch(ahead + kRowBytes - 1);
        }
        memcpy(out + i * kRowBytes, base + rows[i] * kRowBytes, kRowBytes);
    }
    t_guard = nullptr;
    return -1;
}

// One row by pread; returns 0, an errno, or -1 for a short read (past the end of the file).
int read_row(int fd, int64_t data_offset, int64_t row, uint8_t* out, bool direct, uint8_t* aligned) {
    const int64_t offset = data_offset + row * kRowBytes;
    int64_t start = offset, length = kRowBytes;
    uint8_t* dst = out;
    if (direct) {  // O_DIRECT: page-aligned offset, length and buffer (a row spans 1 or 2 pages)
        start = offset & ~(kPage - 1);
        length = ((offset + kRowBytes - start) + kPage - 1) & ~(kPage - 1);
        dst = aligned;
    }
    int64_t need = offset + kRowBytes - start, got = 0;
    while (got < need) {
        ssize_t r = pread(fd, dst + got, static_cast<size_t>(length - got), start + got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return -1;
        got += r;
    }
    if (direct) memcpy(out, aligned + (offset - start), kRowBytes);
    return 0;
}

// ------------------------------------------------------------------ native AIO
constexpr int64_t kMaxExtent = 64 << 10;  // bytes of one merged read
constexpr int kMaxDepth = 256;

struct Extent {
    int64_t start, length;  // page-aligned bytes of the file
    int64_t first, last;    // rows [first, last) of the request it holds
};

// Per-thread AIO context and bounce buffers, created on first use and kept (io_setup costs
// a syscall and kernel memory; a store reads from one thread at a time).
struct AioState {
    aio_context_t ctx = 0;
    int depth = 0;
    uint8_t* buffers = nullptr;
    pid_t owner = 0;  // the process whose context ctx is
    ~AioState() {
        if (ctx != 0 && owner == getpid()) syscall(SYS_io_destroy, ctx);
        free(buffers);
    }
    bool ready(int want) {
        if (owner != getpid()) {
            // A forked child: ctx names its parent's context (every io_submit here fails with
            // EINVAL, and io_destroy is not ours to call); its reads never land in this copy of
            // the buffers, so they are freed and the context set up again.
            ctx = 0;
            depth = 0;
            free(buffers);
            buffers = nullptr;
            owner = getpid();
        }
        if (depth >= want) return true;
        if (ctx != 0) syscall(SYS_io_destroy, ctx);
        ctx = 0;
        free(buffers);
        buffers = static_cast<uint8_t*>(aligned_alloc(kPage, static_cast<size_t>(want) * kMaxExtent));
        if (buffers == nullptr || syscall(SYS_io_setup, want, &ctx) != 0) {
            ctx = 0;
            depth = 0;
            return false;
        }
        depth = want;
        return true;
    }
};

// Completions a blocking wait asks for: a wake-up per completion costs a thread switch and
// resubmits reads one or two at a time (a doorbell each). Waiting for half the depth keeps at
// least half of it in flight and cut CPU per read ~15% here (io_uring 2.8 -> 2.3 us, AIO 3.1
// -> 2.8) at the same reads/s. With nothing left to submit, the rest at once.
int wake_after(int in_flight, int depth, bool more) {
    if (!more) return in_flight;
    return std::max(1, std::min(in_flight, depth / 2));
}

// The calling thread's AIO context (one per thread: a store reads from one thread at a time).
AioState& aio_state() {
    static thread_local AioState state;
    return state;
}

// What both engines below share: a request of ascending rows of an O_DIRECT file, merged into
// extents as its rows are added (the disk step adds its misses while it is still looking
// them up), the bounce-buffer slots, and the rows of each completed extent copied out.
// An engine submits extents_[next_..] into free slots and hands each completion to land().
class ExtentReads {
  public:
    int error = 0;        // errno of a failed read, -1 short read (the file ends early)
    int64_t failed = -1;  // smallest index of a row that failed

    // Reads not finished (in flight, or added and not yet submitted while none failed).
    bool busy() const { return in_flight_ > 0 || (error == 0 && next_ < extents_.size()); }

    // The most reads this call had out at once (a test hook: never more than its depth).
    int peak() const { return peak_; }

    // Rows [added_, n) of the request join the extents (submitted by the next pump): ascending
    // rows whose pages touch an extent not yet submitted are one read with it, while it stays small.
    void extend(int64_t n) {
        for (int64_t i = added_; i < n; ++i) {
            const int64_t offset = data_offset_ + rows_[i] * kRowBytes;
            const int64_t start = offset & ~(kPage - 1);
            const int64_t end = (offset + kRowBytes + kPage - 1) & ~(kPage - 1);
            if (extents_.size() > next_) {
                Extent& e = extents_.back();
                if (start >= e.start && start <= e.start + e.length && end - e.start <= kMaxExtent) {
                    e.length = std::max(e.length, end - e.start);
                    e.last = i + 1;
                    continue;
                }
            }
            extents_.push_back({start, end - start, i, i + 1});
        }
        added_ = std::max(added_, n);
    }

  protected:
    // `slots`: the reads in flight at most (the call's depth; the thread's ring or context,
    // made for the deepest call so far, may hold more).
    void reset(int fd, int64_t data_offset, const int64_t* rows, uint8_t* out, const int64_t* where, int slots) {
        depth_ = slots;
        fd_ = fd;
        data_offset_ = data_offset;
        rows_ = rows;
        out_ = out;
        where_ = where;
        extents_.clear();
        free_slots_.clear();
        for (int k = slots - 1; k >= 0; --k) free_slots_.push_back(k);
        next_ = 0;
        added_ = 0;
        in_flight_ = 0;
        peak_ = 0;
        error = 0;
        failed = -1;
    }

    // Extent `index` read into slot `slot` (`res` bytes, or -errno): its rows go to out, then
    // done(first, last) for the request's rows [first, last) now in place.
    template <class Done>
    void land(size_t index, int slot, const uint8_t* buf, int64_t res, Done& done) {
        const Extent& e = extents_[index];
        --in_flight_;
        free_slots_.push_back(slot);
        if (res < 0) {
            if (error == 0) error = static_cast<int>(-res);
            if (failed < 0 || e.first < failed) failed = e.first;
            return;
        }
        int64_t i = e.first;
        for (; i < e.last; ++i) {
            const int64_t at = data_offset_ + rows_[i] * kRowBytes - e.start;
            if (at + kRowBytes > res) {  // the file ends early
                if (error == 0) error = -1;
                if (failed < 0 || i < failed) failed = i;
                break;
            }
            memcpy(out_ + (where_ != nullptr ? where_[i] : i) * kRowBytes, buf + at, kRowBytes);
        }
        if (i > e.first) done(e.first, i);
    }

    // Slot and extent in one tag (a completion's aio_data / user_data).
    static uint64_t tag(size_t index, int slot) {
        return (static_cast<uint64_t>(index) << 16) | static_cast<uint64_t>(slot);
    }

    int depth_ = 0;
    int fd_ = -1;
    int64_t data_offset_ = 0;
    const int64_t* rows_ = nullptr;
    uint8_t* out_ = nullptr;
    const int64_t* where_ = nullptr;
    std::vector<Extent> extents_;
    std::vector<int> free_slots_;
    size_t next_ = 0;  // extents submitted
    int64_t added_ = 0;
    int in_flight_ = 0;
    int peak_ = 0;
};

// Reads of ascending rows of an O_DIRECT file by native AIO, `depth` in flight, driven by the
// caller: begin() sets up, extend(n) adds rows [0, n) as they become known, pump() reaps what
// completed, copies its rows, calls done(first, last) for the request's rows [first, last) now
// in place, and submits what the free slots allow. The disk step adds its misses as its lookup
// finds them and does its other work between pumps.
class AioReads : public ExtentReads {
  public:
    // 0, or ENGRAM_AIO_UNAVAILABLE when native AIO is unavailable here. Row i lands at
    // out + (where ? where[i] : i) * 264.
    int begin(int fd, int64_t data_offset, const int64_t* rows, uint8_t* out, const int64_t* where, int depth) {
        st_ = &aio_state();
        depth = std::max(1, std::min(depth, kMaxDepth));
        if (!st_->ready(depth)) return ENGRAM_AIO_UNAVAILABLE;
        reset(fd, data_offset, rows, out, where, depth);
        cbs_.resize(static_cast<size_t>(st_->depth));
        queue_.resize(static_cast<size_t>(st_->depth));
        events_.resize(static_cast<size_t>(st_->depth));
        return 0;
    }

    // Reaps completed reads (with `wait`, blocks until enough complete), then submits more.
    // Returns busy().
    template <class Done>
    bool pump(bool wait, Done&& done) {
        if (in_flight_ == 0) {
            submit();
            if (in_flight_ == 0) return false;  // nothing to read, or a submission failed with nothing in flight
        }
        struct timespec zero = {0, 0};
        const int want = wait ? wake_after(in_flight_, depth_, next_ < extents_.size()) : 0;
        const long got = syscall(SYS_io_getevents, st_->ctx, want, in_flight_, events_.data(), wait ? nullptr : &zero);
        if (got < 0) {
            if (errno == EINTR) return true;
            error = errno;  // cannot reap: the context is unusable from here on
            st_->depth = 0;
            failed = 0;
            in_flight_ = 0;
            next_ = extents_.size();
            return false;
        }
        for (long k = 0; k < got; ++k) {
            const io_event& ev = events_[static_cast<size_t>(k)];
            const int slot = static_cast<int>(ev.data & 0xFFFF);
            land(ev.data >> 16, slot, st_->buffers + static_cast<int64_t>(slot) * kMaxExtent, ev.res, done);
        }
        submit();
        return busy();
    }

  private:
    // Fills the free slots with the next extents, in as few io_submit calls as the kernel takes.
    void submit() {
        int batch = 0;
        while (error == 0 && next_ < extents_.size() && !free_slots_.empty()) {
            const int slot = free_slots_.back();
            free_slots_.pop_back();
            iocb& cb = cbs_[static_cast<size_t>(slot)];
            memset(&cb, 0, sizeof cb);
            cb.aio_data = tag(next_, slot);
            cb.aio_lio_opcode = IOCB_CMD_PREAD;
            cb.aio_fildes = static_cast<uint32_t>(fd_);
            cb.aio_buf = reinterpret_cast<uint64_t>(st_->buffers + static_cast<int64_t>(slot) * kMaxExtent);
            cb.aio_nbytes = static_cast<uint64_t>(extents_[next_].length);
            cb.aio_offset = extents_[next_].start;
            queue_[static_cast<size_t>(batch++)] = &cb;
            ++next_;
        }
        for (int done = 0; done < batch;) {
            const long r = syscall(SYS_io_submit, st_->ctx, batch - done, queue_.data() + done);
            if (r < 0) {
                if (errno == EINTR) continue;
                // Not submitted: give those slots back. EAGAIN while reads are in flight means
                // the kernel is out of request slots for now: reap, then submit the rest again
                // (spinning on io_submit would never free any). Anything else is reported.
                const bool later = errno == EAGAIN && in_flight_ > 0;
                if (!later) error = errno;
                for (int k = done; k < batch; ++k) {
                    const uint64_t data = queue_[static_cast<size_t>(k)]->aio_data;
                    free_slots_.push_back(static_cast<int>(data & 0xFFFF));
                    if (!later && failed < 0) failed = extents_[data >> 16].first;
                }
                if (later) next_ -= static_cast<size_t>(batch - done);  // extents were handed out in order
                break;
            }
            done += static_cast<int>(r);
            in_flight_ += static_cast<int>(r);
            peak_ = std::max(peak_, in_flight_);
        }
    }

    AioState* st_ = nullptr;
    std::vector<iocb> cbs_;
    std::vector<iocb*> queue_;
    std::vector<io_event> events_;
};

// The ring of this process's last io_uring call (any thread): its slots, how many are
// registered, and the errno that kept the rest out (engram_rowio_uring_buffers; the stats show it).
std::atomic<int> g_ring_slots{0}, g_fixed_slots{0}, g_register_error{0};

// The same reads by io_uring (engram_uring.h): submission and reaping in one io_uring_enter,
// registered buffers. The engine is chosen per process (engram_rowio_engine, default:
// io_uring where the kernel allows it, else native AIO).
class UringReads : public ExtentReads {
  public:
    int begin(int fd, int64_t data_offset, const int64_t* rows, uint8_t* out, const int64_t* where, int depth) {
        static thread_local engram_io::Uring ring;
        ring_ = &ring;
        depth = std::max(1, std::min(depth, kMaxDepth));
        if (!ring.ready(depth, kMaxExtent)) return ENGRAM_AIO_UNAVAILABLE;
        g_fixed_slots.store(ring.fixed_slots(), std::memory_order_relaxed);
        g_ring_slots.store(ring.depth, std::memory_order_relaxed);
        g_register_error.store(ring.register_error(), std::memory_order_relaxed);
        reset(fd, data_offset, rows, out, where, depth);
        return 0;
    }

    template <class Done>
    bool pump(bool wait, Done&& done) {
        // After a failed enter (fail_submit) the disk step still pumps until not busy: entering
        // the abandoned ring again would submit what its SQ held and reap into freed slots.
        if (!ring_->live()) return busy();
        queue();
        const int want = wait && in_flight_ > 0 ? wake_after(in_flight_, depth_, next_ < extents_.size()) : 0;
        const int err = ring_->enter(static_cast<unsigned>(want), static_cast<unsigned>(in_flight_));
        if (err != 0) {
            fail_submit(err);
            return false;
        }
        ring_->reap([&](uint64_t data, int res) {
            const int slot = static_cast<int>(data & 0xFFFF);
            land(data >> 16, slot, ring_->buffers + static_cast<int64_t>(slot) * kMaxExtent, res, done);
        });
        return busy();
    }

  private:
    void queue() {
        while (error == 0 && next_ < extents_.size() && !free_slots_.empty()) {
            const int slot = free_slots_.back();
            if (!ring_->queue(fd_, extents_[next_].start, slot, static_cast<uint32_t>(extents_[next_].length),
                              tag(next_, slot)))
                break;  // the SQ is full: this pump's enter submits, the next queues the rest
            free_slots_.pop_back();
            ++next_;
            peak_ = std::max(peak_, ++in_flight_);
        }
    }

    // io_uring_enter failed: nothing more is reaped; the ring is dropped (its buffers never
    // freed: reads in flight may still land there) and the next call makes a new one.
    void fail_submit(int err) {
        ring_->abandon();
        if (error == 0) error = err;
        if (failed < 0) failed = 0;
        in_flight_ = 0;
        next_ = extents_.size();
    }

    engram_io::Uring* ring_ = nullptr;
};

// 0: io_uring where available, else native AIO; 1: native AIO; 2: io_uring (else AIO).
std::atomic<int> g_engine{-1};

thread_local int t_last_peak = 0;  // engram_rowio_last_peak

int engine() {
    int e = g_engine.load(std::memory_order_relaxed);
    if (e < 0) {
        const char* env = std::getenv("ENGRAM_IO_ENGINE");
        e = env != nullptr && std::strcmp(env, "aio") == 0 ? 1 : 0;
        g_engine.store(e);
    }
    return e;
}

// The O_DIRECT reads of one call by the process's engine: io_uring, or native AIO where
// io_uring is unavailable (or asked for). begin(), then add() as the rows become known (all
// at once, or as the disk step's lookup finds its misses), pump() until not busy().
class AsyncReads {
  public:
    int begin(int fd, int64_t data_offset, const int64_t* rows, uint8_t* out, const int64_t* where, int depth) {
        uring_ = engine() != 1 && u_.begin(fd, data_offset, rows, out, where, depth) == 0;
        return uring_ ? 0 : aio_.begin(fd, data_offset, rows, out, where, depth);
    }
    // Rows [0, n) of the request are known: they join the reads, what slots allow is submitted
    // and what completed is reaped (done as in pump).
    template <class Done>
    void add(int64_t n, Done&& done) {
        if (uring_) {
            u_.extend(n);
            u_.pump(false, done);
        } else {
            aio_.extend(n);
            aio_.pump(false, done);
        }
    }
    bool busy() const { return uring_ ? u_.busy() : aio_.busy(); }
    template <class Done>
    bool pump(bool wait, Done&& done) {
        return uring_ ? u_.pump(wait, done) : aio_.pump(wait, done);
    }
    int error() const { return uring_ ? u_.error : aio_.error; }
    int64_t failed() const { return uring_ ? u_.failed : aio_.failed; }
    int peak() const { return uring_ ? u_.peak() : aio_.peak(); }

  private:
    AioReads aio_;
    UringReads u_;
    bool uring_ = false;
};

}  // namespace

extern "C" {

// The entry points of engram_rowio_abi.h (their meaning is documented there).
int engram_rowio_copy_mapped(const uint8_t* base, const int64_t* rows, int64_t n, uint8_t* out, int threads,
                             int64_t* failed) {
    ensure_guard();
    // Cached rows cost ~0.1 us each and are done fastest by this thread alone; waking dozens of
    // workers would cost more than the copy. So copy here until this thread takes a major
    // page fault (a row that needed the disk) or has done a decode step's worth, then hand
    // the rest to the pool, which keeps many such reads in flight. Major faults, not elapsed time, decide: a busy machine
    // preempts this thread without any row being cold.
    int64_t start = 0;
    const long major0 = major_faults();
    const int64_t serial_end = std::min(n, kSerialMax);
    while (start < serial_end) {
        const int64_t hi = std::min(serial_end, start + kSerialStep);
        const int64_t bad = copy_guarded(base, rows, start, hi, out);
        if (bad >= 0) {
            *failed = bad;
            return 1;
        }
        start = hi;
        if (major_faults() != major0) break;
    }
    std::atomic<int64_t> first{-1};
    const int64_t rest = n - start;
    const int64_t items = (rest + kRowsPerItem - 1) / kRowsPerItem;
    pool().run(threads, items, [&](int64_t k) {
        const int64_t lo = start + k * kRowsPerItem, hi = std::min(n, lo + kRowsPerItem);
        const int64_t bad = copy_guarded(base, rows, lo, hi, out);
        if (bad >= 0) record_failure(first, bad);
    });
    *failed = first.load();
    return *failed >= 0 ? 1 : 0;
}

int engram_rowio_pread(int fd, int64_t data_offset, const int64_t* rows, int64_t n, uint8_t* out, int threads,
                       int direct, int64_t* failed) {
    std::atomic<int64_t> first{-1};
    std::atomic<int> error{0};
    const int64_t items = (n + kRowsPerItem - 1) / kRowsPerItem;
    pool().run(threads, items, [&](int64_t k) {
        alignas(kPage) static thread_local uint8_t aligned[2 * kPage];
        const int64_t lo = k * kRowsPerItem, hi = std::min(n, lo + kRowsPerItem);
        for (int64_t i = lo; i < hi; ++i) {
            const int err = read_row(fd, data_offset, rows[i], out + i * kRowBytes, direct != 0, aligned);
            if (err != 0) {
                int expected = 0;
                error.compare_exchange_strong(expected, err);
                record_failure(first, i);
                return;
            }
        }
    });
    *failed = first.load();
    return error.load();
}

int engram_rowio_aio(int fd, int64_t data_offset, const int64_t* rows, int64_t n, uint8_t* out, int depth,
                     int64_t* failed) {
    *failed = -1;
    if (n == 0) return 0;
    AsyncReads reads;
    auto none = [](int64_t, int64_t) {};
    if (reads.begin(fd, data_offset, rows, out, nullptr, depth) != 0) return ENGRAM_AIO_UNAVAILABLE;
    reads.add(n, none);
    while (reads.pump(true, none)) {
    }
    t_last_peak = reads.peak();
    *failed = reads.failed();
    return reads.error();
}

int engram_rowio_last_peak(void) { return t_last_peak; }

void engram_rowio_test_short_enters(int n) { engram_io::g_short_enters.store(n); }
void engram_rowio_test_fail_enters(int n) { engram_io::g_fail_enters.store(n); }

void engram_rowio_uring_buffers(int64_t* out) {
    out[0] = g_ring_slots.load(std::memory_order_relaxed);
    out[1] = g_fixed_slots.load(std::memory_order_relaxed);
    out[2] = g_register_error.load(std::memory_order_relaxed);
}

int engram_rowio_engine(int want) {
    if (want == 0 || want == 1) g_engine.store(want);
    const int e = engine();
    // Once a ring was set up in this process, io_uring is taken as available: the store's stats
    // ask on every call, and a probe ring each time (or a transient EMFILE then) is not the answer.
    static std::atomic<pid_t> uring_ok{0};
    if (e == 0 && uring_ok.load(std::memory_order_relaxed) != getpid()) {
        engram_io::Uring probe;
        if (!probe.ready(1, 4096)) return 2;
        uring_ok.store(getpid(), std::memory_order_relaxed);
    }
    return e;
}

}  // extern "C"

// ------------------------------------------------------------------ the native step
#include "engram_disk_step.h"

namespace engram_io {

int read_misses(const DiskFile& f, const int64_t* rows, int64_t m, uint8_t* out, int64_t* failed) {
    *failed = -1;
    if (m == 0) return 0;
    struct stat st;
    if (fstat(f.fd, &st) != 0) return errno;
    if (f.data_offset + (rows[m - 1] + 1) * kRowBytes > static_cast<int64_t>(st.st_size)) {  // truncated
        *failed = m - 1;
        return -1;
    }
    switch (f.mode) {
        case kReadMapped:
            return engram_rowio_copy_mapped(f.base, rows, m, out, f.threads, failed) == 0 ? 0 : EIO;
        case kReadAio:
            return engram_rowio_aio(f.fd, f.data_offset, rows, m, out, f.threads, failed);
        case kReadPread:
            return engram_rowio_pread(f.fd, f.data_offset, rows, m, out, f.threads, f.direct, failed);
        default:
            return 0;
    }
}

}  // namespace engram_io

extern "C" {

// The native step of engram_rowio_abi.h (engram_disk_step.h says how it goes).
int engram_disk_step(const engram_io::DiskFile* file, engram_io::DramCache* cache, const int64_t* ids, int64_t n,
                     int64_t* wanted, int64_t* local, uint8_t* packed, int64_t* missed, uint16_t* rows_out,
                     int decode_threads, engram_io::StepResult* result) {
    using namespace engram_io;
    *result = StepResult{0, 0, 0, -1};
    if (file == nullptr || n < 0 ||
        (n > 0 && (ids == nullptr || wanted == nullptr || local == nullptr || packed == nullptr || missed == nullptr)))
        return kStepBadArgument;
    const int64_t unique = dedupe(ids, n, file->lo, file->hi, wanted, local);
    result->unique = unique;
    static thread_local std::vector<int64_t> slot, miss_ids, hit_units, start, order;
    static thread_local std::vector<uint8_t> miss_rows;
    static thread_local std::vector<AdmitPick> picks;
    static thread_local std::vector<std::pair<int64_t, int64_t>> early;
    slot.resize(static_cast<size_t>(unique));
    miss_ids.resize(static_cast<size_t>(unique));
    hit_units.clear();

    // O_DIRECT reads (io_uring or native AIO) go out while the lookup is still running: each
    // kIssueBatch misses it finds are added to the reads at once (rows ascending, as the
    // lookup goes), so the disk starts on the first ones while the rest are looked up. A row
    // at or past the end of the file (truncated under us) is never issued: the step comes back
    // unread once the reads already out are in, as when a read fails.
    const bool async = file->mode == kReadAio;
    AsyncReads reads;
    int64_t file_rows = INT64_MAX;  // rows the file holds
    int stat_error = 0;
    if (async && unique > 0) {
        struct stat st;
        if (fstat(file->fd, &st) != 0)
            stat_error = errno;
        else
            file_rows = std::max<int64_t>(0, (static_cast<int64_t>(st.st_size) - file->data_offset) / kRowBytes);
    }
    early.clear();
    auto defer = [&](int64_t first, int64_t last) { early.emplace_back(first, last); };  // landed mid-lookup
    bool began = false, unavailable = stat_error != 0;
    int64_t m = 0, readable = 0, issued = 0;  // misses; of them a prefix in the file; of those added to reads
    auto issue = [&] {
        if (!began && !unavailable) {
            began = reads.begin(file->fd, file->data_offset, miss_ids.data(), packed, missed, file->threads) == 0;
            unavailable = !began;
        }
        if (began) reads.add(readable, defer);
        issued = readable;
    };
    auto found = [&](int64_t i) {  // slot[i] is known
        if (slot[i] >= 0) {
            hit_units.push_back(i);
            return;
        }
        missed[m] = i;
        miss_ids[static_cast<size_t>(m++)] = wanted[i];
        if (readable == m - 1 && wanted[i] < file_rows) readable = m;
        if (async && readable - issued >= kIssueBatch) issue();
    };
    if (cache != nullptr && unique > 0) {
        lookup(*cache, wanted, unique, slot.data(), found);
    } else {
        for (int64_t i = 0; i < unique; ++i) {
            slot[i] = -1;
            found(i);
        }
    }
    if (async && readable > issued) issue();
    result->misses = m;
    const int64_t hits = static_cast<int64_t>(hit_units.size());
    auto copy_hits = [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) {
            if (k + kPrefetchIds < hits)
                prefetch_lines(cache->rows + slot[hit_units[k + kPrefetchIds]] * kRowBytes, kRowBytes);
            const int64_t i = hit_units[k];
            memcpy(packed + i * kRowBytes, cache->rows + slot[i] * kRowBytes, kRowBytes);
        }
    };
    int threads = decode_threads > 0 ? decode_threads : default_decode_threads();
    if (n < kDecodeSerial) threads = 1;
    const int64_t tasks = (n + kDecodeGrain - 1) / kDecodeGrain;
    auto decode_all = [&] {
        pool().run(threads, tasks, [&](int64_t t) {
            decode_rows(packed, local, unique, t * kDecodeGrain, std::min(n, (t + 1) * kDecodeGrain), rows_out);
        });
    };

    if (!async || m == 0) {  // all cached, or reads that block: one phase after another
        copy_hits(0, hits);
        if (file->mode == kReadNone && m > 0) return kStepUnread;
        miss_rows.resize(static_cast<size_t>(std::max<int64_t>(m, 1) * kRowBytes));
        int64_t failed = -1;
        const int err = read_misses(*file, miss_ids.data(), m, miss_rows.data(), &failed);
        if (err != 0) {
            result->error = err == kStepAioUnavailable ? 0 : err;
            result->failed = failed;
            return err == kStepAioUnavailable ? kStepAioUnavailable : kStepUnread;
        }
        for (int64_t k = 0; k < m; ++k)
            memcpy(packed + missed[k] * kRowBytes, miss_rows.data() + k * kRowBytes, kRowBytes);
        if (cache != nullptr) admit(*cache, miss_ids.data(), m, miss_rows.data(), kRowBytes);
        if (rows_out != nullptr && n > 0) decode_all();
        return kStepOk;
    }

    // O_DIRECT: the misses' reads are out (up to the depth in flight, refilled as they
    // complete); the hits' copies, the admission decisions and the hits' decode run while they
    // are in flight, each completed row is decoded as it lands, and only the admission's writes
    // wait for the last read (a failed step admits nothing). The policy sees the same state in
    // the same order as before: lookup, then admission decided on the state after every lookup.
    if (stat_error != 0 || readable < m) {  // fstat failed, or the file is truncated
        while (began && reads.pump(true, defer)) {  // what is out lands in packed before we return
        }
        copy_hits(0, hits);
        result->error = stat_error != 0 ? stat_error : -1;
        if (stat_error == 0) result->failed = m - 1;
        return kStepUnread;
    }
    if (!began) {
        copy_hits(0, hits);
        return kStepAioUnavailable;
    }
    const bool decode = rows_out != nullptr;
    if (decode) {
        group_positions(local, n, unique, start, order);
        for (const auto& r : early)
            decode_units(packed, start.data(), order.data(), unique, missed + r.first, r.second - r.first, rows_out);
    }
    auto landed = [&](int64_t first, int64_t last) {  // misses [first, last) are in packed
        if (decode) decode_units(packed, start.data(), order.data(), unique, missed + first, last - first, rows_out);
    };
    constexpr int64_t kChunk = 64;  // rows of other work between looks at the completions
    for (int64_t k = 0; k < hits; k += kChunk) {
        copy_hits(k, std::min(hits, k + kChunk));
        reads.pump(false, landed);
    }
    int64_t rejected = 0;
    if (cache != nullptr) {
        rejected = admit_plan(*cache, miss_ids.data(), m, picks);
        reads.pump(false, landed);
    }
    if (decode) {
        hit_units.push_back(unique);  // the positions outside the shard (+0) decode now too
        const int64_t units = static_cast<int64_t>(hit_units.size());
        int64_t k = 0;
        for (; k < units && reads.busy(); k += kChunk / 4) {
            decode_units(packed, start.data(), order.data(), unique, hit_units.data() + k,
                         std::min(units, k + kChunk / 4) - k, rows_out);
            reads.pump(false, landed);
        }
        if (k < units) {  // the reads are done: the rest on every thread
            // Pointers, not the thread_local vectors: a pool thread names its own, empty ones.
            const int64_t rest = units - k, grain = 16;
            const int64_t *at = start.data(), *by = order.data(), *todo = hit_units.data();
            pool().run(threads, (rest + grain - 1) / grain, [&](int64_t t) {
                const int64_t b = k + t * grain;
                decode_units(packed, at, by, unique, todo + b, std::min(units, b + grain) - b, rows_out);
            });
        }
    }
    while (reads.pump(true, landed)) {
    }
    if (reads.error() != 0) {
        result->error = reads.error();
        result->failed = reads.failed();
        return kStepUnread;
    }
    if (cache != nullptr)
        admit_commit(*cache, miss_ids.data(), picks, rejected, kRowBytes,
                     [&](int64_t src) { return packed + missed[src] * kRowBytes; });
    return kStepOk;
}

int engram_disk_step_decode(int want) {
    using namespace engram_io;
#if ENGRAM_HAVE_AVX512_DECODE
    if (want == 0) use_avx512_decode().store(engram::avx512_decode_supported());
#endif
    if (want == 1) use_avx512_decode().store(false);
    return use_avx512_decode().load() ? 1 : 0;
}

int64_t engram_disk_step_layout(int what) {
    using namespace engram_io;
    // clang-format off: one line per layout field, as a table
    switch (what) {
        case 0: return static_cast<int64_t>(sizeof(DiskFile));
        case 1: return static_cast<int64_t>(sizeof(DramCache));
        case 2: return static_cast<int64_t>(sizeof(StepResult));
        case 3: return kStateLen;
        case 4: return kPolicyFormat;
        case 5: return kCountCap;
        case 6: return kSketchDepth;
        case 7: return kClockBits;
        default: return -1;
    }
    // clang-format on
}

}  // extern "C"
