/* dtralloc C ABI: the entry points torch's CUDAPluggableAllocator calls.
 *
 *   torch.cuda.memory.CUDAPluggableAllocator(path, "dtralloc_malloc", "dtralloc_free")
 *
 * dtralloc.install() wires these plus the optional hooks. No function here
 * throws: errors are printed on stderr, counted, and kept for
 * dtralloc_last_error() (per thread). */
#ifndef DTRALLOC_H_
#define DTRALLOC_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The sizes are size_t, as in torch's prototypes (CUDAPluggableAllocator.h:
 * void*(size_t, int, cudaStream_t) and void(void*, size_t, int, cudaStream_t)).
 *
 * Returns NULL for size 0 and when the request cannot be served (the reason is
 * printed on stderr and kept for dtralloc_last_error). */
void* dtralloc_malloc(size_t size, int device, void* stream);
#ifdef __cplusplus
/* The entry point dtralloc.install() hands torch. Same as dtralloc_malloc, but
 * a request that cannot be served throws std::runtime_error (carrying the OOM
 * message) instead of returning NULL: torch's pluggable-allocator wrapper does
 * not check for NULL, and turns a C++ exception into a Python RuntimeError.
 * C callers (ctypes) must use dtralloc_malloc. */
void* dtralloc_malloc_or_throw(size_t size, int device, void* stream);
#endif
/* A double free or unknown pointer is reported on stderr, counted in
 * num_invalid_frees and otherwise ignored. */
void dtralloc_free(void* ptr, size_t size, int device, void* stream);

/* Optional torch hooks (CUDAPluggableAllocator._set_*_fn). */
void dtralloc_init(int device_count);                        /* init */
void dtralloc_empty_cache(void);                             /* reset: empty_cache */
void dtralloc_set_memory_fraction(double fraction, int device);
void* dtralloc_base_alloc(void* ptr, size_t* size);
void dtralloc_record_stream(void* ptr, void* stream);

/* Diagnostics. */
const char* dtralloc_last_error(void);        /* "" when none */
long long dtralloc_invalid_free_count(void);  /* across devices */

#ifdef __cplusplus
}
#endif
#endif /* DTRALLOC_H_ */
