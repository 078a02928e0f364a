// The extern "C" entry points of libdtralloc.so (include/dtralloc.h): a thin
// shell over global::allocator(). Nothing may throw across this boundary but
// the two entry points torch expects to throw (dtralloc_malloc_or_throw and
// dtralloc_begin_allocate_to_pool): every other error is printed, counted
// where a counter exists, and kept for dtralloc_last_error().
#include "include/dtralloc.h"

#include <atomic>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "global.h"

namespace {

thread_local std::string last_error;
std::atomic<long long> invalid_frees{0};

void report(const char* where, const std::exception& e) {
  last_error = e.what();
  std::fprintf(stderr, "%s (in %s)\n", e.what(), where);
}

dtralloc::Stream to_stream(void* stream) { return reinterpret_cast<dtralloc::Stream>(stream); }

// The one allocation path of both malloc entry points: reports a failure
// (stderr, dtralloc_last_error) and rethrows it for the caller to translate.
void* allocate_or_report(std::size_t size, int device, void* stream, const char* where) {
  if (size == 0) return nullptr;
  last_error.clear();
  try {
    return dtralloc::global::allocator(device).malloc(size, to_stream(stream));
  } catch (const std::exception& e) {
    report(where, e);
    throw;
  }
}

}  // namespace

extern "C" {

void* dtralloc_malloc(size_t size, int device, void* stream) {
  try {
    return allocate_or_report(size, device, stream, "dtralloc_malloc");
  } catch (const std::exception&) {
    return nullptr;  // already reported
  }
}

void* dtralloc_malloc_or_throw(size_t size, int device, void* stream) {
  try {
    return allocate_or_report(size, device, stream, "dtralloc_malloc_or_throw");
  } catch (const std::exception& e) {
    // A plain std::runtime_error: the one exception type torch's bindings are
    // sure to translate (to RuntimeError) whatever torch version loaded us.
    throw std::runtime_error(e.what());
  }
}

void dtralloc_free(void* ptr, size_t /*size*/, int device, void* /*stream*/) {
  if (!ptr) return;
  // A forked child drops the parent's blocks: their memory is not its own.
  if (dtralloc::global::forked_child()) return;
  try {
    dtralloc::Allocator* a = dtralloc::global::existing(device);
    if (!a) throw dtralloc::InvalidPointerError("dtralloc: free on device " + std::to_string(device) +
                                                ", which has no dtralloc allocator");
    a->free(ptr);
  } catch (const dtralloc::InvalidPointerError& e) {
    ++invalid_frees;
    report("dtralloc_free", e);
  } catch (const std::exception& e) {
    report("dtralloc_free", e);
  }
}

void dtralloc_init(int device_count) {
  // Allocators are created lazily per device; here we only surface a bad
  // DTRALLOC_CONF early, at torch's CUDA initialization.
  (void)device_count;
  try {
    dtralloc::global::config();
  } catch (const std::exception& e) {
    report("dtralloc_init", e);
  }
}

void dtralloc_empty_cache(void) {
  for (dtralloc::Allocator* a : dtralloc::global::all_existing()) {
    try {
      a->empty_cache();
    } catch (const std::exception& e) {
      report("dtralloc_empty_cache", e);
    }
  }
}

void dtralloc_set_memory_fraction(double fraction, int device) {
  try {
    dtralloc::global::allocator(device).set_memory_fraction(fraction);
  } catch (const std::exception& e) {
    report("dtralloc_set_memory_fraction", e);
  }
}

void* dtralloc_base_alloc(void* ptr, size_t* size) {
  for (dtralloc::Allocator* a : dtralloc::global::all_existing())
    if (a->owns(ptr)) return a->base_allocation(ptr, size);
  if (size) *size = 0;
  return ptr;
}

void dtralloc_record_stream(void* ptr, void* stream) {
  if (!ptr || dtralloc::global::forked_child()) return;
  for (dtralloc::Allocator* a : dtralloc::global::all_existing()) {
    if (!a->owns(ptr)) continue;
    try {
      a->record_stream(ptr, to_stream(stream));
    } catch (const std::exception& e) {
      report("dtralloc_record_stream", e);
    }
    return;
  }
  ++invalid_frees;
  last_error = "dtralloc: record_stream on a pointer no dtralloc allocator holds";
  std::fprintf(stderr, "%s\n", last_error.c_str());
}

void dtralloc_begin_allocate_to_pool(int device,
                                     std::pair<unsigned long long, unsigned long long> mempool_id,
                                     std::function<bool(CUstream_st*)> /*filter*/) {
  last_error = dtralloc::graph_capture_refusal(
      "torch began a CUDA graph capture (or a torch.cuda.MemPool) on device " +
      std::to_string(device) + " into private pool (" + std::to_string(mempool_id.first) +
      ", " + std::to_string(mempool_id.second) + ")");
  throw std::runtime_error(last_error);
}

const char* dtralloc_last_error(void) { return last_error.c_str(); }

long long dtralloc_invalid_free_count(void) { return invalid_frees.load(); }

}  // extern "C"
