// engram_uring.h: a minimal io_uring by raw syscalls (no liburing), for the disk tier's O_DIRECT
// row reads (included by engram_rowio.cpp).
//
// One ring per thread (a store reads from one thread at a time), made with SINGLE_ISSUER |
// DEFER_TASKRUN where the kernel has them (completions are posted when this thread asks, no
// interrupting task work), its bounce buffers registered once (READ_FIXED: no page pinning
// per read; under a memlock limit too small for all of them, the slots that fit, the rest by
// plain READ). Submission and
// reaping share one io_uring_enter. Where io_uring is unavailable (old kernel, seccomp in a
// container, io_uring_disabled) ready() fails and the caller uses native AIO.
#pragma once

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

// Flags newer than some distributions' kernel headers (5.18 / 5.19 / 6.0 / 6.1); a kernel without
// them refuses them (EINVAL) and ready() retries with fewer.
#ifndef IORING_SETUP_SUBMIT_ALL
#define IORING_SETUP_SUBMIT_ALL (1U << 7)
#endif
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

namespace engram_io {

// A test hook (engram_rowio_test_short_enters): the next this-many io_uring_enter calls that
// have more than one read to submit ask the kernel for one fewer, as when a kernel takes only
// part of a batch (out of request memory mid-batch). Never set outside tests.
inline std::atomic<int> g_short_enters{0};
// The next n io_uring_enter calls that submit reads report EIO after the kernel took them, as a
// failure past submission would (a test hook: the call abandons the ring). Never set outside tests.
inline std::atomic<int> g_fail_enters{0};

class Uring {
  public:
    uint8_t* buffers = nullptr;  // depth slots of `slot_bytes`, page-aligned
    int depth = 0;

    ~Uring() { close_ring(); }

    // A ring of at least `want` entries with `want` buffer slots; false where io_uring is
    // unavailable (for good: ENOSYS, EPERM, EACCES, a kernel refusing every setup) or cannot be
    // set up now (out of memory or of descriptors: this call falls back, the next one tries again).
    bool ready(int want, int64_t slot_bytes) {
        const pid_t pid = getpid();  // a forked child cannot use its parent's ring (single issuer)
        if (depth >= want && owner_ == pid) return true;
        if (failed_) return false;
        // In a forked child the parent's ring descriptor number may have been closed and reused
        // for another file since the fork: it is left open, never closed here (closing it would
        // close that file). The mappings and buffers are the child's own copies to release.
        if (owner_ != 0 && owner_ != pid) fd_ = -1;
        close_ring();
        owner_ = pid;
        io_uring_params p;
        // SUBMIT_ALL: an SQE that fails at submission posts its error and the rest go on, rather
        // than ending the batch there.
        const unsigned tries[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_SUBMIT_ALL,
                                  IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SUBMIT_ALL, IORING_SETUP_SUBMIT_ALL, 0};
        for (unsigned flags : tries) {
            memset(&p, 0, sizeof p);
            p.flags = flags;
            fd_ = static_cast<int>(syscall(__NR_io_uring_setup, want, &p));
            if (fd_ >= 0 || errno != EINVAL) break;
        }
        if (fd_ < 0) {
            const int err = errno;
            failed_ = err == ENOSYS || err == EPERM || err == EACCES || err == EINVAL;
            return false;
        }
        if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {  // before 5.4: not supported here
            failed_ = true;
            close_ring();
            return false;
        }
        ring_bytes_ = std::max<size_t>(p.sq_off.array + p.sq_entries * sizeof(unsigned),
                                       p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe));
        ring_ = mmap(nullptr, ring_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
        sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
        sqes_ = static_cast<io_uring_sqe*>(
            mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES));
        buffers = static_cast<uint8_t*>(aligned_alloc(4096, static_cast<size_t>(want * slot_bytes)));
        if (ring_ == MAP_FAILED || sqes_ == MAP_FAILED || buffers == nullptr) {  // for now (memory)
            if (ring_ == MAP_FAILED) ring_ = nullptr;
            if (sqes_ == MAP_FAILED) sqes_ = nullptr;
            close_ring();
            return false;
        }
        char* r = static_cast<char*>(ring_);
        sq_head_ = reinterpret_cast<unsigned*>(r + p.sq_off.head);
        sq_tail_ = reinterpret_cast<unsigned*>(r + p.sq_off.tail);
        sq_mask_ = *reinterpret_cast<unsigned*>(r + p.sq_off.ring_mask);
        sq_entries_ = p.sq_entries;
        sq_array_ = reinterpret_cast<unsigned*>(r + p.sq_off.array);
        cq_head_ = reinterpret_cast<unsigned*>(r + p.cq_off.head);
        cq_tail_ = reinterpret_cast<unsigned*>(r + p.cq_off.tail);
        cq_mask_ = *reinterpret_cast<unsigned*>(r + p.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe*>(r + p.cq_off.cqes);
        slot_bytes_ = slot_bytes;
        register_buffers(want);
        depth = want;
        queued_ = 0;
        return true;
    }

    // Slots read by READ_FIXED (registered: no page pinning per read), and the errno that kept
    // the rest unregistered (ENOMEM: RLIMIT_MEMLOCK; 0 when all are).
    int fixed_slots() const { return fixed_slots_; }
    int register_error() const { return register_error_; }

    // Queues a read of `len` bytes at `offset` of fd into buffer slot `slot`; false (nothing
    // queued) while the SQ is full: the next enter() makes room.
    bool queue(int fd, int64_t offset, int slot, uint32_t len, uint64_t data) {
        const unsigned tail = *sq_tail_ + queued_;
        if (tail - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE) >= sq_entries_) return false;
        const unsigned idx = tail & sq_mask_;
        io_uring_sqe& s = sqes_[idx];
        memset(&s, 0, sizeof s);
        const bool fixed = slot < fixed_slots_;
        s.opcode = fixed ? IORING_OP_READ_FIXED : IORING_OP_READ;
        s.fd = fd;
        s.off = static_cast<uint64_t>(offset);
        s.addr = reinterpret_cast<uint64_t>(buffers + static_cast<int64_t>(slot) * slot_bytes_);
        s.len = len;
        s.buf_index = static_cast<uint16_t>(fixed ? slot : 0);
        s.user_data = data;
        sq_array_[idx] = idx;
        ++queued_;
        return true;
    }

    // Submits what the SQ holds (what was queued, and what an earlier enter left untaken) and,
    // with wait > 0, waits for up to that many completions, in one syscall; with DEFER_TASKRUN
    // this is also what posts the completions. `in_flight`: the reads queued and not yet
    // reaped. 0 or an errno.
    int enter(unsigned wait, unsigned in_flight) {
        if (queued_ > 0) __atomic_store_n(sq_tail_, *sq_tail_ + queued_, __ATOMIC_RELEASE);
        queued_ = 0;
        for (;;) {
            // The kernel may take fewer than asked (a partial submission returns at once, without
            // waiting): those stay in the SQ and go with the next enter.
            const unsigned pending = *sq_tail_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
            unsigned ask = pending;
            if (ask > 1 && g_short_enters.load(std::memory_order_relaxed) > 0 && g_short_enters.fetch_sub(1) > 0) --ask;
            // Never wait for more than the kernel holds once these are in: a read still in the
            // SQ would never complete.
            const unsigned held = in_flight - pending + ask;
            const long r =
                syscall(__NR_io_uring_enter, fd_, ask, std::min(wait, held), IORING_ENTER_GETEVENTS, nullptr, 0);
            if (r >= 0) {
                if (ask > 0 && g_fail_enters.load(std::memory_order_relaxed) > 0 && g_fail_enters.fetch_sub(1) > 0)
                    return EIO;
                return 0;
            }
            if (errno == EINTR) continue;
            // Out of request memory (EAGAIN) or completions not yet reaped (EBUSY) while reads are
            // in flight: those end. Wait for one (the caller reaps it) and submit the rest later;
            // retrying at once would spin. With none in flight it is an error, as for native AIO.
            if ((errno == EAGAIN || errno == EBUSY) && in_flight > pending) {
                while (syscall(__NR_io_uring_enter, fd_, 0, 1, IORING_ENTER_GETEVENTS, nullptr, 0) < 0) {
                    if (errno != EINTR) return errno;
                }
                return 0;
            }
            return errno;
        }
    }

    // After a failed io_uring_enter: reads may still be landing in `buffers`, so they are never
    // freed (a few MiB, once); the next ready() makes a new ring.
    void abandon() {
        buffers = nullptr;
        depth = 0;
    }
    // False once abandoned: the ring must not be entered or reaped again (a completion reaped
    // now would be copied out of buffers no longer known), only replaced by the next ready().
    bool live() const { return buffers != nullptr; }

    // Hands each posted completion (user_data, res) to fn; returns how many.
    template <class Fn>
    int reap(Fn&& fn) {
        unsigned head = *cq_head_;
        const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
        int got = 0;
        for (; head != tail; ++head, ++got) {
            const io_uring_cqe& c = cqes_[head & cq_mask_];
            fn(c.user_data, c.res);
        }
        __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
        return got;
    }

  private:
    // One iovec per slot, so that under a memory-lock limit (RLIMIT_MEMLOCK, often 8 MiB for a
    // user without CAP_IPC_LOCK, and shared by all that user's processes: 256 slots of 64 KiB
    // are 16 MiB) the first slots that fit are registered and only the rest read by plain READ.
    void register_buffers(int slots) {
        fixed_slots_ = 0;
        register_error_ = 0;
        iovecs_.resize(static_cast<size_t>(slots));
        for (int k = 0; k < slots; ++k)
            iovecs_[k] = {buffers + static_cast<int64_t>(k) * slot_bytes_, static_cast<size_t>(slot_bytes_)};
        auto fits = [&](int n) {
            return syscall(__NR_io_uring_register, fd_, IORING_REGISTER_BUFFERS, iovecs_.data(), n) == 0;
        };
        if (fits(slots)) {
            fixed_slots_ = slots;
            return;
        }
        register_error_ = errno;
        if (register_error_ != ENOMEM) return;  // not a matter of size
        // The most that fit, by bisection (a few tries, once per ring): lo fits, hi does not.
        int lo = 0, hi = slots;
        while (hi - lo > 1) {
            const int mid = lo + (hi - lo) / 2;
            if (fits(mid)) {
                syscall(__NR_io_uring_register, fd_, IORING_UNREGISTER_BUFFERS, nullptr, 0);
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if (lo > 0 && fits(lo)) fixed_slots_ = lo;
    }

    void close_ring() {
        if (ring_ != nullptr) munmap(ring_, ring_bytes_);
        if (sqes_ != nullptr) munmap(sqes_, sqes_bytes_);
        if (fd_ >= 0) close(fd_);  // only ever with no read in flight into `buffers`
        free(buffers);
        ring_ = nullptr;
        sqes_ = nullptr;
        fd_ = -1;
        buffers = nullptr;
        depth = 0;
        fixed_slots_ = 0;
    }

    int fd_ = -1;
    pid_t owner_ = 0;
    bool failed_ = false;
    int fixed_slots_ = 0, register_error_ = 0;
    int64_t slot_bytes_ = 0;
    void* ring_ = nullptr;
    io_uring_sqe* sqes_ = nullptr;
    size_t ring_bytes_ = 0, sqes_bytes_ = 0;
    unsigned *sq_head_ = nullptr, *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
    unsigned sq_mask_ = 0, sq_entries_ = 0, cq_mask_ = 0, queued_ = 0;
    io_uring_cqe* cqes_ = nullptr;
    std::vector<iovec> iovecs_;
};

}  // namespace engram_io
