/* dtralloc C ABI: the entry points torch's CUDAPluggableAllocator calls.
 *
 *   torch.cuda.memory.CUDAPluggableAllocator(path, "dtralloc_malloc_or_throw", "dtralloc_free")
 *
 * dtralloc.install() hands torch these and the hooks below, through the
 * setters of torch._C._CUDAPluggableAllocator (torch/csrc/cuda/Module.cpp).
 * Every prototype is the one torch casts the address to there. Only the two
 * C++ entry points throw (torch turns the exception into a Python error);
 * everything else prints errors on stderr, counts them, and keeps them for
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

/* torch's hooks, by the setter that takes each (set_init_fn, ...). */
void dtralloc_init(int device_count);                            /* set_init_fn */
void dtralloc_empty_cache(void);                                 /* set_reset_fn */
void dtralloc_set_memory_fraction(double fraction, int device);  /* set_memory_fraction_fn */
void* dtralloc_base_alloc(void* ptr, size_t* size);              /* set_base_alloc_fn */
void dtralloc_record_stream(void* ptr, void* stream);            /* set_record_stream_fn */

/* Diagnostics. */
const char* dtralloc_last_error(void);        /* "" when none */
long long dtralloc_invalid_free_count(void);  /* across devices */

#ifdef __cplusplus
}  /* extern "C" */

#include <functional>
#include <utility>

struct CUstream_st;  /* cudaStream_t is CUstream_st* */

/* set_begin_allocate_to_pool: torch calls it when a CUDA graph capture (or a
 * torch.cuda.MemPool) starts routing allocations to a private pool, before
 * cudaStreamBeginCapture. The prototype is torch's FuncType there:
 * void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>), where
 * MempoolId_t is std::pair<unsigned long long, unsigned long long>. dtralloc
 * keeps no private pools, so it always throws std::runtime_error naming the
 * cause and the workaround: the capture fails at once, before it started. */
extern "C" void dtralloc_begin_allocate_to_pool(
    int device, std::pair<unsigned long long, unsigned long long> mempool_id,
    std::function<bool(CUstream_st*)> filter);
#endif
#endif /* DTRALLOC_H_ */
