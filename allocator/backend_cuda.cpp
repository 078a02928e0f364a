// The cuda backend: segments of device memory and stream events from a CUDA
// runtime that is found at run time, so that building dtralloc needs no CUDA
// toolkit and dtralloc shares whichever runtime torch or cupy already loaded.
//
// The runtime is searched for once per process, under a mutex, in this order:
//   (a) DTRALLOC_CUDART=/path/lib.so when set: exactly that file. Failing to
//       load it is an error, never a fallback, because the user asked for it
//       (tests point it at the fake runtime and must not get a real one).
//   (b) a runtime already loaded in the process, by torch or cupy:
//       dlopen(RTLD_NOLOAD) of libcudart.so.13, libcudart.so.12, libcudart.so.
//       Using their copy keeps one runtime, one version and one per-thread
//       "last error" in the process.
//   (c) the loader's usual search: dlopen of libcudart.so.13, then
//       libcudart.so.12, then libcudart.so.
// In (b) and (c) the major version set by prefer_cuda_runtime_major (the one
// the torch in the process was built against; dtralloc.install() sets it)
// goes first: a CUDA 12 torch whose runtime is not loaded yet must not get a
// libcudart.so.13 that happens to be on the search path.
// A successful load is kept for the life of the process (never dlclosed). A
// failed one is not remembered, so a later call, say after `import torch`,
// searches again.
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator.h"  // GraphCaptureError, graph_capture_refusal
#include "backend.h"
#include "config.h"
#include "cudart_api.h"
#include "range_ledger.h"

namespace dtralloc {
namespace {

using namespace cudart;

constexpr const char* kSonames[] = {"libcudart.so.13", "libcudart.so.12",
                                    "libcudart.so"};

// 0 for none; read when the search runs.
std::atomic<int> g_preferred_major{0};

// kSonames with the preferred major's soname moved to the front.
std::vector<std::string> search_order() {
  std::vector<std::string> order(std::begin(kSonames), std::end(kSonames));
  const int major = g_preferred_major.load();
  if (major > 0) {
    const std::string preferred = "libcudart.so." + std::to_string(major);
    auto it = std::find(order.begin(), order.end(), preferred);
    if (it != order.end()) order.erase(it);
    order.insert(order.begin(), preferred);
  }
  return order;
}

std::string tried_list() {
  std::string out;
  for (const std::string& soname : search_order()) out += (out.empty() ? "" : ", ") + soname;
  return out;
}

struct LoadedRuntime {
  std::string path;
  CudaRuntimeApi api{};
};

// A mutex and an atomic rather than std::call_once: a failed search must be
// retryable, and with glibc a std::call_once whose callable threw can hang the
// next caller (GCC bug 66146).
std::mutex g_load_mutex;
// Published once, read without the mutex afterwards; never freed because
// backends and other threads may use the table until the process exits.
std::atomic<const LoadedRuntime*> g_runtime{nullptr};

std::string last_dl_error() {
  const char* message = dlerror();
  return message ? message : "unknown loader error";
}

// (a) The override. Returns nullptr when the variable is unset or empty.
void* open_from_env(std::string& name) {
  const char* path = std::getenv("DTRALLOC_CUDART");
  if (path == nullptr || *path == '\0') return nullptr;
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    throw std::runtime_error(
        std::string("dtralloc: DTRALLOC_CUDART=") + path +
        " could not be loaded: " + last_dl_error() +
        ". Point DTRALLOC_CUDART at a CUDA runtime library "
        "(libcudart.so) or unset it to search the default locations.");
  }
  name = path;
  return handle;
}

// (b) A runtime someone else already loaded; RTLD_NOLOAD never loads a file.
void* open_already_loaded(std::string& name) {
  for (const std::string& soname : search_order()) {
    if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      name = soname;
      return handle;
    }
  }
  dlerror();  // the misses above are expected; do not leave them pending
  return nullptr;
}

// (c) The loader's search path. Loader messages other than "not found" are
// kept for the error, since they explain a runtime that exists but is broken
// (wrong architecture, missing dependency).
void* open_by_soname(std::string& name) {
  std::string broken;
  for (const std::string& soname : search_order()) {
    if (void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      name = soname;
      return handle;
    }
    std::string message = last_dl_error();
    if (message.find("No such file") == std::string::npos) {
      broken += "; " + message;
    }
  }
  throw std::runtime_error(
      std::string("dtralloc: no CUDA runtime found (tried ") + tried_list() +
      broken +
      "). Install the CUDA runtime, import torch/cupy first, or set "
      "DTRALLOC_CUDART=/path/to/libcudart.so");
}

void* open_runtime(std::string& name) {
  if (void* handle = open_from_env(name)) return handle;
  if (void* handle = open_already_loaded(name)) return handle;
  return open_by_soname(name);
}

// The file the loader actually mapped, which for a soname is a full path.
std::string loaded_path(void* handle, const std::string& requested) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr &&
      map->l_name != nullptr && map->l_name[0] != '\0') {
    return map->l_name;
  }
  return requested;
}

template <typename Fn>
void resolve(void* handle, const char* symbol, const std::string& library,
             Fn*& slot) {
  dlerror();
  void* address = dlsym(handle, symbol);
  if (address == nullptr) {
    throw std::runtime_error(
        std::string("dtralloc: the library ") + library + " has no symbol " +
        symbol + " (" + last_dl_error() +
        "), so it is not a usable CUDA runtime. Point DTRALLOC_CUDART at "
        "libcudart.so (CUDA 12 or newer) or unset it.");
  }
  slot = reinterpret_cast<Fn*>(address);
}

template <typename Fn>
void resolve_optional(void* handle, const char* symbol, Fn*& slot) {
  slot = handle ? reinterpret_cast<Fn*>(dlsym(handle, symbol)) : nullptr;
}

void resolve_all(void* handle, const std::string& library,
                 CudaRuntimeApi& api) {
  resolve(handle, "cudaMalloc", library, api.Malloc);
  resolve(handle, "cudaFree", library, api.Free);
  resolve(handle, "cudaMemGetInfo", library, api.MemGetInfo);
  resolve(handle, "cudaGetDevice", library, api.GetDevice);
  resolve(handle, "cudaSetDevice", library, api.SetDevice);
  resolve(handle, "cudaGetDeviceCount", library, api.GetDeviceCount);
  resolve(handle, "cudaDeviceSynchronize", library, api.DeviceSynchronize);
  resolve(handle, "cudaStreamSynchronize", library, api.StreamSynchronize);
  resolve(handle, "cudaStreamWaitEvent", library, api.StreamWaitEvent);
  resolve(handle, "cudaStreamIsCapturing", library, api.StreamIsCapturing);
  resolve(handle, "cudaEventCreateWithFlags", library,
          api.EventCreateWithFlags);
  resolve(handle, "cudaEventRecord", library, api.EventRecord);
  resolve(handle, "cudaEventQuery", library, api.EventQuery);
  resolve(handle, "cudaEventSynchronize", library, api.EventSynchronize);
  resolve(handle, "cudaEventDestroy", library, api.EventDestroy);
  resolve(handle, "cudaEventElapsedTime", library, api.EventElapsedTime);
  resolve(handle, "cudaGetLastError", library, api.GetLastError);
  resolve(handle, "cudaGetErrorString", library, api.GetErrorString);
  resolve(handle, "cudaRuntimeGetVersion", library, api.RuntimeGetVersion);
  // The stream-ordered allocator: optional, all or none (async_segments).
  CudaRuntimeApi::PoolApi& pools = api.pools;
  resolve_optional(handle, "cudaDeviceGetAttribute", pools.DeviceGetAttribute);
  resolve_optional(handle, "cudaMemPoolCreate", pools.MemPoolCreate);
  resolve_optional(handle, "cudaMemPoolDestroy", pools.MemPoolDestroy);
  resolve_optional(handle, "cudaMemPoolGetAttribute", pools.MemPoolGetAttribute);
  resolve_optional(handle, "cudaMemPoolSetAttribute", pools.MemPoolSetAttribute);
  resolve_optional(handle, "cudaMemPoolTrimTo", pools.MemPoolTrimTo);
  resolve_optional(handle, "cudaMallocFromPoolAsync", pools.MallocFromPoolAsync);
  resolve_optional(handle, "cudaFreeAsync", pools.FreeAsync);
  if (!pools.complete()) pools = CudaRuntimeApi::PoolApi{};
  dlerror();  // a miss above is an answer, not an error
}

// The driver's cuDevicePrimaryCtxGetState: from the runtime library itself
// when it exports it (the fake does; a real libcudart does not), else from
// libcuda.so.1, which a working runtime has already loaded. Optional: without
// it DeviceGuard restores the caller's device unconditionally.
//
// The VMM functions (CudaRuntimeApi::VmmApi) come from the same library as
// cuDevicePrimaryCtxGetState, all of them or none.
void resolve_driver(void* runtime_handle, CudaRuntimeApi& api) {
  void* source = runtime_handle;
  if (dlsym(runtime_handle, "cuDevicePrimaryCtxGetState") == nullptr) {
    source = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (source == nullptr) source = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // kept open for good
  }
  resolve_optional(source, "cuDevicePrimaryCtxGetState", api.DevicePrimaryCtxGetState);
  CudaRuntimeApi::VmmApi& vmm = api.vmm;
  resolve_optional(source, "cuDeviceGet", vmm.DeviceGet);
  resolve_optional(source, "cuDeviceGetAttribute", vmm.DeviceGetAttribute);
  resolve_optional(source, "cuCtxGetCurrent", vmm.CtxGetCurrent);
  resolve_optional(source, "cuMemGetAllocationGranularity", vmm.MemGetAllocationGranularity);
  resolve_optional(source, "cuMemAddressReserve", vmm.MemAddressReserve);
  resolve_optional(source, "cuMemAddressFree", vmm.MemAddressFree);
  resolve_optional(source, "cuMemCreate", vmm.MemCreate);
  resolve_optional(source, "cuMemRelease", vmm.MemRelease);
  resolve_optional(source, "cuMemMap", vmm.MemMap);
  resolve_optional(source, "cuMemUnmap", vmm.MemUnmap);
  resolve_optional(source, "cuMemSetAccess", vmm.MemSetAccess);
  resolve_optional(source, "cuGetErrorString", vmm.GetErrorString);
  if (!vmm.complete()) vmm = CudaRuntimeApi::VmmApi{};
  dlerror();  // a miss above is an answer, not an error
}

const LoadedRuntime& load_runtime() {
  if (const LoadedRuntime* loaded = g_runtime.load(std::memory_order_acquire)) {
    return *loaded;
  }
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (const LoadedRuntime* loaded = g_runtime.load(std::memory_order_acquire)) {
    return *loaded;
  }
  std::string requested;
  void* handle = open_runtime(requested);
  auto runtime = std::make_unique<LoadedRuntime>();
  runtime->path = loaded_path(handle, requested);
  try {
    resolve_all(handle, runtime->path, runtime->api);
    resolve_driver(handle, runtime->api);
  } catch (...) {
    dlclose(handle);
    throw;
  }
  g_runtime.store(runtime.get(), std::memory_order_release);
  return *runtime.release();
}

std::string describe(const CudaRuntimeApi& api, cudaError_t err) {
  const char* text = api.GetErrorString(err);
  return std::string(text ? text : "unknown error") + " (CUDA error " +
         std::to_string(err) + ")";
}

// Clears the thread's "last error" before throwing, so that our failure does
// not resurface in torch's or cupy's next cudaGetLastError() check.
[[noreturn]] void throw_cuda_error(const CudaRuntimeApi& api, cudaError_t err,
                                   const std::string& what, int device) {
  api.GetLastError();
  throw std::runtime_error("dtralloc: " + what + " on CUDA device " +
                           std::to_string(device) +
                           " failed: " + describe(api, err));
}

// Makes `device` current for one scope and then gives the caller's thread
// its device back, so that dtralloc never changes the device the user's
// thread works on. Skips both runtime calls when the device is already
// current (the common case).
//
// The restore happens only where the previous device already has a primary
// context, as torch's c10::cuda::MaybeSetDevice does. A thread that never
// chose a device reports device 0 from cudaGetDevice; restoring that with
// cudaSetDevice(0) would create a context on GPU 0 (CUDA 12 initializes it in
// cudaSetDevice), hundreds of MiB per process under torchrun, where each rank
// works on its own GPU. Such a thread keeps the backend's device current
// instead, exactly what torch leaves behind in the same case.
class DeviceGuard {
 public:
  DeviceGuard(const CudaRuntimeApi& api, int device) : api_(api) {
    cudaError_t err = api_.GetDevice(&previous_);
    if (err != cudaSuccess) throw_cuda_error(api_, err, "cudaGetDevice", device);
    if (previous_ == device) return;
    err = api_.SetDevice(device);
    if (err != cudaSuccess) throw_cuda_error(api_, err, "cudaSetDevice", device);
    switched_ = true;
  }
  ~DeviceGuard() {
    if (!switched_ || !has_context(previous_)) return;
    // A destructor cannot throw; a failed restore at least leaves no error
    // behind for the caller's next check.
    if (api_.SetDevice(previous_) != cudaSuccess) api_.GetLastError();
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  // Unknown (no driver function, or it failed) counts as yes: restoring the
  // caller's device matters more than the memory of a stray context.
  bool has_context(int device) const {
    if (api_.DevicePrimaryCtxGetState == nullptr) return true;
    unsigned int flags = 0;
    int active = 0;
    return api_.DevicePrimaryCtxGetState(device, &flags, &active) != 0 || active != 0;
  }

  const CudaRuntimeApi& api_;
  int previous_ = 0;
  bool switched_ = false;
};

// VMM segments: the pages unmap_pages gives back, and the unit in which
// they are created and mapped.
constexpr std::size_t kVmmPage = std::size_t{2} << 20;

std::string describe_driver(const CudaRuntimeApi::VmmApi& vmm, cudrv::CUresult result) {
  const char* text = nullptr;
  if (vmm.GetErrorString(result, &text) != cudrv::CUDA_SUCCESS || text == nullptr) text = "unknown error";
  return std::string(text) + " (CUDA driver error " + std::to_string(result) + ")";
}

// The properties of one page of device memory on `device`.
cudrv::CUmemAllocationProp page_properties(int device) {
  cudrv::CUmemAllocationProp prop{};
  prop.type = cudrv::CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = cudrv::CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = cudrv::CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// Why `device` cannot have VMM segments, "" when it can. Queries the driver
// only (no context is created): the API is there, the device supports it,
// and its granularity divides a 2 MiB page.
std::string vmm_unavailable(const CudaRuntimeApi& api, int device) {
  const CudaRuntimeApi::VmmApi& vmm = api.vmm;
  if (!vmm.complete())
    return "the CUDA driver (libcuda.so.1) does not export the virtual memory management API "
           "(cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemUnmap, ...)";
  cudrv::CUdevice handle = 0;
  cudrv::CUresult r = vmm.DeviceGet(&handle, device);
  if (r != cudrv::CUDA_SUCCESS) return "cuDeviceGet(" + std::to_string(device) + ") failed: " + describe_driver(vmm, r);
  int supported = 0;
  r = vmm.DeviceGetAttribute(&supported, cudrv::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, handle);
  if (r != cudrv::CUDA_SUCCESS) return "cuDeviceGetAttribute failed: " + describe_driver(vmm, r);
  if (supported == 0)
    return "CUDA device " + std::to_string(device) + " does not support virtual memory management";
  const cudrv::CUmemAllocationProp prop = page_properties(device);
  std::size_t granularity = 0;
  r = vmm.MemGetAllocationGranularity(&granularity, &prop, cudrv::CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != cudrv::CUDA_SUCCESS) return "cuMemGetAllocationGranularity failed: " + describe_driver(vmm, r);
  if (granularity == 0 || kVmmPage % granularity != 0)
    return "CUDA device " + std::to_string(device) + " maps memory in units of " + std::to_string(granularity) +
           " bytes, which do not divide dtralloc's 2 MiB pages";
  return "";
}

// Why `device` cannot have async segments (a memory pool of the driver's
// stream-ordered allocator), "" when it can. Creates no context.
std::string async_unavailable(const CudaRuntimeApi& api, int device) {
  const CudaRuntimeApi::PoolApi& pools = api.pools;
  if (!pools.complete())
    return "the CUDA runtime does not export the stream-ordered allocator (cudaMemPoolCreate, "
           "cudaMallocFromPoolAsync, cudaFreeAsync, ...; CUDA 11.2 and later have it)";
  int supported = 0;
  const cudaError_t err = pools.DeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device);
  if (err != cudaSuccess) {
    const std::string why = describe(api, err);
    api.GetLastError();
    return "cudaDeviceGetAttribute(cudaDevAttrMemoryPoolsSupported) failed: " + why;
  }
  if (supported == 0) return "CUDA device " + std::to_string(device) + " does not support memory pools";
  return "";
}

// Where a backend's segments come from.
enum class Segments {
  kMalloc,  // cudaMalloc and cudaFree (the default)
  kVmm,     // reserved address ranges mapped a 2 MiB page at a time (unmap_pages:on)
  kAsync,   // a memory pool of the stream-ordered allocator (async_segments:on)
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CudaRuntimeApi& api, int device, Segments segments)
      : api_(api), device_(device), segments_(segments), page_prop_(page_properties(device)) {}

  ~CudaBackend() override {
    // Segments still holding tensors (the Allocator leaks them at exit on
    // purpose) keep the pool's memory: the driver destroys the pool once
    // they are freed. A failure here (the runtime already unloading at
    // process exit) leaves no error behind for anyone's next check.
    if (pool_ && api_.pools.MemPoolDestroy(pool_) != cudaSuccess) api_.GetLastError();
  }

  const char* name() const override { return "cuda"; }

  // With VMM segments, any whole 2 MiB pages of a segment can go back.
  bool releases_ranges() const override { return segments_ == Segments::kVmm; }

  void* allocate(std::size_t bytes, Stream stream) override {
    DeviceGuard guard(api_, device_);
    if (segments_ == Segments::kVmm) return vmm_allocate(bytes);
    if (segments_ == Segments::kAsync) return async_allocate(bytes, stream);
    void* ptr = nullptr;
    cudaError_t err = api_.Malloc(&ptr, bytes);
    if (err == cudaErrorMemoryAllocation) {
      api_.GetLastError();  // out of memory is an answer, not an error
      return nullptr;
    }
    if (err != cudaSuccess) {
      fail(err, "cudaMalloc of " + std::to_string(bytes) + " bytes");
    }
    return ptr;
  }

  void release(void* ptr, std::size_t bytes, Stream stream) override {
    DeviceGuard guard(api_, device_);
    if (segments_ == Segments::kVmm) return vmm_release(ptr, bytes);
    if (segments_ == Segments::kAsync) return async_release(ptr, bytes, stream);
    cudaError_t err = api_.Free(ptr);
    if (err != cudaSuccess) {
      fail(err, "cudaFree of " + std::to_string(bytes) + " bytes");
    }
  }

  bool device_pool_bytes(DevicePoolBytes& out) override {
    if (segments_ != Segments::kAsync) return false;
    out = DevicePoolBytes{};
    if (!pool_) return true;  // nothing allocated yet
    out.reserved = pool_attribute(cudaMemPoolAttrReservedMemCurrent);
    out.peak = pool_attribute(cudaMemPoolAttrReservedMemHigh);
    return true;
  }

  void reset_device_pool_peak() override {
    if (!pool_) return;
    unsigned long long zero = 0;  // resets the watermark to the current value
    cudaError_t err = api_.pools.MemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero);
    if (err != cudaSuccess) fail(err, "cudaMemPoolSetAttribute(cudaMemPoolAttrReservedMemHigh)");
  }

  // Async segments: the frees enqueued so far complete once the device has
  // run the work before them; then the pool can give their memory back.
  void trim() override {
    if (!pool_) return;
    DeviceGuard guard(api_, device_);
    cudaError_t err = api_.DeviceSynchronize();
    if (err != cudaSuccess) fail(err, "cudaDeviceSynchronize before cudaMemPoolTrimTo");
    err = api_.pools.MemPoolTrimTo(pool_, 0);
    if (err != cudaSuccess) fail(err, "cudaMemPoolTrimTo");
  }

  std::size_t total_bytes() override { return memory_info().total; }
  std::size_t free_bytes() override { return memory_info().free; }

  EventHandle create_event() override {
    DeviceGuard guard(api_, device_);  // an event belongs to the current device
    cudaEvent_t event = nullptr;
    cudaError_t err = api_.EventCreateWithFlags(&event, cudaEventDisableTiming);
    if (err != cudaSuccess) fail(err, "cudaEventCreateWithFlags");
    return event;
  }

  void record_event(EventHandle event, Stream stream) override {
    // Stream 0 means the current device's default stream, hence the guard.
    DeviceGuard guard(api_, device_);
    cudaError_t err =
        api_.EventRecord(as_event(event), reinterpret_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) fail(err, "cudaEventRecord");
  }

  // Query, synchronize and destroy act on the event's own device whatever is
  // current, so they skip the guard; event_completed is polled often.
  bool event_completed(EventHandle event) override {
    cudaError_t err = api_.EventQuery(as_event(event));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      api_.GetLastError();  // "not ready" is an answer, not an error
      return false;
    }
    fail(err, "cudaEventQuery");
  }

  EventHandle create_timing_event() override {
    DeviceGuard guard(api_, device_);
    cudaEvent_t event = nullptr;
    cudaError_t err = api_.EventCreateWithFlags(&event, 0);  // cudaEventDefault: timed
    if (err != cudaSuccess) fail(err, "cudaEventCreateWithFlags");
    return event;
  }

  double elapsed_ms(EventHandle start, EventHandle end) override {
    float ms = 0;
    cudaError_t err = api_.EventElapsedTime(&ms, as_event(start), as_event(end));
    if (err == cudaSuccess) return ms;
    if (err == cudaErrorNotReady) {
      api_.GetLastError();  // an answer, as in event_completed
      return -1;
    }
    fail(err, "cudaEventElapsedTime");
  }

  void synchronize_event(EventHandle event) override {
    cudaError_t err = api_.EventSynchronize(as_event(event));
    if (err != cudaSuccess) fail(err, "cudaEventSynchronize");
  }

  void destroy_event(EventHandle event) override {
    cudaError_t err = api_.EventDestroy(as_event(event));
    if (err != cudaSuccess) fail(err, "cudaEventDestroy");
  }

  void synchronize_device() override {
    DeviceGuard guard(api_, device_);
    cudaError_t err = api_.DeviceSynchronize();
    if (err != cudaSuccess) fail(err, "cudaDeviceSynchronize");
  }

  void synchronize_stream(Stream stream) override {
    cudaError_t err;
    if (stream == 0) {
      DeviceGuard guard(api_, device_);  // 0 is the current device's stream
      err = api_.StreamSynchronize(nullptr);
    } else {
      err = api_.StreamSynchronize(reinterpret_cast<cudaStream_t>(stream));  // its own device's
    }
    if (err != cudaSuccess) fail(err, "cudaStreamSynchronize");
  }

  bool stream_capturing(Stream stream) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t err;
    if (stream == 0) {
      DeviceGuard guard(api_, device_);  // 0 is the current device's stream
      err = api_.StreamIsCapturing(nullptr, &status);
    } else {
      err = api_.StreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status);
    }
    if (err == cudaErrorStreamCaptureImplicit) {
      api_.GetLastError();  // an answer: a blocking stream of the device captures
      return true;
    }
    if (err != cudaSuccess) fail(err, "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }

 private:
  struct MemoryInfo {
    std::size_t free = 0;
    std::size_t total = 0;
  };

  MemoryInfo memory_info() {
    DeviceGuard guard(api_, device_);
    MemoryInfo info;
    cudaError_t err = api_.MemGetInfo(&info.free, &info.total);
    if (err != cudaSuccess) fail(err, "cudaMemGetInfo");
    return info;
  }

  static cudaEvent_t as_event(EventHandle event) {
    return static_cast<cudaEvent_t>(event);
  }

  [[noreturn]] void fail(cudaError_t err, const std::string& what) const {
    throw_cuda_error(api_, err, what, device_);
  }

  // ---- VMM segments ------------------------------------------------------
  //
  // A segment is an address range reserved for it, with one physical 2 MiB
  // page created and mapped at each page of the range. Any page can then be
  // unmapped (its memory goes back to the device) while the others stay where
  // they are, which is what unmap_pages needs and cudaMalloc cannot do. The
  // handle of each page is released right after it is mapped: the driver
  // frees the memory when its mapping goes (cuMemRelease, cuda.h). The
  // reservation is freed once its last page is unmapped.

  // A driver call returns its error and leaves the runtime's last error
  // alone: clearing that here could swallow an error of the program's own.
  [[noreturn]] void fail_driver(cudrv::CUresult result, const std::string& what) const {
    throw std::runtime_error("dtralloc: " + what + " on CUDA device " + std::to_string(device_) +
                             " failed: " + describe_driver(api_.vmm, result));
  }

  // Driver calls need a current context; a thread the runtime has not used
  // yet may have none. cudaSetDevice makes the device's primary context
  // current (CUDA 12 and later create it there).
  void ensure_context() {
    cudrv::CUcontext context = nullptr;
    if (api_.vmm.CtxGetCurrent(&context) == cudrv::CUDA_SUCCESS && context != nullptr) return;
    cudaError_t err = api_.SetDevice(device_);
    if (err != cudaSuccess) fail(err, "cudaSetDevice");
  }

  // Unmaps `pages` pages from `start`; throws on the first failure.
  void unmap_pages(cudrv::CUdeviceptr start, std::size_t pages) {
    for (std::size_t i = 0; i < pages; ++i) {
      cudrv::CUresult r = api_.vmm.MemUnmap(start + i * kVmmPage, kVmmPage);
      if (r != cudrv::CUDA_SUCCESS) fail_driver(r, "cuMemUnmap");
    }
  }

  // Undoes a partly built segment; `result` is why it stopped.
  void* abandon(cudrv::CUdeviceptr base, std::size_t bytes, std::size_t mapped_pages, cudrv::CUresult result,
                const char* what) {
    unmap_pages(base, mapped_pages);
    cudrv::CUresult r = api_.vmm.MemAddressFree(base, bytes);
    if (r != cudrv::CUDA_SUCCESS) fail_driver(r, "cuMemAddressFree");
    if (result == cudrv::CUDA_ERROR_OUT_OF_MEMORY) return nullptr;  // an answer, like cudaMalloc's
    fail_driver(result, std::string(what) + " for a segment of " + std::to_string(bytes) + " bytes");
  }

  void* vmm_allocate(std::size_t bytes) {
    if (bytes == 0 || bytes % kVmmPage != 0)
      throw std::logic_error("dtralloc: cuda VMM segment of " + std::to_string(bytes) +
                             " bytes, not a multiple of 2 MiB (BlockPool::own_segment_size rounds to pages)");
    ensure_context();
    const CudaRuntimeApi::VmmApi& vmm = api_.vmm;
    cudrv::CUdeviceptr base = 0;
    cudrv::CUresult r = vmm.MemAddressReserve(&base, bytes, kVmmPage, 0, 0);
    if (r == cudrv::CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
    if (r != cudrv::CUDA_SUCCESS) fail_driver(r, "cuMemAddressReserve of " + std::to_string(bytes) + " bytes");
    const std::size_t pages = bytes / kVmmPage;
    for (std::size_t i = 0; i < pages; ++i) {
      cudrv::CUmemGenericAllocationHandle handle = 0;
      r = vmm.MemCreate(&handle, kVmmPage, &page_prop_, 0);
      if (r != cudrv::CUDA_SUCCESS) return abandon(base, bytes, i, r, "cuMemCreate");
      r = vmm.MemMap(base + i * kVmmPage, kVmmPage, 0, handle, 0);
      const cudrv::CUresult released = vmm.MemRelease(handle);  // the mapping, if any, keeps the page
      if (r != cudrv::CUDA_SUCCESS) return abandon(base, bytes, i, r, "cuMemMap");
      if (released != cudrv::CUDA_SUCCESS) return abandon(base, bytes, i + 1, released, "cuMemRelease");
    }
    cudrv::CUmemAccessDesc access{};
    access.location = page_prop_.location;
    access.flags = cudrv::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = vmm.MemSetAccess(base, bytes, &access, 1);
    if (r != cudrv::CUDA_SUCCESS) return abandon(base, bytes, pages, r, "cuMemSetAccess");
    reservations_.add(base, bytes);
    return reinterpret_cast<void*>(base);
  }

  // A whole segment or, for unmap_pages, whole pages of one.
  void vmm_release(void* ptr, std::size_t bytes) {
    const auto start = static_cast<cudrv::CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
    const RangeLedger::Allocation segment = reservations_.holding(start, bytes, name());
    if (bytes % kVmmPage != 0 || (start - segment.addr) % kVmmPage != 0)
      throw std::logic_error("dtralloc: cuda VMM release of " + std::to_string(bytes) + " bytes at " +
                             std::to_string(start) + " is not whole pages");
    ensure_context();
    // cudaFree waits for the device; cuMemUnmap is not documented to wait
    // for kernels still using the pages, so wait here.
    cudaError_t err = api_.DeviceSynchronize();
    if (err != cudaSuccess) fail(err, "cudaDeviceSynchronize before cuMemUnmap");
    unmap_pages(start, bytes / kVmmPage);
    const RangeLedger::Allocation whole = reservations_.release(start, bytes, name());
    if (!whole.size) return;
    cudrv::CUresult r = api_.vmm.MemAddressFree(whole.addr, whole.size);
    if (r != cudrv::CUDA_SUCCESS) fail_driver(r, "cuMemAddressFree");
  }

  // ---- async segments ----------------------------------------------------
  //
  // A segment is one allocation from a memory pool of the driver's
  // stream-ordered allocator, made on the stream the segment is for and
  // freed on it (cudaMallocFromPoolAsync, cudaFreeAsync). Neither waits for
  // the device, where cudaMalloc and cudaFree do: under a budget the pool
  // gives a segment back to make one of another size many times a step, and
  // each cudaFree would stall the host until the device caught up. The
  // driver reuses what a free on a stream gave back for the stream's next
  // allocation at once, in stream order; what it cannot reuse it keeps until
  // the next synchronize (release threshold 0), so the device may hold more
  // than the pool's segments until then (device_pool_bytes). The blocks the
  // pool hands out of a segment are used on other streams only after their
  // record_stream events completed, so the free on the segment's stream
  // comes after every use.
  //
  // The pool is the backend's own (cudaMemPoolCreate), not the device's
  // default, so that its figures are the backend's alone. Its memory is
  // accessible from its own device only (cudaMemPoolSetAccess would grant
  // others) and has no IPC handle.

  static cudaStream_t as_stream(Stream stream) { return reinterpret_cast<cudaStream_t>(stream); }

  void ensure_pool() {
    if (pool_) return;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    cudaMemPool_t pool = nullptr;
    cudaError_t err = api_.pools.MemPoolCreate(&pool, &props);
    if (err != cudaSuccess) fail(err, "cudaMemPoolCreate");
    // 0 (the default, set to be sure): what frees gave back and no
    // allocation reused goes back to the device at the next synchronize.
    unsigned long long threshold = 0;
    err = api_.pools.MemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    if (err != cudaSuccess) {
      api_.pools.MemPoolDestroy(pool);
      fail(err, "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)");
    }
    pool_ = pool;
  }

  std::size_t pool_attribute(int attribute) {
    unsigned long long value = 0;
    cudaError_t err = api_.pools.MemPoolGetAttribute(pool_, attribute, &value);
    if (err != cudaSuccess) fail(err, "cudaMemPoolGetAttribute");
    return static_cast<std::size_t>(value);
  }

  void* async_allocate(std::size_t bytes, Stream stream) {
    ensure_pool();
    void* ptr = nullptr;
    cudaError_t err = api_.pools.MallocFromPoolAsync(&ptr, bytes, pool_, as_stream(stream));
    if (err == cudaErrorMemoryAllocation) {
      api_.GetLastError();
      // Memory freed on other streams, or freed here but not where the
      // driver could reuse it, is free once the device has run past the
      // frees: wait once and ask again before answering out of memory.
      err = api_.DeviceSynchronize();
      if (err != cudaSuccess) fail(err, "cudaDeviceSynchronize after cudaMallocFromPoolAsync ran out of memory");
      err = api_.pools.MallocFromPoolAsync(&ptr, bytes, pool_, as_stream(stream));
      if (err == cudaErrorMemoryAllocation) {
        api_.GetLastError();  // out of memory is an answer, not an error
        return nullptr;
      }
    }
    if (err != cudaSuccess) fail(err, "cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes");
    return ptr;
  }

  void async_release(void* ptr, std::size_t bytes, Stream stream) {
    // On a capturing stream the free would become a node of the graph
    // instead of happening; cudaFree would fail there (the capture forbids
    // it), and so does this.
    if (stream_capturing(stream))
      throw GraphCaptureError(graph_capture_refusal(
          "cudaFreeAsync of " + std::to_string(bytes) + " bytes on CUDA device " + std::to_string(device_) +
          " would run on a stream that is capturing a CUDA graph, which would record the free instead of doing it"));
    cudaError_t err = api_.pools.FreeAsync(ptr, as_stream(stream));
    if (err != cudaSuccess) fail(err, "cudaFreeAsync of " + std::to_string(bytes) + " bytes");
  }

  const CudaRuntimeApi& api_;
  const int device_;
  const Segments segments_;
  const cudrv::CUmemAllocationProp page_prop_;
  cudaMemPool_t pool_ = nullptr;  // async segments: made at the first allocation
  // Each segment's address reservation, freed once all its pages are unmapped.
  RangeLedger reservations_;
};

// Device count, or the runtime's error (already cleared from "last error").
cudaError_t query_device_count(const CudaRuntimeApi& api, int& count) {
  count = 0;
  cudaError_t err = api.GetDeviceCount(&count);
  if (err != cudaSuccess) {
    api.GetLastError();
    count = 0;
  }
  return err;
}

}  // namespace

const CudaRuntimeApi& cuda_runtime() { return load_runtime().api; }

int cuda_runtime_version() {
  const CudaRuntimeApi& api = cuda_runtime();
  int version = 0;
  cudaError_t err = api.RuntimeGetVersion(&version);
  if (err != cudaSuccess) {
    api.GetLastError();
    throw std::runtime_error("dtralloc: cudaRuntimeGetVersion failed: " +
                             describe(api, err));
  }
  return version;
}

void prefer_cuda_runtime_major(int major) { g_preferred_major.store(major > 0 ? major : 0); }

std::string cuda_runtime_path() {
  const LoadedRuntime* loaded = g_runtime.load(std::memory_order_acquire);
  return loaded ? loaded->path : std::string();
}

int cuda_device_count() {
  try {
    int count = 0;
    query_device_count(cuda_runtime(), count);
    return count;
  } catch (...) {
    return 0;  // no runtime at all means no devices, by contract
  }
}

namespace {

// The runtime, once `device` is known to exist; throws naming the fix
// otherwise.
const LoadedRuntime& runtime_for_device(int device) {
  const LoadedRuntime& runtime = load_runtime();
  int count = 0;
  cudaError_t err = query_device_count(runtime.api, count);
  if (count == 0) {
    std::string reason = err != cudaSuccess ? describe(runtime.api, err)
                                            : std::string("0 devices");
    throw std::runtime_error(
        "dtralloc: the CUDA runtime " + runtime.path +
        " sees no usable GPU: " + reason +
        ". Check that the NVIDIA driver is installed and a GPU is visible "
        "(nvidia-smi, CUDA_VISIBLE_DEVICES), or use the host/virtual backend.");
  }
  if (device < 0 || device >= count) {
    throw std::runtime_error(
        "dtralloc: CUDA device " + std::to_string(device) +
        " does not exist: the runtime " + runtime.path + " sees " +
        std::to_string(count) + " device(s), valid indices are 0.." +
        std::to_string(count - 1) +
        ". Pass a valid index or check CUDA_VISIBLE_DEVICES.");
  }
  return runtime;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(runtime_for_device(device).api, device, Segments::kMalloc);
}

std::string cuda_vmm_unavailable(int device) {
  return vmm_unavailable(runtime_for_device(device).api, device);
}

namespace {

[[noreturn]] void refuse_unmap_pages(const std::string& why) {
  throw ConfigError("DTRALLOC_CONF: unmap_pages:on gives back pages of CUDA memory through CUDA's virtual "
                    "memory API, and here it cannot: " + why +
                    ". Leave unmap_pages at auto or off (cudaMalloc'd segments).");
}

[[noreturn]] void refuse_async_segments(const std::string& why) {
  throw ConfigError("DTRALLOC_CONF: async_segments:on makes segments with CUDA's stream-ordered allocator, and "
                    "here it cannot: " + why + ". Leave async_segments off (cudaMalloc'd segments).");
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend_for(const Config& config, int device) {
  const LoadedRuntime& runtime = runtime_for_device(device);
  // VMM segments only where unmap_pages is on, as given: under auto the
  // segments are cudaMalloc'd and the Allocator resolves unmap_pages off.
  // Under a budget the pool makes and releases segments every step (a
  // ResNet-50 step at its peak: six a step, each a few hundred 2 MiB pages),
  // and a VMM segment is a cuMemCreate and a cuMemMap a page to make and a
  // device synchronize and a cuMemUnmap a page to release, where cudaMalloc
  // and cudaFree are one call each. On an H100 that made the largest batch
  // that trains in a fixed memory 5-20x slower a sample than with cudaMalloc'd
  // segments, for at most one batch more (bench/results/gpu_session-2026-11-
  // 27-h100.md: ResNet-50 at 5.75x its batch +1941% against +83%, GPT-2
  // +358% at 2.88x against +31% at 2.75x).
  const bool vmm = config.unmap_pages == Switch::kOn;
  if (vmm) {
    const std::string why = vmm_unavailable(runtime.api, device);
    if (!why.empty()) refuse_unmap_pages(why);
  }
  // parse_config refuses async_segments:on beside unmap_pages:on.
  const bool async = config.async_segments == Switch::kOn;
  if (async) {
    const std::string why = async_unavailable(runtime.api, device);
    if (!why.empty()) refuse_async_segments(why);
  }
  return std::make_unique<CudaBackend>(runtime.api, device,
                                       vmm ? Segments::kVmm : async ? Segments::kAsync : Segments::kMalloc);
}

void check_cuda_unmap_pages(int device) {
  const std::string why = cuda_vmm_unavailable(device);
  if (!why.empty()) refuse_unmap_pages(why);
}

void check_cuda_async_segments(int device) {
  const std::string why = async_unavailable(runtime_for_device(device).api, device);
  if (!why.empty()) refuse_async_segments(why);
}

}  // namespace dtralloc
