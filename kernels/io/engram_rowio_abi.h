// engram_rowio_abi.h: the C ABI of libengram_rowio.so (kernels/io/engram_rowio.cpp), the disk
// tier's row reads and its native step: the structures the caller hands over, the status
// codes and the entry points. engram_rowio.cpp includes it (engram_disk_step.h and
// engram_dram_policy.h use its structures), so the compiler checks every definition against
// these prototypes; engram_sglang/core/stores/rowio.py binds them with ctypes (its ctypes
// structures have these layouts), and tests/kernels/test_native_abi.py checks that binding, its
// structures and its constants against this file. Torch-free, C and C++.
#pragma once

#include <stdint.h>

// Threads of one call (reads in flight by pread or the mapping), at most: more are clamped to
// it (stores/rowio.py's MAX_THREADS, which refuses more).
#define ENGRAM_ROWIO_MAX_THREADS 256

// How the native step reads the misses (engram_disk_file.mode).
enum engram_read_mode {
    ENGRAM_READ_MAPPED = 0,  // memcpy from the mapping at engram_disk_file.base
    ENGRAM_READ_AIO = 1,     // O_DIRECT reads by io_uring, native AIO where it is unavailable
    ENGRAM_READ_PREAD = 2,   // pread per row, `threads` in flight
    ENGRAM_READ_NONE = 3,    // the caller reads the misses (tests, fallbacks)
};

// What engram_disk_step returns.
enum engram_step_status {
    ENGRAM_STEP_OK = 0,
    ENGRAM_STEP_UNREAD = 1,  // a read failed (or the file is truncated): hits copied, misses listed
    ENGRAM_STEP_BAD_ARGUMENT = -1,
    ENGRAM_STEP_AIO_UNAVAILABLE = -2,  // neither io_uring nor native AIO here: read another way
};

// engram_rowio_aio's (and its reads') code for "no O_DIRECT engine here": the caller falls
// back to pread. The same value as ENGRAM_STEP_AIO_UNAVAILABLE (the step passes it on).
#define ENGRAM_AIO_UNAVAILABLE (-2)

// The store's file.
typedef struct engram_disk_file {
    int32_t fd, mode;     // an engram_read_mode
    int32_t threads;      // reads in flight
    int32_t direct;       // O_DIRECT file (pread mode)
    int64_t data_offset;  // byte of row 0
    const uint8_t* base;  // row 0 in the mapping (ENGRAM_READ_MAPPED)
    int64_t lo, hi;       // the shard's global rows
} engram_disk_file;

// What the Python DRAM row cache (stores/dram_cache.py) hands over: its arrays and shape.
typedef struct engram_dram_cache {
    uint8_t* rows;    // [slots, 264]
    int64_t* tags;    // [slots], -1 empty
    int64_t* last;    // [slots], clock of the last use
    uint8_t* count;   // [slots]
    uint8_t* sketch;  // [depth / 2, width]: 4-bit counters
    int64_t* state;   // [engram_disk_step_layout(3)]
    int64_t slots, ways, sets, sketch_width, sample;
    int32_t frequency;  // 1: frequency admission, 0: LRU
    int32_t pad_;
} engram_dram_cache;

typedef struct engram_step_result {
    int64_t unique;  // distinct ids of this shard (rows of `packed`)
    int64_t misses;  // of them, not in the DRAM cache (positions in `missed`)
    int64_t error;   // errno of a failed read, -1 short read / past the end, 0
    int64_t failed;  // index into the misses of a failed read, else -1
} engram_step_result;

#ifdef __cplusplus
extern "C" {
#endif

// Copies rows[i] (i < n) of the mapped table at `base` (row 0's address) to out[i].
// Returns 0, or 1 when a row faulted (SIGBUS: I/O error or a file truncated under the
// mapping); *failed is then the smallest faulting index seen.
int engram_rowio_copy_mapped(const uint8_t* base, const int64_t* rows, int64_t n, uint8_t* out, int threads,
                             int64_t* failed);

// Reads rows[i] (i < n) of the file `fd` (row 0 at byte `data_offset`) to out[i] with
// `threads` reads in flight. Returns 0, an errno, or -1 for a short read; *failed is then
// the index of a failed row.
int engram_rowio_pread(int fd, int64_t data_offset, const int64_t* rows, int64_t n, uint8_t* out, int threads,
                       int direct, int64_t* failed);

// Reads rows[i] (i < n, ascending for merging) of an O_DIRECT file `fd` to out[i] by io_uring
// (native AIO where it is unavailable), `depth` reads in flight. Returns 0, an errno, -1 for a
// short read (*failed = the row's index), or ENGRAM_AIO_UNAVAILABLE.
int engram_rowio_aio(int fd, int64_t data_offset, const int64_t* rows, int64_t n, uint8_t* out, int depth,
                     int64_t* failed);

// The most reads the calling thread's last engram_rowio_aio call had in flight (a test hook).
int engram_rowio_last_peak(void);

// The next `n` io_uring_enter calls with more than one read to submit ask the kernel for one
// fewer (a test hook: a kernel that takes part of a batch).
void engram_rowio_test_short_enters(int n);

// The next `n` io_uring_enter calls that submit reads fail with EIO after the kernel took them
// (a test hook: the ring is abandoned with reads in flight).
void engram_rowio_test_fail_enters(int n);

// The ring of this process's last io_uring call: out[0] its buffer slots (0: none yet),
// out[1] how many are registered (read by READ_FIXED), out[2] the errno that kept the rest
// unregistered (ENOMEM: RLIMIT_MEMLOCK), 0 when none did.
void engram_rowio_uring_buffers(int64_t* out);

// The engine of O_DIRECT reads for this process: want 0 io_uring where available (the
// default; ENGRAM_IO_ENGINE=aio makes it 1), 1 native AIO, -1 leaves it. Returns the setting,
// or 2 when want is 0 and io_uring is unavailable here (reads use native AIO).
int engram_rowio_engine(int want);

// One layer's step (engram_disk_step.h): ids[n] any global ids; wanted[n], local[n], missed[n]
// and packed[max(1, n)][264] are the caller's; cache may be null (no DRAM cache); rows_out
// [n][256] bf16 bits, or null (a GPU decodes the packed rows). decode_threads <= 0: every
// usable core (or ENGRAM_CPU_THREADS). Returns an engram_step_status; *result is always set.
int engram_disk_step(const engram_disk_file* file, engram_dram_cache* cache, const int64_t* ids, int64_t n,
                     int64_t* wanted, int64_t* local, uint8_t* packed, int64_t* missed, uint16_t* rows_out,
                     int decode_threads, engram_step_result* result);

// The step's row decode (a test hook): want 0 the production one (AVX-512 where this CPU has
// it), 1 the portable one, -1 leaves it. Returns 1 when the AVX-512 decode runs now, else 0.
int engram_disk_step_decode(int want);

// The layout the library was built with, which stores/rowio.py checks against its own: `what`
// 0..2 sizeof engram_disk_file, engram_dram_cache, engram_step_result; 3 the DRAM cache's
// state length; 4 its policy format; 5 its count cap; 6 its sketch depth; 7 its clock bits.
// Other values: -1.
int64_t engram_disk_step_layout(int what);

#ifdef __cplusplus
}  // extern "C"
#endif
