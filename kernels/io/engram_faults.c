// engram_faults.c: fault injection below the disk tier's native reader, by LD_PRELOAD.
//
// The soak (bench/soak.py) loads this into a real server so that table reads fail and stall
// where a disk would make them fail: inside libc's read calls, under kernels/io/ and
// engram_sglang's retries, never by patching Python. Nothing here is built into the reader, so
// a server without LD_PRELOAD pays nothing.
//
// What it wraps (kernels/io/engram_rowio.cpp calls both through the PLT, so both interpose):
//  * pread, pread64, preadv, preadv64, preadv2, preadv64v2: one "read" per call. An injected
//    EIO returns -1 with errno EIO without reading; a stall sleeps, then reads.
//  * syscall(SYS_io_getevents, ...): native AIO is issued through libc's syscall(), which an
//    LD_PRELOAD library can interpose like any libc function (inline-asm syscalls could not
//    be). One "read" per completion event; an injected EIO rewrites the event's res to -EIO,
//    as a failing disk reports it; a stall delays the return of the call by STALL_MS.
//  * syscall(SYS_io_uring_setup, ...): refused (ENOSYS) while the shim is loaded, so the reader
//    (io_uring by default) uses native AIO, its fallback where io_uring is unavailable.
//  * write, pwrite, pwrite64, writev, pwritev, fsync, fdatasync: only when
//    ENGRAM_FAULTS_WRITE_MATCH is set. An injected ENOSPC returns -1 with errno ENOSPC without
//    writing, as a full filesystem does (what Python's write_text, open("a").write and os.write
//    reach).
// Only reads of files whose path (readlink of /proc/self/fd/N) contains ENGRAM_FAULTS_MATCH
// (writes: ENGRAM_FAULTS_WRITE_MATCH) are touched; every other call is forwarded unchanged.
//
// Configuration (environment, read once at load):
//   ENGRAM_FAULTS_MATCH       path substring of the files to fault (default ".rows": table layers)
//   ENGRAM_FAULTS_ARM         faults only while this path exists (checked every 20 ms at most);
//                             unset: armed from the start
//   ENGRAM_FAULTS_SEED        seed of the per-process random stream (default 1; mixed with the pid)
//   ENGRAM_FAULTS_EIO_PROB    probability that a matched read starts an EIO burst (default 0)
//   ENGRAM_FAULTS_EIO_EVERY   or: every Nth matched read starts one (default 0: off)
//   ENGRAM_FAULTS_EIO_BURST   matched reads failed per burst, the first included (default 1)
//   ENGRAM_FAULTS_EIO_BURST_MS  or: a burst fails every matched read for this many ms (default 0)
//   ENGRAM_FAULTS_EIO_GAP_MS  no burst starts within this many ms of the last one's start
//                             (default 0); with EVERY=1 this schedules one burst per GAP_MS
//   ENGRAM_FAULTS_STALL_PROB  probability that a matched call stalls (default 0)
//   ENGRAM_FAULTS_STALL_EVERY or: every Nth matched call stalls (default 0: off)
//   ENGRAM_FAULTS_STALL_MS    length of a stall (default 50)
//   ENGRAM_FAULTS_SHORT_PROB  probability that a matched pread/preadv call returns short (default 0)
//   ENGRAM_FAULTS_SHORT_EVERY or: every Nth matched pread/preadv call does (default 0: off). A
//                             short call reads what it would, then returns a random prefix of it
//                             (>= 1 byte, < what it read; on an O_DIRECT fd a whole number of 4 KiB
//                             pages, so only reads of more than a page are shortened), as FUSE and
//                             network filesystems may; AIO completions are never shortened
//   ENGRAM_FAULTS_WRITE_MATCH path substring of the files whose writes get ENOSPC (default unset:
//                             writes are never touched)
//   ENGRAM_FAULTS_WRITE_PROB, _WRITE_EVERY, _WRITE_BURST, _WRITE_BURST_MS, _WRITE_GAP_MS
//                             the ENOSPC schedule over matched write calls, as the EIO one over
//                             matched reads (defaults 0, 0, 1, 0, 0: off)
//   ENGRAM_FAULTS_STATS_DIR   each process that sees a matched read keeps its counters in
//                             DIR/faults-PID.bin (a text header line, then uint64 counters;
//                             updated in place through a shared mapping, readable any time)
//
// A count-based burst of N fails N matched reads in total, whichever calls issue them: a call
// retried more than N times therefore always gets through. A time-based burst fails everything
// for its duration, so a burst longer than a reader's retry back-off fails the call.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

// ------------------------------------------------------------------ configuration
static struct {
    int loaded;
    char match[256];
    char arm[1024];
    char stats_dir[1024];
    uint64_t seed;
    char write_match[256];
    double stall_prob, short_prob;
    long stall_every, stall_ms, short_every;
} cfg;

// When a matched call fails, and for how long a failure goes on (EIO on reads, ENOSPC on writes).
struct schedule {
    double prob;     // a matched call starts a burst with this probability
    long every;      // or: every Nth matched call does
    long burst;      // calls failed per burst, the first included
    long burst_ms;   // or: a burst fails every matched call for this many ms
    long gap_ms;     // no burst starts within this many ms of the last one's start
    int c_injected;  // counters bumped per failed call and per burst
    int c_bursts;
    _Atomic uint64_t calls;
    _Atomic long left;
    _Atomic uint64_t until_ns, last_start_ns;
};

// A value that is not a number >= 0 (<= max) stops the process with one line: a soak with a
// silently ignored setting would report faults it never injected.
static double env_number(const char* name, double fallback, double max) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = NULL;
    const double x = strtod(v, &end);
    if (*end != '\0' || !(x >= 0 && x <= max)) {
        fprintf(stderr, "engram_faults: %s=%s: expected a number in [0, %g]\n", name, v, max);
        _exit(2);
    }
    return x;
}

static double env_double(const char* name, double fallback) { return env_number(name, fallback, 1.0); }

static long env_long(const char* name, long fallback) { return (long)env_number(name, (double)fallback, 1e12); }

static void env_string(const char* name, const char* fallback, char* out, size_t size) {
    const char* v = getenv(name);
    snprintf(out, size, "%s", (v && *v) ? v : fallback);
}

// ------------------------------------------------------------------ the real calls
typedef ssize_t (*pread_fn)(int, void*, size_t, off_t);
typedef ssize_t (*preadv_fn)(int, const struct iovec*, int, off_t);
typedef ssize_t (*preadv2_fn)(int, const struct iovec*, int, off_t, int);
typedef long (*syscall_fn)(long, ...);
typedef ssize_t (*write_fn)(int, const void*, size_t);
typedef ssize_t (*pwrite_fn)(int, const void*, size_t, off_t);
typedef ssize_t (*writev_fn)(int, const struct iovec*, int);
typedef ssize_t (*pwritev_fn)(int, const struct iovec*, int, off_t);
typedef int (*fsync_fn)(int);
static pread_fn real_pread, real_pread64;
static preadv_fn real_preadv, real_preadv64;
static preadv2_fn real_preadv2, real_preadv64v2;
static syscall_fn real_syscall;
static write_fn real_write;
static pwrite_fn real_pwrite, real_pwrite64;
static writev_fn real_writev;
static pwritev_fn real_pwritev;
static fsync_fn real_fsync, real_fdatasync;

static void resolve(void) {
    real_pread = (pread_fn)dlsym(RTLD_NEXT, "pread");
    real_pread64 = (pread_fn)dlsym(RTLD_NEXT, "pread64");
    real_preadv = (preadv_fn)dlsym(RTLD_NEXT, "preadv");
    real_preadv64 = (preadv_fn)dlsym(RTLD_NEXT, "preadv64");
    real_preadv2 = (preadv2_fn)dlsym(RTLD_NEXT, "preadv2");
    real_preadv64v2 = (preadv2_fn)dlsym(RTLD_NEXT, "preadv64v2");
    real_syscall = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    real_write = (write_fn)dlsym(RTLD_NEXT, "write");
    real_pwrite = (pwrite_fn)dlsym(RTLD_NEXT, "pwrite");
    real_pwrite64 = (pwrite_fn)dlsym(RTLD_NEXT, "pwrite64");
    real_writev = (writev_fn)dlsym(RTLD_NEXT, "writev");
    real_pwritev = (pwritev_fn)dlsym(RTLD_NEXT, "pwritev");
    real_fsync = (fsync_fn)dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (fsync_fn)dlsym(RTLD_NEXT, "fdatasync");
}

// ------------------------------------------------------------------ counters
// The order is the file's: bench/soak.py reads the names from the header line; new ones are
// appended so that older readers keep their offsets.
enum {
    C_MATCHED,
    C_EIO,
    C_BURSTS,
    C_STALLS,
    C_STALL_US,
    C_PREAD_CALLS,
    C_AIO_EVENTS,
    C_WRITE_CALLS,
    C_ENOSPC,
    C_ENOSPC_BURSTS,
    C_SHORT_READS,
    C_COUNT
};
static const char* const kNames =
    "matched_reads,eio_injected,eio_bursts,stalls,stall_us,pread_calls,aio_events,write_calls,enospc_injected,"
    "enospc_bursts,short_reads";
enum { kHeaderBytes = 256 };

static struct schedule eio = {.c_injected = C_EIO, .c_bursts = C_BURSTS};
static struct schedule enospc = {.c_injected = C_ENOSPC, .c_bursts = C_ENOSPC_BURSTS};

static void env_schedule(const char* prefix, struct schedule* s) {
    char name[64];
    snprintf(name, sizeof name, "ENGRAM_FAULTS_%s_PROB", prefix);
    s->prob = env_double(name, 0.0);
    snprintf(name, sizeof name, "ENGRAM_FAULTS_%s_EVERY", prefix);
    s->every = env_long(name, 0);
    snprintf(name, sizeof name, "ENGRAM_FAULTS_%s_BURST", prefix);
    s->burst = env_long(name, 1);
    snprintf(name, sizeof name, "ENGRAM_FAULTS_%s_BURST_MS", prefix);
    s->burst_ms = env_long(name, 0);
    snprintf(name, sizeof name, "ENGRAM_FAULTS_%s_GAP_MS", prefix);
    s->gap_ms = env_long(name, 0);
    if (s->burst < 1) s->burst = 1;
}

__attribute__((constructor)) static void load(void) {
    resolve();
    env_string("ENGRAM_FAULTS_MATCH", ".rows", cfg.match, sizeof cfg.match);
    env_string("ENGRAM_FAULTS_ARM", "", cfg.arm, sizeof cfg.arm);
    env_string("ENGRAM_FAULTS_STATS_DIR", "", cfg.stats_dir, sizeof cfg.stats_dir);
    env_string("ENGRAM_FAULTS_WRITE_MATCH", "", cfg.write_match, sizeof cfg.write_match);
    cfg.seed = (uint64_t)env_long("ENGRAM_FAULTS_SEED", 1);
    env_schedule("EIO", &eio);
    env_schedule("WRITE", &enospc);
    cfg.stall_prob = env_double("ENGRAM_FAULTS_STALL_PROB", 0.0);
    cfg.stall_every = env_long("ENGRAM_FAULTS_STALL_EVERY", 0);
    cfg.stall_ms = env_long("ENGRAM_FAULTS_STALL_MS", 50);
    cfg.short_prob = env_double("ENGRAM_FAULTS_SHORT_PROB", 0.0);
    cfg.short_every = env_long("ENGRAM_FAULTS_SHORT_EVERY", 0);
    cfg.loaded = 1;
}

static _Atomic uint64_t local_counts[C_COUNT];  // until the stats file exists (or without one)
static _Atomic(uint64_t*) shared_counts;        // inside the stats file's mapping
static pid_t shared_owner;                      // a forked child makes its own file
static pthread_mutex_t stats_mutex = PTHREAD_MUTEX_INITIALIZER;

static _Atomic uint64_t* counts(void) {
    if (!cfg.stats_dir[0]) return local_counts;
    uint64_t* mapped = atomic_load(&shared_counts);
    const pid_t pid = getpid();
    if (mapped != NULL && shared_owner == pid) return (_Atomic uint64_t*)mapped;
    pthread_mutex_lock(&stats_mutex);
    mapped = atomic_load(&shared_counts);
    if (mapped == NULL || shared_owner != pid) {
        char path[1200];
        snprintf(path, sizeof path, "%s/faults-%d.bin", cfg.stats_dir, (int)pid);
        const int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        const size_t size = kHeaderBytes + C_COUNT * sizeof(uint64_t);
        void* map = MAP_FAILED;
        if (fd >= 0 && ftruncate(fd, (off_t)size) == 0)
            map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (fd >= 0) close(fd);
        if (map != MAP_FAILED) {
            snprintf((char*)map, kHeaderBytes, "engram-faults v1 pid=%d fields=%s\n", (int)pid, kNames);
            // What this process counted before the file existed (nothing, normally).
            uint64_t* c = (uint64_t*)((char*)map + kHeaderBytes);
            for (int k = 0; k < C_COUNT; ++k) c[k] = atomic_exchange(&local_counts[k], 0);
            shared_owner = pid;
            atomic_store(&shared_counts, c);
        } else {
            cfg.stats_dir[0] = '\0';  // cannot write it: count locally from here on
        }
    }
    pthread_mutex_unlock(&stats_mutex);
    mapped = atomic_load(&shared_counts);
    return (mapped != NULL && shared_owner == pid) ? (_Atomic uint64_t*)mapped : local_counts;
}

static void bump(int which, uint64_t by) { atomic_fetch_add(&counts()[which], by); }

// ------------------------------------------------------------------ decisions
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int armed(void) {
    if (!cfg.arm[0]) return 1;
    static _Atomic uint64_t checked_ns;
    static _Atomic int state;
    const uint64_t now = now_ns();
    if (now - atomic_load(&checked_ns) > 20000000ull) {
        atomic_store(&state, access(cfg.arm, F_OK) == 0);
        atomic_store(&checked_ns, now);
    }
    return atomic_load(&state);
}

static _Atomic uint64_t draws;
static double uniform(void) {  // splitmix64 of a shared counter: thread-safe, reproducible per process
    uint64_t z = cfg.seed * 0x9E3779B97F4A7C15ull + (uint64_t)getpid() * 0xBF58476D1CE4E5B9ull +
                 atomic_fetch_add(&draws, 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

static int path_matches(int fd, const char* match) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = '\0';
    return strstr(path, match) != NULL;
}

static _Atomic uint64_t matched_calls, short_calls;

// A burst of `s` may start now: 1 for the one thread that claims this start.
static int gap_allows(struct schedule* s) {
    if (s->gap_ms <= 0) return 1;
    const uint64_t now = now_ns(), gap = (uint64_t)s->gap_ms * 1000000ull;
    uint64_t last = atomic_load(&s->last_start_ns);
    return (last == 0 || now - last >= gap) && atomic_compare_exchange_strong(&s->last_start_ns, &last, now);
}

// One matched call under schedule `s`: 1 when it must fail.
static int decide(struct schedule* s) {
    const uint64_t n = atomic_fetch_add(&s->calls, 1) + 1;
    int fail = 0;
    if (s->burst_ms > 0) {
        fail = now_ns() < atomic_load(&s->until_ns);
    } else {
        long left = atomic_load(&s->left);
        while (left > 0 && !(fail = atomic_compare_exchange_weak(&s->left, &left, left - 1))) {
        }
    }
    if (!fail) {
        const int start = s->every > 0 ? (n % (uint64_t)s->every == 0) : (s->prob > 0 && uniform() < s->prob);
        if (start && gap_allows(s)) {
            bump(s->c_bursts, 1);
            if (s->burst_ms > 0)
                atomic_store(&s->until_ns, now_ns() + (uint64_t)s->burst_ms * 1000000ull);
            else
                atomic_store(&s->left, s->burst - 1);
            fail = 1;
        }
    }
    if (fail) bump(s->c_injected, 1);
    return fail;
}

// One matched read: 1 when it must fail with EIO.
static int decide_eio(void) {
    bump(C_MATCHED, 1);
    return decide(&eio);
}

// One matched call: sleeps STALL_MS when it must stall.
static void maybe_stall(void) {
    const uint64_t n = atomic_fetch_add(&matched_calls, 1) + 1;
    const int stall =
        cfg.stall_every > 0 ? (n % (uint64_t)cfg.stall_every == 0) : (cfg.stall_prob > 0 && uniform() < cfg.stall_prob);
    if (!stall || cfg.stall_ms <= 0) return;
    struct timespec ts = {cfg.stall_ms / 1000, (cfg.stall_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    bump(C_STALLS, 1);
    bump(C_STALL_US, (uint64_t)cfg.stall_ms * 1000u);
}

// Before a pread-family call: 0 to go ahead (1: on a matched file), -1 (errno EIO) to fail it.
static int before_pread(int fd) {
    if (!cfg.loaded || !armed() || !path_matches(fd, cfg.match)) return 0;
    const int saved = errno;
    bump(C_PREAD_CALLS, 1);
    maybe_stall();
    const int fail = decide_eio();
    errno = saved;
    if (fail) {
        errno = EIO;
        return -1;
    }
    return 1;
}

// After a matched pread-family call that read `got` bytes: what it returns (maybe a prefix).
static ssize_t after_pread(int fd, int matched, ssize_t got) {
    if (matched != 1 || got < 2 || (cfg.short_every <= 0 && cfg.short_prob <= 0)) return got;
    const int saved = errno;
    const uint64_t n = atomic_fetch_add(&short_calls, 1) + 1;
    const int shorten = cfg.short_every > 0 ? (n % (uint64_t)cfg.short_every == 0) : (uniform() < cfg.short_prob);
    ssize_t out = got;
    if (shorten) {
        // O_DIRECT needs page-aligned offsets for the rest: a real filesystem returns whole pages.
        const int flags = fcntl(fd, F_GETFL);
        const ssize_t unit = (flags >= 0 && (flags & O_DIRECT)) ? 4096 : 1;
        const ssize_t units = got / unit - (got % unit == 0);  // prefixes strictly shorter than got
        if (units >= 1) out = unit * (1 + (ssize_t)(uniform() * (double)units) % units);
    }
    if (out < got) bump(C_SHORT_READS, 1);
    errno = saved;
    return out;
}

// Before a write-family call (or fsync): 0 to go ahead, -1 (errno ENOSPC) to fail it.
static int before_write(int fd) {
    if (!cfg.loaded || !cfg.write_match[0]) return 0;
    const int saved = errno;
    const int matched = armed() && path_matches(fd, cfg.write_match);
    const int fail = matched && (bump(C_WRITE_CALLS, 1), decide(&enospc));
    errno = fail ? ENOSPC : saved;
    return fail ? -1 : 0;
}

// ------------------------------------------------------------------ the wrappers
ssize_t pread(int fd, void* buf, size_t count, off_t offset) {
    if (!real_pread) resolve();
    const int matched = before_pread(fd);
    if (matched < 0) return -1;
    return after_pread(fd, matched, real_pread(fd, buf, count, offset));
}

ssize_t pread64(int fd, void* buf, size_t count, off64_t offset) {
    if (!real_pread64) resolve();
    const int matched = before_pread(fd);
    if (matched < 0) return -1;
    return after_pread(fd, matched, real_pread64(fd, buf, count, offset));
}

ssize_t preadv(int fd, const struct iovec* iov, int n, off_t offset) {
    if (!real_preadv) resolve();
    const int matched = before_pread(fd);
    if (matched < 0) return -1;
    return after_pread(fd, matched, real_preadv(fd, iov, n, offset));
}

ssize_t preadv64(int fd, const struct iovec* iov, int n, off64_t offset) {
    if (!real_preadv64) resolve();
    const int matched = before_pread(fd);
    if (matched < 0) return -1;
    return after_pread(fd, matched, real_preadv64(fd, iov, n, offset));
}

ssize_t preadv2(int fd, const struct iovec* iov, int n, off_t offset, int flags) {
    if (!real_preadv2) resolve();
    const int matched = before_pread(fd);
    if (matched < 0) return -1;
    return after_pread(fd, matched, real_preadv2(fd, iov, n, offset, flags));
}

ssize_t preadv64v2(int fd, const struct iovec* iov, int n, off64_t offset, int flags) {
    if (!real_preadv64v2) resolve();
    const int matched = before_pread(fd);
    if (matched < 0) return -1;
    return after_pread(fd, matched, real_preadv64v2(fd, iov, n, offset, flags));
}

ssize_t write(int fd, const void* buf, size_t count) {
    if (!real_write) resolve();
    if (before_write(fd) < 0) return -1;
    return real_write(fd, buf, count);
}

ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
    if (!real_pwrite) resolve();
    if (before_write(fd) < 0) return -1;
    return real_pwrite(fd, buf, count, offset);
}

ssize_t pwrite64(int fd, const void* buf, size_t count, off64_t offset) {
    if (!real_pwrite64) resolve();
    if (before_write(fd) < 0) return -1;
    return real_pwrite64(fd, buf, count, offset);
}

ssize_t writev(int fd, const struct iovec* iov, int n) {
    if (!real_writev) resolve();
    if (before_write(fd) < 0) return -1;
    return real_writev(fd, iov, n);
}

ssize_t pwritev(int fd, const struct iovec* iov, int n, off_t offset) {
    if (!real_pwritev) resolve();
    if (before_write(fd) < 0) return -1;
    return real_pwritev(fd, iov, n, offset);
}

int fsync(int fd) {
    if (!real_fsync) resolve();
    if (before_write(fd) < 0) return -1;
    return real_fsync(fd);
}

int fdatasync(int fd) {
    if (!real_fdatasync) resolve();
    if (before_write(fd) < 0) return -1;
    return real_fdatasync(fd);
}

// syscall() is variadic; like glibc's own, this passes six argument words on (the kernel
// reads only the ones the call has).
long syscall(long number, ...) {
    if (!real_syscall) resolve();
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int k = 0; k < 6; ++k) a[k] = va_arg(ap, long);
    va_end(ap);
#ifdef SYS_io_uring_setup
    // io_uring's completions land in shared memory this shim does not see: refuse the ring as
    // a seccomp profile would, so the reader falls back to native AIO, which is faulted below.
    if (number == SYS_io_uring_setup && cfg.loaded) {
        errno = ENOSYS;
        return -1;
    }
#endif
    const long got = real_syscall(number, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (number != SYS_io_getevents || got <= 0 || !cfg.loaded || !armed()) return got;
    const int saved = errno;
    struct io_event* events = (struct io_event*)a[3];
    int matched = 0, last_fd = -1, last_match = 0;
    for (long k = 0; k < got; ++k) {
        const struct iocb* cb = (const struct iocb*)(uintptr_t)events[k].obj;
        const int fd = (int)cb->aio_fildes;
        if (fd != last_fd) {
            last_fd = fd;
            last_match = path_matches(fd, cfg.match);
        }
        if (!last_match) continue;
        ++matched;
        bump(C_AIO_EVENTS, 1);
        if (decide_eio()) events[k].res = -EIO;
    }
    if (matched) maybe_stall();
    errno = saved;
    return got;
}
