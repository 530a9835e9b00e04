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
// Only reads of files whose path (readlink of /proc/self/fd/N) contains ENGRAM_FAULTS_MATCH
// are touched; every other call is forwarded unchanged.
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
    double eio_prob, stall_prob;
    long eio_every, eio_burst, eio_burst_ms, eio_gap_ms, stall_every, stall_ms;
} cfg;

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
static pread_fn real_pread, real_pread64;
static preadv_fn real_preadv, real_preadv64;
static preadv2_fn real_preadv2, real_preadv64v2;
static syscall_fn real_syscall;

static void resolve(void) {
    real_pread = (pread_fn)dlsym(RTLD_NEXT, "pread");
    real_pread64 = (pread_fn)dlsym(RTLD_NEXT, "pread64");
    real_preadv = (preadv_fn)dlsym(RTLD_NEXT, "preadv");
    real_preadv64 = (preadv_fn)dlsym(RTLD_NEXT, "preadv64");
    real_preadv2 = (preadv2_fn)dlsym(RTLD_NEXT, "preadv2");
    real_preadv64v2 = (preadv2_fn)dlsym(RTLD_NEXT, "preadv64v2");
    real_syscall = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
}

__attribute__((constructor)) static void load(void) {
    resolve();
    env_string("ENGRAM_FAULTS_MATCH", ".rows", cfg.match, sizeof cfg.match);
    env_string("ENGRAM_FAULTS_ARM", "", cfg.arm, sizeof cfg.arm);
    env_string("ENGRAM_FAULTS_STATS_DIR", "", cfg.stats_dir, sizeof cfg.stats_dir);
    cfg.seed = (uint64_t)env_long("ENGRAM_FAULTS_SEED", 1);
    cfg.eio_prob = env_double("ENGRAM_FAULTS_EIO_PROB", 0.0);
    cfg.eio_every = env_long("ENGRAM_FAULTS_EIO_EVERY", 0);
    cfg.eio_burst = env_long("ENGRAM_FAULTS_EIO_BURST", 1);
    cfg.eio_burst_ms = env_long("ENGRAM_FAULTS_EIO_BURST_MS", 0);
    cfg.eio_gap_ms = env_long("ENGRAM_FAULTS_EIO_GAP_MS", 0);
    cfg.stall_prob = env_double("ENGRAM_FAULTS_STALL_PROB", 0.0);
    cfg.stall_every = env_long("ENGRAM_FAULTS_STALL_EVERY", 0);
    cfg.stall_ms = env_long("ENGRAM_FAULTS_STALL_MS", 50);
    if (cfg.eio_burst < 1) cfg.eio_burst = 1;
    cfg.loaded = 1;
}

// ------------------------------------------------------------------ counters
// The order is the file's: bench/soak.py reads the names from the header line.
enum { C_MATCHED, C_EIO, C_BURSTS, C_STALLS, C_STALL_US, C_PREAD_CALLS, C_AIO_EVENTS, C_COUNT };
static const char* const kNames = "matched_reads,eio_injected,eio_bursts,stalls,stall_us,pread_calls,aio_events";
enum { kHeaderBytes = 256 };

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

static int path_matches(int fd) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = '\0';
    return strstr(path, cfg.match) != NULL;
}

static _Atomic uint64_t matched_reads, matched_calls;
static _Atomic long burst_left;
static _Atomic uint64_t burst_until_ns, last_start_ns;

// A burst may start now: 1 for the one thread that claims this start.
static int gap_allows(void) {
    if (cfg.eio_gap_ms <= 0) return 1;
    const uint64_t now = now_ns(), gap = (uint64_t)cfg.eio_gap_ms * 1000000ull;
    uint64_t last = atomic_load(&last_start_ns);
    return (last == 0 || now - last >= gap) && atomic_compare_exchange_strong(&last_start_ns, &last, now);
}

// One matched read: 1 when it must fail with EIO.
static int decide_eio(void) {
    const uint64_t n = atomic_fetch_add(&matched_reads, 1) + 1;
    bump(C_MATCHED, 1);
    int fail = 0;
    if (cfg.eio_burst_ms > 0) {
        fail = now_ns() < atomic_load(&burst_until_ns);
    } else {
        long left = atomic_load(&burst_left);
        while (left > 0 && !(fail = atomic_compare_exchange_weak(&burst_left, &left, left - 1))) {
        }
    }
    if (!fail) {
        const int start =
            cfg.eio_every > 0 ? (n % (uint64_t)cfg.eio_every == 0) : (cfg.eio_prob > 0 && uniform() < cfg.eio_prob);
        if (start && gap_allows()) {
            bump(C_BURSTS, 1);
            if (cfg.eio_burst_ms > 0)
                atomic_store(&burst_until_ns, now_ns() + (uint64_t)cfg.eio_burst_ms * 1000000ull);
            else
                atomic_store(&burst_left, cfg.eio_burst - 1);
            fail = 1;
        }
    }
    if (fail) bump(C_EIO, 1);
    return fail;
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

// Before a pread-family call: 0 to go ahead, -1 (errno EIO) to fail it.
static int before_pread(int fd) {
    if (!cfg.loaded || !armed() || !path_matches(fd)) return 0;
    const int saved = errno;
    bump(C_PREAD_CALLS, 1);
    maybe_stall();
    const int fail = decide_eio();
    errno = saved;
    if (fail) {
        errno = EIO;
        return -1;
    }
    return 0;
}

// ------------------------------------------------------------------ the wrappers
ssize_t pread(int fd, void* buf, size_t count, off_t offset) {
    if (!real_pread) resolve();
    if (before_pread(fd) < 0) return -1;
    return real_pread(fd, buf, count, offset);
}

ssize_t pread64(int fd, void* buf, size_t count, off64_t offset) {
    if (!real_pread64) resolve();
    if (before_pread(fd) < 0) return -1;
    return real_pread64(fd, buf, count, offset);
}

ssize_t preadv(int fd, const struct iovec* iov, int n, off_t offset) {
    if (!real_preadv) resolve();
    if (before_pread(fd) < 0) return -1;
    return real_preadv(fd, iov, n, offset);
}

ssize_t preadv64(int fd, const struct iovec* iov, int n, off64_t offset) {
    if (!real_preadv64) resolve();
    if (before_pread(fd) < 0) return -1;
    return real_preadv64(fd, iov, n, offset);
}

ssize_t preadv2(int fd, const struct iovec* iov, int n, off_t offset, int flags) {
    if (!real_preadv2) resolve();
    if (before_pread(fd) < 0) return -1;
    return real_preadv2(fd, iov, n, offset, flags);
}

ssize_t preadv64v2(int fd, const struct iovec* iov, int n, off64_t offset, int flags) {
    if (!real_preadv64v2) resolve();
    if (before_pread(fd) < 0) return -1;
    return real_preadv64v2(fd, iov, n, offset, flags);
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
            last_match = path_matches(fd);
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
