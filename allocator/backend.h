// Backends: where a pool's segments come from.
//
// A Backend hands out whole segments (the pool carves blocks out of them) and
// provides the stream events the pool needs for record_stream. Three exist:
//
//   cuda     device memory through the CUDA runtime, found at run time
//            (backend_cuda.cpp; DTRALLOC_CUDART overrides which library)
//   host     aligned host memory with real bytes (tests write patterns into it)
//   virtual  address arithmetic only, any capacity, no bytes behind it
//
// Host and virtual backends have no asynchronous streams. Their events are
// "deferred": an event recorded on a stream stays pending until someone
// synchronizes (synchronize_device, synchronize_event) or calls
// complete_events(). That keeps the record_stream path testable without a GPU.
//
// Backends are not thread-safe on their own; the Allocator serializes calls to
// allocate/release/events under its mutex (CUDA runtime calls are thread-safe,
// the deferred-event bookkeeping is guarded here by its own small mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace dtralloc {

using Stream = std::uintptr_t;  // cudaStream_t as an integer; 0 = default stream
using EventHandle = void*;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;

  // A segment of exactly `bytes` for `stream` (the stream the pool gives
  // the segment's blocks to), or nullptr when the device is out of memory.
  // Never throws for out-of-memory; throws std::runtime_error for other
  // errors. release() gets the segment's stream back: with async segments
  // (cuda) the memory is freed in that stream's order, after the work the
  // stream already has; the others ignore it.
  virtual void* allocate(std::size_t bytes, Stream stream) = 0;
  virtual void release(void* ptr, std::size_t bytes, Stream stream) = 0;
  // True when release() also takes any 2 MiB-aligned range inside a segment
  // (counted from the segment's start, whole pages of 2 MiB), the rest of
  // the segment staying valid where it is: unmap_pages needs it. The host
  // and virtual backends can; cuda can with VMM segments (memory from
  // cudaMalloc is freed whole).
  virtual bool releases_ranges() const { return false; }

  // Async segments (cuda, async_segments:on): the device memory the driver's
  // pool holds for this backend, live segments and freed ones it has not yet
  // given back to the device (it does at the next synchronize), and the most
  // it held since reset_device_pool_peak(). False where segments are freed
  // at once (every other backend).
  struct DevicePoolBytes {
    std::size_t reserved = 0;
    std::size_t peak = 0;
  };
  virtual bool device_pool_bytes(DevicePoolBytes& /*out*/) { return false; }
  virtual void reset_device_pool_peak() {}
  // Gives the device what the backend still holds of released segments
  // (async segments: waits for the device, then trims the driver's pool);
  // empty_cache() calls it. Nothing to do where release() frees at once.
  virtual void trim() {}

  // Device capacity, for `budget:0.5` style fractions and for the OOM message.
  virtual std::size_t total_bytes() = 0;
  virtual std::size_t free_bytes() = 0;

  // True when memory returned by allocate() can be read and written by the
  // host (host backend). Tests use it to write and verify patterns.
  virtual bool host_accessible() const { return false; }

  // Events for record_stream. create_event never returns nullptr.
  virtual EventHandle create_event() = 0;
  virtual void record_event(EventHandle event, Stream stream) = 0;
  virtual bool event_completed(EventHandle event) = 0;  // non-blocking
  virtual void synchronize_event(EventHandle event) = 0;
  virtual void destroy_event(EventHandle event) = 0;
  virtual void synchronize_device() = 0;
  // Waits for everything enqueued on `stream` so far, whichever device the
  // stream belongs to (an event of this device cannot be recorded on another
  // device's stream: record_stream's fallback). Simulated backends have one
  // device and no streams: the whole device.
  virtual void synchronize_stream(Stream /*stream*/) { synchronize_device(); }
  // Deferred backends: mark every recorded event complete. No-op for cuda.
  virtual void complete_events() {}

  // Timing events, recorded and destroyed like the events above: what the
  // live session times a GPU's ops with (op_timer.h), since an op returns
  // to the host once launched. nullptr where the backend has none (host and
  // virtual: the session times their ops with a clock).
  virtual EventHandle create_timing_event() { return nullptr; }
  // Milliseconds from `start`'s completion to `end`'s; negative while either
  // is still pending.
  virtual double elapsed_ms(EventHandle /*start*/, EventHandle /*end*/) { return -1; }

  // True while `stream` is capturing a CUDA graph (or, for the legacy default
  // stream 0, while a blocking stream of the device is): then the pool must
  // not call cudaMalloc, cudaFree or query events (Allocator::malloc). The
  // simulated backends never capture.
  virtual bool stream_capturing(Stream /*stream*/) { return false; }
};

// `capacity_bytes` is the simulated device size for host/virtual backends.
std::unique_ptr<Backend> make_host_backend(std::size_t capacity_bytes);
std::unique_ptr<Backend> make_virtual_backend(std::size_t capacity_bytes);
// Loads the CUDA runtime on first use (see backend_cuda.cpp for the search
// order). Throws std::runtime_error naming the library and the fix when no
// runtime can be loaded. Its segments come from cudaMalloc.
std::unique_ptr<Backend> make_cuda_backend(int device);
// Why `device` cannot have VMM segments; "" when it can. Creates no context;
// throws like make_cuda_backend when there is no such device.
std::string cuda_vmm_unavailable(int device);
// The cuda backend `config` asks for: VMM segments where unmap_pages is on,
// as given (auto makes cudaMalloc'd segments, which cost a GPU far less to
// make and release: backend_cuda.cpp), and the device can have them.
// Each such segment is a reserved address range with its 2 MiB pages mapped
// one by one (CUDA's virtual memory API), so that release() takes page
// ranges (releases_ranges()). unmap_pages:on where the device cannot throws
// ConfigError. With cudaMalloc'd segments the Allocator resolves
// unmap_pages:auto off.
struct Config;
// With async_segments:on, segments come from a memory pool of the driver's
// stream-ordered allocator instead (cudaMallocFromPoolAsync, cudaFreeAsync on
// the segment's stream), so that neither waits for the device.
std::unique_ptr<Backend> make_cuda_backend_for(const Config& config, int device);
// Throws ConfigError naming why unmap_pages:on cannot run on `device`.
void check_cuda_unmap_pages(int device);
// Throws ConfigError naming why async_segments:on cannot run on `device`.
void check_cuda_async_segments(int device);

// Number of CUDA devices the runtime reports (0 when none can be loaded).
int cuda_device_count();
// Path of the CUDA runtime library that was loaded, "" when none yet.
std::string cuda_runtime_path();
// Search libcudart.so.<major> first (backend_cuda.cpp): the CUDA major
// version the torch in the process was built against. 0 = no preference.
// Takes effect only for a search that has not succeeded yet.
void prefer_cuda_runtime_major(int major);

}  // namespace dtralloc
