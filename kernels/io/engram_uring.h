// engram_uring.h: a minimal io_uring by raw syscalls (no liburing), for the disk tier's O_DIRECT
// row reads (included by engram_rowio.cpp).
//
// One ring per thread (a store reads from one thread at a time), made with SINGLE_ISSUER |
// DEFER_TASKRUN where the kernel has them (completions are posted when this thread asks, no
// interrupting task work), its bounce buffers registered once (READ_FIXED: no page pinning
// per read; a memlock limit too small for them falls back to plain READ). Submission and
// reaping share one io_uring_enter. Where io_uring is unavailable (old kernel, seccomp in a
// container, io_uring_disabled) ready() fails and the caller uses native AIO.
#pragma once

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// Flags newer than some distributions' kernel headers (5.19 / 6.0 / 6.1); a kernel without
// them refuses them (EINVAL) and ready() retries with fewer.
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

class Uring {
  public:
    uint8_t* buffers = nullptr;  // depth slots of `slot_bytes`, page-aligned
    int depth = 0;

    ~Uring() { close_ring(); }

    // A ring of at least `want` entries with `want` buffer slots; false where io_uring is unavailable.
    bool ready(int want, int64_t slot_bytes) {
        const pid_t pid = getpid();  // a forked child cannot use its parent's ring (single issuer)
        if (depth >= want && owner_ == pid) return true;
        if (failed_) return false;
        close_ring();
        owner_ = pid;
        io_uring_params p;
        const unsigned tries[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, IORING_SETUP_COOP_TASKRUN, 0};
        for (unsigned flags : tries) {
            memset(&p, 0, sizeof p);
            p.flags = flags;
            fd_ = static_cast<int>(syscall(__NR_io_uring_setup, want, &p));
            if (fd_ >= 0 || errno != EINVAL) break;
        }
        if (fd_ < 0 || !(p.features & IORING_FEAT_SINGLE_MMAP)) {
            failed_ = true;  // ENOSYS, EPERM (seccomp, io_uring_disabled): not asked again
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
        if (ring_ == MAP_FAILED || sqes_ == MAP_FAILED || buffers == nullptr) {
            if (ring_ == MAP_FAILED) ring_ = nullptr;
            if (sqes_ == MAP_FAILED) sqes_ = nullptr;
            failed_ = true;
            close_ring();
            return false;
        }
        char* r = static_cast<char*>(ring_);
        sq_tail_ = reinterpret_cast<unsigned*>(r + p.sq_off.tail);
        sq_mask_ = *reinterpret_cast<unsigned*>(r + p.sq_off.ring_mask);
        sq_array_ = reinterpret_cast<unsigned*>(r + p.sq_off.array);
        cq_head_ = reinterpret_cast<unsigned*>(r + p.cq_off.head);
        cq_tail_ = reinterpret_cast<unsigned*>(r + p.cq_off.tail);
        cq_mask_ = *reinterpret_cast<unsigned*>(r + p.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe*>(r + p.cq_off.cqes);
        iovec iov = {buffers, static_cast<size_t>(want * slot_bytes)};
        fixed_ = syscall(__NR_io_uring_register, fd_, IORING_REGISTER_BUFFERS, &iov, 1) == 0;
        depth = want;
        queued_ = 0;
        return true;
    }

    // Queues a read of `len` bytes at `offset` of fd into `buf` (inside `buffers`).
    void queue(int fd, int64_t offset, uint8_t* buf, uint32_t len, uint64_t data) {
        const unsigned tail = *sq_tail_ + queued_;
        const unsigned idx = tail & sq_mask_;
        io_uring_sqe& s = sqes_[idx];
        memset(&s, 0, sizeof s);
        s.opcode = fixed_ ? IORING_OP_READ_FIXED : IORING_OP_READ;
        s.fd = fd;
        s.off = static_cast<uint64_t>(offset);
        s.addr = reinterpret_cast<uint64_t>(buf);
        s.len = len;
        s.buf_index = 0;
        s.user_data = data;
        sq_array_[idx] = idx;
        ++queued_;
    }

    // Submits what is queued and, with wait > 0, waits for that many completions, in one
    // syscall; with DEFER_TASKRUN this is also what posts the completions. 0 or an errno.
    int enter(unsigned wait) {
        const unsigned submit = queued_;
        if (submit > 0) __atomic_store_n(sq_tail_, *sq_tail_ + submit, __ATOMIC_RELEASE);
        queued_ = 0;
        for (;;) {
            // Interrupted: again with the same count (the kernel takes only what the SQ still holds).
            const long r = syscall(__NR_io_uring_enter, fd_, submit, wait, IORING_ENTER_GETEVENTS, nullptr, 0);
            if (r >= 0) return 0;
            if (errno != EINTR) return errno;
        }
    }

    // After a failed io_uring_enter: reads may still be landing in `buffers`, so they are never
    // freed (a few MiB, once); the next ready() makes a new ring.
    void abandon() {
        buffers = nullptr;
        depth = 0;
    }

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
    }

    int fd_ = -1;
    pid_t owner_ = 0;
    bool failed_ = false, fixed_ = false;
    void* ring_ = nullptr;
    io_uring_sqe* sqes_ = nullptr;
    size_t ring_bytes_ = 0, sqes_bytes_ = 0;
    unsigned *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
    unsigned sq_mask_ = 0, cq_mask_ = 0, queued_ = 0;
    io_uring_cqe* cqes_ = nullptr;
};

}  // namespace engram_io
