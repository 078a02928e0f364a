// A fake CUDA runtime (libdtralloc_fakecudart.so) for machines without a GPU.
//
// It exports the runtime functions dtralloc calls, under their real names and
// with their real C signatures, so DTRALLOC_CUDART can point the cuda backend
// (and anything else that dlopens a libcudart) at it. It also exports the one
// driver function dtralloc uses, cuDevicePrimaryCtxGetState, which a real
// installation has in libcuda.so.1 (backend_cuda.cpp looks in the runtime
// first, then there). Device memory is host memory, so tests can write into
// it. The fakecuda_* functions steer it (device count, capacity, injected
// failures) and report what it saw (call counts, live allocations, used
// bytes, which devices have a context).
//
// Behaviour that tests rely on:
//   * Devices: 1 by default, each with the same capacity (1 GiB by default).
//     cudaMalloc fails with cudaErrorMemoryAllocation when used + size would
//     pass the capacity of the current device. Used bytes count exact sizes.
//   * Errors set the calling thread's "last error", which cudaGetLastError
//     returns and clears, as in the real runtime. cudaEventQuery's
//     cudaErrorNotReady sets it too, the strict reading torch also guards
//     against.
//   * Events are deferred: cudaEventRecord leaves an event pending until
//     cudaEventSynchronize (that event), cudaStreamSynchronize (events recorded
//     on that stream), cudaDeviceSynchronize (events of the current device) or
//     fakecuda_complete_events() (all). An event never recorded is complete.
//     Recording on stream 0 from another device than the event's fails, as it
//     does on a GPU, which catches a missing cudaSetDevice; so does recording
//     on a stream that fakecuda_set_stream_device gave to another device
//     ("event and stream must be on the same device", cudaEventRecord).
//     Other streams belong to no device in particular.
//   * Timing: an event made without cudaEventDisableTiming takes the fake
//     device's clock when recorded (the fake runs work as it is enqueued):
//     the host's monotonic clock, or the time fakecuda_set_clock_ns froze.
//     cudaEventElapsedTime answers as documented: an invalid handle for an
//     event never recorded or made without timing, "not ready" while either
//     is pending.
//   * cudaFree does not complete events (the real one synchronizes). It
//     waits for the device as long as fakecuda_set_free_wait_ns says (the
//     work the real one would wait for; default 0), so that what dtralloc
//     measures of its device calls (device_free_ns) can be checked.
//   * Stream capture (CUDA graphs), as in cudaStreamCaptureModeGlobal:
//     fakecuda_set_stream_capture(stream, status) marks a stream of the
//     current device as capturing; cudaStreamIsCapturing reports it, and on
//     the legacy default stream (0) answers cudaErrorStreamCaptureImplicit
//     while any stream of its device captures. While any capture is active,
//     cudaMalloc, cudaFree, cudaEventQuery, cudaEventSynchronize,
//     cudaStreamSynchronize and cudaDeviceSynchronize fail with
//     cudaErrorStreamCaptureUnsupported and invalidate every active capture,
//     which is what a real GPU does to a capture they interrupt.
//   * Primary contexts, as CUDA 12 and later create them: cudaSetDevice(d)
//     creates device d's context at once, and a call that works on the current
//     device (cudaMalloc, cudaFree, cudaMemGetInfo, cudaEventCreateWithFlags,
//     cudaEventRecord, cudaDeviceSynchronize) creates that device's context
//     if none exists. cudaGetDevice, cudaGetDeviceCount and the error and
//     version queries create none. A context costs hundreds of MiB on a real
//     GPU, so a test can check that no stray one was made.
//
//   * Virtual memory management (the driver's cuMemAddressReserve,
//     cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
//     cuMemAddressFree; cuda.h): a reservation is an inaccessible host
//     mapping; a cuMemCreate'd allocation is a memfd counted against the
//     device's capacity (CUDA_ERROR_OUT_OF_MEMORY past it) and freed once it
//     is released and unmapped; cuMemMap maps it into a reservation, still
//     inaccessible until cuMemSetAccess, as on a GPU. The checks are the
//     documented ones, read strictly: sizes and addresses in multiples of the
//     granularity (2 MiB), a map only on unmapped reserved pages, an unmap
//     of exactly one whole mapping, access set only over a fully mapped
//     range, a reservation freed whole and (stricter than documented) with
//     nothing mapped in it. Each call needs a current context on the calling
//     thread (CUDA_ERROR_INVALID_CONTEXT): cudaSetDevice, or a runtime call
//     that works on the current device, makes that device's context current.
//
//   * Memory pools of the stream-ordered allocator (cudaMemPoolCreate,
//     cudaMallocFromPoolAsync, cudaFreeAsync, cudaMemPoolTrimTo, the
//     attributes ReleaseThreshold, ReservedMemCurrent and ReservedMemHigh):
//     a pool's memory counts against its device's capacity. cudaFreeAsync
//     never waits: the pool holds the freed memory, which an allocation on
//     the same stream reuses at once (the smallest that fits, whole: what it
//     has beyond the request stays reserved with it), any stream once a
//     synchronize or fakecuda_complete_events completed the free.
//     cudaStreamSynchronize (the frees on that stream) and
//     cudaDeviceSynchronize (the device's) complete frees and give them
//     back to the device down to the release threshold (default 0);
//     cudaMemPoolTrimTo gives back completed ones only, as documented. An
//     allocation past the capacity first gives back the pool's completed
//     frees. The pool calls are refused on a capturing stream (on a GPU they
//     would become graph nodes; dtralloc must never make them there), and
//     cudaFree of a pool's allocation, which dtralloc never does, is refused.
//     fakecuda_set_memory_pools(0) makes devices report no support.
//
// No std containers, std::mutex or std::atomic here, on purpose: at -O0 their
// inline members are emitted as weak symbols with default visibility and would
// be exported next to the CUDA API, and `nm -D` must show only the API and the
// controls. Internals have internal linkage; the lock is a pthread mutex.
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cudart_api.h"

#define FAKECUDA_EXPORT extern "C" __attribute__((visibility("default")))

using namespace dtralloc::cudart;

namespace {

constexpr int kMaxDevices = 16;
constexpr int kMaxCaptures = 16;  // streams capturing at once
constexpr int kMaxStreamDevices = 16;  // streams fakecuda_set_stream_device placed
constexpr std::size_t kDefaultCapacity = std::size_t(1) << 30;
constexpr std::size_t kAlignment = 512;
constexpr int kRuntimeVersion = 13000;
// Event handles are numbers, never dereferenced: there is nothing to leak, and
// a destroyed handle is never reissued, so using it is reported, not aliased.
constexpr std::uintptr_t kEventHandleBase = 0x7e000000;
constexpr std::uintptr_t kMemHandleBase = 0x6d000000;  // same, for cuMemCreate
constexpr std::uintptr_t kPoolHandleBase = 0x6c000000;  // same, for cudaMemPoolCreate
constexpr std::size_t kDefaultVmmGranularity = std::size_t{2} << 20;

enum Function {
  kMalloc, kFree, kMemGetInfo, kGetDevice, kSetDevice, kGetDeviceCount,
  kDeviceSynchronize, kStreamSynchronize, kStreamWaitEvent,
  kEventCreateWithFlags, kEventRecord, kEventQuery, kEventSynchronize,
  kEventDestroy, kGetLastError, kGetErrorString, kRuntimeGetVersion,
  kStreamIsCapturing, kEventElapsedTime, kDevicePrimaryCtxGetState,
  kDeviceGet, kDeviceGetAttribute, kCtxGetCurrent, kMemGetAllocationGranularity,
  kMemAddressReserve, kMemAddressFree, kMemCreate, kMemRelease, kMemMap,
  kMemUnmap, kMemSetAccess, kDriverGetErrorString,
  kRtDeviceGetAttribute, kMemPoolCreate, kMemPoolDestroy, kMemPoolGetAttribute,
  kMemPoolSetAttribute, kMemPoolTrimTo, kMallocFromPoolAsync, kFreeAsync,
  kFunctionCount
};

constexpr const char* kFunctionNames[kFunctionCount] = {
    "cudaMalloc", "cudaFree", "cudaMemGetInfo", "cudaGetDevice",
    "cudaSetDevice", "cudaGetDeviceCount", "cudaDeviceSynchronize",
    "cudaStreamSynchronize", "cudaStreamWaitEvent", "cudaEventCreateWithFlags",
    "cudaEventRecord", "cudaEventQuery", "cudaEventSynchronize",
    "cudaEventDestroy", "cudaGetLastError", "cudaGetErrorString",
    "cudaRuntimeGetVersion", "cudaStreamIsCapturing", "cudaEventElapsedTime",
    "cuDevicePrimaryCtxGetState", "cuDeviceGet", "cuDeviceGetAttribute",
    "cuCtxGetCurrent", "cuMemGetAllocationGranularity", "cuMemAddressReserve",
    "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap",
    "cuMemSetAccess", "cuGetErrorString", "cudaDeviceGetAttribute",
    "cudaMemPoolCreate", "cudaMemPoolDestroy", "cudaMemPoolGetAttribute",
    "cudaMemPoolSetAttribute", "cudaMemPoolTrimTo", "cudaMallocFromPoolAsync",
    "cudaFreeAsync"};

// Open-addressing hash map from pointer to a trivially copyable value, with
// linear probing. Deleting re-places the rest of the probe run, which keeps
// lookups correct without tombstones.
template <typename Value>
class PointerMap {
 public:
  Value* find(const void* key) const {
    if (capacity_ == 0) return nullptr;
    for (std::size_t i = home(key);; i = next(i)) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == nullptr) return nullptr;
    }
  }

  // False when the table cannot grow (host out of memory).
  bool insert(const void* key, const Value& value) {
    if ((size_ + 1) * 2 > capacity_ && !grow()) return false;
    place(Slot{key, value});
    return true;
  }

  void erase(const void* key) {
    std::size_t i = home(key);
    while (slots_[i].key != key) i = next(i);
    slots_[i].key = nullptr;
    --size_;
    for (i = next(i); slots_[i].key != nullptr; i = next(i)) {
      Slot moved = slots_[i];
      slots_[i].key = nullptr;
      --size_;
      place(moved);
    }
  }

  template <typename Fn>
  void for_each(Fn fn) {
    for (std::size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].key != nullptr) fn(slots_[i].value);
    }
  }

  template <typename Fn>
  void for_each_key(Fn fn) {
    for (std::size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].key != nullptr) fn(slots_[i].key, slots_[i].value);
    }
  }

  std::size_t size() const { return size_; }

 private:
  struct Slot {
    const void* key;
    Value value;
  };

  std::size_t home(const void* key) const {
    std::uint64_t h = reinterpret_cast<std::uintptr_t>(key);
    h *= 0x9E3779B97F4A7C15ull;  // spreads the low bits aligned pointers lack
    return (h ^ (h >> 32)) & (capacity_ - 1);
  }
  std::size_t next(std::size_t i) const { return (i + 1) & (capacity_ - 1); }

  void place(const Slot& slot) {
    std::size_t i = home(slot.key);
    while (slots_[i].key != nullptr) i = next(i);
    slots_[i] = slot;
    ++size_;
  }

  bool grow() {
    std::size_t new_capacity = capacity_ == 0 ? 64 : capacity_ * 2;
    Slot* fresh = static_cast<Slot*>(std::calloc(new_capacity, sizeof(Slot)));
    if (fresh == nullptr) return false;
    Slot* old = slots_;
    std::size_t old_capacity = capacity_;
    slots_ = fresh;
    capacity_ = new_capacity;
    size_ = 0;
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != nullptr) place(old[i]);
    }
    std::free(old);
    return true;
  }

  Slot* slots_ = nullptr;
  std::size_t capacity_ = 0;  // zero or a power of two
  std::size_t size_ = 0;
};

struct Allocation {
  int device;
  std::size_t bytes;
  // Memory pools: the pool's handle (0 for cudaMalloc) and the bytes the
  // pool holds for it (more than `bytes` where it reused a larger free).
  std::uintptr_t pool;
  std::size_t chunk;
};

// A memory pool of the stream-ordered allocator.
struct MemPool {
  int device;
  std::size_t reserved;  // its live allocations' chunks and its held frees
  std::size_t high;      // cudaMemPoolAttrReservedMemHigh
  unsigned long long threshold;  // cudaMemPoolAttrReleaseThreshold
  int live;              // allocations not yet freed
  bool destroyed;        // cudaMemPoolDestroy came while allocations lived
};

// What a cudaFreeAsync gave a pool back: reusable at once by an allocation
// on the same stream, by any stream once completed (a synchronize, or
// fakecuda_complete_events), and given back to the device by a synchronize
// or cudaMemPoolTrimTo once completed.
struct HeldFree {
  std::uintptr_t pool;
  std::size_t chunk;
  cudaStream_t stream;
  bool completed;
};

// VMM (driver API): a reserved address range, a physical allocation
// (cuMemCreate) and a mapping of one into the other.
struct Reservation {
  std::uintptr_t start;
  std::size_t bytes;
};

struct PhysicalAllocation {
  int fd;  // memfd holding the bytes
  int device;
  std::size_t bytes;
  int mappings;
  bool released;  // cuMemRelease was called; freed when mappings reach 0
};

struct Mapping {
  std::uintptr_t start;
  std::size_t bytes;
  std::uintptr_t handle;
  bool accessible;  // cuMemSetAccess covered it
};

struct EventState {
  int device;
  cudaStream_t stream;
  bool pending;
  bool timed;     // made without cudaEventDisableTiming
  bool recorded;
  long long ns;   // the device clock when recorded (fake_clock_ns)
};

struct Capture {
  int device;
  cudaStream_t stream;  // nullptr: a free slot
  cudaStreamCaptureStatus status;
};

struct StreamDevice {
  cudaStream_t stream;  // nullptr: a free slot
  int device;
};

// Constant-initialized and never destroyed: other threads (or atexit
// handlers of the program under test) may still call in during exit.
struct State {
  pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
  int device_count = 1;
  std::size_t capacity = kDefaultCapacity;
  std::size_t used[kMaxDevices] = {};
  bool context[kMaxDevices] = {};  // the device's primary context exists
  Capture captures[kMaxCaptures] = {};
  StreamDevice stream_devices[kMaxStreamDevices] = {};
  int failing_mallocs = 0;
  std::uintptr_t events_created = 0;
  long long frozen_clock_ns = -1;  // fakecuda_set_clock_ns; negative: the host's clock
  long long free_wait_ns = 0;      // fakecuda_set_free_wait_ns
  PointerMap<Allocation> allocations;
  PointerMap<EventState> events;
  // Memory pools
  bool pools_supported = true;
  std::uintptr_t pools_created = 0;
  PointerMap<MemPool> pools;        // by handle value
  PointerMap<HeldFree> held_frees;  // by address
  // VMM
  bool vmm_supported = true;
  std::size_t vmm_granularity = kDefaultVmmGranularity;
  int failing_creates = 0;
  std::uintptr_t handles_created = 0;
  PointerMap<Reservation> reservations;    // by start
  PointerMap<PhysicalAllocation> handles;  // by handle value
  PointerMap<Mapping> mappings;            // by start
};

State g_state;
long g_calls[kFunctionCount];  // touched only through __atomic builtins

// Under the lock.
long long fake_clock_ns() {
  if (g_state.frozen_clock_ns >= 0) return g_state.frozen_clock_ns;
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<long long>(now.tv_sec) * 1000000000LL + now.tv_nsec;
}

// Per thread, like the real runtime's current device and last error.
thread_local int t_device = 0;
thread_local cudaError_t t_last_error = cudaSuccess;
// Whether t_device's primary context is current on this thread (what the
// driver's cuCtxGetCurrent reports).
thread_local bool t_context_current = false;

class Lock {
 public:
  Lock() { pthread_mutex_lock(&g_state.mutex); }
  ~Lock() { pthread_mutex_unlock(&g_state.mutex); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;
};

void count_call(Function function) {
  __atomic_fetch_add(&g_calls[function], 1, __ATOMIC_RELAXED);
}

cudaError_t fail(cudaError_t err) {
  t_last_error = err;
  return err;
}

// Whether this thread's current device exists (caller holds the lock).
cudaError_t current_device_error() {
  if (g_state.device_count == 0) return cudaErrorNoDevice;
  if (t_device >= g_state.device_count) return cudaErrorInvalidDevice;
  return cudaSuccess;
}

// A call not permitted during a global-mode capture: fails and invalidates
// every active capture (caller holds the lock).
cudaError_t capture_forbids() {
  bool active = false;
  for (Capture& c : g_state.captures) {
    if (c.stream != nullptr && c.status == cudaStreamCaptureStatusActive) {
      c.status = cudaStreamCaptureStatusInvalidated;
      active = true;
    }
  }
  return active ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

// The device fakecuda_set_stream_device gave `stream`, or -1 (caller holds
// the lock).
int stream_device(cudaStream_t stream) {
  for (const StreamDevice& s : g_state.stream_devices) {
    if (stream != nullptr && s.stream == stream) return s.device;
  }
  return -1;
}

Capture* find_capture(int device, cudaStream_t stream) {
  for (Capture& c : g_state.captures) {
    if (c.stream == stream && c.device == device) return &c;
  }
  return nullptr;
}

// A call that works on the current device: like the real runtime, it
// initializes that device's primary context first (caller holds the lock).
cudaError_t use_current_device() {
  if (cudaError_t err = current_device_error()) return err;
  g_state.context[t_device] = true;
  t_context_current = true;
  return cudaSuccess;
}

cudaEvent_t new_event_handle() {
  std::uintptr_t id = ++g_state.events_created;
  return reinterpret_cast<cudaEvent_t>(kEventHandleBase + id * 16);
}

template <typename Predicate>
void complete_events_where(Predicate matches) {
  g_state.events.for_each([&](EventState& event) {
    if (matches(event)) event.pending = false;
  });
}

bool exceeds_capacity(std::size_t used, std::size_t size) {
  std::size_t capacity = g_state.capacity;
  return used > capacity || size > capacity - used;
}

// Whether `stream` of `device` captures a CUDA graph; for the legacy
// stream 0, whether any stream of the device does (caller holds the lock).
bool captures(int device, cudaStream_t stream) {
  for (const Capture& c : g_state.captures)
    if (c.stream != nullptr && c.device == device && (c.stream == stream || stream == nullptr)) return true;
  return false;
}

MemPool* find_pool(std::uintptr_t handle) { return g_state.pools.find(reinterpret_cast<void*>(handle)); }

// Gives the device the completed frees `pool` holds until it holds at most
// `keep` bytes, as a synchronize (keep = the release threshold) or
// cudaMemPoolTrimTo does (caller holds the lock).
void release_held(std::uintptr_t handle, std::size_t keep) {
  MemPool* pool = find_pool(handle);
  if (pool == nullptr) return;
  while (pool->reserved > keep) {
    void* address = nullptr;
    std::size_t chunk = 0;
    g_state.held_frees.for_each_key([&](const void* key, HeldFree& f) {
      if (address == nullptr && f.pool == handle && f.completed) {
        address = const_cast<void*>(key);
        chunk = f.chunk;
      }
    });
    if (address == nullptr) return;
    g_state.held_frees.erase(address);
    std::free(address);
    pool->reserved -= chunk;
    g_state.used[pool->device] -= chunk;
  }
}

// The frees held for `matches` streams have run: reusable by any stream,
// and given back down to each pool's release threshold (caller holds the
// lock).
template <typename Predicate>
void synchronize_frees_where(Predicate matches) {
  g_state.held_frees.for_each([&](HeldFree& f) {
    if (matches(f)) f.completed = true;
  });
  g_state.pools.for_each_key([](const void* key, MemPool& pool) {
    release_held(reinterpret_cast<std::uintptr_t>(key), pool.threshold);
  });
}

const char* error_string(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess: no error";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue: invalid argument";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation: out of memory";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice: no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice: invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle: invalid resource handle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady: device not ready";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported: operation not permitted when "
             "stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated: operation failed due to a "
             "previous error during capture";
    case cudaErrorStreamCaptureImplicit:
      return "cudaErrorStreamCaptureImplicit: operation would make the legacy "
             "stream depend on a capturing blocking stream";
    default: return "unrecognized error code";
  }
}

}  // namespace

// ---- The CUDA runtime API ------------------------------------------------

FAKECUDA_EXPORT cudaError_t cudaMalloc(void** dev_ptr, std::size_t size) {
  count_call(kMalloc);
  if (dev_ptr == nullptr) return fail(cudaErrorInvalidValue);
  *dev_ptr = nullptr;
  Lock lock;
  if (cudaError_t err = use_current_device()) return fail(err);
  if (cudaError_t err = capture_forbids()) return fail(err);
  if (g_state.failing_mallocs > 0) {
    --g_state.failing_mallocs;
    return fail(cudaErrorMemoryAllocation);
  }
  if (size == 0) return cudaSuccess;
  std::size_t& used = g_state.used[t_device];
  if (exceeds_capacity(used, size)) return fail(cudaErrorMemoryAllocation);
  void* memory = nullptr;
  if (posix_memalign(&memory, kAlignment, size) != 0) {
    return fail(cudaErrorMemoryAllocation);
  }
  if (!g_state.allocations.insert(memory, Allocation{t_device, size, 0, size})) {
    std::free(memory);
    return fail(cudaErrorMemoryAllocation);
  }
  used += size;
  *dev_ptr = memory;
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaFree(void* dev_ptr) {
  count_call(kFree);
  if (dev_ptr == nullptr) return cudaSuccess;
  Lock lock;
  if (cudaError_t err = use_current_device()) return fail(err);
  if (cudaError_t err = capture_forbids()) return fail(err);
  const Allocation* allocation = g_state.allocations.find(dev_ptr);
  if (allocation == nullptr) return fail(cudaErrorInvalidValue);
  // A pool's allocation may be freed by cudaFree (the driver then assumes
  // the device is done with it); dtralloc never does, so the fake refuses.
  if (allocation->pool != 0) return fail(cudaErrorInvalidValue);
  if (g_state.free_wait_ns > 0) {  // the device finishing what was launched before
    const timespec wait{static_cast<time_t>(g_state.free_wait_ns / 1000000000),
                        static_cast<long>(g_state.free_wait_ns % 1000000000)};
    nanosleep(&wait, nullptr);
  }
  g_state.used[allocation->device] -= allocation->bytes;
  g_state.allocations.erase(dev_ptr);
  std::free(dev_ptr);
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaMemGetInfo(std::size_t* free,
                                           std::size_t* total) {
  count_call(kMemGetInfo);
  if (free == nullptr || total == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  if (cudaError_t err = use_current_device()) return fail(err);
  std::size_t used = g_state.used[t_device];
  *total = g_state.capacity;
  *free = used < g_state.capacity ? g_state.capacity - used : 0;
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaGetDevice(int* device) {
  count_call(kGetDevice);
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = t_device;
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaSetDevice(int device) {
  count_call(kSetDevice);
  Lock lock;
  if (g_state.device_count == 0) return fail(cudaErrorNoDevice);
  if (device < 0 || device >= g_state.device_count) {
    return fail(cudaErrorInvalidDevice);
  }
  t_device = device;
  g_state.context[device] = true;  // CUDA 12: cudaSetDevice initializes it
  t_context_current = true;
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaGetDeviceCount(int* count) {
  count_call(kGetDeviceCount);
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  *count = g_state.device_count;
  return *count == 0 ? fail(cudaErrorNoDevice) : cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaDeviceSynchronize() {
  count_call(kDeviceSynchronize);
  Lock lock;
  if (cudaError_t err = use_current_device()) return fail(err);
  if (cudaError_t err = capture_forbids()) return fail(err);
  const int device = t_device;
  complete_events_where(
      [device](const EventState& event) { return event.device == device; });
  synchronize_frees_where([device](const HeldFree& f) {
    const MemPool* pool = find_pool(f.pool);
    return pool != nullptr && pool->device == device;
  });
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  count_call(kStreamSynchronize);
  Lock lock;
  if (cudaError_t err = capture_forbids()) return fail(err);
  // Stream 0 is each device's own default stream.
  const int device = t_device;
  complete_events_where([stream, device](const EventState& event) {
    return event.stream == stream &&
           (stream != nullptr || event.device == device);
  });
  synchronize_frees_where([stream, device](const HeldFree& f) {
    const MemPool* pool = find_pool(f.pool);
    return f.stream == stream && pool != nullptr && (stream != nullptr || pool->device == device);
  });
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaStreamWaitEvent(cudaStream_t /*stream*/,
                                                cudaEvent_t event,
                                                unsigned int /*flags*/) {
  count_call(kStreamWaitEvent);
  Lock lock;
  if (g_state.events.find(event) == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaStreamIsCapturing(
    cudaStream_t stream, cudaStreamCaptureStatus* status) {
  count_call(kStreamIsCapturing);
  if (status == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  if (cudaError_t err = current_device_error()) return fail(err);
  if (stream == nullptr) {  // the legacy stream depends on every blocking one
    for (const Capture& c : g_state.captures) {
      if (c.stream != nullptr && c.device == t_device) {
        return fail(cudaErrorStreamCaptureImplicit);
      }
    }
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  const Capture* capture = find_capture(t_device, stream);
  *status = capture ? capture->status : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event,
                                                     unsigned int flags) {
  count_call(kEventCreateWithFlags);
  if (event == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  if (cudaError_t err = use_current_device()) return fail(err);
  cudaEvent_t handle = new_event_handle();
  if (!g_state.events.insert(handle, EventState{t_device, nullptr, false, (flags & cudaEventDisableTiming) == 0, false, 0})) {
    return fail(cudaErrorMemoryAllocation);
  }
  *event = handle;
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaEventRecord(cudaEvent_t event,
                                            cudaStream_t stream) {
  count_call(kEventRecord);
  Lock lock;
  EventState* state = g_state.events.find(event);
  if (state == nullptr) return fail(cudaErrorInvalidResourceHandle);
  // The default stream of another device cannot record this device's event.
  if (stream == nullptr && state->device != t_device) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  // Nor can a stream placed on another device.
  const int placed = stream_device(stream);
  if (placed >= 0 && placed != state->device) return fail(cudaErrorInvalidResourceHandle);
  g_state.context[state->device] = true;
  state->stream = stream;
  state->pending = true;
  state->recorded = true;
  state->ns = fake_clock_ns();
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaEventQuery(cudaEvent_t event) {
  count_call(kEventQuery);
  Lock lock;
  if (cudaError_t err = capture_forbids()) return fail(err);
  const EventState* state = g_state.events.find(event);
  if (state == nullptr) return fail(cudaErrorInvalidResourceHandle);
  return state->pending ? fail(cudaErrorNotReady) : cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  count_call(kEventSynchronize);
  Lock lock;
  if (cudaError_t err = capture_forbids()) return fail(err);
  EventState* state = g_state.events.find(event);
  if (state == nullptr) return fail(cudaErrorInvalidResourceHandle);
  state->pending = false;
  return cudaSuccess;
}

// The documented answers, in the documented order: an event never recorded
// or made with cudaEventDisableTiming is an invalid handle; one still
// pending is "not ready".
FAKECUDA_EXPORT cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start,
                                                 cudaEvent_t end) {
  count_call(kEventElapsedTime);
  if (ms == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  const EventState* a = g_state.events.find(start);
  const EventState* b = g_state.events.find(end);
  if (a == nullptr || b == nullptr || !a->timed || !b->timed ||
      !a->recorded || !b->recorded) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  if (a->pending || b->pending) return fail(cudaErrorNotReady);
  *ms = static_cast<float>(static_cast<double>(b->ns - a->ns) / 1e6);
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) {
  count_call(kEventDestroy);
  Lock lock;
  if (g_state.events.find(event) == nullptr) {
    return fail(cudaErrorInvalidResourceHandle);
  }
  g_state.events.erase(event);
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaGetLastError() {
  count_call(kGetLastError);
  cudaError_t err = t_last_error;
  t_last_error = cudaSuccess;
  return err;
}

FAKECUDA_EXPORT const char* cudaGetErrorString(cudaError_t error) {
  count_call(kGetErrorString);
  return error_string(error);
}

FAKECUDA_EXPORT cudaError_t cudaRuntimeGetVersion(int* runtime_version) {
  count_call(kRuntimeGetVersion);
  if (runtime_version == nullptr) return fail(cudaErrorInvalidValue);
  *runtime_version = kRuntimeVersion;
  return cudaSuccess;
}

// ---- The stream-ordered allocator (memory pools) ---------------------------

// Answers cudaDevAttrMemoryPoolsSupported (fakecuda_set_memory_pools); any
// other attribute reads 0.
FAKECUDA_EXPORT cudaError_t cudaDeviceGetAttribute(int* value, int attribute, int device) {
  count_call(kRtDeviceGetAttribute);
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  if (g_state.device_count == 0) return fail(cudaErrorNoDevice);
  if (device < 0 || device >= g_state.device_count) return fail(cudaErrorInvalidDevice);
  *value = attribute == cudaDevAttrMemoryPoolsSupported && g_state.pools_supported;
  return cudaSuccess;
}

// Checked as documented: pinned memory on an existing device, no IPC handle
// types (the fake has none); devices without memory pools refuse.
FAKECUDA_EXPORT cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  count_call(kMemPoolCreate);
  if (pool == nullptr || props == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  if (g_state.device_count == 0) return fail(cudaErrorNoDevice);
  if (props->allocType != cudaMemAllocationTypePinned || props->handleTypes != cudaMemHandleTypeNone ||
      props->location.type != cudaMemLocationTypeDevice)
    return fail(cudaErrorInvalidValue);
  if (props->location.id < 0 || props->location.id >= g_state.device_count) return fail(cudaErrorInvalidDevice);
  if (!g_state.pools_supported) return fail(cudaErrorInvalidValue);
  const std::uintptr_t handle = kPoolHandleBase + ++g_state.pools_created * 16;
  if (!g_state.pools.insert(reinterpret_cast<void*>(handle), MemPool{props->location.id, 0, 0, 0, 0, false}))
    return fail(cudaErrorMemoryAllocation);
  *pool = reinterpret_cast<cudaMemPool_t>(handle);
  return cudaSuccess;
}

// With allocations still live the pool goes once the last is freed, as
// documented; what it holds of freed ones goes now.
FAKECUDA_EXPORT cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  count_call(kMemPoolDestroy);
  Lock lock;
  const auto handle = reinterpret_cast<std::uintptr_t>(pool);
  MemPool* state = find_pool(handle);
  if (state == nullptr || state->destroyed) return fail(cudaErrorInvalidValue);
  g_state.held_frees.for_each([&](HeldFree& f) {
    if (f.pool == handle) f.completed = true;
  });
  release_held(handle, 0);
  if (state->live > 0) {
    state->destroyed = true;
  } else {
    g_state.pools.erase(pool);
  }
  return cudaSuccess;
}

FAKECUDA_EXPORT cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, int attribute, void* value) {
  count_call(kMemPoolGetAttribute);
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  const MemPool* state = find_pool(reinterpret_cast<std::uintptr_t>(pool));
  if (state == nullptr || state->destroyed) return fail(cudaErrorInvalidValue);
  auto* out = static_cast<unsigned long long*>(value);
  switch (attribute) {
    case cudaMemPoolAttrReleaseThreshold: *out = state->threshold; return cudaSuccess;
    case cudaMemPoolAttrReservedMemCurrent: *out = state->reserved; return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh: *out = state->high; return cudaSuccess;
    default: return fail(cudaErrorInvalidValue);
  }
}

// The release threshold, or the high watermark (any value resets it to
// the current reserved bytes, as documented).
FAKECUDA_EXPORT cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, int attribute, void* value) {
  count_call(kMemPoolSetAttribute);
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  Lock lock;
  MemPool* state = find_pool(reinterpret_cast<std::uintptr_t>(pool));
  if (state == nullptr || state->destroyed) return fail(cudaErrorInvalidValue);
  switch (attribute) {
    case cudaMemPoolAttrReleaseThreshold: state->threshold = *static_cast<unsigned long long*>(value); return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh: state->high = state->reserved; return cudaSuccess;
    default: return fail(cudaErrorInvalidValue);
  }
}

// Gives back only completed frees: one not yet observed by a synchronize
// counts as outstanding, as documented.
FAKECUDA_EXPORT cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, std::size_t min_bytes_to_keep) {
  count_call(kMemPoolTrimTo);
  Lock lock;
  const auto handle = reinterpret_cast<std::uintptr_t>(pool);
  const MemPool* state = find_pool(handle);
  if (state == nullptr || state->destroyed) return fail(cudaErrorInvalidValue);
  release_held(handle, min_bytes_to_keep);
  return cudaSuccess;
}

// Reuses the smallest held free of the pool that fits and that this stream
// may take (freed on it, or completed); otherwise new memory, past the
// device's capacity only after giving back completed frees. Never waits.
// A capturing stream (or any, for the legacy stream 0, while one captures)
// is refused: on a GPU the allocation would become a node of the graph,
// which dtralloc must never ask for.
FAKECUDA_EXPORT cudaError_t cudaMallocFromPoolAsync(void** ptr, std::size_t size, cudaMemPool_t pool,
                                                    cudaStream_t stream) {
  count_call(kMallocFromPoolAsync);
  if (ptr == nullptr) return fail(cudaErrorInvalidValue);
  *ptr = nullptr;
  Lock lock;
  const auto handle = reinterpret_cast<std::uintptr_t>(pool);
  MemPool* state = find_pool(handle);
  if (state == nullptr || state->destroyed) return fail(cudaErrorInvalidValue);
  if (captures(state->device, stream)) return fail(cudaErrorStreamCaptureUnsupported);
  if (size == 0) return cudaSuccess;
  void* reuse = nullptr;
  std::size_t chunk = 0;
  g_state.held_frees.for_each_key([&](const void* key, HeldFree& f) {
    if (f.pool != handle || f.chunk < size || !(f.stream == stream || f.completed)) return;
    if (reuse == nullptr || f.chunk < chunk) {
      reuse = const_cast<void*>(key);
      chunk = f.chunk;
    }
  });
  if (reuse != nullptr) {
    g_state.held_frees.erase(reuse);
    if (!g_state.allocations.insert(reuse, Allocation{state->device, size, handle, chunk})) {
      std::free(reuse);
      state->reserved -= chunk;
      g_state.used[state->device] -= chunk;
      return fail(cudaErrorMemoryAllocation);
    }
    ++state->live;
    *ptr = reuse;
    return cudaSuccess;
  }
  std::size_t& used = g_state.used[state->device];
  if (exceeds_capacity(used, size)) release_held(handle, 0);
  if (exceeds_capacity(used, size)) return fail(cudaErrorMemoryAllocation);
  void* memory = nullptr;
  if (posix_memalign(&memory, kAlignment, size) != 0) return fail(cudaErrorMemoryAllocation);
  if (!g_state.allocations.insert(memory, Allocation{state->device, size, handle, size})) {
    std::free(memory);
    return fail(cudaErrorMemoryAllocation);
  }
  used += size;
  state->reserved += size;
  if (state->reserved > state->high) state->high = state->reserved;
  ++state->live;
  *ptr = memory;
  return cudaSuccess;
}

// Pool allocations only (a cudaMalloc'd pointer would be legal on a GPU;
// dtralloc never frees one this way, so the fake refuses it). The memory
// stays with the pool (HeldFree) and the call never waits.
FAKECUDA_EXPORT cudaError_t cudaFreeAsync(void* dev_ptr, cudaStream_t stream) {
  count_call(kFreeAsync);
  if (dev_ptr == nullptr) return cudaSuccess;
  Lock lock;
  const Allocation* allocation = g_state.allocations.find(dev_ptr);
  if (allocation == nullptr || allocation->pool == 0) return fail(cudaErrorInvalidValue);
  const std::uintptr_t handle = allocation->pool;
  const std::size_t chunk = allocation->chunk;
  MemPool* state = find_pool(handle);
  if (captures(state->device, stream)) return fail(cudaErrorStreamCaptureUnsupported);
  g_state.allocations.erase(dev_ptr);
  --state->live;
  if (state->destroyed) {  // its last allocations take the pool with them
    std::free(dev_ptr);
    state->reserved -= chunk;
    g_state.used[state->device] -= chunk;
    if (state->live == 0) g_state.pools.erase(reinterpret_cast<void*>(handle));
    return cudaSuccess;
  }
  if (!g_state.held_frees.insert(dev_ptr, HeldFree{handle, chunk, stream, false})) {
    std::free(dev_ptr);  // the fake's own table is full: give it back at once
    state->reserved -= chunk;
    g_state.used[state->device] -= chunk;
  }
  return cudaSuccess;
}

// ---- The driver API function dtralloc uses ---------------------------------

// CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags,
// int* active) (cuda.h). CUdevice is the device ordinal; CUresult codes:
// CUDA_SUCCESS 0, CUDA_ERROR_INVALID_VALUE 1, CUDA_ERROR_INVALID_DEVICE 101.
// It creates no context, as on a real driver.
FAKECUDA_EXPORT int cuDevicePrimaryCtxGetState(int dev, unsigned int* flags,
                                               int* active) {
  count_call(kDevicePrimaryCtxGetState);
  if (flags == nullptr || active == nullptr) return 1;
  Lock lock;
  if (dev < 0 || dev >= g_state.device_count) return 101;
  *flags = 0;
  *active = g_state.context[dev] ? 1 : 0;
  return 0;
}

// ---- The driver API's virtual memory management (VMM segments) ------------
//
// Signatures as in cuda.h: CUresult is an int, CUdevice the device ordinal,
// CUdeviceptr and CUmemGenericAllocationHandle unsigned long long.

namespace {

using dtralloc::cudrv::CUmemAccessDesc;
using dtralloc::cudrv::CUmemAllocationProp;
namespace drv = dtralloc::cudrv;

// Checks every VMM call makes first (caller holds the lock).
int vmm_call_error() {
  if (g_state.device_count == 0) return drv::CUDA_ERROR_NOT_INITIALIZED;
  if (!t_context_current) return drv::CUDA_ERROR_INVALID_CONTEXT;
  return drv::CUDA_SUCCESS;
}

bool valid_device_location(const dtralloc::cudrv::CUmemLocation& location) {
  return location.type == drv::CU_MEM_LOCATION_TYPE_DEVICE && location.id >= 0 &&
         location.id < g_state.device_count;
}

bool granular(std::uintptr_t value) { return value % g_state.vmm_granularity == 0; }

const Reservation* reservation_holding(std::uintptr_t start, std::size_t bytes) {
  const Reservation* found = nullptr;
  g_state.reservations.for_each([&](Reservation& r) {
    if (start >= r.start && bytes <= r.bytes && start - r.start <= r.bytes - bytes) found = &r;
  });
  return found;
}

// Bytes of [start, start + bytes) that mappings (only accessible ones, if
// `accessible_only`) cover.
std::size_t mapped_bytes_in(std::uintptr_t start, std::size_t bytes, bool accessible_only = false) {
  std::size_t covered = 0;
  g_state.mappings.for_each([&](Mapping& m) {
    if (accessible_only && !m.accessible) return;
    const std::uintptr_t lo = m.start > start ? m.start : start;
    const std::uintptr_t hi = m.start + m.bytes < start + bytes ? m.start + m.bytes : start + bytes;
    if (lo < hi) covered += hi - lo;
  });
  return covered;
}

void free_physical_if_done(std::uintptr_t handle) {
  PhysicalAllocation* physical = g_state.handles.find(reinterpret_cast<void*>(handle));
  if (physical == nullptr || !physical->released || physical->mappings > 0) return;
  close(physical->fd);
  g_state.used[physical->device] -= physical->bytes;
  g_state.handles.erase(reinterpret_cast<void*>(handle));
}

// Turns [start, start + bytes) back into inaccessible reserved address space.
bool reserve_again(std::uintptr_t start, std::size_t bytes) {
  void* got = mmap(reinterpret_cast<void*>(start), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  return got != MAP_FAILED;
}

}  // namespace

FAKECUDA_EXPORT int cuDeviceGet(int* device, int ordinal) {
  count_call(kDeviceGet);
  if (device == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  if (ordinal < 0 || ordinal >= g_state.device_count) return drv::CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return drv::CUDA_SUCCESS;
}

// Answers CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
// (fakecuda_set_vmm); any other attribute reads 0.
FAKECUDA_EXPORT int cuDeviceGetAttribute(int* value, int attribute, int device) {
  count_call(kDeviceGetAttribute);
  if (value == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  if (device < 0 || device >= g_state.device_count) return drv::CUDA_ERROR_INVALID_DEVICE;
  *value = attribute == drv::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED && g_state.vmm_supported;
  return drv::CUDA_SUCCESS;
}

// The context is a number naming the device, never dereferenced.
FAKECUDA_EXPORT int cuCtxGetCurrent(drv::CUcontext* context) {
  count_call(kCtxGetCurrent);
  if (context == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  *context = t_context_current ? reinterpret_cast<drv::CUcontext>(std::uintptr_t(t_device) + 1) : nullptr;
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemGetAllocationGranularity(std::size_t* granularity, const CUmemAllocationProp* prop,
                                                  int /*option*/) {
  count_call(kMemGetAllocationGranularity);
  if (granularity == nullptr || prop == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  if (!g_state.vmm_supported) return drv::CUDA_ERROR_NOT_SUPPORTED;
  if (!valid_device_location(prop->location)) return drv::CUDA_ERROR_INVALID_DEVICE;
  *granularity = g_state.vmm_granularity;
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemAddressReserve(drv::CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                                        drv::CUdeviceptr /*addr*/, unsigned long long flags) {
  count_call(kMemAddressReserve);
  if (ptr == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  *ptr = 0;
  Lock lock;
  if (int err = vmm_call_error()) return err;
  if (!g_state.vmm_supported) return drv::CUDA_ERROR_NOT_SUPPORTED;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (size == 0 || size % page != 0 || flags != 0 || (alignment & (alignment - 1)) != 0)
    return drv::CUDA_ERROR_INVALID_VALUE;
  if (alignment < page) alignment = page;
  // Over-reserve, then trim to the alignment asked for.
  void* raw = mmap(nullptr, size + alignment, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return drv::CUDA_ERROR_OUT_OF_MEMORY;
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (base + alignment - 1) / alignment * alignment;
  if (start > base) munmap(raw, start - base);
  if (base + alignment > start) munmap(reinterpret_cast<void*>(start + size), base + alignment - start);
  if (!g_state.reservations.insert(reinterpret_cast<void*>(start), Reservation{start, size})) {
    munmap(reinterpret_cast<void*>(start), size);
    return drv::CUDA_ERROR_OUT_OF_MEMORY;
  }
  *ptr = start;
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemAddressFree(drv::CUdeviceptr ptr, std::size_t size) {
  count_call(kMemAddressFree);
  Lock lock;
  if (int err = vmm_call_error()) return err;
  const Reservation* reservation = g_state.reservations.find(reinterpret_cast<void*>(ptr));
  if (reservation == nullptr || reservation->bytes != size) return drv::CUDA_ERROR_INVALID_VALUE;
  if (mapped_bytes_in(ptr, size) != 0) return drv::CUDA_ERROR_INVALID_VALUE;
  munmap(reinterpret_cast<void*>(ptr), size);
  g_state.reservations.erase(reinterpret_cast<void*>(ptr));
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemCreate(drv::CUmemGenericAllocationHandle* handle, std::size_t size,
                                const CUmemAllocationProp* prop, unsigned long long flags) {
  count_call(kMemCreate);
  if (handle == nullptr || prop == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  if (int err = vmm_call_error()) return err;
  if (!g_state.vmm_supported) return drv::CUDA_ERROR_NOT_SUPPORTED;
  if (prop->type != drv::CU_MEM_ALLOCATION_TYPE_PINNED || flags != 0 || size == 0 || !granular(size))
    return drv::CUDA_ERROR_INVALID_VALUE;
  if (!valid_device_location(prop->location)) return drv::CUDA_ERROR_INVALID_DEVICE;
  if (g_state.failing_creates > 0) {
    --g_state.failing_creates;
    return drv::CUDA_ERROR_OUT_OF_MEMORY;
  }
  const int device = prop->location.id;
  if (exceeds_capacity(g_state.used[device], size)) return drv::CUDA_ERROR_OUT_OF_MEMORY;
  const int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0) return drv::CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return drv::CUDA_ERROR_OUT_OF_MEMORY;
  }
  const std::uintptr_t id = kMemHandleBase + ++g_state.handles_created * 16;
  if (!g_state.handles.insert(reinterpret_cast<void*>(id), PhysicalAllocation{fd, device, size, 0, false})) {
    close(fd);
    return drv::CUDA_ERROR_OUT_OF_MEMORY;
  }
  g_state.used[device] += size;
  *handle = id;
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemRelease(drv::CUmemGenericAllocationHandle handle) {
  count_call(kMemRelease);
  Lock lock;
  if (int err = vmm_call_error()) return err;
  PhysicalAllocation* physical = g_state.handles.find(reinterpret_cast<void*>(handle));
  if (physical == nullptr || physical->released) return drv::CUDA_ERROR_INVALID_VALUE;
  physical->released = true;
  free_physical_if_done(handle);
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemMap(drv::CUdeviceptr ptr, std::size_t size, std::size_t offset,
                             drv::CUmemGenericAllocationHandle handle, unsigned long long flags) {
  count_call(kMemMap);
  Lock lock;
  if (int err = vmm_call_error()) return err;
  PhysicalAllocation* physical = g_state.handles.find(reinterpret_cast<void*>(handle));
  if (physical == nullptr || physical->released || offset != 0 || flags != 0 || size == 0 ||
      !granular(ptr) || !granular(size) || size > physical->bytes)
    return drv::CUDA_ERROR_INVALID_VALUE;
  if (reservation_holding(ptr, size) == nullptr || mapped_bytes_in(ptr, size) != 0)
    return drv::CUDA_ERROR_INVALID_VALUE;
  void* got = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, physical->fd, 0);
  if (got == MAP_FAILED) return drv::CUDA_ERROR_OUT_OF_MEMORY;
  if (!g_state.mappings.insert(reinterpret_cast<void*>(ptr), Mapping{ptr, size, handle, false})) {
    reserve_again(ptr, size);
    return drv::CUDA_ERROR_OUT_OF_MEMORY;
  }
  ++physical->mappings;
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemUnmap(drv::CUdeviceptr ptr, std::size_t size) {
  count_call(kMemUnmap);
  Lock lock;
  if (int err = vmm_call_error()) return err;
  Mapping* mapping = g_state.mappings.find(reinterpret_cast<void*>(ptr));
  if (mapping == nullptr || mapping->bytes != size) return drv::CUDA_ERROR_INVALID_VALUE;
  const std::uintptr_t handle = mapping->handle;
  if (!reserve_again(ptr, size)) return drv::CUDA_ERROR_INVALID_VALUE;
  g_state.mappings.erase(reinterpret_cast<void*>(ptr));
  --g_state.handles.find(reinterpret_cast<void*>(handle))->mappings;
  free_physical_if_done(handle);
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuMemSetAccess(drv::CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc,
                                   std::size_t count) {
  count_call(kMemSetAccess);
  if (desc == nullptr || count == 0) return drv::CUDA_ERROR_INVALID_VALUE;
  Lock lock;
  if (int err = vmm_call_error()) return err;
  for (std::size_t i = 0; i < count; ++i) {
    if (!valid_device_location(desc[i].location)) return drv::CUDA_ERROR_INVALID_DEVICE;
    if (desc[i].flags != drv::CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return drv::CUDA_ERROR_INVALID_VALUE;
  }
  if (size == 0 || mapped_bytes_in(ptr, size) != size) return drv::CUDA_ERROR_INVALID_VALUE;
  if (mprotect(reinterpret_cast<void*>(ptr), size, PROT_READ | PROT_WRITE) != 0) return drv::CUDA_ERROR_INVALID_VALUE;
  g_state.mappings.for_each([&](Mapping& m) {
    if (m.start >= ptr && m.start < ptr + size) m.accessible = true;
  });
  return drv::CUDA_SUCCESS;
}

FAKECUDA_EXPORT int cuGetErrorString(int error, const char** text) {
  count_call(kDriverGetErrorString);
  if (text == nullptr) return drv::CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case drv::CUDA_SUCCESS: *text = "no error"; break;
    case drv::CUDA_ERROR_INVALID_VALUE: *text = "invalid argument"; break;
    case drv::CUDA_ERROR_OUT_OF_MEMORY: *text = "out of memory"; break;
    case drv::CUDA_ERROR_NOT_INITIALIZED: *text = "initialization error"; break;
    case drv::CUDA_ERROR_INVALID_DEVICE: *text = "invalid device ordinal"; break;
    case drv::CUDA_ERROR_INVALID_CONTEXT: *text = "invalid device context"; break;
    case drv::CUDA_ERROR_NOT_SUPPORTED: *text = "operation not supported"; break;
    default: *text = nullptr; return drv::CUDA_ERROR_INVALID_VALUE;
  }
  return drv::CUDA_SUCCESS;
}

// ---- Controls for tests --------------------------------------------------

// Whether devices support VMM (CU_DEVICE_ATTRIBUTE_..._SUPPORTED; when not,
// the VMM calls fail with CUDA_ERROR_NOT_SUPPORTED), and the granularity
// cuMemGetAllocationGranularity reports (a power of two).
FAKECUDA_EXPORT void fakecuda_set_vmm(int supported, std::size_t granularity) {
  Lock lock;
  g_state.vmm_supported = supported != 0;
  g_state.vmm_granularity = granularity;
}

// Whether devices support memory pools (cudaDevAttrMemoryPoolsSupported;
// when not, cudaMemPoolCreate fails with cudaErrorInvalidValue).
FAKECUDA_EXPORT void fakecuda_set_memory_pools(int supported) {
  Lock lock;
  g_state.pools_supported = supported != 0;
}

// Memory pools, for leak checks: "pools" (created, not gone), "held" (freed
// allocations a pool still holds); -1 for other names.
FAKECUDA_EXPORT int fakecuda_pool_live(const char* what) {
  if (what == nullptr) return -1;
  Lock lock;
  if (std::strcmp(what, "pools") == 0) return static_cast<int>(g_state.pools.size());
  if (std::strcmp(what, "held") == 0) return static_cast<int>(g_state.held_frees.size());
  return -1;
}

// The next `n` cuMemCreate calls fail with CUDA_ERROR_OUT_OF_MEMORY.
FAKECUDA_EXPORT void fakecuda_fail_next_mem_creates(int n) {
  Lock lock;
  g_state.failing_creates = n > 0 ? n : 0;
}

// Live VMM objects, for leak checks: "reservations", "handles" (created and
// not yet freed, released or not) or "mappings"; -1 for other names.
FAKECUDA_EXPORT int fakecuda_vmm_live(const char* what) {
  if (what == nullptr) return -1;
  Lock lock;
  if (std::strcmp(what, "reservations") == 0) return static_cast<int>(g_state.reservations.size());
  if (std::strcmp(what, "handles") == 0) return static_cast<int>(g_state.handles.size());
  if (std::strcmp(what, "mappings") == 0) return static_cast<int>(g_state.mappings.size());
  return -1;
}

// 1 when every byte of [ptr, ptr + size) is mapped and accessible, as a
// kernel would need; 0 otherwise.
FAKECUDA_EXPORT int fakecuda_vmm_accessible(std::uintptr_t ptr, std::size_t size) {
  Lock lock;
  return mapped_bytes_in(ptr, size, true) == size ? 1 : 0;
}

// Clamped to 0..16. Devices keep their used bytes across changes.
FAKECUDA_EXPORT void fakecuda_set_device_count(int count) {
  Lock lock;
  if (count < 0) count = 0;
  if (count > kMaxDevices) count = kMaxDevices;
  g_state.device_count = count;
}

// Capacity of every device. Lowering it below what is in use only makes the
// next cudaMalloc or cuMemCreate fail; nothing is taken away.
FAKECUDA_EXPORT void fakecuda_set_capacity(std::size_t bytes) {
  Lock lock;
  g_state.capacity = bytes;
}

FAKECUDA_EXPORT void fakecuda_fail_next_mallocs(int n) {
  Lock lock;
  g_state.failing_mallocs = n > 0 ? n : 0;
}

// Calls of a runtime function since the last reset; -1 for unknown names.
FAKECUDA_EXPORT long fakecuda_call_count(const char* function_name) {
  if (function_name == nullptr) return -1;
  for (int i = 0; i < kFunctionCount; ++i) {
    if (std::strcmp(kFunctionNames[i], function_name) == 0) {
      return __atomic_load_n(&g_calls[i], __ATOMIC_RELAXED);
    }
  }
  return -1;
}

// Marks `stream` (not 0) of the calling thread's current device as capturing
// (status 1), invalidated (2) or not capturing (0), as cudaStreamBeginCapture,
// an illegal call and cudaStreamEndCapture would. Returns 0, or -1 when the
// stream is 0 or more than 16 streams would capture at once.
FAKECUDA_EXPORT int fakecuda_set_stream_capture(void* stream, int status) {
  if (stream == nullptr) return -1;
  Lock lock;
  auto* handle = static_cast<cudaStream_t>(stream);
  Capture* capture = find_capture(t_device, handle);
  if (status == cudaStreamCaptureStatusNone) {
    if (capture != nullptr) capture->stream = nullptr;
    return 0;
  }
  for (Capture& c : g_state.captures) {
    if (capture == nullptr && c.stream == nullptr) capture = &c;
  }
  if (capture == nullptr) return -1;
  *capture = Capture{t_device, handle, status};
  return 0;
}

// Places `stream` (not 0) on `device`, as cudaStreamCreate with that device
// current would: an event of another device can no longer be recorded on it.
// A negative device forgets the stream. Returns 0, or -1 when the stream is
// 0, the device does not exist, or 16 streams are placed already.
FAKECUDA_EXPORT int fakecuda_set_stream_device(void* stream, int device) {
  if (stream == nullptr) return -1;
  Lock lock;
  auto* handle = static_cast<cudaStream_t>(stream);
  StreamDevice* slot = nullptr;
  for (StreamDevice& s : g_state.stream_devices) {
    if (s.stream == handle) slot = &s;
  }
  if (device < 0) {
    if (slot != nullptr) slot->stream = nullptr;
    return 0;
  }
  if (device >= g_state.device_count) return -1;
  for (StreamDevice& s : g_state.stream_devices) {
    if (slot == nullptr && s.stream == nullptr) slot = &s;
  }
  if (slot == nullptr) return -1;
  *slot = StreamDevice{handle, device};
  return 0;
}

// The fake device's clock, which timing events read when recorded (the fake
// runs work as it is enqueued): `ns` >= 0 freezes it there, so a test sets
// exact times; negative lets it follow the host's monotonic clock again.
FAKECUDA_EXPORT void fakecuda_set_clock_ns(long long ns) {
  Lock lock;
  g_state.frozen_clock_ns = ns;
}

FAKECUDA_EXPORT void fakecuda_set_free_wait_ns(long long ns) {
  Lock lock;
  g_state.free_wait_ns = ns;
}

// Everything enqueued has run: events complete, and frees held by pools
// become reusable by any stream (they go back to the device at the next
// synchronize, as on a GPU).
FAKECUDA_EXPORT void fakecuda_complete_events() {
  Lock lock;
  complete_events_where([](const EventState&) { return true; });
  g_state.held_frees.for_each([](HeldFree& f) { f.completed = true; });
}

// Back to the defaults, except that live allocations, events and VMM objects
// stay valid: they belong to the code under test (fakecuda_live_allocations
// and fakecuda_vmm_live show them). No device has a context afterwards.
// Current device, current context and last error are reset for the calling
// thread only.
FAKECUDA_EXPORT void fakecuda_reset() {
  for (long& calls : g_calls) __atomic_store_n(&calls, 0, __ATOMIC_RELAXED);
  Lock lock;
  g_state.device_count = 1;
  g_state.capacity = kDefaultCapacity;
  g_state.failing_mallocs = 0;
  g_state.failing_creates = 0;
  g_state.vmm_supported = true;
  g_state.vmm_granularity = kDefaultVmmGranularity;
  g_state.pools_supported = true;
  g_state.frozen_clock_ns = -1;
  g_state.free_wait_ns = 0;
  for (bool& context : g_state.context) context = false;
  t_context_current = false;
  for (Capture& capture : g_state.captures) capture.stream = nullptr;
  for (StreamDevice& s : g_state.stream_devices) s.stream = nullptr;
  complete_events_where([](const EventState&) { return true; });
  t_device = 0;
  t_last_error = cudaSuccess;
}

FAKECUDA_EXPORT int fakecuda_live_allocations() {
  Lock lock;
  return static_cast<int>(g_state.allocations.size());
}

// Events created and not yet destroyed, for leak checks.
FAKECUDA_EXPORT int fakecuda_live_events() {
  Lock lock;
  return static_cast<int>(g_state.events.size());
}

// 0 for a device index out of range.
FAKECUDA_EXPORT std::size_t fakecuda_used_bytes(int device) {
  Lock lock;
  if (device < 0 || device >= kMaxDevices) return 0;
  return g_state.used[device];
}
