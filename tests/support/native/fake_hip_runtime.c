/* A stand-in for libamdhip64 on a machine without ROCm (tests only): the entry points that
 * libengram_hip.so and ops/gpu_runtime.py call, recording what they were given. Built by the
 * tests as libamdhip64.so.6 and loaded before them, it is "the HIP runtime already in the
 * process". Its hipHostGetDevicePointer returns host + kDeviceOffset: a device address that
 * differs from the host pointer, as ROCm's may. */
#include <stddef.h>
#include <stdint.h>

typedef struct { uint32_t x, y, z; } dim3;
typedef void* hipStream_t;

static const uintptr_t kDeviceOffset = 0x100000000000ull;
static int current_device = 0;
static int attrs[128];
static int attrs_set = 0;

/* What the tests read back. */
struct Record {
    int register_calls, register_device, unregister_calls, unregister_device;
    unsigned register_flags;
    uintptr_t register_ptr, unregister_ptr;
    size_t register_bytes;
    int launches;
    dim3 grid, block;
    uintptr_t table;
    int64_t n;
};
static struct Record rec;
struct Record* fake_record(void) { return &rec; }
void fake_set_attribute(int attr, int value) { attrs[attr] = value; }
uintptr_t fake_device_offset(void) { return kDeviceOffset; }

static void default_attrs(void) {
    if (attrs_set) return;
    attrs_set = 1;
    attrs[3] = 1;    /* hipDeviceAttributeCanMapHostMemory */
    attrs[4] = 0;    /* hipDeviceAttributeCanUseHostPointerForRegisteredMem */
    attrs[85] = 1;   /* hipDeviceAttributeUnifiedAddressing */
    attrs[87] = 64;  /* hipDeviceAttributeWarpSize */
}

int hipGetDevice(int* d) { *d = current_device; return 0; }
int hipSetDevice(int d) {
    if (d < 0 || d >= 4) return 101; /* hipErrorInvalidDevice */
    current_device = d;
    return 0;
}
const char* hipGetErrorString(int e) { return e == 0 ? "hipSuccess" : "fake HIP error"; }
int hipGetLastError(void) { return 0; }
int hipDeviceGetAttribute(int* value, int attr, int device) {
    default_attrs();
    if (attr < 0 || attr >= 128 || device < 0 || device >= 4) return 1;
    *value = attrs[attr];
    return 0;
}
int hipHostRegister(void* p, size_t n, unsigned flags) {
    rec.register_calls++;
    rec.register_ptr = (uintptr_t)p;
    rec.register_bytes = n;
    rec.register_flags = flags;
    rec.register_device = current_device;
    return 0;
}
int hipHostUnregister(void* p) {
    rec.unregister_calls++;
    rec.unregister_ptr = (uintptr_t)p;
    rec.unregister_device = current_device;
    return 0;
}
int hipHostGetDevicePointer(void** out, void* p, unsigned flags) {
    (void)flags;
    *out = (void*)((uintptr_t)p + kDeviceOffset);
    return 0;
}
int hipFuncGetAttributes(void* attr, const void* f) { (void)attr; (void)f; return 0; }

/* What clang's HIP host code calls: fat binary registration and the <<<>>> launch. */
static void* module_handle;
void** __hipRegisterFatBinary(const void* data) { (void)data; return &module_handle; }
void __hipRegisterFunction(void** m, const void* h, char* d, const char* n, int limit, void* t, void* b,
                           void* bd, void* gd, int* w) {
    (void)m; (void)h; (void)d; (void)n; (void)limit; (void)t; (void)b; (void)bd; (void)gd; (void)w;
}
void __hipUnregisterFatBinary(void** m) { (void)m; }
static dim3 pending_grid, pending_block;
static size_t pending_shmem;
static hipStream_t pending_stream;
int __hipPushCallConfiguration(dim3 g, dim3 b, size_t shmem, hipStream_t s) {
    pending_grid = g; pending_block = b; pending_shmem = shmem; pending_stream = s;
    return 0;
}
int __hipPopCallConfiguration(dim3* g, dim3* b, size_t* shmem, hipStream_t* s) {
    *g = pending_grid; *b = pending_block; *shmem = pending_shmem; *s = pending_stream;
    return 0;
}
/* The gather kernel's arguments: (table, ids, n, lo, hi, out). */
int hipLaunchKernel(const void* f, dim3 g, dim3 b, void** args, size_t shmem, hipStream_t s) {
    (void)f; (void)shmem; (void)s;
    rec.launches++;
    rec.grid = g;
    rec.block = b;
    rec.table = *(uintptr_t*)args[0];
    rec.n = *(int64_t*)args[2];
    return 0;
}
